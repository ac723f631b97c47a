"""Where a schedule's cost goes: scheduling, the end-of-run trace check, and the actors' own work.

A random-walk schedule does three things: it asks `World.enabled` before every action and draws
a choice (scheduling), it runs the chosen actor's action (the actors' work: host ops, deliveries
and the controller's reactions, devices, collectives), and at the end it checks the trace
(`protocol.invariants.check_trace`, through `sim.checks.final_checks`). This tool records the
choice lists of some seeded schedules, then runs them again three ways: as the search runs them
(``full``), replaying the recorded choices without a readiness probe or a draw (``replay``: what
is left is the actors' work and the end-of-run checks), and replaying them with the trace check
left out (``replay-no-trace-check``). The differences split the cost. It answers "how much
could a reduction in actions or cheaper readiness gain at most" before one is built.

    PYTHONPATH=$PWD python tools/schedule_cost.py [--variant correct] [--topology shared]
                                                  [--schedules 20] [--repeat 3]

prints CPU time per schedule of each part (best of ``--repeat``). CPU time on a shared machine
varies by 20% from minute to minute; for a load-independent split, run one mode at a time under
valgrind (``--mode full``, ``--mode replay``, ``--mode replay-no-trace-check`` and ``--mode
none``, which only records) and subtract the ``I refs`` of ``--mode none`` from each:

    PYTHONPATH=$PWD valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \\
        python tools/schedule_cost.py --mode replay --schedules 6
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from sim.check import CheckSpec
from sim.run import freeze_imports, run_schedule
from sim.search import _chooser
from sim.variants import get_variant
from sim.world import World

MODES = ("full", "replay", "replay-no-trace-check")


def record(scenario, variant, schedules: int) -> list[list[tuple[int, str]]]:
    """Per schedule of the random walk (seed 0, indices 0..schedules-1), the actors chosen and
    how many times the world settled before each."""
    paths = []
    for i in range(schedules):
        world, chooser, path, settles = World(scenario, variant), _chooser("random", 0, i), [], 0
        while world.outcome is None:
            enabled = world.enabled()
            if not enabled:
                world.settle()
                settles += 1
                continue
            actor = enabled[0] if len(enabled) == 1 else chooser.choose(enabled, len(path))
            path.append((settles, actor))
            settles = 0
            world.step(actor)
        world.dispose()
        paths.append(path)
    return paths


def run(mode: str, scenario, variant, paths) -> None:
    """Run the recorded schedules once in ``mode`` (see the module docstring)."""
    if mode == "full":
        for i in range(len(paths)):
            run_schedule(scenario, variant, _chooser("random", 0, i)).world.dispose()
        return
    import sim.checks

    saved = sim.checks.trace_violation
    if mode == "replay-no-trace-check":
        sim.checks.trace_violation = lambda world: None
    try:
        for path in paths:
            world = World(scenario, variant)
            for settles, actor in path:
                for _ in range(settles):
                    world.settle()
                world.step(actor)
            if world.outcome is None:
                raise RuntimeError("a replayed schedule did not end where its recording did")
            world.dispose()
    finally:
        sim.checks.trace_violation = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="correct")
    p.add_argument("--topology", default="shared")
    p.add_argument("--schedules", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--mode", choices=MODES + ("none",),
                   help="run one mode once (for valgrind); default: time every mode")
    args = p.parse_args(argv)
    variant = get_variant(args.variant)
    scenario = variant.scenario(CheckSpec().scenario(args.topology))
    run_schedule(scenario, variant, _chooser("random", 0, 10**6)).world.dispose()  # warm caches
    paths = record(scenario, variant, args.schedules)
    freeze_imports()
    gc.disable()  # as the search loops run them (`sim.run.collector_off`)
    if args.mode is not None:
        if args.mode != "none":
            run(args.mode, scenario, variant, paths)
        return 0
    per = {}
    for mode in MODES:
        best = float("inf")
        for _ in range(args.repeat):
            start = time.process_time()
            run(mode, scenario, variant, paths)
            best = min(best, time.process_time() - start)
        per[mode] = 1000 * best / len(paths)
    actions = sum(len(path) for path in paths) / len(paths)
    full, replay, bare = per["full"], per["replay"], per["replay-no-trace-check"]
    print(f"{args.variant} / {args.topology}: {len(paths)} schedules, {actions:.0f} actions each; "
          f"CPU per schedule, best of {args.repeat}")
    print(f"  whole schedule              {full:7.2f} ms")
    print(f"  scheduling (probes, draws)  {full - replay:7.2f} ms  {100 * (full - replay) / full:4.1f}%")
    print(f"  end-of-run trace check      {replay - bare:7.2f} ms  {100 * (replay - bare) / full:4.1f}%")
    print(f"  the actors' work and rest   {bare:7.2f} ms  {100 * bare / full:4.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
