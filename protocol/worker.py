"""The worker: one rank's side of the step protocol, sans-IO.

`ops_for(command)` checks the command against the rank's state (slot occupancy, KV page
ownership, captured keys, the graph plan) and returns the ordered backend operations (typed
`protocol.backend.Op` records); the driver runs them (`protocol.execution`) and passes the
results to `reply`, or the exception to `fail`. Commands reach their handler by a `match` on
the command type. A failed worker is poisoned: it refuses every
later command but `Teardown`, so no rank goes on to the next collective alone (I13).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from protocol.backend import (
    SYNC,
    AllocateKVCache,
    AssignPages,
    DestroyCommunicator,
    EnqueueSample,
    FreeGraphs,
    GraphMemory,
    Instantiate,
    LaunchGraph,
    MoveSlot,
    Op,
    Prefill,
    PrepareReplay,
    AwaitStep,
    MarkStep,
    ProfileForward,
    ReadTokens,
    Record,
    ReleaseSlot,
    RunEager,
    Upload,
    WarmupCollective,
)
from protocol.commands import (
    AllocateKV,
    Capture,
    Command,
    Finalize,
    FinalizeReport,
    Launch,
    MeasureGraphs,
    MemoryReport,
    ProfileMemory,
    Reply,
    Step,
    Teardown,
    Warmup,
)
from protocol.eligibility import GraphPlan
from protocol.errors import (ConfigError, EligibilityError, PageError, ProtocolError,
                             checked_hook_result, is_int, shown)
from protocol.pages import PageMap
from protocol.slots import SlotMap

__all__ = ["SYNC", "Worker"]


def hook_ops(ops, hook: str) -> Sequence[Op]:
    """``ops`` as returned by the worker hook named ``hook``, checked to be a list (or tuple)
    of ops: one that returned a string failed with "'str' object has no attribute 'name'".

    Raises:
        TypeError: ``ops`` is not a list of `protocol.backend.Op`, naming the hook.
    """
    return checked_hook_result(
        ops, f"Worker.{hook}",
        isinstance(ops, (list, tuple)) and all(isinstance(op, Op) for op in ops),
        "a list of protocol.backend.Op")


class Worker:
    """One rank's protocol state.

    Args:
        rank: this rank (0 samples and carries the step payload).
        world_size: number of ranks.
        plan: the graph plan from the same configuration as the controller's (I7).
        capacity: number of real decode slots: the configuration's max_batch.

    Raises:
        ConfigError: a rank outside 0..world_size - 1, a world size or capacity that is no
            positive integer, or a plan that is no GraphPlan.
    """

    def __init__(self, rank: int, world_size: int, plan: GraphPlan, capacity: int):
        for name, value in (("world_size", world_size), ("capacity", capacity)):
            if not is_int(value) or value < 1:
                raise ConfigError(f"Worker {name}={shown(value)} must be a positive integer")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ConfigError(f"Worker rank={shown(rank)} must be in 0..{world_size - 1}")
        if not isinstance(plan, GraphPlan):
            raise ConfigError(f"Worker plan={shown(plan)}: expected a "
                              "protocol.eligibility.GraphPlan (GraphPlan.from_config)")
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        self.slots = SlotMap(capacity)
        self.pages: PageMap | None = None
        self.uploaded: set = set()
        self.captured: set = set()
        self.serving = False
        self.poisoned: str | None = None
        self.torn_down = False
        # overlapped scheduling: the previous step, whose device work may still run (and
        # whose tokens rank 0 reads in the next step's reply, if it sampled)
        self.in_flight: Step | None = None

    def fingerprint(self) -> tuple:
        """Hashable summary of the state, for the simulator's state hashing."""
        return (self.rank, self.slots.fingerprint(),
                self.pages.fingerprint() if self.pages else (), tuple(sorted(self.captured)),
                tuple(sorted(self.uploaded)), self.serving, self.poisoned is not None,
                self.torn_down, self.plan.batch_cap,
                self.in_flight.seq if self.in_flight is not None else None)

    # -- commands to operations -------------------------------------------------------------

    def ops_for(self, command: Command) -> list[Op]:
        """Operations this rank runs for ``command``, in order; the last is a synchronize, or
        under overlapped scheduling the wait for the previous step and rank 0's token read.

        Raises:
            ProtocolError: the command is invalid here (poisoned worker, slot mismatch,
                ineligible or uncaptured key); the driver turns it into a failed reply.
        """
        if self.poisoned is not None and not isinstance(command, Teardown):
            raise ProtocolError(f"rank {self.rank} is poisoned by an earlier failure "
                                f"({self.poisoned}); refusing command {command.seq}")
        self.check_lifecycle(command)
        match command:
            case Warmup():
                return self._ops_warmup(command)
            case ProfileMemory():
                return self._ops_profilememory(command)
            case MeasureGraphs():
                return self._ops_measuregraphs(command)
            case AllocateKV():
                return self._ops_allocatekv(command)
            case Capture():
                return self._ops_capture(command)
            case Launch():
                return self._ops_launch(command)
            case Finalize():
                return self._ops_finalize(command)
            case Step():
                return self._ops_step(command)
            case Teardown():
                return self._ops_teardown(command)
        return self.ops_for_other(command)

    def check_lifecycle(self, command: Command) -> None:
        """Refuse a command this rank's lifecycle has not reached or has passed: the KV cache is
        allocated once, before any graph that serves is captured (I15: a `Capture` before
        `AllocateKV` would record the placeholder cache the measurement graphs use, and a second
        `AllocateKV` would replace the cache every captured graph reads), no
        other startup command runs once Finalize made the rank serve (I3: serving never
        captures, measures, warms up or profiles), and nothing runs after `Teardown`.

        A sleep/wake cycle that re-allocates the KV cache under graphs captured before it is the
        bug this refuses (vllm-project/vllm PR #53197, where the wake rebuilt tensors a captured
        graph reads); the simulator's variant `kv-realloc-on-wake` shows what it does where
        nothing refuses it. Graphs captured against a probe-sized cache and kept to serve are
        the other (lightseekorg/tokenspeed PR #1509 releases them and captures again once the
        real pool is bound); the variant `capture-before-kv` shows that one.

        Raises:
            ProtocolError: naming the command and the rank; ``invariant`` I15 for a Capture
                before AllocateKV or a second AllocateKV, I3 for another startup command after
                Finalize, None after Teardown.
        """
        if self.torn_down:
            raise ProtocolError(f"rank {self.rank}: {type(command).__name__} (command "
                                f"{command.seq}) after Teardown; a torn-down rank runs nothing")
        if not isinstance(command, STARTUP_COMMANDS):
            return
        if isinstance(command, Capture) and self.pages is None:
            raise ProtocolError(f"rank {self.rank}: Capture of {command.key} (command "
                                f"{command.seq}) before AllocateKV; the graph would capture the "
                                "placeholder cache that the allocation replaces (I15)",
                                invariant="I15")
        if isinstance(command, AllocateKV) and self.pages is not None:
            raise ProtocolError(f"rank {self.rank}: AllocateKV (command {command.seq}) but the KV "
                                "cache is allocated already; a second allocation would replace "
                                "the cache the captured graphs read (I15)", invariant="I15")
        if self.serving:
            raise ProtocolError(f"rank {self.rank}: {type(command).__name__} (command "
                                f"{command.seq}) after Finalize; a serving rank runs no startup "
                                "command (I3)", invariant="I3")

    def ops_for_other(self, command: Command) -> list[Op]:
        """Hook for a variant's own command types; the protocol has none, so this raises.

        Raises:
            ProtocolError: always, naming the command type.
        """
        raise ProtocolError(f"rank {self.rank} has no handler for {type(command).__name__}")

    def _ops_warmup(self, command: Warmup) -> list[Op]:
        return list(_warmup_ops(tuple(command.sizes)))

    def _ops_profilememory(self, command: ProfileMemory) -> list[Op]:
        return [ProfileForward(command.rows), SYNC]

    def _ops_measuregraphs(self, command: MeasureGraphs) -> list[Op]:
        ops: list[Op] = [GRAPH_MEMORY]
        for key in command.keys:
            self.plan.require_eligible(key, "memory measurement")
            ops += _measure_ops(key)
        return ops + [FreeGraphs(), SYNC]

    def _ops_allocatekv(self, command: AllocateKV) -> list[Op]:
        return [AllocateKVCache(command.pages), SYNC]

    def _ops_capture(self, command: Capture) -> list[Op]:
        self.plan.require_eligible(command.key, "capture")
        return list(_capture_ops(command.key))

    def _ops_launch(self, command: Launch) -> list[Op]:
        if command.key not in self.uploaded:
            raise EligibilityError(f"rank {self.rank}: launch of {command.key}, which was not "
                                   "recorded, instantiated and uploaded (I4)", invariant="I4")
        return [_launch_op(command.key), SYNC]

    def _ops_finalize(self, command: Finalize) -> list[Op]:
        return [GRAPH_MEMORY, SYNC]

    def _ops_step(self, step: Step) -> list[Op]:
        ops = list(hook_ops(self.apply_slot_changes(step), "apply_slot_changes"))
        ops += hook_ops(self.apply_page_changes(step), "apply_page_changes")
        if step.admits or step.chunk is not None:
            ops.append(Prefill(step.admits, step.chunk))
        if step.rows:
            ops += hook_ops(self.forward_ops(step), "forward_ops")
        if step.overlap:
            return ops + hook_ops(self.overlapped_tail(step), "overlapped_tail")
        samples = self.rank == 0 and bool(step.rows or step.admits)
        if samples:  # enqueued behind the forward: its host work overlaps the device's
            ops.append(EnqueueSample(step))
        ops.append(SYNC)
        if samples:
            ops.append(ReadTokens(step))
        return ops

    def overlapped_tail(self, step: Step) -> list[Op]:
        """The end of an overlapped step (``step.overlap``): every rank samples, so the ids stay
        on every device for the next step's fed rows (I20); the step's device work is marked
        and the rank waits only for the previous step's (I1 restated: a reply means "this step
        enqueued, the previous one complete"); rank 0 then reads the previous step's tokens,
        which its reply carries (I11).

        Raises:
            ProtocolError: ``step.read`` does not name the previous step, or that step
                sampled nothing, or the step reads nothing while the previous step's tokens
                are unread (they would be lost).
        """
        ops: list[Op] = []
        if step.rows or step.admits:
            ops.append(EnqueueSample(step))
        ops.append(MarkStep(step.seq))
        previous, self.in_flight = self.in_flight, step
        if previous is not None:
            ops.append(AwaitStep(previous.seq))
        unread = previous if previous is not None and previous.samples else None
        if step.read != (unread.seq if unread is not None else None):
            raise ProtocolError(
                f"rank {self.rank}: step {step.seq} reads the tokens of step {step.read}, but "
                f"the step before it with unread tokens is "
                f"{unread.seq if unread is not None else 'none'} (I11)")
        if unread is not None and self.rank == 0:
            ops.append(ReadTokens(unread))
        return ops

    def apply_slot_changes(self, step: Step) -> list[Op]:
        """Apply the step's retirements, moves and admissions to the slot map, with assertions.

        Raises:
            SlotError: the command's view of a slot differs from this rank's (I8).
        """
        ops: list[Op] = []
        for retire in step.retires + step.preempts:
            self.slots.retire(retire)
            ops.append(ReleaseSlot(retire.slot))
        for move in step.moves:
            self.slots.move(move)
            ops.append(MoveSlot(move.src, move.dst))
        for admit in step.admits:
            if admit.start:  # the last chunk: the sequence leaves the chunk slot
                ops.append(MoveSlot(self.slots.chunk_slot, admit.slot))
            self.slots.admit(admit)
        if step.chunk is not None:
            self.slots.chunk(step.chunk)
        self.slots.check_dense()
        self.slots.check_rows(step.rows, admitted=len(step.admits))
        return ops

    def apply_page_changes(self, step: Step) -> list[Op]:
        """Free the pages of finished and preempted requests, hand out the step's pages, and
        check that every admitted prompt and decode row holds the pages it writes (I14).

        Each page change is checked against this rank's page map; the worker never picks a page.
        Raises:
            PageError: a page change or a row does not match this rank's page map, or a step
                arrives before `AllocateKV`.
        """
        if self.pages is None:
            if (step.retires or step.preempts or step.admits or step.rows or step.pages
                    or step.chunk is not None):
                raise PageError(f"rank {self.rank}: step {step.seq} before the KV cache was "
                                "allocated")
            return []
        for leaving in step.retires + step.preempts:
            self.pages.release(leaving.request_id, leaving.pages)
        ops: list[Op] = []
        for assign in step.pages:
            if self.slots.slots.get(assign.slot) != assign.request_id:
                slot = next((s for s, r in self.slots.slots.items() if r == assign.request_id),
                            None)
                raise PageError(f"rank {self.rank}: pages for request {assign.request_id} in "
                                f"slot {assign.slot}, but it holds slot {slot}")
            self.pages.assign(assign)
            ops.append(AssignPages(assign.slot, assign.first_index, assign.pages))
        for admit in step.admits:
            self.pages.check_admit(admit)
        if step.chunk is not None:
            self.pages.check_chunk(step.chunk)
        self.pages.check_rows(step.rows)
        return ops

    def forward_ops(self, step: Step) -> list[Op]:
        """Replay the step's graph if the command names one, else run it eagerly."""
        if step.key is None:
            return [RunEager(step)]
        if step.key not in self.captured:
            raise EligibilityError(f"rank {self.rank}: decode step {step.seq} asks to replay "
                                   f"{step.key}, which was not captured at startup (I3)",
                                   invariant="I3")
        return [PrepareReplay(step), _launch_op(step.key)]

    # -- results to replies -------------------------------------------------------------------

    def reply(self, command: Command, results: Sequence[Any]) -> Reply:
        """The reply once every op of ``command`` ran; ``results`` are their return values in order."""
        payload: Any = None
        match command:
            case Capture(key=key):
                self.uploaded.add(key)
            case Launch(key=key):
                self.captured.add(key)
            case ProfileMemory():
                free, peak = results[0]
                payload = MemoryReport(free_bytes=free, peak_activation_bytes=peak)
            case MeasureGraphs(keys=keys):
                # results: graph_memory, then (record, instantiate, graph_memory) per key
                sizes = [results[0]] + [results[3 * i + 3] for i in range(len(keys))]
                payload = {key: sizes[i + 1] - sizes[i] for i, key in enumerate(keys)}
            case AllocateKV(pages=pages, batch_cap=cap, page_size=page_size):
                self.pages = PageMap(pages, page_size)
                if cap is not None:
                    self.plan = self.plan.fitted(cap)
            case Finalize():
                self.serving = True
                payload = FinalizeReport(captured=frozenset(self.captured), graph_bytes=results[0])
            case Step(overlap=True, read=read) if self.rank == 0:
                payload = results[-1] if read is not None else None
            case Step(overlap=False) if self.rank == 0 and (command.rows or command.admits):
                payload = results[-1]
            case Teardown():
                self.torn_down = True
        if payload is None:
            return _plain_reply(self.rank, command.seq)
        return Reply(rank=self.rank, seq=command.seq, ok=True, payload=payload)

    def fail(self, command: Command, error: BaseException) -> Reply:
        """Poison this worker and report ``error`` for ``command``."""
        self.poisoned = f"{type(error).__name__}: {error}"
        return Reply(rank=self.rank, seq=command.seq, ok=False, error=self.poisoned,
                     error_kind=getattr(error, "kind", "error"),
                     invariant=getattr(error, "invariant", None))

    def _ops_teardown(self, command: Teardown) -> list[Op]:
        self.in_flight = None
        return [SYNC, FreeGraphs(), DestroyCommunicator()]


STARTUP_COMMANDS = (Warmup, ProfileMemory, MeasureGraphs, AllocateKV, Capture, Launch, Finalize)
"""Commands of the startup sequence alone (`Worker.check_lifecycle` refuses them once serving)."""


# The startup sweep's ops depend on the graph key (or the warm-up sizes) alone: frozen records,
# built once and shared by every rank and run, so that each is described once (`Op.described`)
GRAPH_MEMORY = GraphMemory()


@lru_cache(maxsize=4096)
def _warmup_ops(sizes: tuple[int, ...]) -> tuple[Op, ...]:
    return tuple(WarmupCollective(n) for n in sizes) + (SYNC,)


@lru_cache(maxsize=4096)
def _measure_ops(key) -> tuple[Op, ...]:
    return Record(key), Instantiate(key), GRAPH_MEMORY


@lru_cache(maxsize=4096)
def _capture_ops(key) -> tuple[Op, ...]:
    return Record(key), Instantiate(key), Upload(key), SYNC


@lru_cache(maxsize=4096)
def _launch_op(key) -> LaunchGraph:
    return LaunchGraph(key)


@lru_cache(maxsize=4096)
def _plain_reply(rank: int, seq: int) -> Reply:
    """The successful reply without a payload (most of the sweep's): one frozen record per
    (rank, seq), shared by every run."""
    return Reply(rank=rank, seq=seq, ok=True)
