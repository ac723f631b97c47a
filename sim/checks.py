"""End-of-run checks: divergence detectors and trace invariants that turn a run into a verdict."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from protocol.errors import ProtocolError, RankFailure, StartupRefused, WatchdogExpired
from protocol.invariants import check_trace
from sim.common import Outcome
from sim.kv import next_token


def reference_tokens(request, vocab: int) -> list[int]:
    """The tokens ``request`` gets when it runs alone: the divergence oracle for sampled tokens.

    Each step reads the whole history (prompt, then every token generated so far), as the
    modelled model does from the request's KV slot.
    """
    return list(_reference(tuple(request.prompt), request.max_tokens,
                           frozenset(request.stop_token_ids), vocab))


@lru_cache(maxsize=4096)  # a search runs one workload's few requests thousands of times
def _reference(prompt: tuple[int, ...], max_tokens: int, stop: frozenset[int],
               vocab: int) -> tuple[int, ...]:
    history = list(prompt)
    out = []
    while len(out) < max_tokens:
        token = next_token(history, vocab)
        out.append(token)
        history.append(token)
        if token in stop:
            break
    return tuple(out)


class WrongToken(NamedTuple):
    """Where a request's sampled tokens first differ from running it alone.

    Attributes:
        request: the request id.
        index: the output index of its first wrong token (or where its outputs end early or
            run long).
        got: the tokens it was sampled.
        want: the tokens running it alone gives (`reference_tokens`).
    """

    request: int
    index: int
    got: list[int]
    want: list[int]


def first_wrong_token(world) -> WrongToken | None:
    """The first finished request (by id) whose tokens differ from running it alone, with
    its first wrong token, or None."""
    ctrl = world.ctrl
    for rid in sorted(ctrl.finished):
        got = ctrl.outputs[rid]
        want = reference_tokens(ctrl.requests[rid], world.scenario.vocab)
        if got != want:
            index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
            return WrongToken(rid, index, got, want)
    return None


def token_divergence(world) -> Outcome | None:
    """Requests whose sampled tokens differ from running them alone. The outcome names no
    invariant: this end-of-run comparison sees that a token is wrong, not which rule produced
    it (the direct checks name theirs at the step that breaks it); `attribute_divergence`
    then names the step that sampled the token. It used to name I12 whenever a replay had run
    and I11 otherwise, a guess that misnamed chunked-prefill and overlap bugs."""
    wrong = first_wrong_token(world)
    if wrong is None:
        return None
    rid, first, got, want = wrong
    return Outcome("divergence", f"request {rid} diverged at output token {first}: sampled "
                                 f"{got[first:first + 3]}, running alone gives {want[first:first + 3]}",
                   check="tokens")


def attribute_divergence(scenario, variant, result):
    """``result`` (a `sim.run.RunResult`) whose token divergence names the step that sampled
    the first wrong token: the run is replayed with a watch on that request's outputs, and the
    step is the command whose replies delivered the token (step-locked) or, for an overlapped
    step, the step whose tokens those replies carried (`Step.read`). Other results, and a
    divergence whose token cannot be found again, are returned unchanged. For reports: one
    extra run."""
    from dataclasses import replace

    from protocol.commands import Step
    from sim.run import run_schedule
    from sim.strategies import Replay

    outcome = result.outcome
    if outcome.verdict != "divergence" or outcome.step is not None:
        return result
    wrong = first_wrong_token(result.world)
    if wrong is None:
        return result
    rid, index = wrong.request, wrong.index
    steps: dict[int, Step] = {}
    found: list[int] = []

    def watch(world) -> None:
        current = world.ctrl.current
        if isinstance(current, Step):
            steps[current.seq] = current
        if found or len(world.ctrl.outputs.get(rid, ())) <= index:
            return
        seq = next(e.seq for e in reversed(world.trace)
                   if e.actor == "controller" and e.kind == "receive")
        step = steps.get(seq)
        found.append(step.read if step is not None and step.overlap else seq)

    run_schedule(scenario, variant, Replay(result.choices), on_state=watch)
    if not found or found[0] is None:
        return result
    detail = f"{outcome.detail} (the token step {found[0]} sampled)"
    return replace(result, outcome=replace(outcome, step=found[0], detail=detail))


def trace_violation(world) -> Outcome | None:
    """The first invariant the trace breaks, if any."""
    violations = check_trace(world.trace, world.config.shape.allreduce_bytes)
    if violations:
        v = violations[0]
        at = next((i for i, e in enumerate(world.trace) if e is v.event), None)
        return Outcome("invariant", f"{v.invariant} violated: {v.text}", v.invariant,
                       rank=v.rank, step=v.step, check=v.clause, at=at)
    return None


def final_checks(world) -> Outcome:
    """Verdict of a run that reached Done."""
    for check in (token_divergence, trace_violation):
        outcome = check(world)
        if outcome is not None:
            return outcome
    unfinished = [r for r in world.ctrl.requests if r not in world.ctrl.finished]
    if unfinished:
        return Outcome("divergence", f"requests {unfinished} never finished", check="unfinished")
    return Outcome("clean", f"{len(world.ctrl.finished)} requests served, teardown completed")


def abort_checks(world, error: ProtocolError) -> Outcome:
    """Verdict of a run the controller aborted, chosen from the error's fields (kind,
    invariant, failed rank), never from its text."""
    text = str(error)
    step = getattr(error, "step", None)
    if world.ctrl.watchdog.armed:
        return Outcome("invariant", f"I6 violated: the sweep failed ({text}) but the watchdog stays "
                                    f"armed; it aborts the healthy process at "
                                    f"t={world.ctrl.watchdog.deadline:g}s", "I6", step=step,
                           check="armed-after-failed-sweep")
    if world.dead:
        named = set(error.failed) if isinstance(error, RankFailure) else set()
        if not named or not named <= world.dead:
            blamed = (f"rank(s) {sorted(named)} as failed" if named else
                      "no failed rank, only the ranks not collected "
                      f"{sorted(getattr(error, 'uncollected', ()))}")
            return Outcome("invariant", f"I13 violated: rank(s) {sorted(world.dead)} died, but the "
                                        f"failure names {blamed}: {text}", "I13",
                           rank=min(world.dead), step=step, check="failure-names-other-ranks")
        return _dropped_requests(world, error) or Outcome("abort", f"rank failure: {text}",
                                                          rank=error.rank, step=step,
                                                          check="rank-died")
    dropped = _dropped_requests(world, error)
    if dropped is not None:
        return dropped
    match error:
        case StartupRefused():
            return Outcome("startup-refused", text, step=step, check=_reported(error))
        case RankFailure(kind="oom"):
            return Outcome("oom", text, "I9", rank=error.rank, step=step, check=_reported(error))
        case RankFailure(kind="divergence"):
            return Outcome("divergence", text, error.invariant, rank=error.rank, step=step,
                           check=_reported(error))
        case RankFailure(invariant=str() as invariant):
            return Outcome("invariant", text, invariant, rank=error.rank, step=step,
                           check=_reported(error))
    violation = trace_violation(world)
    if violation is not None:
        return violation
    kind = "watchdog" if isinstance(error, WatchdogExpired) else "rank failure"
    return Outcome("abort", f"{kind}: {text}", rank=getattr(error, "rank", None), step=step,
                   check=_reported(error))


def _reported(error: ProtocolError) -> str:
    """The check name of a failure the controller raised: ``rank:`` and the kind a rank's
    reply reported (`ProtocolError.kind`), or ``controller:`` and its own check's kind where no
    rank reported one (the Finalize checks, `RankFailure` without ``kinds``), so a rank's OOM
    and the controller's graph-reserve check never count as one failure."""
    source = "rank" if getattr(error, "kinds", None) else "controller"
    return f"{source}:{error.kind}"


def _dropped_requests(world, error: ProtocolError) -> Outcome | None:
    """I18: when the run fails, every request in flight (submitted, not finished) has an error;
    a request left without one waits forever for tokens that never come."""
    ctrl = world.ctrl
    silent = sorted(r for r in ctrl.requests
                    if r not in ctrl.finished and ctrl.request_error(r) is None)
    if not silent:
        return None
    return Outcome("invariant", f"I18 violated: the run failed ({error}) but request(s) "
                                f"{silent} in flight got no error: their callers wait forever",
                   "I18", rank=getattr(error, "rank", None), step=getattr(error, "step", None),
                   check="request-left-waiting")


def slot_divergence(world, rank: int, step) -> Outcome | None:
    """After rank ``rank`` ran ``step``: its slot map must equal the scheduler's (I8)."""
    # row i holds slot i (`Step` always holds `DecodeRows`): the columns give the map
    want = dict(enumerate(step.rows.request_ids))
    want.update({a.slot: a.request_id for a in step.admits})
    if step.chunk is not None:  # the request in chunked prefill holds the chunk slot
        want[step.chunk.slot] = step.chunk.request_id
    elif (holder := world.ctrl.chunk_holder()) is not None:
        want[world.ctrl.slots.chunk_slot] = holder
    got = world.workers[rank].slots.slots
    if got != want:
        diff = sorted(s for s in set(want) | set(got) if want.get(s) != got.get(s))
        s = diff[0]
        return Outcome("divergence", f"rank {rank}'s slot map differs from the scheduler's after "
                                     f"step {step.seq}: slot {s} holds request {got.get(s)} on the "
                                     f"rank but {want.get(s)} in the scheduler", "I8",
                       rank=rank, step=step.seq, check="slot-map-after-step")
    return None


def page_divergence(world, rank: int, step) -> Outcome | None:
    """After rank ``rank`` ran ``step``: its KV page tables must equal the controller's (I14)."""
    pool, pages = world.ctrl.pool, world.workers[rank].pages
    if pool is None or pages is None:
        return None
    if pool.tables == pages.tables:  # equal as they are: equal as lists too (the usual case)
        return None
    want = {r: list(p) for r, p in pool.tables.items()}
    got = {r: list(p) for r, p in pages.tables.items()}
    if got == want:
        return None
    request = min(r for r in set(want) | set(got) if want.get(r) != got.get(r))
    return Outcome("divergence", f"rank {rank}'s KV page table differs from the controller's after "
                                 f"step {step.seq}: request {request} holds pages "
                                 f"{got.get(request, [])} on the rank but {want.get(request, [])} "
                                 "in the controller", "I14", check="page-table-after-step")
