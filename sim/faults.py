"""Faults everywhere: injected faults drawn from every op a run executes, and their coverage.

A fault names (kind, rank, op, occurrence). Rather than a fixed list of ops and the first few
calls, `fault_sites` runs the scenario once without faults and records every backend op every
rank executed, with its occurrence number and its phase (``sweep``: before the first serving
step; ``serving``: after), so a fault can land on any op of any rank at any occurrence across
the whole run -- capture record, prefill, eager steps, slot moves, replay preparation, serving
launches. `random_fault` picks a phase (each with equal chance, so serving is not drowned by
the sweep's many ops), then a site in it. The world counts fired faults per phase and per op
(`fault_coverage`), and `lockstep check` requires faults fired in both phases.
"""

from __future__ import annotations

import random
from collections import Counter

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
    phases = ", ".join(f"{p} {reached.get('fault_fired_' + p, 0)}" for p in PHASES)
    ops = sorted(((k[len("fault_op_"):], v) for k, v in reached.items()
                  if k.startswith("fault_op_") and v), key=lambda kv: (-kv[1], kv[0]))
    return f"faults fired: {phases}; by op: " + ", ".join(f"{op} {n}" for op, n in ops)
