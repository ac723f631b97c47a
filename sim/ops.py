"""The modelled backend: what each per-rank backend op does to the simulated world.

`ModelledBackend.attempt(rank, host, op, probe)` matches on the op's type and either tests
(``probe=True``) or performs the op, returning BLOCKED, PROGRESS or DONE; a performed op that
finishes leaves its result in ``host.result``. Lock-holding calls go through `locked` (H1, H2),
allocations through `alloc` (H7), device work through `enqueue` (H3, H6). A variant's own op
types are modelled by the handlers in its ``sim_ops``, keyed by the op class.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from protocol.backend import (
    AllocateKVCache,
    AssignPages,
    AwaitStep,
    DestroyCommunicator,
    EnqueueSample,
    FreeGraphs,
    GraphMemory,
    Instantiate,
    LaunchGraph,
    MarkStep,
    MoveSlot,
    Op,
    Prefill,
    PrepareReplay,
    ProfileForward,
    ReadTokens,
    Record,
    ReleaseSlot,
    ReplayRows,
    RunEager,
    Synchronize,
    Upload,
    WarmupCollective,
)
from protocol.commands import Step
from protocol.errors import ConfigError
from protocol.keys import SHORT, GraphKey
from sim.common import (BLOCKED, DONE, PROGRESS, Collective, Outcome, SimFault, Signature,
                        command_text)
from sim.comms import pairing_key
from sim.devices import (
    CAPTURED,
    ClearSlot,
    CopySlot,
    EagerDecode,
    Graph,
    GraphReplay,
    PrefillKernel,
    SampleKernel,
    SetPages,
    StepMark,
    WriteReplayMeta,
    padded_rows,
)
from sim.paged_kv import PagedKV

if TYPE_CHECKING:
    from sim.world import Host, World

LOCKING_OPS = (Record, Instantiate, Upload, LaunchGraph, AllocateKVCache, FreeGraphs)
"""Ops that may take the process's driver lock (H1)."""

ALWAYS_READY = (WarmupCollective, ProfileForward, GraphMemory, ReleaseSlot,
                AssignPages, MoveSlot, Prefill, PrepareReplay, RunEager, EnqueueSample,
                ReadTokens)
"""Ops that never block in the model (host-side work or a plain enqueue), probed for free."""


_NBYTES = attrgetter("nbytes")


@lru_cache(maxsize=4096)
def _graph_collectives(shape, key: GraphKey) -> tuple[tuple[Signature, bool], ...]:
    """What a replay of the default graph of ``key`` issues: its all-reduces, on the main
    stream (one frozen record per model shape and key, for every rank and run)."""
    sig = Signature("all-reduce", shape.allreduces_per_step, shape.allreduce_bytes(key.bucket),
                    f"graph {key}", mode="graph")
    return ((sig, False),)


@lru_cache(maxsize=4096)
def _uniform_columns(token: int, position: int, slot: int, n: int) -> ReplayRows:
    """`ReplayRows` of ``n`` equal rows (every sweep replay reads padding only): immutable and
    fixed by the row's fields, so one record per (row, count) serves every rank and run."""
    return ReplayRows((token,) * n, (position,) * n, (slot,) * n)


@lru_cache(maxsize=4096)
def _warmup_signature(nbytes: int) -> Signature:
    """The warm-up all-reduce of ``nbytes`` bytes: one frozen record per size, for every rank
    and run."""
    return Signature("all-reduce", 1, nbytes, "warm-up")


def _columns(rows) -> ReplayRows:
    """`ReplayRows` of a list or tuple of `DecodeRow`s: tokens, positions and slots.

    Padded rows end in a run of one padding row (a whole sweep replay is padding), so the
    run of rows equal to the last one is expanded by repetition instead of row by row:
    equal rows have equal fields, so the tuples are the same as a loop over every row.
    """
    n = len(rows)
    if not n:
        return ReplayRows((), (), ())
    last = rows[-1]
    first = rows.index(last)
    if first == 0 and rows.count(last) == n:  # one row throughout (a sweep replay's padding)
        return _uniform_columns(last.token, last.position, last.slot, n)
    if rows.count(last) == n - first:  # every row from `first` on equals the last one
        head, run = rows[:first], n - first
        return ReplayRows(tuple([x.token for x in head]) + (last.token,) * run,
                          tuple([x.position for x in head]) + (last.position,) * run,
                          tuple([x.slot for x in head]) + (last.slot,) * run)
    return ReplayRows(tuple([x.token for x in rows]), tuple([x.position for x in rows]),
                      tuple([x.slot for x in rows]))


class ModelledBackend:
    """The backend of every rank of one world.

    Args:
        world: the world whose devices, locks, memory and graphs the ops change.
    """

    def __init__(self, world: World):
        self.world = world
        hz = world.hz
        # fixed for the whole run, read by every lock-holding call (`locked`)
        self._waits = {(q, f): hz.h2_waits(q, f) for q in (False, True) for f in (False, True)}
        self._quiesce_scope = [
            tuple(world.procs[world.proc_of[r]]) if hz.h2_scope == "process"
            else tuple(hz.quiesce_devices(r, world.procs[world.proc_of[r]], world.ws))
            for r in range(world.ws)]
        self._graph_collectives: dict[GraphKey, tuple] = {}
        self._checked_calls: set[tuple] = set()  # (communicator, peer, rank) found valid
        self._padded: tuple = (None, ())  # (step, its padded rows): see `padded`
        # fixed for the whole run, read by the readiness functions (`readiness`)
        self._h1 = hz.h1_driver_lock
        self._h4_hangs = hz.h4_lazy_connect and hz.h4_mode == "hang"
        self._quiesces = self._waits[(True, False)]
        self._scope_devices = [tuple(world.devices[d] for d in scope)
                               for scope in self._quiesce_scope]
        self.readiness = {Record: self._record_ready, Instantiate: self._quiescing_ready,
                          Upload: self._quiescing_ready, LaunchGraph: self._launch_ready,
                          AwaitStep: self._await_ready}
        """Op class -> ready(r, host, op): whether `attempt` with ``probe`` would answer
        other than BLOCKED, for the ops of the startup sweep (the most probed after
        synchronize); the same answer without the dispatch and the generic lock discipline.
        Only exact classes: a subclass, or any other op, is probed through `attempt`."""
        self.performers = {
            Record: self._perform_record,
            Instantiate: self._perform_instantiate,
            LaunchGraph: self._perform_launch,
            Upload: self._perform_upload,
            Synchronize: self._perform_synchronize,
            GraphMemory: self._perform_graph_memory,
            WarmupCollective: self._perform_warmup,
            ReleaseSlot: self._perform_release_slot,
            AssignPages: self._perform_assign_pages,
            MoveSlot: self._perform_move_slot,
            Prefill: self._perform_prefill,
            PrepareReplay: self._perform_prepare_replay,
            RunEager: self._perform_run_eager,
            EnqueueSample: self.enqueue_sample,
            ReadTokens: self.read_tokens,
            MarkStep: self.mark_step,
            AwaitStep: self._perform_await_step,
        }
        """Op class -> perform(r, host, op): `attempt` without ``probe``, without its ``match``
        (each case tried is a type test); the same calls as the match makes. Exact classes
        only, as `readiness`. Bound methods, not lambdas: a row's minimal run (its world
        included) goes back from a worker process by pickle."""

    # -- dispatch ---------------------------------------------------------------------------------

    def attempt(self, r: int, host: Host, op: Op, probe: bool) -> int:
        """Test (``probe``) or perform ``op`` on rank ``r``; BLOCKED, PROGRESS or DONE."""
        if not probe:
            perform = self.performers.get(type(op))
            if perform is not None:
                return perform(r, host, op)
        match op:  # the sweep's ops first: a match tries its cases in order
            case Record(key):
                return self.record(r, host, key, probe)
            case Instantiate(key):
                return self.graph_driver_call(r, host, key, probe, "instantiated")
            case LaunchGraph(key):
                return self.launch(r, host, key, probe)
            case Upload(key):
                return self.graph_driver_call(r, host, key, probe, "uploaded")
            case Synchronize():
                return self.synchronize(r, host, probe)
            case GraphMemory():
                return DONE if probe else self.done(host, self.graph_bytes(r))
            case WarmupCollective(nbytes):
                return self.warmup_collective(r, host, nbytes, probe)
            case ProfileForward(rows):
                return self.profile_memory(r, host, rows, probe)
            case FreeGraphs():
                return self.free_graphs(r, host, probe)
            case AllocateKVCache(pages):
                return self.allocate_kv(r, host, pages, probe)
            case ReleaseSlot(slot):
                return DONE if probe else self.page_table_done(r, host, ClearSlot(slot))
            case AssignPages(slot, first_index, pages):
                return DONE if probe else self.page_table_done(
                    r, host, SetPages(slot, first_index, pages))
            case MoveSlot(src, dst):
                return DONE if probe else self.enqueue_done(r, host, CopySlot(src, dst))
            case Prefill(admits, chunk):
                return DONE if probe else self.prefill(r, host, admits, chunk)
            case PrepareReplay():
                return DONE if probe else self._perform_prepare_replay(r, host, op)
            case RunEager(step):
                return DONE if probe else self.run_eager(r, host, step)
            case EnqueueSample():
                return DONE if probe else self.enqueue_sample(r, host, op)
            case ReadTokens():
                return DONE if probe else self.read_tokens(r, host, op)
            case MarkStep():
                return DONE if probe else self.mark_step(r, host, op)
            case AwaitStep():
                if not self._await_ready(r, host, op):
                    return BLOCKED
                return DONE if probe else self.done(host)
            case DestroyCommunicator():
                return self.destroy_communicator(r, host, probe)
        handler = self.world.variant.sim_ops.get(type(op))
        if handler is None:
            raise SimFault(f"the simulator models no backend op {op.name!r} "
                           f"({type(op).__name__})", kind="unmodelled")
        host.lock_blocked = False  # set again by `locked` if the handler waits for the lock
        status = handler(self, r, host, op, probe)
        if type(status) is not int or status not in (BLOCKED, PROGRESS, DONE):
            # a fresh user's handler returned "yes": read as not DONE, the run ended in livelock
            raise TypeError(f"sim_ops handler {getattr(handler, '__qualname__', handler)!r} "
                            f"for {type(op).__name__} returned {status!r}; expected BLOCKED, "
                            "PROGRESS or DONE (sim.common)")
        return status

    def _perform_record(self, r: int, host: Host, op: Record) -> int:
        return self.record(r, host, op.key, False)

    def _perform_instantiate(self, r: int, host: Host, op: Instantiate) -> int:
        return self.graph_driver_call(r, host, op.key, False, "instantiated")

    def _perform_launch(self, r: int, host: Host, op: LaunchGraph) -> int:
        return self.launch(r, host, op.key, False)

    def _perform_upload(self, r: int, host: Host, op: Upload) -> int:
        return self.graph_driver_call(r, host, op.key, False, "uploaded")

    def _perform_synchronize(self, r: int, host: Host, op: Synchronize) -> int:
        """`synchronize` performed: done once the rank's streams are empty."""
        dev = self.world.devices[r]
        if dev.main or dev.side:  # Device.busy, inlined
            return BLOCKED
        host.result = None
        return DONE

    def _perform_graph_memory(self, r: int, host: Host, op: GraphMemory) -> int:
        return self.done(host, self.graph_bytes(r))

    def _perform_warmup(self, r: int, host: Host, op: WarmupCollective) -> int:
        return self.warmup_collective(r, host, op.nbytes, False)

    def _perform_release_slot(self, r: int, host: Host, op: ReleaseSlot) -> int:
        return self.page_table_done(r, host, ClearSlot(op.slot))

    def _perform_assign_pages(self, r: int, host: Host, op: AssignPages) -> int:
        return self.page_table_done(r, host, SetPages(op.slot, op.first_index, op.pages))

    def _perform_move_slot(self, r: int, host: Host, op: MoveSlot) -> int:
        return self.enqueue_done(r, host, CopySlot(op.src, op.dst))

    def _perform_prefill(self, r: int, host: Host, op: Prefill) -> int:
        return self.prefill(r, host, op.admits, op.chunk)

    def _perform_prepare_replay(self, r: int, host: Host, op: PrepareReplay) -> int:
        return self.prepare_replay(r, host, op.step, self.host_buffer(op.step))

    def _perform_await_step(self, r: int, host: Host, op: AwaitStep) -> int:
        """`await_step` performed: done once the device ran the step's `StepMark`."""
        if not self._await_ready(r, host, op):
            return BLOCKED
        host.result = None
        return DONE

    def _await_ready(self, r: int, host: Host, op: AwaitStep) -> bool:
        """`await_step` probed: ready once the device ran the step's `StepMark`."""
        return self.world.devices[r].marked >= op.seq

    @staticmethod
    def host_buffer(step: Step) -> int:
        """Which of a rank's two pinned host buffers (staging of the replay inputs; copy of the
        sampled ids) ``step`` uses: one per step parity under overlapped scheduling (step n+1
        writes its inputs while step n's copy may still wait on the stream, and step n's ids
        land while the host reads step n-1's; step n+2 comes only after step n completed),
        else buffer 0."""
        return step.seq % 2 if step.overlap else 0

    def prepare_replay(self, r: int, host: Host, step: Step, staging: int) -> int:
        """Write ``step``'s padded rows into host staging buffer ``staging`` now and enqueue
        their copy to the replay inputs, which reads that buffer when the device runs it."""
        rows = self.padded(step)
        self.world.devices[r].staging[staging] = (step.seq, rows)
        return self.enqueue_done(r, host, WriteReplayMeta(step.seq, rows, step.feed, staging))

    def mark_step(self, r: int, host: Host, op: MarkStep) -> int:
        """Mark the end of command ``op.seq``'s device work on the main stream."""
        return self.enqueue_done(r, host, StepMark(op.seq))

    def _perform_run_eager(self, r: int, host: Host, op: RunEager) -> int:
        return self.run_eager(r, host, op.step)

    def _record_ready(self, r: int, host: Host, op: Record) -> bool:
        """`record` probed: blocked by H4 in hang mode before the warm-up of its size, or by
        another thread holding the driver lock (H1); it waits for no device (H2)."""
        if self._h4_hangs and (self.world.config.shape.allreduce_bytes(op.key.bucket)
                               not in self.world.connected[r]):
            return False
        if self._h1:
            holder = self.world.locks[host.proc]
            return holder is None or holder == r
        return True

    def _quiescing_ready(self, r: int, host: Host, op) -> bool:
        """instantiate / upload probed (`locked` with ``quiesce``): blocked by another thread
        holding the driver lock; a thread that would take the lock makes progress even while
        it must wait for quiescence (H2), one that holds it (or with H1 off) waits."""
        if self._h1:
            holder = self.world.locks[host.proc]
            if holder is None:
                return True  # it takes the lock: progress, whatever the devices do
            if holder != r:
                return False
        if self._quiesces:
            for dev in self._scope_devices[r]:
                if dev.main or dev.side:  # Device.busy, inlined
                    return False
        return True

    def _launch_ready(self, r: int, host: Host, op: LaunchGraph) -> bool:
        """launch probed: only the implicit upload of a never-uploaded graph can block."""
        graph = self.world.graphs[r].get(op.key)
        if graph is not None and not graph.uploaded:
            return self._quiescing_ready(r, host, op)
        return True

    # -- helpers for ops (and for variants' own ops) -----------------------------------------------

    def done(self, host: Host, value: Any = None) -> int:
        """Finish the current op with ``value`` as its result."""
        host.result = value
        return DONE

    def enqueue(self, r: int, kernel, side: bool = False) -> None:
        """Append a compute kernel, or a collective given by its `Signature`, to a stream of
        rank ``r`` (main, or side with ``side``).

        A collective is numbered per communicator on this rank (`sim.common.Collective`).

        Raises:
            ConfigError: the signature names a communicator the scenario lacks, a host group,
                a communicator rank ``r`` is not a member of, or a send/receive peer outside it.
        """
        w = self.world
        dev = w.devices[r]
        if isinstance(kernel, Signature):
            sig = kernel
            if (sig.comm, sig.peer, r) not in self._checked_calls:
                self._check_call(r, sig)
            key = pairing_key(sig.comm, sig.op, r, sig.peer)
            index = dev.paired.get(key, 0)
            order = dev.issued.get(sig.comm, 0)
            dev.paired[key] = index + 1
            dev.issued[sig.comm] = order + 1
            kernel = Collective(index, sig, order)
            dev.enqueued_collectives += 1
        stream = dev.side if side else dev.main
        if not stream:  # the kernel becomes the stream's head
            w.device_model.heads_moved()
        stream.append(kernel)
        w.queued += 1

    def _check_call(self, r: int, sig: Signature) -> None:
        """Raise ConfigError if rank ``r`` may not enqueue ``sig`` (see `enqueue`); remember a
        valid (communicator, peer, rank) so that later calls skip the check."""
        comm = self.world.comm(sig.comm)
        members = comm.members(self.world.ws)
        if not comm.device or r not in members or (
                sig.peer is not None and (sig.peer not in members or sig.peer == r)):
            what = ("a host group" if not comm.device else
                    f"a communicator of ranks {list(members)}")
            raise ConfigError(f"rank {r} enqueues {sig.op}"
                              + (f" with rank {sig.peer}" if sig.peer is not None else "")
                              + f" on communicator {sig.comm!r}, {what}")
        self._checked_calls.add((sig.comm, sig.peer, r))

    def send(self, r: int, peer: int, nbytes: int, comm: str = "tp", side: bool = False,
             label: str = "send") -> None:
        """Enqueue a point-to-point send of ``nbytes`` bytes from rank ``r`` to ``peer`` on
        ``comm``; it completes together with ``peer``'s matching `recv` (same communicator,
        same index in the pair's channel, same size)."""
        self.enqueue(r, Signature("send", 1, nbytes, label, comm, peer=peer), side)

    def recv(self, r: int, peer: int, nbytes: int, comm: str = "tp", side: bool = False,
             label: str = "recv") -> None:
        """Enqueue a point-to-point receive of ``nbytes`` bytes on rank ``r`` from ``peer``."""
        self.enqueue(r, Signature("recv", 1, nbytes, label, comm, peer=peer), side)

    def host_collective(self, r: int, host: Host, sig: Signature, probe: bool) -> int:
        """A collective on a host group (``sig.comm`` names a `Communicator` with
        ``device=False``): the host thread blocks until every member's host is in the call
        with the same index, then all return. Calls of differing signature are a divergence.

        Returns PROGRESS when rank ``r`` arrives, BLOCKED while peers are missing, DONE once all
        arrived.

        Raises:
            ConfigError: ``sig.comm`` is unknown, a device communicator, or lacks rank ``r``.
        """
        w = self.world
        comm = w.comm(sig.comm)
        members = comm.members(w.ws)
        if comm.device or r not in members:
            raise ConfigError(f"rank {r} calls host collective {sig.op} on communicator "
                              f"{sig.comm!r}, which is not a host group with rank {r} in it")
        seq = w.host_seq.get((r, sig.comm), 0)
        arrived = w.host_arrivals.setdefault((sig.comm, seq), {})
        if r not in arrived:
            if not probe:
                arrived[r] = sig
            return PROGRESS
        if not all(m in arrived for m in members):
            return BLOCKED
        if probe:
            return DONE
        first = arrived[members[0]]
        if any(not arrived[m].matches(first) for m in members):
            lines = "; ".join(f"rank {m} is in {arrived[m].op} ({arrived[m].label}: "
                              f"{arrived[m].nbytes} bytes)" for m in members)
            w.outcome = Outcome("divergence", f"host collectives differ on communicator "
                                              f"{sig.comm} call #{seq}: {lines}", "I2",
                                rank=r, step=host.cmd.seq, check="host-collectives-differ")
            return DONE
        w.host_seq[(r, sig.comm)] = seq + 1
        left = w.host_left.setdefault((sig.comm, seq), set())
        left.add(r)
        if len(left) == len(members):
            del w.host_arrivals[(sig.comm, seq)]
            del w.host_left[(sig.comm, seq)]
        return self.done(host)

    def page_table_done(self, r: int, host: Host, kernel) -> int:
        """A page-table update (I14): stream-ordered behind the main stream's queued kernels, and
        applied at once when that stream is idle -- nothing but this rank's later kernels reads
        the table, so running it before other actors move is the same run (a partial-order
        reduction that keeps the state space of steps without slot moves unchanged)."""
        dev = self.world.devices[r]
        if dev.main:
            return self.enqueue_done(r, host, kernel)
        self.world.device_model.execute(r, dev, kernel)
        return self.done(host)

    def enqueue_done(self, r: int, host: Host, kernel) -> int:
        """Enqueue ``kernel`` and finish the op."""
        self.enqueue(r, kernel)
        return self.done(host)

    def locked(self, r: int, host: Host, quiesce: bool, probe: bool, frees: bool = False) -> int:
        """Driver-lock discipline (H1) and device quiescence (H2) for a lock-holding call.

        ``quiesce``: the call is one the literature says waits (instantiate, upload, implicit
        upload, allocation); ``frees``: it frees device memory, which the H200 probes measured
        waiting. Whether it waits is `HazardModel.h2_waits` of the two.

        Returns DONE when the call may complete now (the lock is released again), PROGRESS when
        it took the lock but must wait, BLOCKED when it can do nothing.
        """
        w = self.world
        p = host.proc
        holder = w.locks[p]
        acquired = False
        if w.hz.h1_driver_lock:
            if holder is not None and holder != r:
                host.lock_blocked = True
                return BLOCKED
            if holder is None:
                acquired = True
                if not probe:
                    w.locks[p] = r
                    host.holding = True
        waits = (quiesce or frees) and self._waits.get((quiesce, frees))
        if waits is None:  # flags that are not bools: ask the hazard model itself
            waits = w.hz.h2_waits(quiesce, frees)
        if waits:  # HazardModel.h2_waits
            devices = w.devices
            for d in self._quiesce_scope[r]:  # HazardModel.quiesce_devices under h2_scope
                dev = devices[d]
                if dev.main or dev.side:  # Device.busy, inlined: the hottest probe
                    return PROGRESS if acquired else BLOCKED
        if not probe:
            w.release_lock(host)
        return DONE

    def alloc(self, r: int, nbytes: int, what: str | Callable[[], str]) -> None:
        """Take ``nbytes`` on rank ``r`` (H7); raises SimFault (OOM) past capacity.

        ``what`` names the allocation in the error: a string, or a function returning one
        (formatted only when the allocation fails; a sweep allocates once per graph)."""
        w = self.world
        capacity = w.scenario.memory.capacity
        if w.hz.h7_memory and w.used[r] + nbytes > capacity:
            what = what() if callable(what) else what
            raise SimFault(f"out of memory on rank {r}: {what} needs {nbytes} bytes, "
                           f"{capacity - w.used[r]} free", kind="oom", invariant="I9")
        w.used[r] += nbytes

    def eager_sig(self, rows: int, label: str) -> Signature:
        """The all-reduces of one eager forward over ``rows`` rows."""
        shape = self.world.config.shape
        return Signature("all-reduce", shape.allreduces_per_step, shape.allreduce_bytes(rows), label)

    def enqueue_eager(self, r: int, rows: int, label: str) -> None:
        """Enqueue one eager forward's all-reduces over ``rows`` rows on rank ``r``: run
        eagerly, they connect their size class, as a warm-up collective does (H4)."""
        sig = self.eager_sig(rows, label)
        self.world.connected[r].add(sig.nbytes)
        self.enqueue(r, sig)

    def graph(self, r: int, key: GraphKey) -> Graph:
        """Rank ``r``'s graph of ``key``; raises SimFault if it holds none."""
        graph = self.world.graphs[r].get(key)
        if graph is None:
            raise SimFault(f"rank {r} has no recorded graph {key}", kind="unmodelled")
        return graph

    def padded(self, step: Step):
        """The step's rows padded to its bucket on the scratch slot, as `prepare_replay` writes them.

        Every rank pads the same step object alike, so the last step's (immutable) rows are
        kept and handed to the next rank that asks for that very step."""
        if step is not self._padded[0]:
            self._padded = (step, padded_rows(step.rows, step.bucket, self.world.config.max_batch))
        return self._padded[1]

    def commanded_path(self, r: int, host: Host, key: GraphKey | None) -> bool:
        """Direct I2 check in a serving step: the rank replays exactly the step's key, with the
        step's bucket, or runs eagerly exactly when the step names no key. Ends the run and
        returns False on a departure."""
        step = host.cmd
        if not isinstance(step, Step):
            return True
        if key == step.key and (key is None or key.bucket == step.bucket):
            return True
        did = f"replayed {key}" if key is not None else "ran eagerly"
        want = f"replay {step.key}" if step.key is not None else "run eagerly"
        self.world.outcome = Outcome(
            "divergence", f"rank {r} {did} in step {step.seq}, whose command says {want} "
            f"(bucket {step.bucket}, {len(step.rows)} rows): ranks no longer run one program",
            "I2", rank=r, step=step.seq, check="replay-differs-from-command")
        return False

    def graph_bytes(self, r: int) -> int:
        """Bytes rank ``r``'s graphs hold."""
        return sum(map(_NBYTES, self.world.graphs[r].values()))

    # -- the ops ----------------------------------------------------------------------------------

    def synchronize(self, r: int, host: Host, probe: bool) -> int:
        if self.world.devices[r].busy():
            return BLOCKED
        return DONE if probe else self.done(host)

    def warmup_collective(self, r: int, host: Host, nbytes: int, probe: bool) -> int:
        if probe:
            return DONE
        self.world.connected[r].add(nbytes)
        self.enqueue(r, _warmup_signature(nbytes))
        return self.done(host)

    def profile_memory(self, r: int, host: Host, rows: int, probe: bool) -> int:
        if probe:
            return DONE
        w = self.world
        peak = rows * w.scenario.memory.activation_per_row
        free = w.scenario.memory.capacity - w.used[r]
        self.alloc(r, peak, "eager profile activations (kept as the activation workspace)")
        self.enqueue_eager(r, rows, "profile")
        return self.done(host, (free, peak))

    def record(self, r: int, host: Host, key: GraphKey, probe: bool) -> int:
        w = self.world
        size = w.config.shape.allreduce_bytes(key.bucket)
        if w.hz.h4_lazy_connect and size not in w.connected[r]:
            if w.hz.h4_mode == "hang":
                return BLOCKED
            if not probe:
                raise SimFault(f"I5: all-reduce of {size} bytes connects lazily inside the "
                               f"capture of {key} on rank {r} (no warm-up at that size)",
                               kind="lazy-connect", invariant="I5")
            return PROGRESS
        status = self.locked(r, host, quiesce=False, probe=probe)
        if status != DONE or probe:
            return status
        # graphs share one memory pool per rank (as captures given one pool handle do): a graph
        # holds its own bytes and grows the pool to what its bucket needs, if it is larger
        mem = w.scenario.memory
        growth = max(0, mem.graph_pool_bytes(key.bucket) - w.graph_pool[r])
        nbytes = mem.graph_base + growth
        self.alloc(r, nbytes, lambda: f"graph {key} (and its growth of the shared pool)")
        w.graph_pool[r] += growth
        buffers = w.devices[r].buffers
        w.graphs[r][key] = Graph(key, nbytes, buffers=tuple([buffers[n].ref for n in CAPTURED]))
        self.register(r, key, "tp", "all-reduce input")
        return self.done(host)

    def register(self, r: int, key: GraphKey, comm: str, what: str) -> None:
        """Add a buffer that graph ``key``'s collectives on ``comm`` use to rank ``r``'s
        registration table (custom all-reduce's IPC graph buffers, exchanged with the peers at
        the end of capture); every rank must hold as many as its peers (I17). Freeing the
        graphs empties the table."""
        self.world.devices[r].registered.append((key, comm, what))

    def graph_driver_call(self, r: int, host: Host, key: GraphKey, probe: bool, flag: str) -> int:
        """instantiate / upload: a lock-holding call that waits for quiescence (H1, H2)."""
        status = self.locked(r, host, quiesce=True, probe=probe)
        if status != DONE or probe:
            return status
        setattr(self.graph(r, key), flag, True)
        return self.done(host)

    def launch(self, r: int, host: Host, key: GraphKey, probe: bool) -> int:
        collectives = self._graph_collectives.get(key)
        if collectives is None:  # one frozen record per key: the same for every launch of it
            collectives = self._graph_collectives[key] = _graph_collectives(
                self.world.config.shape, key)
        return self.launch_with(r, host, key, probe, collectives)

    def launch_with(self, r: int, host: Host, key: GraphKey, probe: bool,
                    collectives: tuple[tuple[Signature, bool], ...]) -> int:
        """Launch rank ``r``'s graph of ``key`` whose replay issues ``collectives`` -- (signature,
        on the side stream) pairs, in issue order -- before its compute; the implicit upload
        of a never-uploaded graph takes the driver lock and waits for quiescence (H1, H2), and
        a serving replay is checked against the command (I2) and its buffers (I15). A variant
        whose graphs hold collectives on several streams or communicators calls this."""
        w = self.world
        graph = w.graphs[r].get(key)
        if graph is not None and not graph.uploaded:
            status = self.locked(r, host, quiesce=True, probe=probe)
            if status != DONE or probe:
                return status
            graph.uploaded = True
        if probe:
            return DONE
        graph = self.graph(r, key)
        if not self.commanded_path(r, host, key) or not self.live_buffers(r, host, graph):
            return DONE
        for sig, side in collectives:
            self.enqueue(r, sig, side)
        self.enqueue(r, GraphReplay(key, host.cmd.seq, graph.buffers))
        if w.ctrl.serving:
            w.events["replay"] += 1
            step = host.cmd
            if isinstance(step, Step):
                if len(step.rows) < key.bucket:
                    w.events["padded_replay"] += 1
                if step.admits or step.chunk is not None:
                    w.events["mixed_replay"] += 1
                if w.config.short_context is not None:
                    self.count_path(r, key)
                    positions = step.rows.positions
                    if (positions and GraphKey(key.bucket, SHORT) in w.graphs[r]
                            and positions[0] < w.config.short_context <= max(positions)):
                        # slot 0's context (position + 1) fits the short path and a row behind
                        # it does not, in a bucket with a short graph: the first-row bug's
                        # case, where the step's path differs by which row is asked
                        w.events["first_row_behind"] = w.events.get("first_row_behind", 0) + 1
        return self.done(host, self.replay_rows(r, graph, key.bucket))

    def count_path(self, r: int, key: GraphKey) -> None:
        """With the short-context path on, count a serving replay of rank ``r``'s graph ``key``:
        ``short_replay`` for the short path, ``short_declined`` for a `DECODE` replay of a
        bucket that has a short graph too (the step's longest context kept it off the short
        path, I22), so a clean run shows both sides of the boundary."""
        events = self.world.events
        if key.path == SHORT:
            events["short_replay"] = events.get("short_replay", 0) + 1
        elif GraphKey(key.bucket, SHORT) in self.world.graphs[r]:
            events["short_declined"] = events.get("short_declined", 0) + 1

    def replay_rows(self, r: int, graph: Graph, bucket: int) -> ReplayRows:
        """The rows a replay of ``graph`` just enqueued will read: the last replay-metadata
        write queued before it on the main stream (stream order), else what the replay-input
        buffer it captured holds now -- the launch's result, which the trace check compares
        with the step's rows (I12)."""
        dev = self.world.devices[r]
        for kernel in reversed(dev.main):
            if isinstance(kernel, WriteReplayMeta):
                rows = kernel.rows[:bucket]
                break
        else:
            ref = next(ref for ref in graph.buffers if ref[0] == "replay-inputs")
            rows = dev.allocations[ref].data[:bucket]
        return _columns(rows)

    def live_buffers(self, r: int, host: Host, graph: Graph) -> bool:
        """Direct I15 check: every buffer the graph captured is still the live one (same
        generation). Ends the run and returns False otherwise."""
        live = self.world.devices[r].buffers
        for name, generation in graph.buffers:
            if live[name].generation != generation:
                by = live[name].by
                who = command_text(by) if by is not None else "a later allocation"
                self.world.outcome = Outcome(
                    "invariant", f"I15 violated: rank {r} replays {graph.key} in command "
                    f"{host.cmd.seq}, which captured {name} generation {generation}, but "
                    f"{who} re-allocated {name} since (live generation "
                    f"{live[name].generation}): the replay reads and writes freed memory",
                    "I15", rank=r, step=host.cmd.seq, check="replay-of-freed-buffer",
                    cause=by.seq if by is not None else None)
                return False
        return True

    def free_graphs(self, r: int, host: Host, probe: bool) -> int:
        """Free every graph of rank ``r``: a driver free, so it takes the lock (H1) and, under
        the measured H2 calls, waits for quiescence."""
        status = self.locked(r, host, quiesce=False, probe=probe, frees=True)
        if status != DONE or probe:
            return status
        w = self.world
        w.used[r] -= self.graph_bytes(r)
        w.graphs[r].clear()
        w.graph_pool[r] = 0  # the last graph's release frees the shared pool
        w.devices[r].registered.clear()
        return self.done(host)

    def allocate_kv(self, r: int, host: Host, pages: int, probe: bool) -> int:
        status = self.locked(r, host, quiesce=True, probe=probe)
        if status != DONE or probe:
            return status
        nbytes = (pages + 1) * self.world.config.kv_page_bytes
        self.alloc(r, nbytes, f"KV cache of {pages} pages")
        cfg = self.world.config
        self.world.devices[r].allocate("kv", PagedKV(cfg.max_batch + 1, pages, cfg.page_size),
                                       by=host.cmd, nbytes=nbytes)
        return self.done(host)

    def prefill(self, r: int, host: Host, admits, chunk=None) -> int:
        """One packed prefill of the admissions (a last chunk: its tokens after ``start``)
        and the step's non-final chunk, if any: one eager forward over all their tokens."""
        tokens = sum(len(a.tokens) for a in admits) + (len(chunk.tokens) if chunk else 0)
        if chunk is not None or any(a.start for a in admits):
            self.world.events["chunked_prefill"] = self.world.events.get("chunked_prefill", 0) + 1
        self.enqueue_eager(r, tokens, "prefill")
        return self.enqueue_done(r, host, PrefillKernel(host.cmd.seq, admits, chunk))

    def run_eager(self, r: int, host: Host, step) -> int:
        if not self.commanded_path(r, host, None):
            return DONE
        self.enqueue_eager(r, len(step.rows), "eager decode")
        self.world.events["eager_decode"] += 1
        return self.enqueue_done(r, host, EagerDecode(step.seq, self.padded(step), step.feed))

    def enqueue_sample(self, r: int, host: Host, op: EnqueueSample) -> int:
        """The sampler kernel behind the step's forward (`SampleKernel`), copying into the
        step's host buffer (`host_buffer`)."""
        return self.sample_into(r, host, op.step, self.host_buffer(op.step))

    def sample_into(self, r: int, host: Host, step: Step, buffer: int) -> int:
        """Enqueue ``step``'s `SampleKernel` (row i from logits row i, then the admitted
        requests from their prefill, in slot order), its ids copied into pinned host buffer
        ``buffer``."""
        admitted = tuple(a.request_id for a in step.admits)
        return self.enqueue_done(r, host, SampleKernel(
            step.seq, len(step.rows), admitted, step.rows.request_ids + admitted, buffer))

    def read_tokens(self, r: int, host: Host, op: ReadTokens) -> int:
        """Rank 0: what the host sees of the step's tokens now (the step reply's token tuple):
        the sampler's copy once the device ran it, else a stale or empty buffer, whose tokens
        read as -1."""
        return self.read_token_buffer(r, host, op.step, self.host_buffer(op.step))

    def read_token_buffer(self, r: int, host: Host, step: Step, buffer: int) -> int:
        """`read_tokens` of ``step`` from pinned host buffer ``buffer``, with the direct I11
        check that the buffer holds that step's ids (not yet copied, or overwritten by a
        later step's copy: vllm-project/vllm PR #36013)."""
        sampled = self.world.devices[r].host_ids[buffer]
        seq, tokens = sampled.seq, sampled.ids
        if seq != step.seq:  # direct I11 check: the copy this read needs has not happened
            when = ("after a later step's copy overwrote them" if seq is not None and seq > step.seq
                    else "before its device ran the step's sampler")
            self.world.outcome = Outcome(
                "invariant", f"I11 violated: rank {r} read the token ids of step {step.seq} "
                f"{when} (the host buffer holds "
                f"{'no tokens yet' if seq is None else f'the tokens of step {seq}'})", "I11",
                rank=r, step=host.cmd.seq if host.cmd is not None else step.seq,
                check="token-copy-not-done")
            tokens = (-1,) * (len(step.rows) + len(step.admits))
        return self.done(host, tokens)

    def destroy_communicator(self, r: int, host: Host, probe: bool) -> int:
        if self.world.hz.h5_comm_refcount and self.world.graphs[r]:
            return BLOCKED
        return DONE if probe else self.done(host)
