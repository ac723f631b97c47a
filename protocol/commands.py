"""The command vocabulary: what the controller broadcasts and what ranks reply.

Every rank receives the same command for a sequence number (I2), so every decision a rank acts on
-- the graph key, slot moves, KV size -- is carried in the command, never derived by the rank.
Commands are frozen dataclasses of plain values so that they compare, hash and serialise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.keys import GraphKey


@dataclass(frozen=True)
class Command:
    """Base of every command; ``seq`` is the step-lock sequence number (0, 1, 2, ...)."""

    seq: int


@dataclass(frozen=True)
class Warmup(Command):
    """Run one eager collective per message size (bytes) before any capture (I5)."""

    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProfileMemory(Command):
    """Eager forward at ``rows`` rows to measure peak activation memory; no graph (I9)."""

    rows: int = 1


@dataclass(frozen=True)
class MeasureGraphs(Command):
    """Record + instantiate every key, measure the retained graph set's bytes, then free them.

    Nothing is launched, so no collective runs and no rank waits on a peer (I9; the
    ``uncoordinated-profile`` variant launches here instead).
    """

    keys: tuple[GraphKey, ...] = ()


@dataclass(frozen=True)
class AllocateKV(Command):
    """Allocate ``pages`` KV pages of ``page_size`` tokens on every rank: one figure for all (I9).

    ``batch_cap`` is the memory-fitted cap of the graph plan; every worker refits its copy of the
    plan to it, so workers and controller keep one eligibility answer (I7). The pages start free;
    the controller hands them out in steps (I14).
    """

    pages: int = 0
    batch_cap: int | None = None
    page_size: int = 16


@dataclass(frozen=True)
class Capture(Command):
    """Phase one of the capture barrier: record, instantiate and upload ``key``; ack when idle (I4)."""

    key: GraphKey = GraphKey(1)


@dataclass(frozen=True)
class Launch(Command):
    """Phase two of the capture barrier: launch the uploaded ``key``; ack when drained (I4)."""

    key: GraphKey = GraphKey(1)


@dataclass(frozen=True)
class Finalize(Command):
    """End of the startup sweep: every rank reports its captured keys and graph bytes (I3, I9)."""

    keys: tuple[GraphKey, ...] = ()


@dataclass(frozen=True)
class SlotMove:
    """Swap-remove compaction carried in a step (I8): the request in ``src`` moves to ``dst``.

    Attributes:
        request_id: the request that moves (checked against the worker's occupancy).
        src: its old slot (the last live slot).
        dst: the slot just freed by a retirement.
    """

    request_id: int
    src: int
    dst: int


@dataclass(frozen=True)
class Retire:
    """Request ``request_id`` finished: it leaves slot ``slot`` (I8) and frees ``pages`` (I14).

    ``pages`` are the KV page ids the request held, in page-table order; a worker checks them
    against its own page map before freeing them.
    """

    request_id: int
    slot: int
    pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class Preempt:
    """Request ``request_id`` is preempted: it leaves slot ``slot`` and frees ``pages`` (I14).

    The controller queues it again; it is re-admitted later with its prompt plus the tokens it
    already generated as the prompt (recompute), so nothing of its KV survives on any rank.
    """

    request_id: int
    slot: int
    pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class PageAssign:
    """Request ``request_id`` (in ``slot`` after this step's moves and admissions) gets KV pages.

    Attributes:
        request_id: the request that grows.
        slot: its slot, after this step's slot changes.
        first_index: where ``pages`` go in its page table (the number of pages it held before).
        pages: page ids chosen by the controller, each free on every rank (I14).
    """

    request_id: int
    slot: int
    first_index: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Admit:
    """Request ``request_id`` takes slot ``slot`` and is prefilled with ``prompt`` token ids.

    ``params`` is the request's opaque engine payload (sampling parameters, seed), carried to
    every rank unchanged; the protocol never reads it. ``output_index`` is the index among the
    request's generated tokens of the token this prefill samples: 0 for a new request, k for a
    request preempted after k tokens and recomputed (its ``prompt`` then ends with those k
    tokens), so a seeded sampler draws the same stream as without preemption.
    """

    request_id: int
    slot: int
    prompt: tuple[int, ...]
    params: Any = field(default=None, compare=False)
    output_index: int = 0


@dataclass(frozen=True)
class DecodeRow:
    """One decode row: feed ``token`` at ``position`` for the request in ``slot``."""

    slot: int
    request_id: int
    token: int
    position: int


@dataclass(frozen=True)
class Step(Command):
    """One serving step, applied in this order: retirements and preemptions (slots and pages
    freed), slot moves, admissions, page assignments, forward.

    Attributes:
        retires: finished requests leaving their slots and freeing their pages.
        preempts: running requests preempted to free pages (I14); they leave their slots too.
        moves: compaction moves that fill the holes retirements left (swap-remove).
        admits: new (or recomputed) requests, prefilled eagerly in this step.
        pages: KV pages handed out in this step (I14): the admitted prompts' pages and each
            decode row's next page when its position crosses into a new page.
        rows: decode rows, in slot order 0..n-1 (dense).
        key: graph to replay for the decode rows, or None to run the step eagerly. A pure
            function of the command, decided by the controller's plan (I2, I7).
        bucket: padded row count of the decode part (rows above ``len(rows)`` are padding and
            use the reserved padding slot and page); 0 when there are no decode rows.
    """

    retires: tuple[Retire, ...] = ()
    moves: tuple[SlotMove, ...] = ()
    admits: tuple[Admit, ...] = ()
    rows: tuple[DecodeRow, ...] = ()
    key: GraphKey | None = None
    bucket: int = 0
    pages: tuple[PageAssign, ...] = ()
    preempts: tuple[Preempt, ...] = ()


@dataclass(frozen=True)
class Teardown(Command):
    """Free every graph, then destroy the communicator (I10)."""


@dataclass(frozen=True)
class Reply:
    """A rank's answer to command ``seq``; sent only once the rank's device work for it is done (I1).

    Attributes:
        rank: the replying rank.
        seq: the command's sequence number.
        ok: False if the rank failed the command (it is then poisoned).
        payload: command-specific result: sampled tokens {request_id: token} from rank 0 for a
            step, a memory report for profiling, the captured keys and graph bytes for Finalize.
        error: the failure text when ``ok`` is False.
        error_kind: the failure's kind (`protocol.errors.ProtocolError.kind`; ``"error"`` for
            any other exception) when ``ok`` is False.
        invariant: the invariant the failure names, if any.
    """

    rank: int
    seq: int
    ok: bool = True
    payload: Any = None
    error: str | None = None
    error_kind: str | None = None
    invariant: str | None = None


@dataclass(frozen=True)
class MemoryReport:
    """A rank's memory figures in bytes (I9)."""

    free_bytes: int = 0
    peak_activation_bytes: int = 0
    graph_bytes: int = 0


@dataclass(frozen=True)
class FinalizeReport:
    """A rank's captured key set and the bytes its retained graph set holds."""

    captured: frozenset[GraphKey] = field(default_factory=frozenset)
    graph_bytes: int = 0
