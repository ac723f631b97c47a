"""Overlapped against step-locked scheduling on the synchronous driver, as a server drives the
controller: requests submitted while serving, finished requests taken as soon as they finish,
shutdown mid-run, a backend that cannot sample some tokens (NO_TOKEN), stop tokens, tiny KV
pools, chunked prefill, world sizes 1 and 2. Outputs, finished and failed requests and pages
must be the same (a reviewer's harness; it found `take_finished` crashing the overlapped
controller, and kills the mutants of the NO_TOKEN path and of the stop-token snapshot)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from protocol.commands import Step
from protocol.config import ProtocolConfig
from protocol.controller import Broadcast, Controller, Done, Idle
from protocol.eligibility import GraphPlan
from protocol.requests import Request
from protocol.worker import Worker
from tests.protocol.driver import PAGE_BYTES, deliver, PagedBackend

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8, kv_page_bytes=PAGE_BYTES, page_size=4)


class UnsampleableBackend(PagedBackend):
    """`PagedBackend` whose token is NO_TOKEN (None) when the modelled token is in ``bad``."""

    def __init__(self, rank, pages, bad):
        super().__init__(rank, pages)
        self.bad = bad

    def _next(self, slot, length):
        token = super()._next(slot, length)
        return None if token in self.bad else token


def serve(requests, later, overlap, pages, world_size, budget, take, shutdown_at, bad):
    """Drive controller and workers to Done; ``later``: step count -> requests submitted
    after that step's replies. Returns (outputs, finished, failed, page tables left)."""
    config = ProtocolConfig(world_size=world_size, decode_overlap=overlap,
                            max_prefill_tokens=budget, **SMALL)
    ctrl = Controller(config, pages_per_seq=4)
    workers = [Worker(r, world_size, GraphPlan.from_config(config), config.max_batch)
               for r in range(world_size)]
    backends = [UnsampleableBackend(r, pages, bad) for r in range(world_size)]
    later, pending = dict(later), list(requests)
    taken, failed, steps = {}, set(), 0
    for _ in range(20_000):
        if take:
            for rid in list(ctrl.finished):
                if rid in ctrl.failed_requests:
                    failed.add(rid)
                taken[rid] = ctrl.take_finished(rid)
        action = ctrl.next_action()
        if isinstance(action, Done):
            outputs = {**taken, **ctrl.outputs}
            tables = [w.pages.fingerprint() for w in workers] + [ctrl.pool.tables]
            return outputs, sorted(taken) + sorted(ctrl.finished), failed | ctrl.failed_requests, tables
        if isinstance(action, Idle):
            if pending:
                for request in pending:
                    ctrl.submit(request)
                pending = []
            elif later:
                for request in later.pop(min(later)):
                    ctrl.submit(request)
            else:
                ctrl.shutdown()
            continue
        assert isinstance(action, Broadcast), action
        command = action.command
        deliver(ctrl, workers, backends, command)
        if isinstance(command, Step):
            steps += 1
            for request in later.pop(steps, ()):
                ctrl.submit(request)
            if steps == shutdown_at and not later:  # every request submitted: shut down early
                ctrl.shutdown()
    raise AssertionError("the driver did not finish")


STOPS = st.sampled_from([frozenset(), frozenset(range(0, 97, 5)), frozenset(range(0, 97, 2)),
                         frozenset(range(3, 97, 7))])


@st.composite
def workloads(draw):
    stops = draw(STOPS)
    count = draw(st.integers(1, 12))
    requests = [Request(i, tuple(draw(st.lists(st.integers(0, 96), min_size=1, max_size=9))),
                        max_tokens=draw(st.integers(1, 8)),  # fits 4 pages of 4
                        stop_token_ids=stops if draw(st.booleans()) else frozenset())
                for i in range(count)]
    first = draw(st.integers(1, count))
    later: dict[int, list] = {}
    for request in requests[first:]:
        later.setdefault(draw(st.integers(1, 12)), []).append(request)
    return requests[:first], later


@settings(max_examples=150, deadline=None)
@given(work=workloads(), pages=st.sampled_from([4, 5, 6, 8, 12, 64]),
       world_size=st.sampled_from([1, 2]), budget=st.sampled_from([3, 5, 8192]),
       take=st.booleans(), shutdown_at=st.sampled_from([None, 1, 2, 3, 5]),
       bad=st.sampled_from([frozenset(), frozenset({3}), frozenset({3, 11, 50}),
                            frozenset(range(1, 97, 3))]))
def test_overlap_serves_a_live_workload_as_step_locked_does(work, pages, world_size, budget,
                                                            take, shutdown_at, bad):
    first, later = work
    run = dict(pages=pages, world_size=world_size, budget=budget, take=take,
               shutdown_at=shutdown_at, bad=bad)
    locked = serve(first, later, False, **run)
    outputs, finished, failed, tables = serve(first, later, True, **run)
    assert outputs == locked[0]
    assert finished == locked[1] and len(set(finished)) == len(finished)
    assert failed == locked[2]
    assert all(t in ((), {}) for t in tables) and all(t in ((), {}) for t in locked[3])
