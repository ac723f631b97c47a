"""Devices and collectives: what each rank's device holds and how kernels leave its streams.

A device has two FIFO streams (main and side) of kernels. A compute kernel (a `Kernel` record)
at the head of a stream runs on its own; a collective (`sim.common.Collective`) completes only
when every member rank of its communicator has the matching call (same communicator, same
index) at the head of a stream (H3), and a mismatch of signature is a divergence. A
communicator runs its calls on one device in issue order; two of them in flight at once may
wedge (H9, `sim.comms`). Graphs a rank holds are `Graph` records.

A device's memory is a set of `sim.kv.Buffer`s: the KV cache (per slot and position), the
fixed-address replay inputs (one row per bucket row: slot, token, position) and the logits rows
sampling reads. Decode kernels execute exactly their rows: live rows read and write their slot,
padding rows the scratch slot. A graph replay reads and writes the buffers the graph captured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import is_
from typing import TYPE_CHECKING, Any, ClassVar

from protocol.commands import Admit, Chunk, DecodeRow
from protocol.keys import SHORT, GraphKey
from sim.common import Collective, Outcome, sig_text
from sim.kv import PAD_REQUEST, Buffer, ModelledKV, next_token

if TYPE_CHECKING:
    from sim.world import World


@dataclass(frozen=True)
class Kernel:
    """Base of compute kernels; ``label`` names the kind in traces."""

    label: ClassVar[str] = "kernel"


@dataclass(frozen=True)
class WriteReplayMeta(Kernel):
    """Copy step ``seq``'s rows, padding rows included, into the fixed-address replay inputs
    (I12): the copy reads host staging buffer ``staging`` when the device runs it (so a host
    that rewrote that buffer since gives the device other rows); ``rows`` is what the host wrote
    there for this step. With ``feed`` (overlapped scheduling), live row i's token is the id
    the previous step sampled at index ``feed[i]``, read from the device's ids (I20)."""

    label: ClassVar[str] = "meta"
    seq: int
    rows: tuple[DecodeRow, ...]
    feed: tuple[int, ...] | None = None
    staging: int | None = None


@dataclass(frozen=True)
class EagerDecode(Kernel):
    """Eager decode of step ``seq``'s rows (padding rows included) on the live buffers; with
    ``feed``, the live rows' tokens come from the device's sampled ids (I20)."""

    label: ClassVar[str] = "decode"
    seq: int
    rows: tuple[DecodeRow, ...]
    feed: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StepMark(Kernel):
    """The end of command ``seq``'s device work on this stream (a CUDA event; overlapped
    scheduling): `AwaitStep` of ``seq`` returns once the device ran it."""

    label: ClassVar[str] = "mark"
    seq: int


@dataclass(frozen=True)
class GraphReplay(Kernel):
    """Replay of graph ``key`` in command ``seq``: computes the first ``key.bucket`` rows of
    the replay inputs it captured, on the KV and logits buffers it captured (``buffers``:
    (name, generation) pairs)."""

    label: ClassVar[str] = "replay"
    key: GraphKey
    seq: int
    buffers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class PrefillKernel(Kernel):
    """Eager prefill of the admitted requests of command ``seq`` into their slots (a last
    chunk writes its tokens from ``start`` on, after what earlier chunks cached), and of the
    step's non-final ``chunk`` through the chunk slot, which samples nothing."""

    label: ClassVar[str] = "prefill"
    seq: int
    admits: tuple[Admit, ...]
    chunk: Chunk | None = None


@dataclass(frozen=True)
class CopySlot(Kernel):
    """Copy slot ``src``'s KV into slot ``dst`` (compaction); with paged KV, move its page-table
    row."""

    label: ClassVar[str] = "copy"
    src: int
    dst: int


@dataclass(frozen=True)
class SetPages(Kernel):
    """Write the command's ``pages`` into ``slot``'s page-table row from ``first_index`` on (I14)."""

    label: ClassVar[str] = "pages"
    slot: int
    first_index: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class SampleKernel(Kernel):
    """The sampler of command ``seq`` and the copy of its token ids to the host: reads logits
    rows 0..``rows``-1, then the prefill outputs of ``admitted`` (request ids), and leaves
    (seq, token ids) in pinned host buffer ``buffer`` (`Device.host_ids`) and on the device
    (`Device.device_ids`, with ``requests``: the request of each id, for the I20 check). A
    logits row or prefill output not computed in command ``seq`` gives token -1."""

    label: ClassVar[str] = "sample"
    seq: int
    rows: int
    admitted: tuple[int, ...] = ()
    requests: tuple[int, ...] = ()
    buffer: int = 0


@dataclass(frozen=True)
class SampledIds:
    """Token ids a `SampleKernel` wrote: those of command ``seq`` (None before the first), in
    slot order; ``requests``: whose each id is (kept on the device copy only)."""

    seq: int | None = None
    ids: tuple[int, ...] = ()
    requests: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClearSlot(Kernel):
    """Empty ``slot``'s page-table row: its request retired or was preempted (I14)."""

    label: ClassVar[str] = "clear"
    slot: int


@dataclass
class Graph:
    """A graph one rank holds: its key, the bytes it holds, how far it got, and the buffers it
    captured as (name, generation) pairs."""

    key: GraphKey
    nbytes: int
    instantiated: bool = False
    uploaded: bool = False
    buffers: tuple[tuple[str, int], ...] = ()


CAPTURED = ("kv", "replay-inputs", "logits")
"""Buffers a decode graph captures: the KV cache, its static inputs and its static output."""


def padded_rows(rows: tuple[DecodeRow, ...], bucket: int, scratch: int) -> tuple[DecodeRow, ...]:
    """``rows`` padded to ``bucket`` with padding rows on the scratch slot (position 0, token 0)."""
    pad = DecodeRow(slot=scratch, request_id=PAD_REQUEST, token=0, position=0)
    return tuple(rows) + (pad,) * max(0, bucket - len(rows))


def _padding_run(rows) -> int:
    """Where the trailing run of one padding row object starts in ``rows`` (a list or
    tuple), or ``len(rows)`` if the last row is not padding: `DeviceModel.decode` writes such
    a run once, so it need not visit each of its rows (a sweep replay is all padding)."""
    n = len(rows)
    if not n or rows[-1].request_id != PAD_REQUEST:
        return n
    last = rows[-1]
    start = rows.index(last)  # the first row equal to it; the run needs the very object
    tail = rows[start:] if start else rows  # no copy of a replay that is padding throughout
    return start if all(map(is_, tail, repeat(last))) else n - 1


@dataclass
class Device:
    """One rank's device: FIFO streams of kernels and its memory.

    Attributes:
        main, side: the streams; each entry a `Kernel` or a `Collective`.
        buffers: name -> the live `Buffer` of that name.
        allocations: (name, generation) -> every buffer ever allocated, freed ones included (a
            graph that captured a freed buffer still reads and writes it).
        prefill_out: request id -> (command seq, token) of its prefill.
        enqueued_collectives, completed_collectives: counters over the run (every communicator).
        issued: communicator name -> calls of it enqueued on this device (its issue order).
        paired: pairing channel (`sim.comms.pairing_key`) -> calls enqueued in it.
        done: communicator name -> calls of it completed on this device.
        registered: this rank's registration table: one (graph key, communicator, buffer)
            entry per buffer a captured collective registered (custom all-reduce's IPC graph
            buffers); compared across ranks at the end of each capture (I17).
        host_ids: the two pinned host buffers `SampleKernel`s copy token ids into (buffer 0
            alone without overlapped scheduling); what a host read of the tokens sees
            (`ReadTokens`), whether or not the step's copy happened yet.
        device_ids: the ids the last `SampleKernel` left on the device, which the next step's
            fed rows read (overlapped scheduling, I20).
        staging: pinned host staging buffer -> (step seq, rows) the host last wrote there for a
            replay-metadata copy (`WriteReplayMeta.staging`).
        marked: the last `StepMark` the device ran (-1: none).
    """

    rank: int
    main: list = field(default_factory=list)
    side: list = field(default_factory=list)
    buffers: dict = field(default_factory=dict)
    allocations: dict = field(default_factory=dict)
    prefill_out: dict = field(default_factory=dict)
    enqueued_collectives: int = 0
    completed_collectives: int = 0
    issued: dict = field(default_factory=dict)
    paired: dict = field(default_factory=dict)
    done: dict = field(default_factory=dict)
    registered: list = field(default_factory=list)
    host_ids: list = field(default_factory=lambda: [SampledIds(), SampledIds()])
    device_ids: SampledIds = SampledIds()
    staging: dict = field(default_factory=dict)
    marked: int = -1

    @property
    def sampled(self) -> SampledIds:
        """Host buffer 0 of the sampled ids (the only one without overlapped scheduling)."""
        return self.host_ids[0]

    def allocate(self, name: str, data, by=None, nbytes: int = 0) -> Buffer:
        """A new live buffer ``name`` holding ``data``, one generation past the previous one;
        ``by`` names the command that allocates it, ``nbytes`` its size (`Buffer`)."""
        old = self.buffers.get(name)
        buffer = Buffer(name, old.generation + 1 if old else 0, data, by, nbytes)
        self.buffers[name] = buffer
        self.allocations[buffer.ref] = buffer
        return buffer

    def live(self, name: str):
        """The data of the live buffer ``name``."""
        return self.buffers[name].data

    def busy(self) -> bool:
        """True while any kernel is queued or running."""
        return bool(self.main or self.side)

    def collective_head(self) -> list | None:
        """The stream whose head is a collective, or None."""
        for stream in (self.main, self.side):
            if stream and isinstance(stream[0], Collective):
                return stream
        return None

    def collective_heads(self) -> list:
        """The streams whose head is a collective (main first)."""
        return [s for s in (self.main, self.side) if s and type(s[0]) is Collective]

    def next_of(self, kernel: Collective) -> bool:
        """True if ``kernel`` is the next call its communicator runs on this device."""
        return kernel.order == self.done.get(kernel.sig.comm, 0)

    def finish(self, kernel: Collective) -> None:
        """Count ``kernel`` (just popped from a stream head) as completed."""
        comm = kernel.sig.comm
        self.done[comm] = self.done.get(comm, 0) + 1
        self.completed_collectives += 1

    def compute_head(self) -> list | None:
        """The stream whose head is a compute kernel, or None."""
        for stream in (self.main, self.side):
            if stream and not isinstance(stream[0], Collective):
                return stream
        return None

    def fingerprint(self) -> tuple:
        """Hashable contents of the live buffers and the prefill outputs."""
        kv = self.buffers["kv"]
        return (kv.generation, kv.data.fingerprint(), tuple(self.live("replay-inputs")),
                tuple(sorted(self.live("logits").items())), tuple(sorted(self.prefill_out.items())),
                tuple(sorted(self.done.items())), len(self.registered), tuple(self.host_ids),
                self.device_ids, self.marked)


class DeviceModel:
    """The device and collective actors of one world."""

    def __init__(self, world: World):
        self.world = world
        self._members: dict[str, tuple[int, ...]] = {}
        self._ready = None  # `ready_collective`'s answer, kept while `_ready_kept`
        self._ready_kept = False  # until a stream head moves (`heads_moved`)

    def device_ready(self, r: int) -> bool:
        """True if device ``r`` can run a kernel now."""
        dev = self.world.devices[r]
        if dev.compute_head() is not None:
            return True
        return not self.world.hz.h3_spinning_collectives and dev.collective_head() is not None

    def step_device(self, r: int) -> None:
        """Run the compute kernel at a stream head (or, H3 off, a lone collective)."""
        w = self.world
        dev = w.devices[r]
        main, side = dev.main, dev.side  # `Device.compute_head`, inlined: once per device action
        if main and not isinstance(main[0], Collective):
            stream = main
        elif side and not isinstance(side[0], Collective):
            stream = side
        else:
            stream = None
        self.heads_moved()  # a head leaves below
        if stream is None:
            kernel = dev.collective_head().pop(0)
            w.queued -= 1
            dev.finish(kernel)
            w.event(f"device{r}", "collective", kernel.sig.label, rank=r, detail=sig_text(kernel))
            return
        kernel = stream.pop(0)
        w.queued -= 1
        self.execute(r, dev, kernel)

    def execute(self, r: int, dev: Device, kernel: Any) -> None:
        """What a compute kernel does to the device's buffers."""
        match kernel:
            case WriteReplayMeta(seq=seq, rows=rows, feed=feed, staging=staging):
                if staging is not None:
                    rows = self.staged_rows(r, dev, seq, staging)
                    if rows is None:
                        return
                if feed is not None:
                    rows = self.fed_rows(r, dev, seq, rows, feed)
                if rows is not None and self.check_rows(r, seq, rows):
                    inputs = dev.live("replay-inputs")
                    inputs[:len(rows)] = rows
            case EagerDecode(seq=seq, rows=rows, feed=feed):
                if feed is not None:
                    rows = self.fed_rows(r, dev, seq, rows, feed)
                if rows is not None and self.check_rows(r, seq, rows):
                    padding = _padding_run(rows)  # read twice below: found once
                    if self.check_continues(r, seq, dev.live("kv"), rows, padding=padding):
                        self.decode(dev.live("kv"), dev.live("logits"), seq, rows,
                                    padding=padding)
            case StepMark(seq=seq):
                dev.marked = seq
            case GraphReplay(key=key, seq=seq, buffers=refs):
                captured = {}
                for ref in refs:  # a loop, not a comprehension: once per replay
                    captured[ref[0]] = dev.allocations[ref].data
                rows = captured["replay-inputs"][:key.bucket]
                padding = _padding_run(rows)  # read twice below: found once
                # the short path's fused kernel reads one tile of short_context tokens (I22)
                window = self.world.config.short_context if key.path == SHORT else None
                if self.check_continues(r, seq, captured["kv"], rows, padding=padding):
                    self.decode(captured["kv"], captured["logits"], seq, rows, padding=padding,
                                window=window)
            case PrefillKernel(seq=seq, admits=admits, chunk=chunk):
                kv = dev.live("kv")
                pieces = [(a.request_id, a.slot, a.start) for a in admits]
                if chunk is not None:
                    pieces.append((chunk.request_id, chunk.slot, chunk.start))
                if not self.check_chunks(r, seq, kv, pieces):
                    return
                for admit in admits:  # the next token reads the whole prompt back from the KV
                    for position in range(admit.start, len(admit.prompt)):
                        kv.write(admit.slot, position, admit.prompt[position])
                    kv.lengths[admit.slot] = len(admit.prompt)
                    history = kv.read(admit.slot, len(admit.prompt) - 1)
                    dev.prefill_out[admit.request_id] = (seq, next_token(history, self.vocab))
                if chunk is not None:  # its logits are computed too, and read by no one
                    for i, token in enumerate(chunk.tokens):
                        kv.write(chunk.slot, chunk.start + i, token)
                    kv.lengths[chunk.slot] = chunk.end
                    history = kv.read(chunk.slot, chunk.end - 1)
                    dev.prefill_out[chunk.request_id] = (seq, next_token(history, self.vocab))
            case CopySlot(src=src, dst=dst):
                dev.live("kv").copy(src, dst)
            case SetPages(slot=slot, first_index=first, pages=pages):
                dev.live("kv").assign(slot, first, pages)
            case ClearSlot(slot=slot):
                dev.live("kv").clear(slot)
            case SampleKernel(seq=seq, rows=rows, admitted=admitted, requests=requests,
                              buffer=buffer):
                logits = dev.live("logits")
                tokens = []
                for i in range(rows):  # a row not computed in this command reads as -1
                    at, token = logits.get(i, (None, -1))
                    tokens.append(token if at == seq else -1)
                for request_id in admitted:
                    at, token = dev.prefill_out.get(request_id, (None, -1))
                    tokens.append(token if at == seq else -1)
                ids = tuple(tokens)
                dev.host_ids[buffer] = SampledIds(seq, ids)
                dev.device_ids = SampledIds(seq, ids, requests)
            case _:
                handler = self.world.variant.sim_kernels.get(type(kernel))
                if handler is not None:
                    handler(self.world, r, dev, kernel)

    @property
    def vocab(self) -> int:
        """The modelled vocabulary size."""
        return self.world.scenario.vocab

    def decode(self, kv: ModelledKV, logits: dict, seq: int, rows, corrupt: bool = False,
               padding: int | None = None, window: int | None = None) -> None:
        """Run decode rows: row i writes its token at its position of its slot, reads the
        slot's positions 0..p, and leaves (seq, next token) in logits row i. With ``corrupt``
        the logits are off by one (a partial all-reduce sum). ``padding``: where the rows'
        trailing padding run starts (`_padding_run`), if the caller found it already.
        ``window``: the row reads only positions 0..window-1 (the short-context path's one
        tile, `protocol.keys.SHORT`), so a row whose context, p + 1, is longer loses the
        tokens past it and its next token changes (I22); None reads all."""
        vocab = self.vocab
        last_padding = None  # padding rows repeat one row object: write it once
        run = _padding_run(rows) if padding is None else padding
        for i in range(run):
            row = rows[i]
            if row.request_id == PAD_REQUEST:
                # nothing reads a padding row's logits; its KV write goes where its slot says
                if row is not last_padding:
                    last_padding = row
                    kv.write(row.slot, row.position, row.token)
                continue
            kv.write(row.slot, row.position, row.token)
            kv.lengths[row.slot] = row.position + 1
            if window is not None and row.position >= window:
                token = next_token(kv.read(row.slot, window - 1), vocab)
            else:
                token = next_token(kv.read(row.slot, row.position), vocab)
            logits[i] = (seq, (token + 1) % vocab if corrupt else token)
        if run < len(rows) and rows[run] is not last_padding:  # the trailing run: one write
            row = rows[run]
            kv.write(row.slot, row.position, row.token)

    def check_continues(self, r: int, seq: int, kv, rows, padding: int | None = None) -> bool:
        """Direct I21 check: every live decode row continues its slot's sequence -- the slot
        caches exactly ``position`` tokens (the engine's ``seq_lens``) before the row writes
        its own. A row whose slot caches fewer reads KV positions nobody wrote: its prompt was
        never prefilled, as when a mixed step's admissions are taken into the decode graph as
        rows (vllm-project/vllm #53051). On a violation the run ends with the step and rank.
        ``padding`` as for `decode`."""
        lengths = kv.lengths
        for i in range(_padding_run(rows) if padding is None else padding):
            row = rows[i]
            if row.request_id == PAD_REQUEST:
                continue
            have = lengths.get(row.slot, 0)
            if have != row.position:
                self.world.outcome = Outcome(
                    "invariant", f"I21 violated: rank {r}'s step {seq} decodes request "
                    f"{row.request_id} at position {row.position} of slot {row.slot}, whose "
                    f"sequence caches {have} tokens: the row reads KV its sequence never "
                    "wrote there (a prompt not prefilled before its request became a decode "
                    "row, or a stale cache)", "I21",
                    rank=r, step=seq, check="decode-row-past-cache")
                return False
        return True

    def check_chunks(self, r: int, seq: int, kv, pieces) -> bool:
        """Direct I19 check: a prefill piece -- (request, slot, start): an admission, the last
        chunk of a chunked prefill, or a non-final chunk -- writes right after the tokens its
        slot's sequence already caches (``start`` of them; 0 for a new sequence). A chunk
        written from any other position overwrites cached tokens or leaves a gap. On a
        violation the run ends with the step and rank."""
        for rid, slot, start in pieces:
            have = kv.lengths.get(slot, 0)
            if have != start:
                self.world.outcome = Outcome(
                    "invariant", f"I19 violated: rank {r}'s prefill in step {seq} writes request "
                    f"{rid}'s prompt from position {start} in slot {slot}, whose sequence "
                    f"caches {have} tokens: a prefill piece must continue its slot's "
                    "sequence (a whole prompt starts in an empty slot, a chunk right after "
                    "the tokens cached)", "I19",
                    rank=r, step=seq, check="prefill-gap")
                return False
        return True

    def staged_rows(self, r: int, dev: Device, seq: int, staging: int):
        """The rows the replay-metadata copy of step ``seq`` reads from host staging buffer
        ``staging`` now; direct I12 check: the host has not rewritten it for a later step
        before this copy ran (lightseekorg/tokenspeed PR #376; vllm-project/vllm PR #25279).
        Ends the run and returns None on a violation."""
        at, rows = dev.staging.get(staging, (None, ()))
        if at == seq:
            return rows
        self.world.outcome = Outcome(
            "invariant", f"I12 violated: rank {r}'s replay inputs of step {seq} are copied from "
            f"host staging buffer {staging}, which the host rewrote for step {at} before the "
            "copy ran: the step replays another step's rows", "I12", rank=r, step=seq,
            check="staging-rewritten-before-copy")
        return None

    def fed_rows(self, r: int, dev: Device, seq: int, rows, feed: tuple[int, ...]):
        """``rows`` with live row i's token replaced by the id the previous step sampled at
        ``feed[i]``, read from the device (overlapped scheduling). Direct I20 check: those ids
        are step ``seq - 1``'s, and ``feed[i]`` is the index of row i's own request in them
        (sgl-project/sglang-jax #1487: a row read another request's future token). Ends the
        run and returns None on a violation."""
        ids = dev.device_ids
        if ids.seq != seq - 1:
            self.world.outcome = Outcome(
                "invariant", f"I20 violated: rank {r}'s step {seq} feeds its rows from the ids "
                f"{'of no step' if ids.seq is None else f'of step {ids.seq}'} on its device, not "
                f"step {seq - 1}'s: this rank did not sample the step before", "I20",
                rank=r, step=seq, check="fed-from-other-step")
            return None
        out = list(rows)
        for i, index in enumerate(feed):
            row = rows[i]
            owner = ids.requests[index] if 0 <= index < len(ids.requests) else None
            if owner != row.request_id:
                self.world.outcome = Outcome(
                    "invariant", f"I20 violated: rank {r}'s step {seq} feeds request "
                    f"{row.request_id} (row {i}) the token sampled in step {seq - 1} at index "
                    f"{index}, which is {f'request {owner}' if owner is not None else 'no row'}'s",
                    "I20", rank=r, step=seq, check="fed-other-request")
                return None
            out[i] = DecodeRow(row.slot, row.request_id, ids.ids[index], row.position)
        events = self.world.events
        events["fed_row"] = events.get("fed_row", 0) + len(feed)
        return tuple(out)

    def check_rows(self, r: int, seq: int, rows) -> bool:
        """Direct I8 check: a decode's live rows name the dense slots 0..n-1 in order and its
        padding rows the scratch slot. On a violation the run ends with the step and rank."""
        scratch = self.world.config.max_batch
        for i, row in enumerate(rows):
            padding = row.request_id == PAD_REQUEST
            if (padding and row.slot != scratch) or (not padding and row.slot != i):
                what = "padding" if padding else f"request {row.request_id}'s"
                want = f"the scratch slot {scratch}" if padding else f"slot {i}"
                self.world.outcome = Outcome(
                    "invariant", f"I8 violated: rank {r}'s decode metadata for step {seq} sends "
                    f"{what} row {i} to slot {row.slot}, not {want}; it writes KV that a live "
                    "request reads", "I8", rank=r, step=seq, check="metadata-wrong-slot")
                return False
        return True

    def members(self, comm: str) -> tuple[int, ...]:
        """The member ranks of communicator ``comm``."""
        members = self._members.get(comm)
        if members is None:
            members = self._members[comm] = self.world.comm(comm).members(self.world.ws)
        return members

    def wedges(self) -> list[tuple[int, Collective, Collective]]:
        """(rank, main head, side head) for every device whose two streams hold collectives of
        one communicator at their heads at once where H9 makes that a wedge: either is
        in-graph, or the communicator runs one collective in flight even eagerly."""
        w = self.world
        if not w.hz.h9_one_in_flight:
            return []
        out = []
        for r, dev in enumerate(w.devices):
            main, side = dev.main, dev.side
            if not (main and side):
                continue
            a, b = main[0], side[0]
            if type(a) is not Collective or type(b) is not Collective:
                continue
            if a.sig.comm != b.sig.comm:
                continue
            if a.sig.mode == "graph" or b.sig.mode == "graph" or w.comm(a.sig.comm).one_in_flight:
                out.append((r, a, b))
        return out

    def ready_collective(self):
        """What the ``collectives`` actor would do now: ``("complete", comm, streams)`` for the
        first communicator (or send/receive pair) whose every participant has its next call at
        a stream head and whose calls match, ``("diverge", text)`` when they all do but differ,
        or None. A call waits behind an earlier call of its communicator still queued on the
        other stream; a wedged communicator (H9, `wedges`) completes nothing on that device.

        The answer depends only on what is at the stream heads (a device's completed counts
        change only as a collective leaves a head), so it is kept until a head moves
        (`heads_moved`): the scheduler asks again after every action.
        """
        if not self._ready_kept:
            self._ready = self.find_ready_collective()
            self._ready_kept = True
        return self._ready

    def heads_moved(self) -> None:
        """A stream's head changed (a kernel left it, or one arrived on an empty stream):
        `ready_collective` must look again."""
        self._ready_kept = False

    def find_ready_collective(self):
        """`ready_collective` computed afresh, without its cache."""
        w = self.world
        h9 = w.hz.h9_one_in_flight
        heads: dict[str, dict[int, list]] = {}
        for r, dev in enumerate(w.devices):
            main, side = dev.main, dev.side
            a = main[0] if main and type(main[0]) is Collective else None
            b = side[0] if side and type(side[0]) is Collective else None
            if a is None:
                if b is None:
                    continue
            elif (h9 and b is not None and a.sig.comm == b.sig.comm
                    and (a.sig.mode == "graph" or b.sig.mode == "graph"
                         or w.comms[a.sig.comm].one_in_flight)):
                continue  # wedged (H9): this device completes nothing of that communicator
            done = dev.done
            if a is not None and a.order == done.get(a.sig.comm, 0):
                at = heads.get(a.sig.comm)
                if at is None:
                    at = heads[a.sig.comm] = {}
                at[r] = main
            if b is not None and b.order == done.get(b.sig.comm, 0):
                at = heads.get(b.sig.comm)
                if at is None:
                    at = heads[b.sig.comm] = {}
                at[r] = side
        for comm, at in heads.items():
            for r, stream in at.items():
                kernel = stream[0]
                sig = kernel.sig
                peer = sig.peer
                if peer is None:
                    members = self.members(comm)
                    if not all(map(at.__contains__, members)):
                        continue
                    kernels = [at[m][0] for m in members]
                    index = kernel.index
                    for k in kernels:
                        ks = k.sig
                        # one Signature object (a graph's, shared by every rank) matches itself
                        if ks.peer is not None or k.index != index or (
                                ks is not sig and not ks.matches(sig)):
                            lines = "; ".join(f"rank {m} is in {sig_text(k)}"
                                              for m, k in zip(members, kernels))
                            return ("diverge", f"collective sequences differ across ranks on "
                                               f"communicator {comm}: {lines}")
                    return ("complete", comm, [at[m] for m in members])
                if peer not in at:
                    continue
                other = at[peer][0]
                want = {"send": "recv", "recv": "send"}.get(sig.op)
                if (other.sig.peer != r or other.sig.op != want or other.index != kernel.index
                        or other.sig.nbytes != sig.nbytes):
                    return ("diverge", f"point-to-point calls differ on communicator {comm}: "
                                       f"rank {r} is in {sig_text(kernel)}, rank {peer} in "
                                       f"{sig_text(other)}")
                return ("complete", comm, [stream, at[peer]])
        return None

    def step_collective(self) -> None:
        """Complete the collective (or send/receive pair) `ready_collective` finds, or report
        the divergence."""
        w = self.world
        found = self.ready_collective()
        if found is None:
            return
        if found[0] == "diverge":
            w.outcome = Outcome("divergence", found[1], "I2", step=w.current_seq(),
                                check="device-collectives-differ")
            return
        _, comm, streams = found
        first = streams[0][0]
        self.heads_moved()
        for stream in streams:
            kernel = stream.pop(0)
            w.queued -= 1
            for dev in w.devices:
                if dev.main is stream or dev.side is stream:
                    dev.finish(kernel)
                    break
        w.event("collectives", "collective", first.sig.label, detail=sig_text(first))
