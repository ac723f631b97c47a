"""Chunked prefill (issue 12 item 2): a prompt longer than a step's prefill budget is written
into the paged KV cache over several steps, decode rows going on beside it; only the last
chunk samples."""

import pytest
from hypothesis import given, settings, strategies as st

from protocol.commands import Admit, Chunk, Step
from protocol.config import ProtocolConfig
from protocol.controller import Done
from protocol.errors import PageError, SlotError
from protocol.eligibility import GraphPlan
from protocol.requests import Request
from protocol.worker import Worker
from tests.protocol.driver import PAGE_BYTES, PagedBackend, drive

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8, kv_page_bytes=PAGE_BYTES, page_size=4)


def _run(requests, budget, pages=64, world_size=1):
    config = ProtocolConfig(world_size=world_size, max_prefill_tokens=budget, **SMALL)
    backends = [PagedBackend(r, pages) for r in range(world_size)]
    ctrl, workers, _, sent, action = drive(config, requests, backends=backends,
                                           pages_per_seq=8)
    return ctrl, workers, [c for c in sent if isinstance(c, Step)], action


def _requests(shapes):
    return [Request(i, tuple(range(10 + 3 * i, 10 + 3 * i + p)), max_tokens=m)
            for i, (p, m) in enumerate(shapes)]


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_beside_decode_rows():
    reqs = _requests([(3, 8), (11, 3)])
    whole, _, _, _ = _run(reqs, budget=32)
    ctrl, workers, steps, action = _run(reqs, budget=4, world_size=2)
    assert isinstance(action, Done)
    assert ctrl.outputs == whole.outputs  # same tokens as prefilling the prompt at once
    chunks = [s.chunk for s in steps if s.chunk is not None]
    assert [(c.request_id, c.start, c.end) for c in chunks] == [(1, 0, 1), (1, 1, 5),
                                                                 (1, 5, 9)]
    last = next(a for s in steps for a in s.admits if a.request_id == 1)
    assert (last.start, len(last.prompt)) == (9, 11)
    # decode rows of request 0 share the steps that carry request 1's chunks
    assert all(s.rows.request_ids == (0,) for s in steps if s.chunk is not None
               and s.chunk.start > 0)
    # a step carrying a chunk replays the graph of its decode rows (the chunk is not a row)
    assert all(s.key is not None and s.key.bucket == s.bucket == 1
               for s in steps if s.chunk is not None and s.rows)
    assert workers[0].pages.fingerprint() == workers[1].pages.fingerprint() == ()


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6)), min_size=1,
                       max_size=6),
       budget=st.integers(1, 12), pages=st.integers(8, 40))
def test_any_budget_and_pool_give_the_tokens_of_unchunked_prefill(shapes, budget, pages):
    reqs = _requests(shapes)
    whole, _, _, _ = _run(reqs, budget=64)
    ctrl, workers, steps, action = _run(reqs, budget=budget, pages=pages)
    assert isinstance(action, Done), action
    assert ctrl.outputs == whole.outputs
    for step in steps:  # every step stays within its prefill budget
        tokens = sum(len(a.tokens) for a in step.admits)
        assert tokens + (len(step.chunk.tokens) if step.chunk else 0) <= budget
    assert workers[0].pages.fingerprint() == ()


def test_page_pressure_preempts_the_chunked_prefill_first_and_restarts_it():
    reqs = _requests([(2, 16), (2, 16), (20, 2)])
    whole, _, _, _ = _run(reqs, budget=64)
    ctrl, _, steps, action = _run(reqs, budget=4, pages=8)
    assert isinstance(action, Done)
    assert ctrl.outputs == whole.outputs
    preempted = [p for s in steps for p in s.preempts]
    assert any(p.request_id == 2 and p.slot == 9 for p in preempted), preempted
    restarts = [s.chunk for s in steps if s.chunk is not None and s.chunk.request_id == 2
                and s.chunk.start == 0]
    assert len(restarts) >= 2


def _serving_worker():
    from protocol.commands import AllocateKV

    config = ProtocolConfig(world_size=1, **SMALL)
    worker = Worker(0, 1, GraphPlan.from_config(config), config.max_batch)
    worker.reply(AllocateKV(0, pages=16, page_size=4), [None, None])
    return worker


def test_worker_refuses_a_chunk_through_another_slot_or_without_its_pages():
    from protocol.commands import PageAssign

    worker = _serving_worker()
    with pytest.raises(SlotError, match="through slot 3, but the chunk slot is 9"):
        worker.ops_for(Step(1, chunk=Chunk(5, 3, 0, (1, 2))))
    worker = _serving_worker()
    with pytest.raises(PageError, match="writes positions 0..4 but it holds 1 pages"):
        worker.ops_for(Step(1, chunk=Chunk(5, 9, 0, (1, 2, 3, 4, 5)),
                            pages=(PageAssign(5, 9, 0, (0,)),)))
    worker = _serving_worker()
    ops = worker.ops_for(Step(1, chunk=Chunk(5, 9, 0, (1, 2, 3, 4, 5)),
                              pages=(PageAssign(5, 9, 0, (0, 1)),)))
    assert [op.name for op in ops] == ["assign_pages", "prefill", "synchronize"]  # no sample
    with pytest.raises(SlotError, match="chunk of request 6 at 5, but the chunk slot holds 5"):
        worker.ops_for(Step(2, chunk=Chunk(6, 9, 5, (1,))))


def test_the_last_chunk_moves_the_sequence_out_of_the_chunk_slot_and_samples():
    from protocol.commands import PageAssign

    worker = _serving_worker()
    worker.ops_for(Step(1, chunk=Chunk(5, 9, 0, (1, 2, 3, 4)), pages=(PageAssign(5, 9, 0, (0,)),)))
    ops = worker.ops_for(Step(2, admits=(Admit(5, 0, (1, 2, 3, 4, 5, 6), start=4),),
                              pages=(PageAssign(5, 0, 1, (1,)),)))
    assert [op.name for op in ops] == ["move_slot", "assign_pages", "prefill", "enqueue_sample",
                                       "synchronize", "read_tokens"]
    assert ops[0].args == (9, 0) and worker.slots.slots == {0: 5}
    worker = _serving_worker()
    with pytest.raises(SlotError, match="last chunk of request 5 \\(from 4\\) but the chunk "
                                        "slot holds None"):
        worker.ops_for(Step(1, admits=(Admit(5, 0, (1, 2, 3, 4, 5, 6), start=4),)))


def test_a_chunk_whose_pages_the_pool_lacks_waits_while_decode_rows_go_on():
    # 8 pages of 4 tokens: while requests 0 and 1 decode, request 2's fourth chunk (tokens
    # 8..10, a third page) does not fit; that step carries only the rows, nobody is preempted,
    # and the chunk follows once 0 and 1 retire
    reqs = _requests([(1, 8), (12, 4), (12, 1)])
    whole, _, _, _ = _run(reqs, budget=64, pages=8)
    ctrl, workers, steps, action = _run(reqs, budget=3, pages=8)
    assert isinstance(action, Done) and ctrl.preemptions == 0
    assert ctrl.outputs == whole.outputs
    chunks = [(s.chunk.start, s.chunk.end) for s in steps
              if s.chunk is not None and s.chunk.request_id == 2]
    assert chunks == [(0, 2), (2, 5), (5, 8), (8, 11)]
    first, fourth = (next(i for i, s in enumerate(steps)
                          if s.chunk is not None and s.chunk.request_id == 2 and s.chunk.start == k)
                     for k in (5, 8))
    waiting = steps[first + 1:fourth]
    assert waiting and all(s.chunk is None and not s.admits and s.rows.request_ids == (0, 1)
                           for s in waiting)
    last = next(a for s in steps for a in s.admits if a.request_id == 2)
    assert (last.start, len(last.prompt)) == (11, 12)
    assert workers[0].pages.fingerprint() == ()


def test_the_last_chunk_leaves_only_the_rest_of_the_budget_to_admissions():
    # budget 4: request 0's last chunk takes 2 tokens, so request 1 (3 tokens) no longer fits
    # the step whole; it starts its own chunked prefill with the 2 tokens left
    reqs = _requests([(6, 2), (3, 2)])
    whole, _, _, _ = _run(reqs, budget=64)
    ctrl, _, steps, action = _run(reqs, budget=4)
    assert isinstance(action, Done) and ctrl.outputs == whole.outputs
    for step in steps:
        tokens = sum(len(a.tokens) for a in step.admits)
        assert tokens + (len(step.chunk.tokens) if step.chunk else 0) <= 4
    last = next(s for s in steps if any(a.request_id == 0 for a in s.admits))
    assert [(a.request_id, a.start) for a in last.admits] == [(0, 4)]
    assert (last.chunk.request_id, last.chunk.start, last.chunk.end) == (1, 0, 2)


def test_the_last_chunk_takes_a_decode_slot_from_the_admissions_of_its_step():
    # two decode slots: request 0 holds one, request 1's last chunk takes the other, so
    # request 2 waits for a free slot although the step's prefill budget has room for it
    config = ProtocolConfig(world_size=1, max_prefill_tokens=6, **dict(SMALL, max_batch=2))
    reqs = _requests([(1, 6), (8, 2), (2, 2)])
    ctrl, _, _, sent, action = drive(config, reqs, backends=[PagedBackend(0, 64)],
                                     pages_per_seq=8)
    assert isinstance(action, Done)
    steps = [c for c in sent if isinstance(c, Step)]
    assert max(len(s.rows) + len(s.admits) for s in steps) == 2
    last = next(s for s in steps if any(a.request_id == 1 for a in s.admits))
    assert [a.request_id for a in last.admits] == [1] and last.rows.request_ids == (0,)
    assert sorted(ctrl.finished) == [0, 1, 2]


def test_the_last_chunk_takes_one_decode_slot_and_leaves_the_rest_to_admissions():
    # three decode slots: request 0 holds one, request 1's last chunk takes one, so request 2
    # is admitted beside that chunk, in the same step (a mutation-run survivor: the last
    # chunk counted for two slots and request 2 waited a step)
    config = ProtocolConfig(world_size=1, max_prefill_tokens=6, **dict(SMALL, max_batch=3))
    reqs = _requests([(1, 6), (8, 2), (2, 2)])
    ctrl, _, _, sent, action = drive(config, reqs, backends=[PagedBackend(0, 64)],
                                     pages_per_seq=8)
    assert isinstance(action, Done) and sorted(ctrl.finished) == [0, 1, 2]
    last = next(c for c in sent if isinstance(c, Step)
                and any(a.request_id == 1 for a in c.admits))
    assert [(a.request_id, a.start) for a in last.admits] == [(1, 5), (2, 0)], last.admits
    assert last.rows.request_ids == (0,)
