"""The controller and workers: step lock, sweep order, barriers, failure, replies (I1-I4, I10, I13)."""

import pytest

from protocol.commands import Capture, Finalize, Launch, MeasureGraphs, Reply, Step, Teardown, Warmup
from protocol.config import ProtocolConfig
from protocol.controller import Abort, Broadcast, Controller, Done, Wait
from protocol.eligibility import GraphPlan
from protocol.errors import EligibilityError, ProtocolError, RankFailure, ReplyError
from protocol.keys import GraphKey
from protocol.pages import PagePool
from protocol.requests import Request
from protocol.worker import Worker
from tests.protocol.driver import FakeBackend, deliver, drive

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)


def test_startup_sweep_order_and_serving():
    config = ProtocolConfig(**SMALL)
    reqs = [Request(i, (1, 2), max_tokens=3) for i in range(5)]
    ctrl, workers, backends, sent, action = drive(config, reqs)
    assert isinstance(action, Done)
    kinds = [type(c).__name__ for c in sent]
    assert kinds[:4] == ["Warmup", "ProfileMemory", "MeasureGraphs", "AllocateKV"]
    sweep = sent[4:12]
    assert [type(c) for c in sweep] == [Capture, Launch] * 4
    assert [c.key.bucket for c in sweep[::2]] == [8, 4, 2, 1]  # largest first
    assert isinstance(sent[12], Finalize) and isinstance(sent[-1], Teardown)
    assert sorted(ctrl.finished) == list(range(5))
    assert all(out == [7, 7, 7] for out in ctrl.outputs.values())
    # I5: the warm-up covers each message size the graphs use
    assert set(sent[0].sizes) == {config.shape.allreduce_bytes(b) for b in (1, 2, 4, 8)}
    # I10: graphs freed before the communicator on every rank
    for b in backends:
        names = [op.name for op in b.log]
        assert names.index("free_graphs", len(names) - 3) < names.index("destroy_communicator")


def test_serving_steps_replay_their_decode_rows_mixed_steps_too():
    config = ProtocolConfig(**SMALL)
    reqs = [Request(i, (1, 2), max_tokens=4) for i in range(3)]
    late = [Request(3, (5, 6, 7), max_tokens=2)]

    def submit_late(ctrl, command):  # arrives while the first three decode
        if isinstance(command, Step) and late:
            ctrl.submit(late.pop())

    _, _, _, sent, _ = drive(config, reqs, after_reply=submit_late)
    steps = [c for c in sent if isinstance(c, Step)]
    assert steps[0].admits and not steps[0].rows and steps[0].key is None  # prefill only
    decode = [s for s in steps if s.rows and not s.admits]
    assert decode and all(s.key == GraphKey(4) and s.bucket == 4 for s in decode)
    # a mixed step replays the bucket of its decode rows; its admissions are not rows of it
    mixed = [s for s in steps if s.rows and s.admits]
    assert mixed and all(s.key == GraphKey(s.bucket) and s.bucket == 4 and len(s.rows) == 3
                         for s in mixed)


def test_a_mixed_steps_bucket_holds_its_decode_rows_not_its_admissions():
    """4 decode rows beside 1 admission: bucket 4 (rows only), not 8 (rows + admissions)."""
    config = ProtocolConfig(**SMALL)
    reqs = [Request(i, (1, 2), max_tokens=4) for i in range(4)]
    late = [Request(4, (5, 6, 7), max_tokens=2)]

    def submit_late(ctrl, command):
        if isinstance(command, Step) and late:
            ctrl.submit(late.pop())

    _, _, _, sent, _ = drive(config, reqs, after_reply=submit_late)
    mixed = [s for s in sent if isinstance(s, Step) and s.rows and s.admits]
    assert mixed and all(len(s.rows) == 4 and s.key == GraphKey(4) and s.bucket == 4
                         for s in mixed)


def test_admissions_per_step_respect_the_prefill_token_budget():
    config = ProtocolConfig(**SMALL, max_prefill_tokens=10)
    lengths = [4, 5, 2, 12, 3, 9, 1]
    reqs = [Request(i, tuple(range(1, n + 1)), max_tokens=2) for i, n in enumerate(lengths)]
    _, _, _, sent, action = drive(config, reqs)
    assert isinstance(action, Done)
    steps = [c for c in sent if isinstance(c, Step) and (c.admits or c.chunk)]
    pieces = [[(a.request_id, a.start, len(a.prompt)) for a in c.admits]
              + ([(c.chunk.request_id, c.chunk.start, c.chunk.end)] if c.chunk else [])
              for c in steps]
    # in order, every step within 10 prompt tokens: what does not fit is prefilled in chunks
    # (the 2-token prompt starts in the 1 token left after 4 + 5, the 12-token one takes the
    # 9 left after its last token, and so on; a piece is (request, start, end))
    assert pieces == [[(0, 0, 4), (1, 0, 5), (2, 0, 1)], [(2, 1, 2), (3, 0, 9)],
                      [(3, 9, 12), (4, 0, 3), (5, 0, 4)], [(5, 4, 9), (6, 0, 1)]]
    assert all(sum(len(a.tokens) for a in c.admits) + (len(c.chunk.tokens) if c.chunk else 0)
               <= 10 for c in steps)


def test_step_lock_waits_for_every_rank():
    ctrl = Controller(ProtocolConfig(**SMALL))
    action = ctrl.next_action()
    assert isinstance(action, Broadcast) and isinstance(action.command, Warmup)
    ctrl.on_reply(Reply(rank=1, seq=0))
    assert ctrl.next_action() == Wait((0,))
    ctrl.on_reply(Reply(rank=0, seq=0))
    assert isinstance(ctrl.next_action(), Broadcast)


@pytest.mark.parametrize("reply,match", [
    (Reply(rank=2, seq=0), "outside world size 2"),
    (Reply(rank=0, seq=5), "command 0 is outstanding"),
])
def test_bad_replies_are_rejected_and_fail_the_controller(reply, match):
    ctrl = Controller(ProtocolConfig(**SMALL))
    ctrl.next_action()
    with pytest.raises(ReplyError, match=match):
        ctrl.on_reply(reply)
    assert isinstance(ctrl.next_action(), Abort)


def test_duplicate_reply_rejected():
    ctrl = Controller(ProtocolConfig(**SMALL))
    ctrl.next_action()
    ctrl.on_reply(Reply(rank=0, seq=0))
    with pytest.raises(ReplyError, match="duplicate reply from rank 0"):
        ctrl.on_reply(Reply(rank=0, seq=0))


def test_reply_without_outstanding_command():
    ctrl = Controller(ProtocolConfig(**SMALL))
    with pytest.raises(ReplyError, match="no command is outstanding"):
        ctrl.on_reply(Reply(rank=0, seq=0))


def test_rank0_step_reply_must_carry_tokens():
    config = ProtocolConfig(world_size=1, **SMALL)
    ctrl, workers, _, sent, _ = drive(config, [])
    ctrl2 = Controller(config)
    # drive ctrl2 to serving by hand using the first run's replies is long; instead build a step
    ctrl2.phase = "serving"
    ctrl2.pool = PagePool(num_pages=8, page_size=16, max_pages_per_seq=4)
    ctrl2.submit(Request(1, (1, 2)))
    action = ctrl2.next_action()
    assert isinstance(action.command, Step)
    with pytest.raises(ReplyError, match="must carry 1 token ids in slot order.*got 2 token"):
        ctrl2.on_reply(Reply(rank=0, seq=action.command.seq, payload=(5, 6)))
    ctrl3 = Controller(config)
    ctrl3.phase = "serving"
    ctrl3.pool = PagePool(num_pages=8, page_size=16, max_pages_per_seq=4)
    ctrl3.submit(Request(1, (1, 2)))
    action = ctrl3.next_action()
    with pytest.raises(ReplyError, match="must carry 1 token ids.*got \\{1: 5\\}"):
        ctrl3.on_reply(Reply(rank=0, seq=action.command.seq, payload={1: 5}))  # the old dict


def test_rank_failure_aborts_naming_ranks_and_disarms_watchdog():
    config = ProtocolConfig(**SMALL)
    ctrl, workers, _, sent, action = drive(config, [], fail=(1, "instantiate"))
    assert isinstance(action, Abort) and action.how == "abort"
    assert isinstance(action.error, RankFailure)
    assert action.error.failed == (1,)
    assert "rank(s) 1" in str(action.error)
    assert not ctrl.watchdog.armed
    # I13: nothing is sent after the failing command
    assert isinstance(sent[-1], MeasureGraphs)
    with pytest.raises(ProtocolError, match="poisoned"):
        workers[1].ops_for(Warmup(99, ()))


def test_uncollected_ranks_named_on_failure():
    ctrl = Controller(ProtocolConfig(world_size=3, **SMALL))
    ctrl.next_action()
    ctrl.on_reply(Reply(rank=1, seq=0, ok=False, error="x"))
    action = ctrl.next_action()
    assert action.error.uncollected == (0, 2)


def test_watchdog_expiry_aborts_during_startup():
    now = [0.0]
    ctrl = Controller(ProtocolConfig(watchdog_timeout_s=10, **SMALL), clock=lambda: now[0])
    ctrl.next_action()
    ctrl.on_reply(Reply(rank=0, seq=0))
    now[0] = 11
    action = ctrl.next_action()
    assert isinstance(action, Abort) and "ranks not collected: 1" in str(action.error)


def test_the_startup_watchdog_spans_the_whole_startup_not_each_command():
    """I6: the startup watchdog is armed once, at the first startup command, and expires
    when the startup as a whole outlasts it, though each command took less."""
    from protocol.commands import ProfileMemory, Warmup

    now = [0.0]
    config = ProtocolConfig(watchdog_timeout_s=10, world_size=1, **SMALL)
    ctrl = Controller(config, clock=lambda: now[0])
    worker = Worker(0, 1, GraphPlan.from_config(config), config.max_batch)
    backend = FakeBackend(0, None, 10**12)
    sent = []
    while True:
        action = ctrl.next_action()
        if isinstance(action, Abort):
            break
        assert isinstance(action, Broadcast), action
        sent.append(action.command)
        deliver(ctrl, [worker], [backend], action.command)
        now[0] += 4  # each command answered within 4 s of the 10 s limit
    assert [type(c) for c in sent] == [Warmup, ProfileMemory, MeasureGraphs], sent
    assert now[0] == 12 and "exceeded its 10 s watchdog" in str(action.error), action.error


def test_step_timeout_aborts_during_serving():
    now = [0.0]
    ctrl = Controller(ProtocolConfig(step_timeout_s=5, **SMALL), clock=lambda: now[0])
    ctrl.phase = "serving"
    ctrl.pool = PagePool(num_pages=8, page_size=16, max_pages_per_seq=4)
    ctrl.submit(Request(1, (1,)))
    ctrl.next_action()
    now[0] = 6
    action = ctrl.next_action()
    assert isinstance(action, Abort) and "timed out after 5 s" in str(action.error)


def _worker(allocated: bool = False, **kw):
    config = ProtocolConfig(**SMALL, **kw)
    worker = Worker(0, 2, GraphPlan.from_config(config), 8)
    if allocated:
        from protocol.commands import AllocateKV
        worker.reply(AllocateKV(0, pages=4, page_size=16), [None, None])
    return worker


def test_worker_refuses_uncaptured_replay_and_ineligible_capture():
    w = _worker(allocated=True, graph_batch_cap=2)
    with pytest.raises(EligibilityError, match="capture of graph decode@8 refused"):
        w.ops_for(Capture(0, GraphKey(8)))
    with pytest.raises(EligibilityError, match="launch of decode@2, which was not recorded") as info:
        w.ops_for(Launch(0, GraphKey(2)))
    assert info.value.invariant == "I4"


def test_worker_capture_barrier_ops_end_in_sync():
    w = _worker(allocated=True)
    ops = [op.name for op in w.ops_for(Capture(0, GraphKey(4)))]
    assert ops == ["record", "instantiate", "upload", "synchronize"]
    w.reply(Capture(0, GraphKey(4)), [None] * 4)
    assert [op.name for op in w.ops_for(Launch(1, GraphKey(4)))] == ["launch", "synchronize"]


def test_decode_step_for_uncaptured_key_fails_loudly():
    from protocol.commands import Admit, AllocateKV, DecodeRow, PageAssign
    w = _worker()
    w.reply(AllocateKV(0, pages=4, page_size=16), [None, None])
    w.ops_for(Step(0, admits=(Admit(1, 0, (1,)),), pages=(PageAssign(1, 0, 0, (0,)),)))
    with pytest.raises(EligibilityError, match="not captured at startup") as info:
        w.ops_for(Step(1, rows=(DecodeRow(0, 1, 5, 1),), key=GraphKey(1), bucket=1))
    assert info.value.invariant == "I3"


def test_workers_refit_their_plan_to_the_memory_cap():
    from protocol.commands import AllocateKV
    w = _worker()
    w.reply(AllocateKV(0, pages=10, batch_cap=2), [None, None])
    assert w.plan.batch_cap == 2
    with pytest.raises(EligibilityError, match="decode@4 refused"):
        w.ops_for(Capture(1, GraphKey(4)))


def test_take_finished_and_params_travel_to_workers():
    config = ProtocolConfig(**SMALL)
    reqs = [Request(i, (1, 2), max_tokens=2, params={"temperature": 0.5}) for i in range(2)]
    ctrl, workers, backends, sent, action = drive(config, reqs)
    admits = [a for c in sent if isinstance(c, Step) for a in c.admits]
    assert admits and all(a.params == {"temperature": 0.5} for a in admits)
    allocate = next(c for c in sent if type(c).__name__ == "AllocateKV")
    assert allocate.batch_cap == 8 and all(w.plan.batch_cap == 8 for w in workers)
    assert ctrl.take_finished(0) == [7, 7]
    from protocol.errors import ConfigError
    with pytest.raises(ConfigError, match="request 0 is unknown"):
        ctrl.take_finished(0)


def test_deadline_is_the_earliest_abort():
    now = [0.0]
    ctrl = Controller(ProtocolConfig(watchdog_timeout_s=10, **SMALL), clock=lambda: now[0])
    assert ctrl.deadline() == float("inf")
    ctrl.next_action()
    assert ctrl.deadline() == 10


def test_a_failure_gives_every_request_in_flight_its_error():
    """I18: running and queued requests all end with the run's error; none waits forever."""
    now = [0.0]
    ctrl = Controller(ProtocolConfig(step_timeout_s=5, max_batch=1, buckets=(1,)),
                      clock=lambda: now[0])
    ctrl.phase = "serving"
    ctrl.pool = PagePool(num_pages=8, page_size=16, max_pages_per_seq=4)
    for rid in (1, 2):  # batch cap 1: request 2 stays queued behind request 1
        ctrl.submit(Request(rid, (1,)))
    ctrl.next_action()
    assert ctrl.pending and ctrl.request_error(1) is None
    ctrl.on_rank_dead(1)
    action = ctrl.next_action()
    assert isinstance(action, Abort)
    assert ctrl.request_error(1) is action.error and ctrl.request_error(2) is action.error
