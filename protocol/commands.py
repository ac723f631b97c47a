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

    With ``start`` > 0 this is the last chunk of a chunked prefill (see `Chunk`): the first
    ``start`` tokens of ``prompt`` are already in the cache, in the chunk slot, and the
    sequence moves from there into ``slot`` before ``prompt[start:]`` is prefilled.

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
    start: int = 0

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt tokens this step prefills: ``prompt[start:]``."""
        return self.prompt[self.start:] if self.start else self.prompt


@dataclass(frozen=True)
class Chunk:
    """A non-final chunk of a chunked prefill: write ``tokens`` at positions ``start`` ..
    ``start + len(tokens) - 1`` of request ``request_id``'s sequence, through ``slot`` (the
    reserved chunk slot, `protocol.slots.SlotTable.chunk_slot`), and sample nothing.

    A prompt longer than a step's prefill budget is prefilled over several steps: one `Chunk`
    per step while tokens remain past the budget, each after the previous one (``start`` is
    the number of prompt tokens already in the cache), then the last chunk as an `Admit` with
    ``start`` > 0, which moves the sequence from the chunk slot into its decode slot,
    prefills ``prompt[start:]`` and samples the request's first token. Only the last chunk
    samples: a token drawn after a non-final chunk would be predicted from part of the prompt
    (the ``chunk-...`` variants in `sim.variants_chunked`). Pages grow with each chunk
    (`PageAssign`s of the same step, I14).
    """

    request_id: int
    slot: int
    start: int
    tokens: tuple[int, ...]

    @property
    def end(self) -> int:
        """One past the last position this chunk writes."""
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class DecodeRow:
    """One decode row: feed ``token`` at ``position`` for the request in ``slot``.

    A step carries its rows column-wise (`DecodeRows`); this record is one row of it, as
    iteration yields it (traces, the simulator's modelled kernels, tests).
    """

    slot: int
    request_id: int
    token: int
    position: int


@dataclass(frozen=True)
class DecodeRows:
    """A step's decode rows, column-wise: row i feeds ``tokens[i]`` at ``positions[i]`` for
    request ``request_ids[i]``, which holds slot i (rows are the dense slots 0..n-1, I8).

    Three tuples of ints instead of one record per row, so that building, checking, sending and
    writing a step's rows into the replay buffers costs no Python work per row (issue 12 item
    4): each step is a few C-level passes over these columns. Iterating yields `DecodeRow`
    records (slot i for row i), for readers that want rows one at a time.

    Raises:
        ValueError: the columns differ in length.
    """

    request_ids: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.request_ids) == len(self.tokens) == len(self.positions):
            raise ValueError(f"decode rows with {len(self.request_ids)} request ids, "
                             f"{len(self.tokens)} tokens and {len(self.positions)} positions")

    @classmethod
    def of(cls, rows) -> "DecodeRows":
        """The columns of `DecodeRow` records, which must name slots 0..n-1 in order.

        Raises:
            ValueError: row i names a slot other than i.
        """
        rows = tuple(rows)
        for i, row in enumerate(rows):
            if row.slot != i:
                raise ValueError(f"decode row {i} names slot {row.slot}: the rows of a step are "
                                 "the dense slots 0..n-1 in order")
        return cls(tuple(r.request_id for r in rows), tuple(r.token for r in rows),
                   tuple(r.position for r in rows))

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self):
        return map(DecodeRow, range(len(self.request_ids)), self.request_ids, self.tokens,
                   self.positions)

    def __getitem__(self, i: int) -> DecodeRow:
        return DecodeRow(range(len(self))[i], self.request_ids[i], self.tokens[i],
                         self.positions[i])


NO_TOKEN = None
"""What rank 0's step reply holds for a request it could not sample (non-finite logits): the
controller ends that request (`Controller.failed_requests`)."""

FED = -1
"""A decode row's token under overlapped scheduling: the host does not have it; the row's
input token is resolved on the device from the previous step's sampled ids (`Step.feed`)."""


@dataclass(frozen=True)
class Step(Command):
    """One serving step, applied in this order: retirements and preemptions (slots and pages
    freed), slot moves, admissions, page assignments, forward.

    Attributes:
        retires: finished requests leaving their slots and freeing their pages.
        preempts: running requests preempted to free pages (I14); they leave their slots too.
        moves: compaction moves that fill the holes retirements left (swap-remove).
        admits: new (or recomputed) requests, prefilled eagerly in this step (with ``start``
            > 0: the last chunk of a chunked prefill).
        chunk: a non-final chunk of a chunked prefill, prefilled in the same packed batch as
            the admissions, sampling nothing; or None.
        pages: KV pages handed out in this step (I14): the admitted prompts' pages and each
            decode row's next page when its position crosses into a new page.
        rows: decode rows, column-wise, in slot order 0..n-1 (dense); a tuple of `DecodeRow`
            records is accepted and turned into columns (`DecodeRows.of`).
        key: graph to replay for the decode rows, or None to run the step eagerly. A pure
            function of the command, decided by the controller's plan (I2, I7).
        bucket: padded row count of the decode part (rows above ``len(rows)`` are padding and
            use the reserved padding slot and page); 0 when there are no decode rows.
        overlap: overlapped scheduling (``ProtocolConfig.decode_overlap``): the rank marks the
            end of this step's device work, waits only for the previous step's, and (rank 0)
            replies with the tokens of ``read``; every rank samples (I1, I11, I20).
        feed: overlapped scheduling only: row i's input
            token is the id the previous step sampled at index ``feed[i]`` of its slot order
            (its rows, then its admissions), read on the device, and ``rows.tokens`` hold
            `FED`; None: the rows carry their tokens (I20).
        read: overlapped scheduling only: the seq of the earlier step (always ``seq - 1``)
            whose sampled tokens rank 0's reply to this step carries; None: the reply carries
            this step's own tokens (after its synchronize), or none.
    """

    retires: tuple[Retire, ...] = ()
    moves: tuple[SlotMove, ...] = ()
    admits: tuple[Admit, ...] = ()
    rows: DecodeRows = DecodeRows()
    key: GraphKey | None = None
    bucket: int = 0
    pages: tuple[PageAssign, ...] = ()
    preempts: tuple[Preempt, ...] = ()
    chunk: Chunk | None = None
    overlap: bool = False
    feed: tuple[int, ...] | None = None
    read: int | None = None

    def __post_init__(self) -> None:
        if type(self.rows) is not DecodeRows:
            object.__setattr__(self, "rows", DecodeRows.of(self.rows))

    @property
    def samples(self) -> bool:
        """True if the step samples a token: it has decode rows or admissions."""
        return bool(self.rows.request_ids or self.admits)


@dataclass(frozen=True)
class Teardown(Command):
    """Free every graph, then destroy the communicator (I10)."""


@dataclass(frozen=True)
class Reply:
    """A rank's answer to command ``seq``; sent only once the rank's device work for it is done
    (I1) -- under overlapped scheduling, once its device work for ``seq - 1`` is done and the
    work for ``seq`` is enqueued.

    Attributes:
        rank: the replying rank.
        seq: the command's sequence number.
        ok: False if the rank failed the command (it is then poisoned).
        payload: command-specific result: for a step, rank 0's sampled token ids, a tuple in
            slot order (the decode rows, then the admissions; `NO_TOKEN` for a request it
            could not sample) -- of the step itself, or of the step it names in ``read``; a memory report for profiling; the captured keys and graph
            bytes for Finalize.
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
