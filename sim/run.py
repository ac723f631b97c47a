"""Run one schedule of a scenario and variant to its verdict."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from lockstep.args import one_line_repr
from protocol.errors import ConfigError
from sim.guard import counting_choices
from sim.scenario import Scenario
from sim.world import Outcome, World


@dataclass
class RunResult:
    """One run: its verdict, the choices that produced it, and what it reached.

    Attributes:
        outcome: the verdict.
        choices: the actor chosen at every action (replayable).
        actions: number of actions taken.
        reached: counters of interesting events (graph replays in serving, live-slot
            compaction moves, faults fired), for vacuity checks.
        world: the final world (trace in ``world.trace``).
    """

    outcome: Outcome
    choices: list[str] = field(default_factory=list)
    actions: int = 0
    reached: dict = field(default_factory=dict)
    world: World | None = None


COLLECT_EVERY = 500
"""Runs between the collections `collector_off` makes itself."""


@contextmanager
def collector_off():
    """The cyclic collector off for a block of runs (as `run_schedule` turns it off for one);
    yields ``ran()``, to be called after each run.

    For a search loop that calls `World.dispose` on each run it is done with: reference
    counting then frees those worlds at once, so the collector, off between the runs too,
    never scans a world alive (about 5% of a schedule's CPU when it did, once per run right
    after it ended). Faulted and failing runs still leave some cycles (exceptions with their
    tracebacks, wait-for graphs: 9-14 KB a run), so ``ran()`` collects every `COLLECT_EVERY`
    runs and a long serial search stays bounded.
    """
    automatic = gc.isenabled()
    gc.disable()
    runs = 0

    def ran() -> None:
        nonlocal runs
        runs += 1
        if runs % COLLECT_EVERY == 0:
            gc.collect()

    try:
        yield ran
    finally:
        if automatic:
            gc.enable()


def run_schedule(scenario: Scenario, variant, chooser, on_state=None,
                 deadline: float | None = None) -> RunResult:
    """Run until a verdict, asking ``chooser.choose(enabled, step)`` at every action where
    more than one actor is enabled; where only one is, that one runs, and a chooser with a
    ``on_forced(actor, step)`` method is told (`sim.strategies.Replay` checks it against its
    recording).

    Args:
        on_state: optional callback(world) after every action (for state counting).
        deadline: ``time.perf_counter()`` value past which the run stops with verdict
            ``budget`` (not a protocol verdict: the search ran out of time mid-run).
    Raises:
        ConfigError: a scenario, variant or chooser of the wrong kind, or a chooser of one's
            own that chose an actor not enabled.
    """
    # The cyclic collector finds nothing to free during a run (the world is alive throughout;
    # 0 objects in the runs measured), but its automatic passes scan the run's young objects
    # every few hundred allocations and promote them, so that the world, garbage once the run
    # is over, waits for a full collection. Off during the run, it scans a finished world about
    # once alive and once dead (see `freeze_imports`).
    chooser = _checked(scenario, variant, chooser)
    automatic = gc.isenabled()
    gc.disable()
    try:
        return _run(scenario, variant, chooser, on_state, deadline)
    finally:
        if automatic:
            gc.enable()


class _OwnChooser:
    """A chooser not of `sim.strategies`, whose every choice is checked against the enabled
    actors: a name no actor has was a KeyError deep in the world, and a disabled actor's would
    step it out of turn."""

    def __init__(self, chooser):
        self.chooser = chooser

    def choose(self, enabled: list[str], step: int) -> str:
        actor = self.chooser.choose(enabled, step)
        if actor not in enabled:
            raise ConfigError(f"chooser {type(self.chooser).__name__} chose {actor!r} at action "
                              f"{step}, which is not enabled (enabled: {', '.join(enabled)})")
        return actor


def check_scenario(scenario) -> None:
    """Refuse a ``scenario`` that is no `Scenario` (a function of the run index, say, where a
    search takes one scenario).

    Raises:
        ConfigError: one line naming the value.
    """
    if not isinstance(scenario, Scenario):
        hint = (": a function of the run index is what sample_search takes; call it, or pass "
                "a Scenario" if callable(scenario) else "")
        raise ConfigError(f"scenario {one_line_repr(scenario, 60)}: expected a Scenario "
                          f"(sim.scenario.default_scenario makes one){hint}")


def check_variant_arg(variant) -> None:
    """Refuse a ``variant`` that is no `sim.variants.Variant` (its name, say).

    Raises:
        ConfigError: one line naming the value.
    """
    from sim.variants import REGISTRY, Variant

    if not isinstance(variant, Variant):
        hint = (f": sim.variants.get_variant({variant!r}) gives the variant of that name"
                if isinstance(variant, str) and variant in REGISTRY else
                " (sim.variants.get_variant('correct'), or one of your own)")
        raise ConfigError(f"variant {one_line_repr(variant, 60)}: expected a Variant{hint}")


def _checked(scenario, variant, chooser):
    """``chooser`` as the run uses it (see `_OwnChooser`); raises ConfigError naming an
    argument of the wrong kind, before the world is built."""
    from sim.strategies import PCT, Drawn, RandomWalk, Replay, Sticky

    check_scenario(scenario)
    check_variant_arg(variant)
    if scenario.faults:
        known = variant.fault_ops()
        for fault in scenario.faults:
            if fault.op not in known:  # it would never fire, and the run would read clean
                raise ConfigError(f"fault op {one_line_repr(fault.op, 40)} is no op of "
                                  f"{variant.name}'s runs; one of {', '.join(known)}")
    if isinstance(chooser, (list, tuple)) or hasattr(chooser, "__array__"):
        # a numpy array has a choose method of its own, which failed deep inside the run
        raise ConfigError(f"chooser {one_line_repr(chooser, 60)}: a sequence of choices; "
                          "wrap a list of actor names in Replay(choices)")
    if isinstance(chooser, type) or not callable(getattr(chooser, "choose", None)):
        raise ConfigError(f"chooser {one_line_repr(chooser, 60)}: expected an object with a "
                          "choose(enabled, step) method, such as RandomWalk(seed)")
    if type(chooser) in (RandomWalk, PCT, Replay, Sticky, Drawn):
        return chooser
    return _OwnChooser(chooser)


def _run(scenario: Scenario, variant, chooser, on_state, deadline: float | None) -> RunResult:
    world = World(scenario, variant)
    choices: list[str] = []
    # bound once: this loop runs once per action
    enabled_now, advance, record, choose = world.enabled, world.step, choices.append, chooser.choose
    forced = getattr(chooser, "on_forced", None)  # told the actors no choice was asked for
    now = time.perf_counter
    with counting_choices(choices):  # the watchdog's progress: one choice per action
        # checked before every action: a variant's hook may take seconds per action (every
        # 1024th action let a 0.7 s hook overrun a 5 s budget by 35 s)
        while world.outcome is None:
            if deadline is not None and now() > deadline:
                world.outcome = Outcome("budget",
                                        f"time budget ended the run after {len(choices)} actions",
                                        check="time-budget")
                break
            enabled = enabled_now()
            if not enabled:
                world.settle()
                continue
            if len(enabled) == 1:
                actor = enabled[0]
                if forced is not None:
                    forced(actor, len(choices))
            else:
                actor = choose(enabled, len(choices))
            record(actor)
            advance(actor)
            if on_state is not None:
                on_state(world)
    return RunResult(world.outcome, choices, world.actions, dict(world.events), world)


def freeze_imports() -> None:
    """Leave every object alive now out of the cyclic collector's later passes.

    For a process about to search, after its imports (and a user's variant files): a
    finished run that is not disposed of (`World.dispose`, which the search loops call) leaves
    its world as cyclic garbage, and the collections that free it would scan the modules'
    objects too each time. Objects alive now are never collected afterwards, so call it once
    per process (docs/simulator-figures.md has the collector's share of a search).
    """
    gc.freeze()


def correct_run(scenario: Scenario) -> RunResult:
    """One fault-free run of the correct protocol under ``scenario``. Its serving steps do not
    depend on the schedule (the controller issues each step after every reply to the one
    before; `tests/sim/test_config_reach.py`), so what this run reaches every schedule reaches."""
    from sim.strategies import RandomWalk
    from sim.variants import CORRECT

    return run_schedule(scenario, CORRECT, RandomWalk(0))
