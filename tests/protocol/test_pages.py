"""KV pages on demand (I14): pool, worker page map, admission by free pages, preemption."""

import pytest
from hypothesis import given, settings, strategies as st

from protocol.commands import Admit, AllocateKV, DecodeRow, PageAssign, Preempt, SlotMove, Step
from protocol.config import ProtocolConfig
from protocol.controller import Abort, Controller, Done
from protocol.eligibility import GraphPlan
from protocol.errors import ConfigError, PageError
from protocol.pages import PageMap, PagePool, pages_for
from protocol.requests import Request
from protocol.worker import Worker
from tests.protocol.driver import PAGE_BYTES, PagedBackend, drive

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8, kv_page_bytes=PAGE_BYTES, page_size=4)


def test_pages_for_rounds_up():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_pool_hands_out_lowest_free_pages_and_takes_them_back():
    pool = PagePool(num_pages=6, page_size=4, max_pages_per_seq=3)
    a = pool.allocate(1, 5)
    assert (a.first_index, a.pages) == (0, (0, 1))
    assert pool.allocate(1, 8) is None            # two pages hold 8 tokens already
    b = pool.allocate(2, 4)
    assert b.pages == (2,)
    assert pool.release(1) == (0, 1)
    assert pool.allocate(2, 12).pages == (0, 1)   # freed pages are reused, lowest first
    assert pool.free_count == 3 and pool.held(2) == 3


def test_pool_refuses_more_than_it_has_or_one_sequence_may_hold():
    pool = PagePool(num_pages=3, page_size=4, max_pages_per_seq=2)
    with pytest.raises(PageError, match="above 2 per sequence"):
        pool.allocate(1, 9)
    pool.allocate(1, 8)
    with pytest.raises(PageError, match="needs 2 more pages, 1 are free"):
        pool.allocate(2, 8)
    with pytest.raises(PageError, match="watermark of 3 pages"):
        PagePool(num_pages=3, page_size=4, max_pages_per_seq=2, watermark_pages=3)


def test_admission_leaves_the_watermark_free_unless_nothing_runs():
    pool = PagePool(num_pages=4, page_size=4, max_pages_per_seq=4, watermark_pages=1)
    assert pool.can_admit(16, running=0)
    assert not pool.can_admit(16, running=1)
    assert pool.can_admit(12, running=1)


def test_page_map_checks_every_change_against_its_view():
    pages = PageMap(num_pages=4, page_size=4)
    pages.assign(PageAssign(1, 0, 0, (2,)))
    with pytest.raises(PageError, match="page 2 given to request 5 is still held by request 1"):
        pages.assign(PageAssign(5, 1, 0, (2,)))
    with pytest.raises(PageError, match="at index 0, but it holds 1 pages"):
        pages.assign(PageAssign(1, 0, 0, (3,)))
    with pytest.raises(PageError, match="outside \\[0, 4\\)"):
        pages.assign(PageAssign(6, 1, 0, (4,)))
    with pytest.raises(PageError, match="release of pages \\[3\\] from request 1, but it holds \\[2\\]"):
        pages.release(1, (3,))
    pages.check_row(DecodeRow(0, 1, 7, 3))
    with pytest.raises(PageError, match="writes position 4 \\(page index 1\\), but it holds 1"):
        pages.check_row(DecodeRow(0, 1, 7, 4))
    with pytest.raises(PageError, match="prefilled with 5 tokens but holds 1 pages"):
        pages.check_admit(Admit(1, 0, (1, 2, 3, 4, 5)))
    pages.release(1, (2,))
    pages.assign(PageAssign(5, 1, 0, (2,)))


def _serving_worker(pages=4):
    config = ProtocolConfig(**SMALL)
    worker = Worker(0, 1, GraphPlan.from_config(config), config.max_batch)
    worker.reply(AllocateKV(0, pages=pages, page_size=4), [None, None])
    return worker


def test_worker_poisons_itself_on_a_page_it_did_not_see_freed():
    worker = _serving_worker()
    worker.ops_for(Step(1, admits=(Admit(1, 0, (1, 2)),), pages=(PageAssign(1, 0, 0, (0,)),)))
    bad = Step(2, admits=(Admit(2, 1, (3,)),), rows=(DecodeRow(0, 1, 9, 2),),
               pages=(PageAssign(2, 1, 0, (0,)),))
    with pytest.raises(PageError, match="page 0 given to request 2 is still held by request 1"):
        worker.ops_for(bad)


def test_worker_emits_page_ops_after_slot_changes_and_frees_preempted_pages():
    worker = _serving_worker()
    worker.ops_for(Step(1, admits=(Admit(1, 0, (1, 2)), Admit(2, 1, (3,))),
                        pages=(PageAssign(1, 0, 0, (0,)), PageAssign(2, 1, 0, (1,)))))
    ops = worker.ops_for(Step(2, preempts=(Preempt(1, 0, (0,)),),
                              moves=(SlotMove(2, 1, 0),),
                              admits=(Admit(3, 1, (5, 6, 7, 8, 9)),),
                              pages=(PageAssign(3, 1, 0, (0, 2)),),
                              rows=(DecodeRow(0, 2, 4, 1),)))
    names = [op.name for op in ops]
    assert names[:3] == ["release_slot", "move_slot", "assign_pages"]
    assert ops[2].args == (1, 0, (0, 2))
    assert worker.pages.tables == {2: [1], 3: [0, 2]}


def test_step_before_allocate_kv_is_refused():
    config = ProtocolConfig(**SMALL)
    worker = Worker(0, 1, GraphPlan.from_config(config), config.max_batch)
    with pytest.raises(PageError, match="before the KV cache was allocated"):
        worker.ops_for(Step(0, admits=(Admit(1, 0, (1,)),)))


def _run(pages, requests, world_size=1, pages_per_seq=4, **kw):
    config = ProtocolConfig(world_size=world_size, **SMALL, **kw)
    backends = [PagedBackend(r, pages) for r in range(world_size)]
    ctrl, workers, _, sent, action = drive(config, requests, backends=backends,
                                           pages_per_seq=pages_per_seq)
    return ctrl, workers, sent, action


def _requests(shapes):
    return [Request(i, tuple(range(10 + i, 10 + i + p)), max_tokens=m)
            for i, (p, m) in enumerate(shapes)]


def test_page_exhaustion_preempts_and_every_request_gets_its_greedy_tokens():
    shapes = [(5, 9), (3, 12), (7, 6), (2, 10), (6, 8)]
    roomy, _, _, done = _run(64, _requests(shapes))
    tight, workers, sent, action = _run(5, _requests(shapes))
    assert isinstance(done, Done) and isinstance(action, Done)
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert sorted(tight.finished) == list(range(len(shapes)))
    assert tight.outputs == roomy.outputs
    recomputed = [a for s in sent if isinstance(s, Step) for a in s.admits if a.output_index]
    assert recomputed, "a preempted request must be re-admitted with its generated tokens"
    for admit in recomputed:
        request = _requests(shapes)[admit.request_id]
        assert admit.prompt[:len(request.prompt)] == request.prompt
        assert len(admit.prompt) == len(request.prompt) + admit.output_index
    assert workers[0].pages.tables == {}


def test_admission_is_by_free_pages_not_max_batch_times_pages_per_seq():
    # 8 slots x 4 pages would need 32 pages; 12 serve all eight requests at once
    ctrl, _, sent, action = _run(12, _requests([(3, 2)] * 8), kv_watermark=0.0)
    assert isinstance(action, Done)
    first = next(s for s in sent if isinstance(s, Step))
    assert len(first.admits) == 8
    assert sum(len(p.pages) for p in first.pages) == 8


def test_request_that_cannot_fit_alone_is_refused_naming_it():
    ctrl = Controller(ProtocolConfig(**SMALL), pages_per_seq=2)
    assert ctrl.config.page_size == 4
    # no pool yet: the bound is one full-length sequence, which every memory fit leaves room for
    with pytest.raises(ConfigError, match="request 1: 6 prompt tokens \\+ 4 new tokens need 3 KV "
                                          "pages, above the 2 one sequence may hold"):
        ctrl.submit(Request(1, tuple(range(6)), max_tokens=4))
    ctrl.submit(Request(2, tuple(range(5)), max_tokens=4))  # 8 tokens fed: 2 pages, fits
    assert ctrl._absorb(AllocateKV(3, pages=8, page_size=4), {}) is None
    assert [r.request_id for r in ctrl.pending] == [2] and 1 not in ctrl.requests
    with pytest.raises(ConfigError, match="request 3: 6 prompt tokens \\+ 4 new tokens need 3 KV "
                                          "pages, above the 2 one sequence may hold"):
        ctrl.submit(Request(3, tuple(range(6)), max_tokens=4))


def test_a_pool_smaller_than_one_sequence_fails_the_run_at_allocation():
    """Only a fit that breaks plan_memory's bound (a variant's `fit_memory`) gives a pool below
    one full-length sequence; a queued request that fits no longer is found at AllocateKV."""
    ctrl = Controller(ProtocolConfig(**SMALL), pages_per_seq=2)
    ctrl.submit(Request(1, tuple(range(5)), max_tokens=4))
    error = ctrl._absorb(AllocateKV(3, pages=1, page_size=4), {})
    assert isinstance(error, ConfigError) and "above the 1 one sequence may hold" in str(error)


def test_startup_needs_only_one_full_length_sequence_of_pages():
    _, _, sent, action = _run(4, _requests([(2, 3)]), pages_per_seq=4)
    assert isinstance(action, Done)
    assert next(c for c in sent if isinstance(c, AllocateKV)).pages == 4
    _, _, _, action = _run(3, _requests([(2, 3)]), pages_per_seq=4)
    assert isinstance(action, Abort) and "too few for even one sequence" in str(action.error)


def test_every_rank_applies_the_same_page_tables():
    _, workers, sent, action = _run(6, _requests([(5, 7), (3, 9), (6, 5), (2, 8)]), world_size=2)
    assert isinstance(action, Done)
    assert any(s.preempts for s in sent if isinstance(s, Step))
    assert workers[0].pages.fingerprint() == workers[1].pages.fingerprint() == ()


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=7),
       pages=st.integers(4, 20), watermark=st.sampled_from([0.0, 0.01, 0.2]))
def test_any_pool_that_holds_one_sequence_serves_every_request_with_unchanged_tokens(
        shapes, pages, watermark):
    roomy, _, _, _ = _run(64, _requests(shapes), kv_watermark=watermark)
    tight, workers, sent, action = _run(pages, _requests(shapes), kv_watermark=watermark)
    assert isinstance(action, Done), action
    assert tight.outputs == roomy.outputs
    for step in (s for s in sent if isinstance(s, Step)):
        handed = [p for a in step.pages for p in a.pages]
        assert len(handed) == len(set(handed))


@pytest.mark.parametrize("sizes", [(0, 16, 4), (8, 0, 4), (8, 16, 0)])
def test_a_page_pool_refuses_any_size_below_one(sizes):
    # pages, tokens per page, pages per sequence: each alone makes the pool unusable
    with pytest.raises(PageError, match="each must be at least 1"):
        PagePool(*sizes)


def test_a_pool_without_a_watermark_admits_into_its_last_free_page():
    """The default is no watermark: beside a running request, a prompt may take every page
    left (a mutation-run survivor: a default of one page went unnoticed)."""
    pool = PagePool(num_pages=4, page_size=4, max_pages_per_seq=4)
    pool.allocate(0, 8)  # a running request holds two pages
    assert pool.can_admit(8, running=1) and not pool.can_admit(9, running=1)
    assert PagePool(4, 4, 4, watermark_pages=1).can_admit(12, running=0)  # waived when alone
