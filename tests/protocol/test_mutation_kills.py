"""Tests added for mutants of protocol/ that survived every other check (docs/mutation.md):
each pins a behaviour that the default `lockstep check` and the other tests never reach."""

from protocol.commands import Step
from protocol.config import ModelShape, ProtocolConfig
from protocol.controller import Done
from protocol.requests import Request
from tests.protocol.driver import drive


def test_one_step_admits_no_more_requests_than_the_batch_cap_leaves_room_for():
    # more requests waiting at once than the cap: admission must stop when the cap is full
    config = ProtocolConfig(buckets=(1, 2, 4), max_batch=2)
    ctrl, _, _, sent, action = drive(config, [Request(i, (1, 2), max_tokens=3) for i in range(5)])
    assert isinstance(action, Done)
    steps = [c for c in sent if isinstance(c, Step)]
    assert max(len(s.rows) + len(s.admits) for s in steps) == 2
    assert sorted(ctrl.finished) == [0, 1, 2, 3, 4]


def test_model_shape_accepts_its_smallest_sizes():
    # one all-reduce per layer, one byte per element, one layer: each is a valid shape
    shape = ModelShape(hidden_size=1, num_layers=1, allreduces_per_layer=1, dtype_bytes=1)
    assert shape.allreduces_per_step == 2  # the layer's all-reduce and the LM head's
    assert shape.allreduce_bytes(3) == 3


def test_done_is_the_answer_from_then_on():
    # a driver that asks again after Done (a second loop, a late reply) gets Done again
    ctrl, _, _, _, action = drive(ProtocolConfig(buckets=(1, 2), max_batch=2),
                                  [Request(0, (1,), max_tokens=2)])
    assert isinstance(action, Done)
    assert isinstance(ctrl.next_action(), Done) and isinstance(ctrl.next_action(), Done)


def test_perform_calls_the_backend_method_of_every_op_and_returns_its_value():
    import dataclasses
    import inspect

    import protocol.backend as backend_module
    from protocol.backend import Backend, Op, perform

    calls = []

    # the memory reports are checked (`perform` refuses a wrong kind): values of their kind
    results = {"profile_memory": (5, 6), "graph_memory": 7}

    def method(name):
        def call(self, *args):
            calls.append((name, args))
            return results.get(name, f"result of {name}")
        return call

    Recording = type("Recording", (Backend,), {name: method(name)
                                               for name in Backend.__abstractmethods__})
    backend = Recording()
    ops = [cls for _, cls in inspect.getmembers(backend_module, inspect.isclass)
           if issubclass(cls, Op) and cls is not Op]
    assert len(ops) == len(Backend.__abstractmethods__) == 21
    for cls in ops:
        op = cls(*[f"arg {f.name}" for f in dataclasses.fields(cls)])
        assert perform(backend, op) == results.get(op.name, f"result of {op.name}"), cls
        assert calls[-1] == (op.name, op.args), cls


def test_a_request_rank_0_could_not_sample_finishes_failed_and_the_others_go_on(monkeypatch):
    from tests.protocol.driver import FakeBackend

    orig = FakeBackend.run

    def run(self, op):
        out = orig(self, op)
        if op.name == "read_tokens":  # slot order: the rows, then the admissions
            step = op.args[0]
            ids = step.rows.request_ids + tuple(a.request_id for a in step.admits)
            return tuple(None if rid == 0 else tok for rid, tok in zip(ids, out))
        return out

    monkeypatch.setattr(FakeBackend, "run", run)
    config = ProtocolConfig(buckets=(1, 2), max_batch=2, cuda_graphs=False, world_size=1)
    ctrl, _, _, _, action = drive(config, [Request(0, (1,), 3), Request(1, (2,), 3)])
    assert isinstance(action, Done)
    assert ctrl.failed_requests == {0} and set(ctrl.finished) == {0, 1}
    assert ctrl.outputs[0] == [] and ctrl.outputs[1] == [7, 7, 7]
    assert ctrl.take_finished(0) == [] and ctrl.take_finished(1) == [7, 7, 7]


def test_protocol_errors_survive_pickling_to_a_worker_process():
    import pickle

    from protocol.errors import RankFailure, WatchdogExpired

    failure = RankFailure("rank 1 failed", (1,), (0,), {1: "boom"}, {1: "oom"}, {1: "I9"}, step=7)
    back = pickle.loads(pickle.dumps(failure))
    assert isinstance(back, RankFailure) and str(back) == "rank 1 failed"
    assert (back.failed, back.errors, back.kind, back.invariant, back.step) == (
        (1,), {1: "boom"}, "oom", "I9", 7)
    assert pickle.loads(pickle.dumps(WatchdogExpired("late", (2,)))).uncollected == (2,)


def test_command_run_done_returns_the_reply_after_the_last_op():
    from protocol.commands import Warmup
    from protocol.execution import CommandRun
    from protocol.worker import Worker
    from protocol.eligibility import GraphPlan

    config = ProtocolConfig(buckets=(1, 2), max_batch=2)
    run = CommandRun(Worker(0, 2, GraphPlan.from_config(config), 2), Warmup(0, (64,)))
    replies = [run.done(None) for _ in range(len(run.ops))]
    assert replies[:-1] == [None] * (len(replies) - 1)
    assert replies[-1] is run.reply and replies[-1].ok and replies[-1].seq == 0


def test_worker_rows_must_match_both_slot_and_request():
    import pytest

    from protocol.commands import Admit, DecodeRow, DecodeRows
    from protocol.errors import SlotError
    from protocol.slots import SlotMap

    slots = SlotMap(4)
    slots.admit(Admit(1, 0, (1,)))
    slots.admit(Admit(2, 1, (1,)))
    slots.check_rows(DecodeRows.of((DecodeRow(0, 1, 5, 1), DecodeRow(1, 2, 5, 1))))
    with pytest.raises(SlotError, match="row 1 names slot 1 request 9, but slot 1 holds 2"):
        slots.check_rows(DecodeRows((1, 9), (5, 5), (1, 1)))  # right slot, wrong request
    with pytest.raises(SlotError, match="row 0 names slot 0 request 2, but slot 0 holds 1"):
        slots.check_rows(DecodeRows((2, 1), (5, 5), (1, 1)))  # the requests swapped
    # a row's slot is its index: a row naming another slot is refused when the rows are built
    with pytest.raises(ValueError, match="decode row 0 names slot 1"):
        DecodeRows.of((DecodeRow(1, 1, 5, 1), DecodeRow(0, 2, 5, 1)))
    with pytest.raises(ValueError, match="2 request ids, 1 tokens and 2 positions"):
        DecodeRows((1, 2), (5,), (1, 1))


def test_worker_refuses_a_decode_row_past_its_requests_pages():
    import pytest

    from protocol.commands import Admit, AllocateKV, DecodeRow, PageAssign
    from protocol.eligibility import GraphPlan
    from protocol.errors import PageError
    from protocol.worker import Worker

    config = ProtocolConfig(buckets=(1, 2), max_batch=2, cuda_graphs=False)
    worker = Worker(0, 2, GraphPlan.from_config(config), 2)
    alloc = AllocateKV(0, pages=8, batch_cap=2, page_size=4)
    worker.reply(alloc, [None] * len(worker.ops_for(alloc)))
    admit = Step(1, admits=(Admit(1, 0, (1, 2, 3)),), pages=(PageAssign(1, 0, 0, (0,)),))
    worker.ops_for(admit)  # three tokens on one page of four
    ok = Step(2, rows=(DecodeRow(0, 1, 9, 3),), bucket=1)  # position 3: still page 0
    worker.ops_for(ok)
    past = Step(3, rows=(DecodeRow(0, 1, 9, 4),), bucket=1)  # position 4 needs page 1: none given
    with pytest.raises(PageError, match="writes position 4"):
        worker.ops_for(past)


def test_every_command_has_the_next_sequence_number():
    config = ProtocolConfig(buckets=(1, 2), max_batch=2)
    _, _, _, sent, action = drive(config, [Request(i, (1, 2), max_tokens=3) for i in range(3)])
    assert isinstance(action, Done)
    assert [c.seq for c in sent] == list(range(len(sent)))


def test_op_arguments_are_described_for_the_trace():
    from protocol.keys import GraphKey
    from protocol.trace import describe_args

    step = Step(4)
    assert describe_args((3, GraphKey(8), step, (1, 2, 3), "x")) == "3, decode@8, step 4, 3 items, x"
    # one argument (most ops) and two (move_slot's source and destination)
    assert [describe_args((a,)) for a in (7, GraphKey(8), step, (1, 2))] == [
        "7", "decode@8", "step 4", "2 items"]
    assert describe_args((3, 1)) == "3, 1" and describe_args((GraphKey(2), None)) == "decode@2"
    # prefill's arguments: the admissions, then the chunk of a chunked prefill, if any
    from protocol.commands import Chunk
    assert describe_args(((), Chunk(3, 9, 4, (5, 6)))) == "0 items, chunk r3[4:6]"


def test_measured_graph_bytes_are_each_graphs_increment():
    from protocol.commands import MeasureGraphs
    from protocol.eligibility import GraphPlan
    from protocol.keys import GraphKey
    from protocol.worker import Worker

    config = ProtocolConfig(buckets=(1, 2, 4), max_batch=4)
    worker = Worker(0, 2, GraphPlan.from_config(config), 4)
    keys = (GraphKey(4), GraphKey(2), GraphKey(1))
    command = MeasureGraphs(0, keys)
    ops = worker.ops_for(command)
    readings = iter([1000, 1700, 1750, 1760])  # graph_memory before and after each record
    results = [next(readings) if op.name == "graph_memory" else None for op in ops]
    assert worker.reply(command, results).payload == {GraphKey(4): 700, GraphKey(2): 50,
                                                      GraphKey(1): 10}


# -- added for the survivors of the 2026-12-01 run on d61d1a7 (docs/mutation.md) ----------------

def test_protocol_messages_and_settings_refuse_assignment():
    # commands, replies, actions, configs and records are shared by reference: the simulator
    # and an in-process driver hand one command object to every rank, so a record one rank
    # could change would change it under the others
    import dataclasses

    import protocol.backend
    import protocol.commands
    import protocol.config
    import protocol.controller
    import protocol.eligibility
    import protocol.invariants
    import protocol.keys
    import protocol.memory
    import protocol.requests

    mutable = {protocol.controller.Chunking, protocol.controller.Sampled}  # the controller's own records
    modules = (protocol.backend, protocol.commands, protocol.config, protocol.controller,
               protocol.eligibility, protocol.invariants, protocol.keys, protocol.memory,
               protocol.requests)
    classes = [c for m in modules for c in vars(m).values()
               if isinstance(c, type) and dataclasses.is_dataclass(c)
               and c.__module__ == m.__name__ and c not in mutable]
    assert len(classes) > 50
    for cls in classes:
        record = object.__new__(cls)  # no __init__: assignment alone is under test
        name = dataclasses.fields(cls)[0].name if dataclasses.fields(cls) else "seq"
        try:
            setattr(record, name, 1)
        except dataclasses.FrozenInstanceError:
            continue
        raise AssertionError(f"{cls.__qualname__}.{name} could be assigned")


def test_the_default_model_and_kv_page_are_those_of_qwen3_4b():
    # the defaults the simulator checks with describe the real checkpoint (engine/presets.py,
    # from its config.json): 36 layers of width 2560; a page of 16 tokens holds K and V of the
    # 8 KV heads of 128 elements in every layer, in bf16
    from engine.presets import PRESETS
    from protocol.config import QWEN3_4B

    real = PRESETS["qwen3-4b"]
    config = ProtocolConfig()
    assert config.shape == QWEN3_4B
    assert (QWEN3_4B.hidden_size, QWEN3_4B.num_layers) == (real["hidden_size"],
                                                           real["num_hidden_layers"])
    assert config.kv_page_bytes == (config.page_size * real["num_hidden_layers"] * 2
                                    * real["num_key_value_heads"] * real["head_dim"]
                                    * QWEN3_4B.dtype_bytes)


def test_the_default_prefill_budget_is_8192_tokens():
    # documented default (ProtocolConfig.max_prefill_tokens): a prompt of 8192 tokens is
    # prefilled by one step; one of 8193 is a chunk of 8192, then the last token
    config = ProtocolConfig(buckets=(1, 2), max_batch=2, world_size=1)
    for length, chunked in ((8192, False), (8193, True)):
        _, _, _, sent, action = drive(config, [Request(0, tuple(range(length)), max_tokens=1)],
                                      pages_per_seq=600)
        assert isinstance(action, Done)
        chunks = [c.chunk for c in sent if isinstance(c, Step) and c.chunk is not None]
        assert bool(chunks) == chunked, length
        admit = next(a for c in sent if isinstance(c, Step) for a in c.admits)
        assert (len(admit.prompt), admit.start) == (length, 8192 if chunked else 0)
        if chunked:
            assert [(c.start, len(c.tokens)) for c in chunks] == [(0, 8192)]


def test_taking_a_finished_request_forgets_it():
    # a server takes each request's tokens once: the request leaves `finished` (a long-running
    # server would otherwise keep every id it ever served there)
    import pytest

    from protocol.errors import ConfigError

    config = ProtocolConfig(buckets=(1, 2), max_batch=2)
    ctrl, _, _, _, action = drive(config, [Request(0, (1,), max_tokens=2),
                                           Request(1, (2,), max_tokens=2)])
    assert isinstance(action, Done) and sorted(ctrl.finished) == [0, 1]
    assert ctrl.take_finished(0) == [7, 7]
    assert ctrl.finished == [1]
    assert ctrl.take_finished(1) == [7, 7] and ctrl.finished == []
    with pytest.raises(ConfigError, match="request 0 is unknown"):
        ctrl.take_finished(0)


def test_no_request_is_taken_after_shutdown_or_failure():
    import pytest

    from protocol.controller import Controller
    from protocol.errors import ConfigError

    config = ProtocolConfig(buckets=(1, 2), max_batch=2)
    closing = Controller(config)
    closing.submit(Request(0, (1,)))
    closing.shutdown()
    with pytest.raises(ConfigError, match="request 1 submitted after shutdown"):
        closing.submit(Request(1, (1,)))
    assert list(closing.requests) == [0]
    ctrl, _, _, _, _ = drive(config, [Request(0, (1,))], fail=(1, "record"))
    assert ctrl.phase == "failed" and not ctrl.closing
    with pytest.raises(ConfigError, match=r"^request 5 submitted after the run failed \("):
        ctrl.submit(Request(5, (1,)))


def test_a_rank_holding_more_graph_bytes_at_finalize_than_the_reserve_fails_the_run():
    # I9 at Finalize: the graphs captured at startup may not hold more than MeasureGraphs
    # reserved before the KV cache was sized; rank 1 holds 50 bytes more per graph
    from protocol.controller import Abort
    from protocol.errors import RankFailure
    from tests.protocol.driver import FakeBackend

    class Heavier(FakeBackend):
        def run(self, op):
            if op.name == "upload":
                self.graph_bytes += 50
            return super().run(op)

    config = ProtocolConfig(buckets=(1, 2), max_batch=2)
    ctrl, _, _, sent, action = drive(config, [Request(0, (1,))],
                                     backends=[FakeBackend(0), Heavier(1)])
    assert isinstance(action, Abort) and isinstance(action.error, RankFailure)
    assert action.error.invariant == "I9" and action.error.failed == (1,)
    assert "rank 1 holds 300 graph bytes, above the reserve of 200" in str(action.error)
    assert type(sent[-1]).__name__ == "Finalize" and not any(isinstance(c, Step) for c in sent)
    assert ctrl.phase == "failed"


def test_a_rank_reporting_another_captured_graph_set_at_finalize_fails_the_run(monkeypatch):
    # I3 at Finalize: every rank must report the plan's key set; rank 1 lost one graph
    import dataclasses

    from protocol.commands import Finalize
    from protocol.controller import Abort
    from protocol.errors import RankFailure
    from protocol.keys import GraphKey
    from protocol.worker import Worker

    real = Worker.reply

    def reply(self, command, results):
        out = real(self, command, results)
        if self.rank == 1 and isinstance(command, Finalize):
            lost = dataclasses.replace(out.payload, captured=out.payload.captured - {GraphKey(2)})
            out = dataclasses.replace(out, payload=lost)
        return out

    monkeypatch.setattr(Worker, "reply", reply)
    config = ProtocolConfig(buckets=(1, 2), max_batch=2)
    ctrl, _, _, sent, action = drive(config, [Request(0, (1,))])
    assert isinstance(action, Abort) and isinstance(action.error, RankFailure)
    assert action.error.invariant == "I3" and action.error.failed == (1,)
    assert "rank 1 captured a different graph set (missing ['decode@2'], extra [])" in str(
        action.error)
    assert type(sent[-1]).__name__ == "Finalize" and not any(isinstance(c, Step) for c in sent)


def _worker_with_requests_1_and_2():
    """A worker of 2 slots and 8 KV pages of 4 tokens whose slots 0 and 1 hold requests 1 and
    2 (one token each, on pages 0 and 1)."""
    from protocol.commands import Admit, AllocateKV, PageAssign
    from protocol.eligibility import GraphPlan
    from protocol.worker import Worker

    config = ProtocolConfig(buckets=(1, 2), max_batch=2, cuda_graphs=False)
    worker = Worker(0, 2, GraphPlan.from_config(config), 2)
    alloc = AllocateKV(0, pages=8, batch_cap=2, page_size=4)
    worker.reply(alloc, [None] * len(worker.ops_for(alloc)))
    worker.ops_for(Step(1, admits=(Admit(1, 0, (1,)), Admit(2, 1, (1,))),
                        pages=(PageAssign(1, 0, 0, (0,)), PageAssign(2, 1, 0, (1,)))))
    return worker


def test_a_worker_refuses_a_step_whose_rows_are_not_its_slots():
    # the worker checks each step's rows against its own slot map: a row naming another
    # request, or a live slot without its row, poisons the rank instead of decoding garbage
    import pytest

    from protocol.commands import DecodeRow
    from protocol.errors import SlotError

    worker = _worker_with_requests_1_and_2()
    with pytest.raises(SlotError, match="row 1 names slot 1 request 9, but slot 1 holds 2"):
        worker.ops_for(Step(2, rows=(DecodeRow(0, 1, 5, 1), DecodeRow(1, 9, 5, 1)), bucket=2))
    with pytest.raises(SlotError, match="1 decode rows and 0 admissions for 2 live slots"):
        worker.ops_for(Step(3, rows=(DecodeRow(0, 1, 5, 1),), bucket=1))


# -- added for the survivors of the 2026-12-06 sample of 150 (docs/mutation.md) ------------------

def test_closing_is_true_once_shutdown_is_called():
    # the simulator's world stops feeding arrivals on `closing`; None would read as open
    from protocol.controller import Controller

    ctrl = Controller(ProtocolConfig(buckets=(1, 2), max_batch=2))
    assert ctrl.closing is False
    ctrl.shutdown()
    assert ctrl.closing is True


def test_a_trace_event_survives_a_json_round_trip():
    import json

    from protocol.trace import TraceEvent

    event = TraceEvent("rank1", "op", "launch", 7, 1, "decode@8", False, 2.5, ("a", "b"))
    back = TraceEvent.from_json(json.loads(json.dumps(event.to_json())))
    assert back == event and isinstance(back.data, tuple)
    assert TraceEvent.from_json({k: v for k, v in event.to_json().items() if k != "data"}) == \
        event._replace(data=())


def test_a_last_chunk_whose_pages_exactly_fill_the_pool_is_admitted():
    # 3 pages of 4 tokens and one request of 11 prompt tokens and 2 new tokens (12 tokens, 3
    # pages): the chunks of 3 tokens take all 3 pages, so the last chunk needs no page and the
    # pool has none free -- a growth equal to the free count fits
    from tests.protocol.driver import PAGE_BYTES, PagedBackend, drive as drive_paged

    config = ProtocolConfig(world_size=1, max_prefill_tokens=3, buckets=(1, 2), max_batch=2,
                            kv_page_bytes=PAGE_BYTES, page_size=4, kv_watermark=0.0)
    request = Request(0, tuple(range(10, 21)), max_tokens=2)
    ctrl, _, _, sent, action = drive_paged(config, [request], backends=[PagedBackend(0, 3)],
                                           pages_per_seq=3, max_iter=200)
    assert isinstance(action, Done), action
    assert len(ctrl.outputs[0]) == 2
    last = next(a for c in sent if isinstance(c, Step) for a in c.admits)
    assert (last.start, len(last.prompt)) == (9, 11)


def test_graphs_that_take_no_new_memory_reserve_nothing():
    # a graph recorded into memory the pool already holds adds 0 bytes: its reserve is 0, not 1
    from tests.protocol.driver import FakeBackend

    class PooledGraphs(FakeBackend):
        def run(self, op):
            result = super().run(op)
            self.graph_bytes = 0  # every record lands in memory already held
            return result

    config = ProtocolConfig(buckets=(1, 2, 4), max_batch=4)
    ctrl, _, _, _, action = drive(config, [Request(0, (1, 2), max_tokens=2)],
                                  backends=[PooledGraphs(r) for r in range(config.world_size)])
    assert isinstance(action, Done)
    assert ctrl.memory.graph_reserve_bytes == 0


def test_a_worker_names_the_hole_a_retirement_without_its_compaction_leaves():
    # the controller must move the last slot into a retired one; a step that does not leaves a
    # hole, and the worker says so, rather than a row mismatch that hides the cause
    import pytest

    from protocol.commands import DecodeRow, Retire
    from protocol.errors import SlotError

    worker = _worker_with_requests_1_and_2()
    with pytest.raises(SlotError, match=r"slots are not dense: occupied \[1\]"):
        worker.ops_for(Step(2, retires=(Retire(1, 0),), rows=(DecodeRow(0, 2, 5, 1),), bucket=1))
