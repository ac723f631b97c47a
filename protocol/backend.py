"""The per-rank backend interface: the only way a worker touches its device.

A worker never calls these itself. It returns a list of typed operations (`Op` records) for a
command; a driver runs each op against its backend (the simulator's modelled device, or the
engine's CUDA/CPU executor) and hands the results back. That keeps the worker sans-IO: the
simulator can interleave ranks between any two ops, and the engine runs them for real.

`perform(backend, op)` is the one place an op reaches a backend method: a `match` on the op's
type, so a reader can follow a command from the controller through the worker to the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

from protocol.commands import Admit, Chunk, Step
from protocol.errors import ProtocolError, checked_hook_result, is_int
from protocol.keys import GraphKey
from protocol.trace import describe_args


class _Described:
    """`Op.described`: computed on first use and kept on the op, whose instance attribute then
    shadows this (non-data) descriptor. Ops are frozen records, and the startup sweep's are
    built once per graph key and shared by every rank and run (`protocol.worker`), so most
    ops are described once, not once per trace event."""

    def __get__(self, op: "Op | None", owner: type | None = None):
        if op is None:
            return self
        text = op.__dict__["described"] = describe_args(op.args)
        return text


@dataclass(frozen=True)
class Op:
    """Base of every backend operation: a frozen record of the call's arguments.

    ``name`` is the op's name in traces (``"record"``); ``args`` its argument values in field
    order. A variant that needs an op the protocol does not define subclasses `Op` and models
    it in the simulator (`sim.variants.Variant.sim_ops`, keyed by the class).
    """

    name: ClassVar[str] = "op"

    described: ClassVar[str] = _Described()
    """The op's arguments as its trace events show them (`protocol.trace.describe_args`)."""

    @property
    def args(self) -> tuple[Any, ...]:
        """The op's argument values, in field order."""
        getter = _ARGS.get(self.__class__)
        if getter is None:
            getter = _ARGS[self.__class__] = _args_getter(self.__match_args__)
        return getter(self)

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})"


def _args_getter(names: tuple[str, ...]) -> Callable[[Op], tuple[Any, ...]]:
    """op -> the values of fields ``names``, as a tuple (what `Op.args` returns)."""
    if not names:
        return lambda op: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda op: (one(op),)
    return attrgetter(*names)


_ARGS: dict[type, Callable[[Op], tuple[Any, ...]]] = {}
"""Op class -> its `_args_getter`, built on first use (`Op.args` runs once per op in a trace)."""


@dataclass(frozen=True)
class WarmupCollective(Op):
    """One eager all-reduce of ``nbytes`` bytes (I5)."""

    name: ClassVar[str] = "warmup_collective"
    nbytes: int


@dataclass(frozen=True)
class ProfileForward(Op):
    """Eager forward at ``rows`` rows for the memory profile (I9)."""

    name: ClassVar[str] = "profile_memory"
    rows: int


@dataclass(frozen=True)
class GraphMemory(Op):
    """Read the bytes this rank's graphs hold."""

    name: ClassVar[str] = "graph_memory"


@dataclass(frozen=True)
class Record(Op):
    """Stream-capture the decode step of ``key``."""

    name: ClassVar[str] = "record"
    key: GraphKey


@dataclass(frozen=True)
class Instantiate(Op):
    """Instantiate the recorded graph of ``key``."""

    name: ClassVar[str] = "instantiate"
    key: GraphKey


@dataclass(frozen=True)
class Upload(Op):
    """Upload the executable graph of ``key``."""

    name: ClassVar[str] = "upload"
    key: GraphKey


@dataclass(frozen=True)
class LaunchGraph(Op):
    """Enqueue a replay of ``key`` (in serving, of the step `PrepareReplay` just set up)."""

    name: ClassVar[str] = "launch"
    key: GraphKey


@dataclass(frozen=True)
class FreeGraphs(Op):
    """Free every graph this rank holds."""

    name: ClassVar[str] = "free_graphs"


@dataclass(frozen=True)
class AllocateKVCache(Op):
    """Allocate ``pages`` KV pages plus the reserved padding page."""

    name: ClassVar[str] = "allocate_kv"
    pages: int


@dataclass(frozen=True)
class MoveSlot(Op):
    """Move per-slot state from slot ``src`` to slot ``dst`` (compaction, I8)."""

    name: ClassVar[str] = "move_slot"
    src: int
    dst: int


@dataclass(frozen=True)
class ReleaseSlot(Op):
    """The request in ``slot`` retired or was preempted: its page-table row is emptied (I14)."""

    name: ClassVar[str] = "release_slot"
    slot: int


@dataclass(frozen=True)
class AssignPages(Op):
    """Write ``pages`` into ``slot``'s page-table row from ``first_index`` on (I14)."""

    name: ClassVar[str] = "assign_pages"
    slot: int
    first_index: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Prefill(Op):
    """Eager prefill of newly admitted requests into their slots, and of ``chunk`` (a
    non-final chunk of a chunked prefill, through the chunk slot; None when the step has
    none), in one packed batch."""

    name: ClassVar[str] = "prefill"
    admits: tuple[Admit, ...]
    chunk: Chunk | None = None


@dataclass(frozen=True)
class PrepareReplay(Op):
    """Write ``step``'s rows into the fixed-address replay buffers (I12)."""

    name: ClassVar[str] = "prepare_replay"
    step: Step


@dataclass(frozen=True)
class ReplayRows:
    """What a graph replay reads from a rank's fixed-address replay buffers, row by row: the
    result a backend's `launch` returns in serving when it reports what it replays (I12).

    Attributes:
        tokens, positions, slots: one int per row, the replay buffers' first rows in order.
    """

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    slots: tuple[int, ...]

    @classmethod
    def of_step(cls, step: Step) -> "ReplayRows":
        """The live rows ``step`` commands, in order (padding rows excluded)."""
        return cls(step.rows.tokens, step.rows.positions, tuple(range(len(step.rows))))

    def first(self, n: int) -> "ReplayRows":
        """The first ``n`` rows."""
        return ReplayRows(self.tokens[:n], self.positions[:n], self.slots[:n])

    def text(self) -> str:
        """``(slot, position, token)`` per row, for traces."""
        return " ".join([f"({s},{p},{t})" for s, p, t in zip(self.slots, self.positions,
                                                            self.tokens)])


@dataclass(frozen=True)
class RunEager(Op):
    """Enqueue ``step``'s decode rows eagerly, padded to its bucket."""

    name: ClassVar[str] = "run_eager"
    step: Step


@dataclass(frozen=True)
class Synchronize(Op):
    """Block until this rank's device work is complete (I1, I11)."""

    name: ClassVar[str] = "synchronize"


@dataclass(frozen=True)
class EnqueueSample(Op):
    """Rank 0 (every rank under overlapped scheduling): enqueue the sampling of every admitted
    and decoded request of ``step`` behind the step's forward, and the copy of the token ids
    to the host; returns before the device reaches them, so the host's launch work overlaps
    the forward still running. The ids also stay on the device, where the next step's rows
    read their input tokens under overlapped scheduling (`Step.feed`, I20)."""

    name: ClassVar[str] = "enqueue_sample"
    step: Step


@dataclass(frozen=True)
class ReadTokens(Op):
    """Rank 0: the token ids `EnqueueSample` computed for ``step``, read on the host only after
    the step's synchronize, or under overlapped scheduling after `AwaitStep` of that step (I11:
    a device-to-host copy is not complete before the device is; sgl-project/sglang #16493 read
    a non-blocking GPU-to-CPU copy with no synchronization; vllm-project/vllm PR #36013 read
    pinned memory in the next step before its copy landed)."""

    name: ClassVar[str] = "read_tokens"
    step: Step


@dataclass(frozen=True)
class MarkStep(Op):
    """Overlapped scheduling: mark the end of command ``seq``'s device work on this rank's
    stream (a CUDA event), for a later `AwaitStep`."""

    name: ClassVar[str] = "mark_step"
    seq: int


@dataclass(frozen=True)
class AwaitStep(Op):
    """Overlapped scheduling: block until this rank's device reached the `MarkStep` of command
    ``seq`` (all of its device work, the copy of its token ids included); the device may go
    on with later commands' work (I1, I11)."""

    name: ClassVar[str] = "await_step"
    seq: int


@dataclass(frozen=True)
class DestroyCommunicator(Op):
    """Destroy the TP communicator; only after `FreeGraphs` (I10)."""

    name: ClassVar[str] = "destroy_communicator"


SYNC = Synchronize()

ENQUEUING = (WarmupCollective, ProfileForward, LaunchGraph, Prefill, RunEager, MoveSlot,
             PrepareReplay, ReleaseSlot, AssignPages, EnqueueSample, MarkStep)
"""Ops whose device work may still run when the host call returns (H6)."""


class Backend(ABC):
    """Device operations of one rank. Every method may raise; the worker then fails the command.

    Host calls may return before their device work is complete (stream semantics); only
    `synchronize` (and, under overlapped scheduling, `await_step`) waits for the device, and a
    worker replies only after it (I1).
    """

    @abstractmethod
    def warmup_collective(self, nbytes: int) -> None:
        """Run one eager all-reduce of ``nbytes`` bytes so the communicator connects that size (I5)."""

    @abstractmethod
    def profile_memory(self, rows: int) -> tuple[int, int]:
        """Eager forward at ``rows`` rows; returns (free bytes, peak activation bytes)."""

    @abstractmethod
    def record(self, key: GraphKey) -> None:
        """Stream-capture one decode step of ``key.bucket`` rows into the shared graph pool."""

    @abstractmethod
    def instantiate(self, key: GraphKey) -> None:
        """Instantiate the recorded graph of ``key`` into an executable graph."""

    @abstractmethod
    def upload(self, key: GraphKey) -> None:
        """Upload the executable graph of ``key`` to the device, so launch does no implicit upload."""

    @abstractmethod
    def launch(self, key: GraphKey) -> None:
        """Enqueue a replay of ``key``; returns before the device finishes."""

    @abstractmethod
    def graph_memory(self) -> int:
        """Bytes held by this rank's graph pool and executable graphs now."""

    @abstractmethod
    def free_graphs(self) -> None:
        """Free every graph this rank holds."""

    @abstractmethod
    def allocate_kv(self, pages: int) -> None:
        """Allocate the paged KV cache (``pages`` pages plus the reserved padding page)."""

    @abstractmethod
    def move_slot(self, src: int, dst: int) -> None:
        """Move per-slot state (page-table row, length) from slot ``src`` to slot ``dst``."""

    @abstractmethod
    def release_slot(self, slot: int) -> None:
        """Forget the KV pages of the request leaving ``slot`` (retired or preempted): its
        page-table row points at the padding page again; the pages return to the controller's
        pool (I14)."""

    @abstractmethod
    def assign_pages(self, slot: int, first_index: int, pages: tuple[int, ...]) -> None:
        """Write ``pages`` into ``slot``'s page-table row from ``first_index`` on (I14). The page
        ids come from the command; the backend never chooses one."""

    @abstractmethod
    def prefill(self, admits: tuple[Admit, ...], chunk: Chunk | None = None) -> None:
        """Enqueue eager prefill of newly admitted requests into their slots (an admission
        with ``start`` > 0 prefills only ``prompt[start:]``, after the cached ``start``
        tokens) and of ``chunk`` through the chunk slot, in one packed batch; only the
        admissions' last tokens are sampled."""

    @abstractmethod
    def prepare_replay(self, step: Step) -> None:
        """Write the step's tokens, positions, lengths and tables into the fixed-address buffers (I12)."""

    @abstractmethod
    def run_eager(self, step: Step) -> None:
        """Enqueue the decode rows of ``step`` eagerly (no graph)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until this rank's device work, collectives included, is complete (I1, I11)."""

    @abstractmethod
    def enqueue_sample(self, step: Step) -> None:
        """Rank 0 (every rank under overlapped scheduling): enqueue the sampling of the next
        token of every decoded and admitted request of ``step``, and the copy of the token ids
        to the host; keep the ids on the device for the next step's fed rows; returns at once."""

    @abstractmethod
    def read_tokens(self, step: Step) -> tuple[int | None, ...]:
        """Rank 0 only, after `synchronize` (or `await_step` of ``step``): the token ids
        `enqueue_sample` computed for ``step``, in slot order (the rows, then the admissions),
        `NO_TOKEN` for a request that could not be sampled."""

    @abstractmethod
    def mark_step(self, seq: int) -> None:
        """Overlapped scheduling: record the end of command ``seq``'s device work on this
        rank's stream (a backend that cannot overlap raises)."""

    @abstractmethod
    def await_step(self, seq: int) -> None:
        """Overlapped scheduling: block until the device work `mark_step` marked for ``seq``
        completed."""

    @abstractmethod
    def destroy_communicator(self) -> None:
        """Destroy the TP communicator; only after `free_graphs` (I10)."""


def _byte_count(value) -> bool:
    return is_int(value) and value >= 0


def perform(backend: Backend, op: Op) -> Any:
    """Run ``op`` on ``backend`` and return its result.

    Raises:
        ProtocolError: ``op`` is a variant's own op, which a real backend does not run.
        TypeError: a memory report of the wrong kind (`profile_memory`, `graph_memory`),
            naming the method: the worker's reply failed on it with a TypeError that escaped
            `protocol.execution.run_command`, no reply sent and the worker not poisoned.
        Exception: whatever the backend method raises.
    """
    match op:
        case WarmupCollective(nbytes):
            return backend.warmup_collective(nbytes)
        case ProfileForward(rows):
            report = backend.profile_memory(rows)
            return checked_hook_result(
                report, "Backend.profile_memory",
                isinstance(report, tuple) and len(report) == 2
                and all(_byte_count(b) for b in report),
                "(free bytes, peak activation bytes), two integers >= 0")
        case GraphMemory():
            held = backend.graph_memory()
            return checked_hook_result(held, "Backend.graph_memory", _byte_count(held),
                                       "the bytes the rank's graphs hold, an integer >= 0")
        case Record(key):
            return backend.record(key)
        case Instantiate(key):
            return backend.instantiate(key)
        case Upload(key):
            return backend.upload(key)
        case LaunchGraph(key):
            return backend.launch(key)
        case FreeGraphs():
            return backend.free_graphs()
        case AllocateKVCache(pages):
            return backend.allocate_kv(pages)
        case MoveSlot(src, dst):
            return backend.move_slot(src, dst)
        case ReleaseSlot(slot):
            return backend.release_slot(slot)
        case AssignPages(slot, first_index, pages):
            return backend.assign_pages(slot, first_index, pages)
        case Prefill(admits, chunk):
            return backend.prefill(admits, chunk)
        case PrepareReplay(step):
            return backend.prepare_replay(step)
        case RunEager(step):
            return backend.run_eager(step)
        case Synchronize():
            return backend.synchronize()
        case EnqueueSample(step):
            return backend.enqueue_sample(step)
        case ReadTokens(step):
            return backend.read_tokens(step)
        case MarkStep(seq):
            return backend.mark_step(seq)
        case AwaitStep(seq):
            return backend.await_step(seq)
        case DestroyCommunicator():
            return backend.destroy_communicator()
    raise ProtocolError(f"backend {type(backend).__name__} has no op {op.name!r} "
                        f"({type(op).__name__})")
