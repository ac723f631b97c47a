"""Faults everywhere: injected faults drawn from every op a run executes, and their coverage.

A fault names (kind, rank, op, occurrence). Rather than a fixed list of ops and the first few
calls, `fault_sites` runs the scenario once without faults and records every backend op every
rank executed, with its occurrence number and its phase (``sweep``: before the first serving
step; ``serving``: after), so a fault can land on any op of any rank at any occurrence across
the whole run -- capture record, prefill, eager steps, slot moves, replay preparation, serving
launches. `random_fault` picks a phase (each with equal chance, so serving is not drowned by
the sweep's many ops), then a site in it. The world counts fired faults per phase and per op
(`fault_coverage`), and `lockstep check` requires faults fired in both phases.

A variant whose bug shows only when something fails (an instantiate that raises, one that
hangs) names a `FaultFamily` -- the kind of fault and the op -- and the checker searches its
members (`FaultSearch`): every rank, and every call of that op a fault-free run of the same
scenario makes on that rank. The occurrence numbers therefore come from the scenario (how many
buckets, how many ranks, what the profile measures), never from the variant.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from sim.common import FAULT_OP_EVENT, fault_phase_event
from sim.scenario import FAULT_KINDS, Fault, Scenario

PHASES = ("sweep", "serving")

_SITES: dict = {}


def fault_sites(scenario: Scenario, seed: int = 0) -> dict[str, list[tuple[int, str, int]]]:
    """Phase -> [(rank, op name, occurrence)] of every op one fault-free run of the correct
    protocol executes (cached per scenario and seed)."""
    key = (scenario, seed)
    if key not in _SITES:
        from sim.run import run_schedule
        from sim.strategies import RandomWalk
        from sim.variants import CORRECT

        world = run_schedule(scenario.with_(faults=()), CORRECT, RandomWalk(seed)).world
        sites: dict[str, list] = {phase: [] for phase in PHASES}
        counts: Counter = Counter()
        phase = "sweep"
        for e in world.trace:
            if e.kind == "send" and e.what == "Step":
                phase = "serving"
            elif e.kind == "op" and e.ok and e.rank is not None:
                counts[(e.rank, e.what)] += 1
                sites[phase].append((e.rank, e.what, counts[(e.rank, e.what)]))
        _SITES[key] = sites
    return _SITES[key]


def random_fault(scenario: Scenario, index: int, seed: int) -> Fault:
    """A fault for run ``index``: a kind, then a phase, then any op site of that phase."""
    rng = random.Random(seed * 7919 + index)
    kind = rng.choice(FAULT_KINDS)
    sites = fault_sites(scenario, seed)
    phase = rng.choice([p for p in PHASES if sites[p]])
    rank, op, occurrence = rng.choice(sites[phase])
    delay = scenario.config.watchdog_timeout_s * rng.choice((0.1, 2.0))
    return Fault(kind, rank, op, occurrence, delay)


def fault_coverage(reached) -> str:
    """One line: faults fired per phase and per op, from a run's or a search's counters."""
    phases = ", ".join(f"{p} {reached.get(fault_phase_event(p), 0)}" for p in PHASES)
    ops = sorted(((k[len(FAULT_OP_EVENT):], v) for k, v in reached.items()
                  if k.startswith(FAULT_OP_EVENT) and v), key=lambda kv: (-kv[1], kv[0]))
    return f"faults fired: {phases}; by op: " + ", ".join(f"{op} {n}" for op, n in ops)


@dataclass(frozen=True)
class FaultFamily:
    """Faults of one ``kind`` on one backend ``op`` (or any op), at any rank and any call of it,
    optionally only in one phase of the run.

    Attributes:
        kind: a `sim.scenario.FAULT_KINDS` member (``"raise"``, ``"hang"``, ``"die"`` ...).
        op: backend op name (`protocol.backend.Op.name`), e.g. ``"instantiate"``; None: any op.
        phase: ``"sweep"`` or ``"serving"`` (see `PHASES`) to search only that phase's calls;
            None: the whole run.
        delay_s: extra seconds, for ``"slow"``.

    Raises:
        ValueError: ``kind`` is not a fault kind, or ``phase`` not a phase.
    """

    kind: str
    op: str | None = None
    phase: str | None = None
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {', '.join(FAULT_KINDS)}")
        if self.phase is not None and self.phase not in PHASES:
            raise ValueError(f"fault phase {self.phase!r} is not one of {', '.join(PHASES)}")

    def describe(self) -> str:
        """``"instantiate"``, ``"any op in serving"`` ... for messages."""
        what = self.op or "any op"
        return what + (f" in {self.phase}" if self.phase else "")

    def members(self, scenario: Scenario, variant, seed: int = 0) -> tuple[Fault, ...]:
        """Every (rank, op, occurrence) of the family in one fault-free run of ``variant``
        (under ``scenario``), as faults, in run order.

        Empty if that run never makes such a call (then no member can show the bug here).
        """
        from sim.run import run_schedule
        from sim.strategies import RandomWalk

        probe = run_schedule(scenario.with_(faults=()), variant, RandomWalk(seed))
        calls: Counter = Counter()
        found = []
        phase = "sweep"
        for e in probe.world.trace:
            if e.kind == "send" and e.what == "Step":
                phase = "serving"
            elif e.kind == "op" and e.ok and e.rank is not None:
                calls[(e.rank, e.what)] += 1
                if (self.op in (None, e.what)) and self.phase in (None, phase):
                    found.append(Fault(self.kind, e.rank, e.what, calls[(e.rank, e.what)],
                                       self.delay_s))
        return tuple(found)


@dataclass(frozen=True)
class FaultSearch:
    """Run index -> the scenario with one member of a fault family (picklable).

    Runs 0..len-1 take the members in a seeded random order, so a search of at least as many
    runs as members tries each one; later runs draw members at random.
    """

    base: Scenario
    faults: tuple[Fault, ...]
    seed: int

    def __len__(self) -> int:
        return len(self.faults)

    def __call__(self, index: int) -> Scenario:
        order = list(range(len(self.faults)))
        random.Random(self.seed).shuffle(order)
        if index < len(order):
            pick = order[index]
        else:
            pick = random.Random(self.seed * 7919 + index).randrange(len(order))
        return self.base.with_(faults=(self.faults[pick],))
