"""The domain reducer: fewer context switches, same verdict.

A failing schedule is rewritten as the points where it switches actor; the `Sticky` scheduler
replays it exactly. Then switch points are removed (ddmin-style, preemptions first) while the
verdict stays the same, and the shortest surviving run wins. The result reads as a short story
because each remaining switch is one that matters.
"""

from __future__ import annotations

import time

from sim.run import RunResult, run_schedule
from sim.scenario import Scenario
from sim.strategies import Sticky


def switch_points(choices: list[str]) -> dict[int, str]:
    """Step -> actor at every step where the schedule changes actor (and at step 0)."""
    points = {}
    previous = None
    for i, actor in enumerate(choices):
        if actor != previous:
            points[i] = actor
        previous = actor
    return points


def same_failure(a: RunResult, b: RunResult) -> bool:
    """Same verdict, same invariant and, for a verdict no invariant names, the same check."""
    x, y = a.outcome, b.outcome
    return x.verdict == y.verdict and x.invariant == y.invariant and x.check == y.check


def reduce_schedule(scenario: Scenario, variant, failing: RunResult,
                    time_budget: float = 2.0, max_attempts: int | None = None) -> RunResult:
    """A run with the same verdict as ``failing`` and as few switches and actions as found in
    ``time_budget`` seconds -- or, when ``max_attempts`` is given, in that many re-runs, which
    makes the result independent of machine speed (the generated docs rely on that)."""
    start = time.perf_counter()
    best = failing
    points = switch_points(failing.choices)
    attempts = [0]

    def out_of_budget() -> bool:
        if max_attempts is not None:
            return attempts[0] >= max_attempts
        return time.perf_counter() - start >= time_budget

    runs: dict[tuple[int, ...], RunResult] = {}

    def run_keeping(kept: list[int]) -> RunResult:
        """The run that switches at the steps ``kept`` (of ``points``). A run is a function of
        its switches, so one made before is looked up instead of made again (the final run
        below is usually the last candidate that kept the failure)."""
        key = tuple(kept)
        if key not in runs:
            runs[key] = run_schedule(scenario, variant, Sticky({k: points[k] for k in kept}))
        return runs[key]

    def attempt(kept: list[int]) -> RunResult | None:
        attempts[0] += 1  # a looked-up run counts too: the budget, so the result, stays as it was
        result = run_keeping(kept)
        return result if same_failure(result, failing) else None

    empty = attempt([])
    if empty is not None and empty.actions <= best.actions:
        return empty
    keys = sorted(points)
    chunk = max(1, len(keys) // 2)
    while chunk >= 1 and not out_of_budget():
        removed_any = False
        i = 0
        while i < len(keys) and not out_of_budget():
            trial_keys = keys[:i] + keys[i + chunk:]
            result = attempt(trial_keys)
            if result is not None:
                keys = trial_keys
                removed_any = True
                if result.actions <= best.actions:
                    best = result
            else:
                i += chunk
        if not removed_any:
            chunk //= 2
    final = run_keeping(keys)
    if same_failure(final, failing) and final.actions <= best.actions:
        best = final
    return best
