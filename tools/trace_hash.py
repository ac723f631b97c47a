"""A golden hash over what seeded runs of every shipped variant do, for speed work on the simulator.

A change meant only to make the simulator faster must leave every seeded run as it was: the same
choices, the same trace event for event, the same verdict and the same `reached` counters. This
tool runs every shipped variant under both topologies, under three scenarios (the variant's base
scenario or its per-run draw, a random fault per run as the correct protocol's faulted rows draw
it, and one member of the variant's own fault search where it has one), with random walk and
PCT, ``--runs`` runs each, and prints one SHA-256 over all of it (and, with ``--per-variant``,
one per variant, to find which one changed). Run it before and after a change; the hashes must be equal.

A known-bad variant's search is hashed on, past ``--runs``, to the first run that fails (at most
`CATCH_RUNS`), under the strategy and scenario family `lockstep check` searches it with: the
run that catches it is what its row stands on. Without it a bad variant whose bug shows only
from run 3 on (``short-path-first-row``: its controller takes the correct one's every decision
until a step's slot 0 fits the short path and a row behind it does not) hashed exactly the
correct protocol's runs, and its digest was ``correct-short-path``'s.

    PYTHONPATH=$PWD python tools/trace_hash.py [--runs 3] [--per-variant] [--variant NAME ...]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

from sim.check import CheckSpec, bad_search_setup, faulted_family, scenario_family
from sim.run import run_schedule
from sim.scenario import TOPOLOGIES
from sim.search import _chooser, run_length
from sim.variants import SHIPPED, get_variant

CATCH_RUNS = 12
"""Runs a known-bad variant's own search is hashed up to when none of the first ``--runs``
fails: past the first failing run of every shipped variant at the default configuration
(run 6 of ``overlap-one-staging-buffer``, its seventh), few enough that a row that cannot fail (not
reachable on one topology) costs a few runs more."""


def _scenarios(variant, spec: CheckSpec, topology: str):
    """(label, run index -> scenario) of every scenario hashed for ``variant``."""
    base = variant.scenario(spec.scenario(topology))
    # "base": the variant's scenario, or its per-run draw over it (`Variant.draw`)
    family = scenario_family(variant, base, spec.seed)
    out = [("base", family), ("random-fault", faulted_family(family, base, spec.seed))]
    if variant.fault_search is not None:
        scenario_for, _, reason = bad_search_setup(variant, spec, topology, base)
        if reason is None:
            out.append(("fault-search", scenario_for))
    return out


def _catch_label(variant, spec: CheckSpec) -> tuple[str, str] | None:
    """(label, strategy) of the scenario family and strategy `lockstep check` searches a
    known-bad ``variant`` with (its fault search, else its base or draw), or None for a
    protocol expected clean."""
    if variant.clean_everywhere:
        return None
    return ("fault-search" if variant.fault_search is not None else "base",
            spec.strategy_for(variant))


def _feed(h, result) -> None:
    o = result.outcome
    h.update(repr((o.verdict, o.invariant, o.rank, o.step, o.detail, o.cycle)).encode())
    h.update("\x00".join(result.choices).encode())
    h.update(repr(result.actions).encode())
    for event in result.world.trace:
        h.update(repr(tuple(event)).encode())
    h.update(repr(sorted(result.reached.items())).encode())


def variant_hash(name: str, runs: int, spec: CheckSpec) -> str:
    variant = get_variant(name)
    catch = _catch_label(variant, spec)
    h = hashlib.sha256()
    for topology in TOPOLOGIES:
        try:
            scenarios = _scenarios(variant, spec, topology)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be set up hashes its error
            h.update(f"setup error {type(exc).__name__}: {exc}".encode())
            continue
        for label, scenario_for in scenarios:
            for strategy in ("random", "pct"):
                try:
                    steps = run_length(scenario_for(0), variant, strategy, spec.seed)
                except Exception as exc:  # noqa: BLE001 - hashed as a run error, as below
                    h.update(f"run-length error {type(exc).__name__}: {exc}".encode())
                    continue
                last, caught = CATCH_RUNS if (label, strategy) == catch else runs, False
                for i in range(last):
                    h.update(f"{topology}/{label}/{strategy}/{i}".encode())
                    try:
                        result = run_schedule(scenario_for(i), variant,
                                              _chooser(strategy, spec.seed, i, steps))
                    except Exception as exc:  # noqa: BLE001
                        h.update(f"run error {type(exc).__name__}: {exc}".encode())
                        continue
                    _feed(h, result)
                    # a fault search's loud abort is the right answer to its fault, as in the check
                    caught = caught or result.outcome.verdict not in (
                        ("clean", "abort") if label == "fault-search" else ("clean",))
                    if i + 1 >= runs and caught:
                        break  # a known-bad variant's catch is hashed
    return h.hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--per-variant", action="store_true")
    parser.add_argument("--variant", action="append", default=[])
    args = parser.parse_args(argv)
    spec = CheckSpec()
    total = hashlib.sha256()
    start = time.process_time()
    for name in args.variant or SHIPPED:
        digest = variant_hash(name, args.runs, spec)
        total.update(f"{name}:{digest}".encode())
        if args.per_variant:
            print(f"{digest[:16]} {name}", flush=True)
    print(f"{total.hexdigest()} ({len(args.variant or SHIPPED)} variants, {args.runs} runs each, "
          f"{time.process_time() - start:.1f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
