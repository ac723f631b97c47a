"""The memory headroom a check draws per run, and the most headroom a scenario's memory allows.

`ProtocolConfig.memory_headroom_bytes` is what the protocol promises to leave free on every rank
once its graphs and KV cache are in place (an engine's ``gpu_memory_utilization`` share left to
other tenants, non-torch allocations and fragmentation: vLLM sizes its KV cache from
``gpu_memory_utilization x total`` less the profiled peak, and an engine that fills the whole
device instead OOMs later, at serving time). A headroom of 0, the only one the check used to run,
makes a protocol that ignores it, counts it twice or takes it off the wrong rank's report read
exactly as the correct one. So the correct protocol's rows draw it per run (`HeadroomDraw`),
and the simulator holds the protocol to its promise from both sides:

- a run that serves must have left the headroom free on every rank (`sim.world`'s direct I9
  check when serving starts);
- a run refused at startup must be one whose memory cannot hold even the smallest plan with
  that headroom (`refusal_expected`): refusing a configuration that fits is as wrong as
  serving one that does not.

The bound (`largest_headroom`) is computed from the modelled memory (`sim.scenario.MemoryModel`)
and the one graph plan (`protocol.eligibility.GraphPlan`, I7), not from the controller's fit:
the smallest plan keeps the graphs of the smallest bucket and one full-length sequence of KV
pages beside the reserved padding page (`protocol.memory.plan_memory`), on the tightest rank.

Which rows draw it: ``correct`` and ``correct-eager``, and the correct protocol under paging
pressure, chunked prefill, overlapped scheduling and the short path (``paged-kv-pressure``,
``chunked-prefill``, ``chunked-prefill-pressure``, ``overlapped-scheduling``,
``overlapped-eager``, ``correct-short-path``), where a fit that mishandles the headroom only
under that feature would otherwise read as correct (a capped KV pool, above all, leaves memory
free that an uncapped row's fit gives the KV cache). Two clean counterparts do not:
``overlap-two-communicators`` and ``dp-idle-rank-dummy-batch`` run two and eight schedules for
one interleaving or one idle lane each, which a refused run would spend, and their memory is
``correct``'s, already held to its headroom.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from protocol.eligibility import GraphPlan
from sim.scenario import MiB, Scenario


def largest_headroom(scenario: Scenario) -> int:
    """The largest ``memory_headroom_bytes`` with which ``scenario``'s memory still holds the
    smallest plan a correct protocol can start with (negative: none, not even 0): the tightest
    rank's room (`room`) less the smallest plan's need (`smallest_need`). The scenario's own
    headroom plays no part."""
    return room(scenario) - smallest_need(scenario)


def room(scenario: Scenario) -> int:
    """Bytes the tightest rank has for graphs, KV cache and headroom: what each rank reports
    before any graph exists, its free bytes less the eager profile's peak (a forward over the
    largest planned bucket, whose activations stay allocated), least over the ranks."""
    cfg, mem = scenario.config, scenario.memory
    peak = GraphPlan.from_config(cfg).buckets[-1] * mem.activation_per_row
    return min(mem.capacity - mem.weights - mem.overhead(r) - peak for r in range(cfg.world_size))


def smallest_need(scenario: Scenario) -> int:
    """Bytes of the smallest plan: the graphs of the smallest bucket -- every path the plan
    captures for it, in one pool -- and the KV pages of one full-length sequence plus the
    padding page (`protocol.memory.plan_memory`)."""
    cfg = scenario.config
    plan = GraphPlan.from_config(cfg)
    smallest = plan.fitted(plan.buckets[0]).keys()
    return (scenario.memory.graph_set_bytes(k.bucket for k in smallest)
            + (scenario.pages_per_seq + 1) * cfg.kv_page_bytes)


def refusal_expected(scenario: Scenario) -> bool:
    """Whether a correct protocol must refuse ``scenario`` at startup: its headroom is more
    than its memory leaves beside the smallest plan (`largest_headroom`)."""
    return scenario.config.memory_headroom_bytes > largest_headroom(scenario)


KINDS = ("roomy", "roomy", "over", "tight", "exact", "roomy")
"""What run ``i`` of a `HeadroomDraw` draws, ``KINDS[i mod 6]`` (run 0 keeps the base): every
kind within six consecutive runs, so that a row of a few schedules misses none, and five runs
in six serve, so that the serving interleavings the row is for are still searched.

- ``roomy``: uniform from 0 to the most that still keeps every graph of the full batch cap
  beside one sequence; the KV cache takes the rest. Half of these are more than half the
  bound, where a headroom counted twice no longer fits.
- ``over``: refused. The bound plus one byte in runs 2, 14, 26, ...; in runs 8, 20, 32, ...
  uniform above the bound by up to the tightest rank's whole room (a headroom past the
  device).
- ``tight``: uniform over the last `TIGHT_PAGES` KV pages and the graph set's bytes below the
  bound: the fit drops to a smaller batch cap and keeps fewer graphs (measured again, I9), or
  keeps a few KV pages only, so admission waits for pages (I14). Where ``max_kv_pages`` caps
  the pool (`sim.variants_paging.page_pressure`), only the pages below the cap count: a
  headroom that leaves the capped pool whole is a roomy one.
- ``exact``: the bound itself: one sequence of KV pages beside the smallest bucket's graphs.
"""

TIGHT_PAGES = 32
"""KV pages below the bound that a ``tight`` draw may leave, besides the graph set: from one
sequence (pressure on every admission) to about twice what the check's 17 short requests hold
at once."""

OVERHEAD_RANGE = (64 * MiB, 4096 * MiB)
"""Bytes already in use on one rank (NCCL buffers, another tenant) that half the draws add, so
that the tightest rank is not every rank and a headroom taken off another rank's report shows;
at least 64 MiB, well past the few KV pages' rounding a fit leaves over."""


@dataclass(frozen=True)
class HeadroomDraw:
    """Run index -> ``base`` with its ``memory_headroom_bytes`` drawn for that run (`KINDS`),
    and in half the runs one rank made the tightest by an overhead (`OVERHEAD_RANGE`);
    picklable, seeded by (``seed``, index). Run 0 keeps the base; a base whose memory holds no
    plan at all is kept for every run.

    ``within`` is a row's own per-run draw (run index -> scenario, e.g. a
    `sim.scenario.ShortPathDraw` over ``base``), drawn first: run i's headroom is drawn over
    run i's scenario of ``within``, since the bound depends on what that draw changes (the
    graph plan of a drawn ``short_context``). Build one with `HeadroomAfter`.
    """

    base: Scenario
    seed: int
    within: Callable[[int], Scenario] | None = None

    def __call__(self, index: int) -> Scenario:
        if self.within is not None:
            return HeadroomDraw(self.within(index), self.seed)(index)
        if index == 0:
            return self.base
        rng = random.Random(f"headroom {self.seed} {index}")
        overhead = None
        if rng.random() < 0.5:
            overhead = (rng.randrange(self.base.config.world_size), rng.randint(*OVERHEAD_RANGE))
        kind = KINDS[index % len(KINDS)]
        if kind == "over":
            kind = "one-over" if (index // len(KINDS)) % 2 == 0 else "far-over"
        return self.drawn(kind, rng, overhead)

    def drawn(self, kind: str, rng: random.Random,
              overhead: tuple[int, int] | None = None) -> Scenario:
        """``base`` with ``overhead`` -- (rank, bytes) -- added to that rank's and a headroom of
        ``kind`` (`KINDS`; ``over`` as ``one-over`` or ``far-over``) drawn from ``rng``; the
        base itself if its memory, with the overhead, holds no plan at all."""
        sc = self._with_overhead(overhead)
        bound = largest_headroom(sc)
        if bound < 0:
            return self.base
        cfg, mem = sc.config, sc.memory
        keys = GraphPlan.from_config(cfg).keys()
        # the most headroom that keeps every graph of the full batch cap beside one sequence
        full = max(0, room(sc) - mem.graph_set_bytes(k.bucket for k in keys)
                   - (sc.pages_per_seq + 1) * cfg.kv_page_bytes)
        match kind:
            case "roomy":
                headroom = rng.randint(0, full)
            case "one-over":
                headroom = bound + 1
            case "far-over":
                headroom = rng.randint(bound + 1, bound + max(1, room(sc)))
            case "tight":
                pages = TIGHT_PAGES
                if cfg.max_kv_pages is not None:  # past the cap, pages are left free anyway
                    pages = min(pages, max(0, cfg.max_kv_pages - sc.pages_per_seq))
                headroom = rng.randint(max(0, full - pages * cfg.kv_page_bytes), bound)
            case "exact":
                headroom = bound
            case _:
                raise ValueError(f"unknown headroom kind {kind!r}")
        return sc.with_(config=replace(cfg, memory_headroom_bytes=headroom))

    def _with_overhead(self, overhead: tuple[int, int] | None) -> Scenario:
        if overhead is None:
            return self.base
        rank, extra = overhead
        overheads = dict(self.base.memory.rank_overhead)
        overheads[rank] = overheads.get(rank, 0) + extra
        return self.base.with_(memory=replace(self.base.memory,
                                              rank_overhead=tuple(sorted(overheads.items()))))

    def members(self) -> list[Scenario]:
        """The scenarios a one-scenario search (exhaustive, Hypothesis) takes in turn, cheapest
        first: one byte past the bound and far past it (refused at startup: a few hundred
        states each), the bound itself, and three quarters of it -- past half, where a headroom
        counted twice no longer fits -- with the last rank made the tightest by the smallest
        overhead drawn. The headroom is startup arithmetic that no schedule changes, so only
        the last two serve, and the second stands for the base: its interleavings are the
        base's (an exhaustive search of both at buckets 1,2,4 found the same 2,991 distinct
        states), and what only a drawn run shows -- a headroom dropped, doubled or taken from
        another rank's report -- it shows as well. Each serving member costs a search as long as
        the base's, so two of them, not all the kinds (``tight`` is left to the sample search).
        With ``within``: these four over its run 0, then its own members (its run 0 if it lists
        none) at the base's headroom -- not every pairing, which would search four times over.
        """
        if self.within is not None:
            own = getattr(self.within, "members", None)
            return (HeadroomDraw(self.within(0), self.seed).members()
                    + (own() if own is not None else [self.within(0)]))
        rng = random.Random(f"headroom members {self.seed}")
        members = [self.drawn("one-over", rng), self.drawn("far-over", rng),
                   self.drawn("exact", rng)]
        busy = self._with_overhead((self.base.config.world_size - 1, OVERHEAD_RANGE[0]))
        bound = largest_headroom(busy)
        if bound >= 0:
            busy = busy.with_(config=replace(busy.config, memory_headroom_bytes=3 * bound // 4))
        return members + [busy if bound >= 0 else self.base]


@dataclass(frozen=True)
class HeadroomAfter:
    """A `sim.variants.Variant.draw` for a row that has a per-run draw of its own (``first``,
    a ``(scenario, seed) -> (run index -> scenario)`` such as `sim.scenario.ShortPathDraw`):
    each run draws ``first``'s scenario, then its headroom over it (`HeadroomDraw.within`);
    picklable."""

    first: Callable[[Scenario, int], Callable[[int], Scenario]]

    def __call__(self, base: Scenario, seed: int) -> HeadroomDraw:
        return HeadroomDraw(base, seed, within=self.first(base, seed))
