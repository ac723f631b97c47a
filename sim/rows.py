"""The rows of `lockstep check`, several at a time: one worker process per row in flight.

A default check has about 50 rows (every shipped variant under both topologies). Most are short (a
bad variant fails at its first schedule and is reduced in a few re-runs), a few are long (the
correct protocol's clean and faulted schedules). Parallelising inside each search leaves every
core but one idle during the short rows, and starts worker processes for each long search; here
whole rows go to `sim.workers.WorkerPool` workers instead, the longest first, and each row's
searches run serially in its worker. Every row is the same as when run alone: its searches are
seeded per run index, and a search's reported failure is its lowest-indexed failing run whatever
the number of processes, so the table does not depend on ``jobs``.

Used when there are more rows than jobs; with fewer (one variant, or a 10,000-schedule search of
the correct protocol) each search is parallel instead (`sim.search.sample_search`). Variants a
worker cannot look up by name (loaded from a user's file, registered at run time) run in this
process after the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from sim.check import CheckSpec, Row, check_variant, variant_spec
from sim.variants import REGISTRY, SHIPPED, Variant, get_variant


def expects_clean(variant: Variant) -> bool:
    """True for the correct protocol (under any scenario): clean in every topology."""
    return variant.clean_everywhere


def _row_task(spec: CheckSpec, task: tuple[str, str], deadline: float) -> list[Row]:
    """Worker side: the rows of one shipped variant in one topology (searches run serially)."""
    name, topology = task
    return check_variant(get_variant(name), spec, topology)


def _shipped(variant: Variant) -> bool:
    return variant.name in SHIPPED and REGISTRY.get(variant.name) is variant


def check_rows(variants: list[Variant], topologies: tuple[str, ...], spec: CheckSpec,
               on_rows: Callable[[list[Row], int], None] | None = None,
               progress=None) -> list[list[Row]]:
    """The rows of every (variant, topology), in that order.

    Args:
        on_rows: called with each finished (variant, topology)'s rows and the schedules it
            planned, as rows finish (in any order).
        progress: per-schedule callback for rows that run in this process.

    With ``spec.jobs > 1`` and more rows than jobs, shipped variants' rows run on worker
    processes (see the module docstring); otherwise every row runs here, each search with
    ``spec.jobs`` workers.
    """
    tasks = [(v, t) for v in variants for t in topologies]
    results: dict[int, list[Row]] = {}
    pooled = [i for i, (v, _) in enumerate(tasks) if _shipped(v)]
    if spec.jobs > 1 and len(tasks) > spec.jobs and len(pooled) > 1:
        _pool_rows(tasks, pooled, spec, results, on_rows)
    for i, (variant, topology) in enumerate(tasks):
        if i not in results:
            results[i] = check_variant(variant, spec, topology, progress)
            if on_rows is not None:
                on_rows(results[i], planned_schedules(variant, spec))
    return [results[i] for i in range(len(tasks))]


def planned_schedules(variant: Variant, spec: CheckSpec) -> int:
    """Schedules a check of ``variant`` in one topology plans, under its own caps."""
    spec = variant_spec(variant, spec)
    return spec.planned_clean + spec.fault_schedules if expects_clean(variant) else spec.schedules


def _pool_rows(tasks, pooled: list[int], spec: CheckSpec, results: dict, on_rows) -> None:
    """Run the ``pooled`` tasks on workers, longest first; a worker that dies leaves its task
    (and any not yet handed out) to the caller's serial loop."""
    from sim.workers import JobNotPicklable, WorkerError, WorkerPool

    order = sorted(pooled, key=lambda i: (not expects_clean(tasks[i][0]), i))
    serial_spec = replace(spec, jobs=1)
    # A row runs at most two searches of time_budget each plus its reductions; a stuck hook is
    # stopped inside the worker by the stall watchdog (sim.guard), this only bounds a silent one.
    deadline = time.perf_counter() + len(order) * (2 * spec.time_budget + 60.0)
    try:
        pool = WorkerPool(_row_task, serial_spec, min(spec.jobs, len(order)), deadline)
    except JobNotPicklable:
        return
    with pool:
        try:
            for position, _, rows in pool.results([(tasks[i][0].name, tasks[i][1]) for i in order]):
                i = order[position]
                results[i] = rows
                if on_rows is not None:
                    on_rows(rows, planned_schedules(tasks[i][0], spec))
        except WorkerError:
            return  # the rest run serially, where an error becomes that row's own error row


__all__ = ["check_rows", "expects_clean", "planned_schedules"]
