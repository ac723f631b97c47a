"""End-of-run checks: divergence detectors and trace invariants that turn a run into a verdict."""

from __future__ import annotations

from protocol.errors import ConfigError, ProtocolError, WatchdogExpired
from sim.invariants import check_trace
from sim.world import Outcome, token_fn


def reference_tokens(request, vocab: int) -> list[int]:
    """The tokens ``request`` gets when it runs alone: the divergence oracle for sampled tokens."""
    out = []
    position = len(request.prompt) - 1
    token = request.prompt[-1]
    while len(out) < request.max_tokens:
        token = token_fn(request.request_id, position, token, vocab)
        out.append(token)
        position += 1
        if token in request.stop_token_ids:
            break
    return out


def token_divergence(world) -> Outcome | None:
    """Requests whose sampled tokens differ from running them alone."""
    ctrl = world.ctrl
    for rid in sorted(ctrl.finished):
        got = ctrl.outputs[rid]
        want = reference_tokens(ctrl.requests[rid], world.scenario.vocab)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return Outcome("divergence", f"request {rid} diverged at output token {first}: sampled "
                                         f"{got[first:first + 3]}, running alone gives {want[first:first + 3]}",
                           "I12" if world.events["replay"] else "I11")
    return None


def trace_violation(world) -> Outcome | None:
    """The first invariant the trace breaks, if any."""
    violations = check_trace(world.trace, world.config.shape.allreduce_bytes)
    if violations:
        name, text = violations[0]
        return Outcome("invariant", f"{name} violated: {text}", name)
    return None


def final_checks(world) -> Outcome:
    """Verdict of a run that reached Done."""
    for check in (token_divergence, trace_violation):
        outcome = check(world)
        if outcome is not None:
            return outcome
    unfinished = [r for r in world.ctrl.requests if r not in world.ctrl.finished]
    if unfinished:
        return Outcome("divergence", f"requests {unfinished} never finished")
    return Outcome("clean", f"{len(world.ctrl.finished)} requests served, teardown completed")


def abort_checks(world, error: ProtocolError) -> Outcome:
    """Verdict of a run the controller aborted."""
    text = str(error)
    if world.ctrl.watchdog.armed:
        return Outcome("invariant", f"I6 violated: the sweep failed ({text}) but the watchdog stays "
                                    f"armed; it aborts the healthy process at "
                                    f"t={world.ctrl.watchdog.deadline:g}s", "I6")
    if isinstance(error, ConfigError) and "startup refused" in text:
        return Outcome("startup-refused", text)
    if "I5" in text:
        return Outcome("invariant", text, "I5")
    if "I3 violated" in text:
        return Outcome("divergence", text, "I3")
    if "I9 violated" in text:
        return Outcome("oom", text, "I9")
    if "out of memory" in text and "injected" not in text:
        return Outcome("oom", text, "I9")
    violation = trace_violation(world)
    if violation is not None:
        return violation
    kind = "watchdog" if isinstance(error, WatchdogExpired) else "rank failure"
    return Outcome("abort", f"{kind}: {text}")


def slot_divergence(world, rank: int, step) -> Outcome | None:
    """After rank ``rank`` ran ``step``: its slot map must equal the scheduler's (I8)."""
    want = {row.slot: row.request_id for row in step.rows}
    want.update({a.slot: a.request_id for a in step.admits})
    got = world.workers[rank].slots.slots
    if got != want:
        diff = sorted(s for s in set(want) | set(got) if want.get(s) != got.get(s))
        s = diff[0]
        return Outcome("divergence", f"rank {rank}'s slot map differs from the scheduler's after "
                                     f"step {step.seq}: slot {s} holds request {got.get(s)} on the "
                                     f"rank but {want.get(s)} in the scheduler", "I8")
    return None


def page_divergence(world, rank: int, step) -> Outcome | None:
    """After rank ``rank`` ran ``step``: its KV page tables must equal the controller's (I14)."""
    pool, pages = world.ctrl.pool, world.workers[rank].pages
    if pool is None or pages is None:
        return None
    want = {r: list(p) for r, p in pool.tables.items()}
    got = {r: list(p) for r, p in pages.tables.items()}
    if got == want:
        return None
    request = min(r for r in set(want) | set(got) if want.get(r) != got.get(r))
    return Outcome("divergence", f"rank {rank}'s KV page table differs from the controller's after "
                                 f"step {step.seq}: request {request} holds pages "
                                 f"{got.get(request, [])} on the rank but {want.get(request, [])} "
                                 "in the controller", "I14")
