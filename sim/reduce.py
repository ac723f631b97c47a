"""The domain reducer: fewer context switches, same verdict.

A failing schedule is rewritten as the points where it switches actor; the `Sticky` scheduler
replays it exactly. Then switch points are removed (ddmin-style: halves, quarters, ... and last
one at a time) while the failure stays the same and the run gets no longer: the shortest run
found wins, and of runs as short the one with fewer switches. The result reads as a short story
because each remaining switch is one that matters: given the budget to finish, it is 1-minimal
-- without any one of its switches (`switches_of`) the failure is gone or the run is longer.
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
    """Same verdict, same invariant and the same check (`sim.common.Outcome.check`): one rule
    of an invariant is never traded for another while reducing."""
    x, y = a.outcome, b.outcome
    return x.verdict == y.verdict and x.invariant == y.invariant and x.check == y.check


def switches_of(scenario: Scenario, variant, run: RunResult) -> dict[int, str]:
    """Step -> actor at each switch of ``run`` that is a choice, not forced because the actor
    running blocked (`Sticky.effective` of a replay): what the reducer counts and removes.
    `Sticky` with these alone replays ``run``."""
    sticky = Sticky(switch_points(run.choices))
    run_schedule(scenario, variant, sticky)
    return sticky.effective


def reduce_schedule(scenario: Scenario, variant, failing: RunResult,
                    time_budget: float = 2.0, max_attempts: int | None = None) -> RunResult:
    """A run with the same failure as ``failing``, no longer, with as few switches as found in
    ``time_budget`` seconds -- or, when ``max_attempts`` is given, in that many re-runs, which
    makes the result independent of machine speed (the generated docs rely on that).

    A removal is taken when the failure stays and the run is no longer than the best so far (a
    tie in actions goes to the run with fewer switches); the switches that run took are the
    next to remove. With the budget to finish, the last pass has tried removing each remaining
    switch alone, and each time lost the failure or made the run longer (1-minimal). A
    reduction that ends on the schedule it was given returns ``failing`` itself, so an outcome
    a caller refined (`sim.checks.attribute_divergence`) survives reducing a reduced run."""
    start = time.perf_counter()
    attempts = [0]

    def out_of_budget() -> bool:
        if max_attempts is not None:
            return attempts[0] >= max_attempts
        return time.perf_counter() - start >= time_budget

    runs: dict[tuple[tuple[int, str], ...], tuple[RunResult, list[tuple[int, str]]]] = {}

    def run_keeping(kept: list[tuple[int, str]]) -> tuple[RunResult, list[tuple[int, str]]]:
        """The run that switches at ``kept`` (step, actor) and the switches it took: no more
        than were listed (one can lose its effect once an earlier one is gone). A run is a
        function of its switches, so one made before is looked up instead of made again."""
        key = tuple(kept)
        if key not in runs:
            sticky = Sticky(dict(kept))
            runs[key] = (run_schedule(scenario, variant, sticky), sorted(sticky.effective.items()))
        return runs[key]

    def attempt(kept: list[tuple[int, str]]) -> tuple[RunResult, list[tuple[int, str]]] | None:
        attempts[0] += 1  # a looked-up run counts too: the budget, so the result, stays as it was
        result, taken = run_keeping(kept)
        return (result, taken) if same_failure(result, failing) else None

    def given_if_same(run: RunResult) -> RunResult:
        return failing if run.choices == failing.choices else run

    empty = attempt([])
    if empty is not None and empty[0].actions <= failing.actions:
        return given_if_same(empty[0])
    best, keys = failing, sorted(switch_points(failing.choices).items())
    chunk = max(1, len(keys) // 2)
    while chunk >= 1 and not out_of_budget():
        removed_any = False
        i = 0
        while i < len(keys) and not out_of_budget():
            kept = attempt(keys[:i] + keys[i + chunk:])
            if kept is not None and kept[0].actions <= best.actions:
                best, keys = kept  # fewer switches, no more actions
                removed_any = True
            else:
                i += chunk
        if not removed_any:
            chunk //= 2
    return given_if_same(best)
