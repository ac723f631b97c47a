"""I22 under the rest of serving: the short decode path with overlapped scheduling, mixed steps
(admissions and chunked prefill beside decode rows) and preemption (pages on demand).

Each step's key must be `GraphPlan.key_for` of its decode rows and the controller's longest
context -- the furthest decode row's position + 1, counted here from the step's own rows --
and never the short key while a row's context exceeds ``short_context``. The ranks'
`ShortTileBackend` reads one tile of ``short_context`` tokens per row on a short replay, so
the tokens must also equal those of the same run with the short path off."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from protocol.commands import Step
from protocol.config import ProtocolConfig
from protocol.controller import Broadcast, Controller, Done, Idle
from protocol.eligibility import GraphPlan
from protocol.keys import DECODE, SHORT
from protocol.requests import Request
from protocol.worker import Worker
from tests.protocol.driver import PAGE_BYTES, deliver, ShortTileBackend

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8, kv_page_bytes=PAGE_BYTES, page_size=4)
PAGES_PER_SEQ = 4
"""Pages one sequence may hold: 16 tokens of 4-token pages, so prompt + max_tokens <= 16."""


def serve(requests, later=(), *, short_context, short_max_bucket=8, overlap=False, pages=64,
          budget=8192, world_size=1):
    """Drive controller and workers to Done. ``later``: (step count, request) pairs submitted
    once that many steps were sent. Returns (outputs, the Steps sent, the controller)."""
    config = ProtocolConfig(world_size=world_size, decode_overlap=overlap,
                            max_prefill_tokens=budget, short_context=short_context,
                            short_max_bucket=short_max_bucket, **SMALL)
    ctrl = Controller(config, pages_per_seq=PAGES_PER_SEQ)
    plan = GraphPlan.from_config(config)
    workers = [Worker(r, world_size, plan, config.max_batch) for r in range(world_size)]
    backends = [ShortTileBackend(r, pages, short_context, len(plan.keys()))
                for r in range(world_size)]
    pending, waiting, steps = list(requests), sorted(later, key=lambda x: x[0]), []
    for _ in range(20_000):
        action = ctrl.next_action()
        if isinstance(action, Done):
            return dict(ctrl.outputs), steps, ctrl
        if isinstance(action, Idle):
            if pending:
                for request in pending:
                    ctrl.submit(request)
                pending = []
            elif waiting:
                ctrl.submit(waiting.pop(0)[1])
            else:
                ctrl.shutdown()
            continue
        assert isinstance(action, Broadcast), action
        command = action.command
        deliver(ctrl, workers, backends, command)
        if isinstance(command, Step):
            steps.append(command)
            while waiting and waiting[0][0] <= len(steps):
                ctrl.submit(waiting.pop(0)[1])
    raise AssertionError("the driver did not finish")


def check_keys(steps, ctrl, short_context) -> None:
    """Every step's key is `key_for` of its decode rows at their longest context, and no
    step replays the short path with a row past ``short_context`` tokens of context."""
    assert ctrl.plan.short_context == short_context
    for step in steps:
        if not step.rows:
            assert step.key is None, step
            continue
        longest = max(step.rows.positions) + 1
        assert (step.key, step.bucket) == ctrl.plan.key_for(len(step.rows), longest), step.seq
        if longest > short_context:
            assert step.key is None or step.key.path != SHORT, (step.seq, longest)


def served_as_without_the_short_path(requests, later=(), *, short_context, **run):
    """Serve with the short path on and off; check the keys and that the tokens agree.
    Returns the Steps sent with it on."""
    outputs, steps, ctrl = serve(requests, later, short_context=short_context, **run)
    off, off_steps, _ = serve(requests, later, short_context=None, **run)
    check_keys(steps, ctrl, short_context)
    assert outputs == off, short_context
    assert sorted(outputs) == sorted(r.request_id for r in requests) + sorted(
        r.request_id for _, r in later)
    # the schedule does not depend on the path: the same rows, admissions and preemptions
    assert [(s.rows, s.admits, s.preempts) for s in steps] == [
        (s.rows, s.admits, s.preempts) for s in off_steps]
    assert all(s.key is None or s.key.path == DECODE for s in off_steps)
    return steps


@st.composite
def workloads(draw, max_later=8):
    """Requests that fit one sequence's pages, some submitted while earlier ones decode."""
    count = draw(st.integers(1, 8))
    requests = []
    for i in range(count):
        prompt = draw(st.lists(st.integers(1, 96), min_size=1, max_size=9))
        requests.append(Request(i, tuple(prompt),
                                max_tokens=draw(st.integers(1, 16 - len(prompt)))))
    first = draw(st.integers(1, count))
    later = [(draw(st.integers(1, max_later)), r) for r in requests[first:]]
    return requests[:first], later


SHORT_CONTEXTS = st.integers(1, 16)
SHORT_CAPS = st.sampled_from([1, 2, 8])


@settings(max_examples=80, deadline=None)
@given(work=workloads(), short_context=SHORT_CONTEXTS, cap=SHORT_CAPS,
       world_size=st.sampled_from([1, 2]), pages=st.sampled_from([6, 64]))
def test_overlapped_steps_take_the_path_of_their_longest_row(work, short_context, cap,
                                                             world_size, pages):
    """Under overlap a step is built before the previous one's tokens are read; its rows
    (a finished request's leftover row included) still set its longest context."""
    first, later = work
    steps = served_as_without_the_short_path(first, later, short_context=short_context,
                                             short_max_bucket=cap, overlap=True,
                                             world_size=world_size, pages=pages)
    assert all(s.overlap for s in steps)


@settings(max_examples=80, deadline=None)
@given(work=workloads(), short_context=SHORT_CONTEXTS, cap=SHORT_CAPS,
       budget=st.sampled_from([3, 5, 8192]), overlap=st.booleans())
def test_mixed_steps_take_the_path_of_their_decode_rows(work, short_context, cap, budget,
                                                        overlap):
    """Admissions and prefill chunks beside decode rows: the path follows the decode rows
    only (their prefill runs eagerly, I21), whatever the prompts' lengths."""
    first, later = work
    served_as_without_the_short_path(first, later, short_context=short_context,
                                     short_max_bucket=cap, budget=budget, overlap=overlap)


@settings(max_examples=80, deadline=None)
@given(work=workloads(max_later=3), short_context=SHORT_CONTEXTS, cap=SHORT_CAPS,
       pages=st.sampled_from([4, 5, 6, 8]), overlap=st.booleans())
def test_preempted_and_readmitted_requests_take_the_path_of_their_longest_row(
        work, short_context, cap, pages, overlap):
    """A tiny pool preempts; a re-admitted request's rows continue at positions past its
    generated tokens, and those count toward the step's longest context."""
    first, later = work
    served_as_without_the_short_path(first, later, short_context=short_context,
                                     short_max_bucket=cap, pages=pages, overlap=overlap)


def _workload():
    """Eight requests of 2..8 prompt tokens and 5..9 new tokens (at most 16 tokens in all),
    four of them arriving while the first decode."""
    requests = []
    for i in range(8):
        prompt = tuple(range(1, 3 + (i * 5) % 7))
        requests.append(Request(i, prompt, max_tokens=min(16 - len(prompt), 5 + (i * 3) % 5)))
    return requests[:4], [(1 + i, r) for i, r in enumerate(requests[4:])]


def test_every_combination_meets_the_boundary_on_both_sides():
    """Over every short_context of the workload's contexts, the properties above meet what
    they are about: short replays and steps kept off the short path that are overlapped,
    mixed, after a preemption, and with a re-admitted request's row."""
    first, later = _workload()
    seen = set()
    for short_context in range(1, 17):
        for run in (dict(overlap=True), dict(budget=5), dict(pages=5),
                    dict(pages=5, overlap=True)):
            steps = served_as_without_the_short_path(first, later, short_context=short_context,
                                                     **run)
            readmitted = set()
            preempted = False
            for step in steps:
                preempted |= bool(step.preempts)
                readmitted |= {a.request_id for a in step.admits if a.output_index}
                if not step.rows:
                    continue
                path = step.key.path
                fits = max(step.rows.positions) + 1 <= short_context
                if step.overlap:
                    seen.add(("overlap", path, fits))
                if step.admits or step.chunk is not None:
                    seen.add(("mixed", path, fits))
                if preempted:
                    seen.add(("after a preemption", path, fits))
                if readmitted & set(step.rows.request_ids):
                    seen.add(("re-admitted row", path, fits))
    for what in ("overlap", "mixed", "after a preemption", "re-admitted row"):
        assert (what, SHORT, True) in seen, what
        assert (what, DECODE, False) in seen, what
    assert not any(path == SHORT and not fits for _, path, fits in seen)
