"""Overlapped scheduling (ProtocolConfig.decode_overlap): the controller builds step n+1 while
step n runs. Rows take their input tokens from the previous step's sampled ids on the device
(Step.feed), rank 0's reply carries the previous step's tokens (Step.read), a request that
stops on a stop token has one leftover row whose token is dropped. Whatever the workload, the
tokens are those of the step-locked protocol."""

import pytest
from hypothesis import given, settings, strategies as st

from protocol.commands import FED, Reply, Step
from protocol.config import ProtocolConfig
from protocol.controller import Done
from protocol.eligibility import GraphPlan
from protocol.errors import ProtocolError, ReplyError
from protocol.requests import Request
from protocol.worker import Worker
from tests.protocol.driver import PAGE_BYTES, PagedBackend, drive

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8, kv_page_bytes=PAGE_BYTES, page_size=4)


def _run(requests, overlap, pages=64, world_size=1, pages_per_seq=4, **kw):
    config = ProtocolConfig(world_size=world_size, decode_overlap=overlap, **SMALL, **kw)
    backends = [PagedBackend(r, pages) for r in range(world_size)]
    ctrl, workers, _, sent, action = drive(config, requests, backends=backends,
                                           pages_per_seq=pages_per_seq)
    return ctrl, workers, [s for s in sent if isinstance(s, Step)], action


def _requests(shapes, stops=frozenset()):
    return [Request(i, tuple(range(10 + i, 10 + i + p)), max_tokens=m, stop_token_ids=stops)
            for i, (p, m) in enumerate(shapes)]


def _stopping_workload():
    """Requests of which some stop on a stop token before their length (the PagedBackend's
    tokens are a hash of the sequence modulo 97, so a few common residues stop some)."""
    shapes = [(5, 12), (3, 12), (7, 10), (2, 12), (6, 11), (4, 12)]
    stops = frozenset(range(0, 97, 7))
    return _requests(shapes, stops)


def test_overlapped_rows_are_fed_from_the_previous_step_and_its_reply_reads_it():
    ctrl, _, steps, action = _run(_requests([(5, 6), (3, 8), (2, 4)]), overlap=True)
    assert isinstance(action, Done)
    assert all(s.overlap for s in steps)
    for prev, step in zip(steps, steps[1:]):
        assert step.read == (prev.seq if prev.samples else None)
        if step.rows:
            assert set(step.rows.tokens) == {FED}
            order = [r.request_id for r in prev.rows] + [a.request_id for a in prev.admits]
            assert [order[i] for i in step.feed] == list(step.rows.request_ids)
    assert steps[-1].read is not None and not steps[-1].samples  # the last tokens are read
    assert sorted(ctrl.finished) == [0, 1, 2]


def test_a_request_that_stops_gets_one_leftover_row_whose_token_is_dropped():
    requests = _stopping_workload()
    locked, _, _, _ = _run(requests, overlap=False)
    ctrl, _, steps, action = _run(requests, overlap=True)
    assert isinstance(action, Done)
    stopped = [r for r in requests if len(locked.outputs[r.request_id]) < r.max_tokens]
    assert stopped, "the workload must stop some request on a stop token"
    assert ctrl.outputs == locked.outputs
    for r in stopped:
        rows = [s for s in steps if r.request_id in s.rows.request_ids]
        # its prefill sampled the first token; one row per later token, and one more whose
        # token came after the stop token and was dropped
        assert len(rows) == len(locked.outputs[r.request_id])


def test_a_request_that_ends_by_length_gets_no_leftover_row():
    requests = _requests([(5, 6), (3, 1), (2, 4)])
    ctrl, _, steps, action = _run(requests, overlap=True)
    assert isinstance(action, Done)
    for r in requests:
        rows = sum(r.request_id in s.rows.request_ids for s in steps)
        assert rows == r.max_tokens - 1  # the first token comes from its prefill
        assert len(ctrl.outputs[r.request_id]) == r.max_tokens


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 9)), min_size=1, max_size=7),
       pages=st.integers(4, 24), budget=st.sampled_from([3, 5, 8192]),
       stops=st.sampled_from([frozenset(), frozenset(range(0, 97, 5)), frozenset(range(0, 97, 2))]),
       world_size=st.sampled_from([1, 2]))
def test_overlap_gives_the_step_locked_tokens_under_preemption_chunking_and_stops(
        shapes, pages, budget, stops, world_size):
    requests = _requests(shapes, stops)
    kw = dict(pages=pages, world_size=world_size, max_prefill_tokens=budget)
    locked, _, _, first = _run(requests, overlap=False, **kw)
    ctrl, workers, steps, action = _run(requests, overlap=True, **kw)
    assert isinstance(first, Done) and isinstance(action, Done), action
    assert ctrl.outputs == locked.outputs
    assert sorted(ctrl.finished) == sorted(locked.finished)
    assert all(w.pages.fingerprint() == () for w in workers)


def test_a_request_preempted_after_sampling_its_stop_token_finishes_and_is_not_recomputed():
    # two requests fill a tight pool; the younger is preempted in the very step in which the
    # token it sampled last -- a stop token -- is still unread
    found = 0
    for seed in range(40):
        shapes = [(3 + seed % 5, 9), (2 + seed % 3, 9), (4, 9)]
        requests = _requests(shapes, frozenset(range(seed % 7, 97, 4)))
        locked, _, _, _ = _run(requests, overlap=False, pages=4)
        ctrl, _, steps, action = _run(requests, overlap=True, pages=4)
        assert isinstance(action, Done)
        assert ctrl.outputs == locked.outputs, seed
        for r in requests:
            out = locked.outputs[r.request_id]
            preempted = [s for s in steps for p in s.preempts if p.request_id == r.request_id]
            readmitted = [a for s in steps for a in s.admits
                          if a.request_id == r.request_id and a.output_index == len(out)]
            if len(out) < r.max_tokens and preempted and not readmitted:
                found += 1
    assert found, "no seed preempted a request whose last unread token was a stop token"


def test_worker_refuses_a_step_that_does_not_read_the_previous_steps_tokens():
    config = ProtocolConfig(world_size=1, decode_overlap=True, **SMALL)
    worker = Worker(0, 1, GraphPlan.from_config(config), config.max_batch)
    worker.in_flight = Step(4, rows=(), admits=(), overlap=True)
    with pytest.raises(ProtocolError, match="reads the tokens of step 3, but the step before it "
                                            "with unread tokens is none"):
        worker.overlapped_tail(Step(5, overlap=True, read=3))


def test_rank0_reply_must_carry_the_previous_steps_token_count():
    ctrl, _, steps, _ = _run(_requests([(3, 4), (2, 4)]), overlap=True)
    config = ProtocolConfig(world_size=1, decode_overlap=True, **SMALL)
    # replay the run's controller up to a step that reads a two-request step, then answer short
    from protocol.controller import Broadcast, Controller
    c = Controller(config, pages_per_seq=4)
    workers = [Worker(0, 1, GraphPlan.from_config(config), config.max_batch)]
    backend = PagedBackend(0, 64)
    for r in _requests([(3, 4), (2, 4)]):
        c.submit(r)
    while True:
        action = c.next_action()
        assert isinstance(action, Broadcast)
        command = action.command
        if isinstance(command, Step) and command.read is not None:
            break
        if hasattr(command, "page_size"):
            backend.page_size = command.page_size
        ops = workers[0].ops_for(command)
        c.on_reply(workers[0].reply(command, [backend.run(op) for op in ops]))
    with pytest.raises(ReplyError, match=f"must carry 2 token ids in slot order \\(step "
                                         f"{command.read}'s rows, then admissions\\), got 1"):
        c.on_reply(Reply(0, command.seq, payload=(5,)))


def _collect_dropped(requests):
    """Serve ``requests`` overlapped; after each reply, what `dropped_tokens` names (it must be
    empty unless the reply being collected carries an earlier step's tokens)."""
    dropped = []

    def check(ctrl, command):
        got = ctrl.dropped_tokens()
        if not (isinstance(command, Step) and command.read is not None):
            assert got == frozenset(), (command, got)  # Teardown too, after the last read
        dropped.extend(sorted(got))

    config = ProtocolConfig(world_size=1, decode_overlap=True, **SMALL)
    ctrl, _, _, _, action = drive(config, requests, backends=[PagedBackend(0, 64)],
                                  pages_per_seq=4, after_reply=check)
    assert isinstance(action, Done)
    return ctrl, dropped


def test_dropped_tokens_name_each_leftover_row_in_the_reply_that_carries_it():
    requests = _stopping_workload()
    locked, _, _, _ = _run(requests, overlap=False)
    stopped = sorted(r.request_id for r in requests
                     if len(locked.outputs[r.request_id]) < r.max_tokens)
    ctrl, dropped = _collect_dropped(requests)
    assert stopped and sorted(dropped) == stopped  # one leftover row per stopped request
    assert ctrl.leftover_rows == len(dropped)
    assert ctrl.outputs == locked.outputs
    # a lone request that stops on its first token: its leftover row is the last one read
    lone = [Request(0, (10, 11), max_tokens=9, stop_token_ids=frozenset(range(97)))]
    ctrl, dropped = _collect_dropped(lone)
    assert dropped == [0] and ctrl.outputs[0] == _run(lone, overlap=False)[0].outputs[0]
