"""Memory reservation for the retained graph set, before the KV cache is sized (I9).

Each rank reports its free bytes, its eager peak activation (measured under TP without graphs)
and the bytes of each graph it recorded and instantiated without launching. The controller then
picks one effective batch cap and one KV page count for all ranks, from the tightest rank and the
largest graph figures, reserving *every* graph it keeps -- not only the largest (pegainfer #780,
PR #848 review; vLLM PR #30515) -- and sizing that reserve from the effective batch it fits, not
the requested one (pegainfer qwen35 TP graph PR: the oversized reserve starved capacity to zero).

KV pages are handed out on demand (I14, `protocol.pages`), so the KV cache need not hold every
slot at full length: the plan only needs room for one full-length sequence, which a lone request
can always use once the scheduler has preempted the others.
A cap of ``c`` rows keeps every bucket up to the one that holds ``c`` rows, and reserves exactly
those graphs (issue 13, item 1: a cap compared with bucket sizes left the full batch's bucket out).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protocol.buckets import select_bucket
from protocol.commands import MemoryReport
from protocol.errors import ConfigError, StartupRefused
from protocol.keys import GraphKey


@dataclass(frozen=True)
class MemoryPlan:
    """The controller's memory decision, the same for every rank.

    Attributes:
        batch_cap: the largest admitted batch (rows); graphs are kept for every bucket up to
            the one that holds it.
        kv_pages: KV pages each rank allocates.
        graph_reserve_bytes: bytes reserved for the retained graph set on each rank.
    """

    batch_cap: int
    kv_pages: int
    graph_reserve_bytes: int


def pages_needed(batch: int, pages_per_seq: int) -> int:
    """KV pages to hold ``batch`` sequences of full length (the padding page comes on top)."""
    return batch * pages_per_seq


MIN_SEQUENCES = 1
"""Full-length sequences the KV cache must hold at least: one, so that every request that fits
``max_model_len`` can finish (I14 preempts the others); more concurrency only helps throughput."""


def candidate_caps(buckets: tuple[int, ...], max_batch: int) -> list[int]:
    """Batch caps (rows) the memory fit tries, largest first: ``max_batch``, then each smaller bucket."""
    return sorted({b for b in buckets if b <= max_batch} | {max_batch}, reverse=True)


def kept_buckets(buckets: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """The buckets whose graphs a batch cap of ``cap`` rows keeps: up to the one holding ``cap``."""
    return tuple(b for b in buckets if b <= select_bucket(cap, buckets))


def plan_memory(reports: Mapping[int, MemoryReport], graph_bytes: Mapping[GraphKey, int],
                buckets: tuple[int, ...], max_batch: int, page_bytes: int, pages_per_seq: int,
                headroom_bytes: int = 0, max_pages: int | None = None) -> MemoryPlan:
    """Fit the largest batch cap whose graphs plus KV cache fit on the tightest rank.

    Args:
        reports: rank -> its memory report (bytes).
        graph_bytes: key -> largest bytes any rank measured for that graph.
        buckets: ascending decode buckets; candidate caps are the buckets up to ``max_batch``
            and ``max_batch`` itself.
        max_batch: requested maximum batch (rows).
        page_bytes: bytes of one KV page on one rank.
        pages_per_seq: KV pages one full-length sequence needs.
        headroom_bytes: bytes to leave free.
        max_pages: most KV pages to hand out (None: all that fit).

    Returns:
        the plan for the largest cap whose graph reserve leaves room for one full-length
        sequence; its KV gets all remaining memory, less the reserved padding page that
        `allocate_kv` adds. ``cap x pages_per_seq`` may exceed the pages: KV pages are handed
        out on demand and a short pool preempts (I14).

    Raises:
        ConfigError: no cap, not even one row, fits; names the tightest rank and the numbers.
    """
    if not reports:
        raise ConfigError("no memory reports: every rank must report before KV sizing")
    if max_pages is not None and max_pages < pages_needed(MIN_SEQUENCES, pages_per_seq):
        raise ConfigError(f"startup refused: max_kv_pages={max_pages} is below one full-length "
                          f"sequence ({pages_per_seq} pages)")
    tight_rank = min(reports, key=lambda r: reports[r].free_bytes - reports[r].peak_activation_bytes)
    tight = reports[tight_rank]
    budget = tight.free_bytes - tight.peak_activation_bytes - headroom_bytes
    for cap in candidate_caps(buckets, max_batch):
        kept = kept_buckets(buckets, cap)
        reserve = sum(v for k, v in graph_bytes.items() if k.bucket in kept)
        pages = (budget - reserve) // page_bytes - 1  # one page is the reserved padding page
        if max_pages is not None:
            pages = min(pages, max_pages)
        if pages >= pages_needed(MIN_SEQUENCES, pages_per_seq):
            return MemoryPlan(batch_cap=cap, kv_pages=int(pages), graph_reserve_bytes=reserve)
    left = (f"{budget} bytes" if budget > 0 else
            f"no bytes ({tight.free_bytes} free, {tight.peak_activation_bytes} of activations, "
            f"{headroom_bytes} of headroom)")
    raise StartupRefused(
        f"startup refused: rank {tight_rank} has {left} after activations and headroom, "
        f"too few for even one sequence ({pages_needed(1, pages_per_seq)} KV pages of "
        f"{page_bytes} bytes) beside its graphs")
