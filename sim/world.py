"""The simulated world: controller, one host thread and one device per rank, driver locks, memory.

A run is a pure function of (scenario, variant, scheduler choices): the world exposes the actors
that can make progress (`enabled`) and advances one of them (`step`). Nothing here is threaded
and nothing reads a real clock; time advances only when every actor is blocked on a timer.

Actors: ``controller``; ``rank<r>`` (host thread of rank r, running its worker's backend ops);
``device<r>`` (executes the compute kernels at the head of rank r's streams); ``collectives``
(completes a collective once every rank's device has it at the head of a stream: H3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.backend import Op
from protocol.commands import Command, Step
from protocol.controller import Abort, Broadcast, Done, Idle, Wait
from protocol.eligibility import GraphPlan
from protocol.errors import ProtocolError
from protocol.keys import GraphKey
from protocol.trace import TraceEvent, describe_args
from sim.scenario import Scenario

BLOCKED, PROGRESS, DONE = 0, 1, 2
FOREVER = float("inf")


class SimFault(ProtocolError):
    """An error a modelled backend op raised (injected fault, OOM, lazy connect in capture)."""


def token_fn(request_id: int, position: int, token: int, vocab: int) -> int:
    """The modelled model: next token of ``request_id`` after ``token`` at ``position``."""
    return (request_id * 7919 + position * 104729 + token * 31 + 17) % vocab


@dataclass
class Host:
    """One rank's host thread."""

    rank: int
    proc: int
    inbox: list = field(default_factory=list)
    cmd: Command | None = None
    ops: list = field(default_factory=list)
    pc: int = 0
    results: list = field(default_factory=list)
    holding: bool = False
    ready_at: float | None = None
    op_counts: dict = field(default_factory=dict)
    fault_armed: object = None
    started: bool = False


@dataclass
class Device:
    """One rank's device: FIFO streams of kernels and the buffers kernels write."""

    rank: int
    main: list = field(default_factory=list)
    side: list = field(default_factory=list)
    out: dict = field(default_factory=dict)
    meta: tuple = (None, ())
    enqueued_collectives: int = 0
    completed_collectives: int = 0

    def busy(self) -> bool:
        return bool(self.main or self.side)

    def collective_head(self):
        for stream in (self.main, self.side):
            if stream and stream[0][0] == "c":
                return stream
        return None


@dataclass
class Outcome:
    """How a run ended.

    Attributes:
        verdict: ``clean``, ``abort``, ``deadlock``, ``hang``, ``hang-at-exit``, ``divergence``,
            ``oom``, ``startup-refused``, ``invariant``, ``livelock``.
        detail: one-paragraph explanation (the wait-for cycle for a deadlock).
        invariant: the invariant named by the verdict (``"I6"``), if any.
        cycle: wait-for cycle as (node, sentence) pairs, for deadlocks.
    """

    verdict: str
    detail: str = ""
    invariant: str | None = None
    cycle: tuple = ()


class World:
    """One simulated run. Call `enabled()` and `step(actor)` until `outcome` is set.

    Args:
        scenario: configuration, topology, hazards, memory, workload, faults.
        variant: the protocol variant (controller and worker classes) under test.
        trace: record `TraceEvent`s in ``self.trace`` (always on for invariant checks).
    """

    def __init__(self, scenario: Scenario, variant):
        self.scenario = sc = scenario
        self.config = cfg = scenario.config
        self.hz = scenario.hazards
        self.variant = variant
        self.ws = cfg.world_size
        self.clock = 0.0
        self.trace: list[TraceEvent] = []
        self.ctrl = variant.controller_cls(cfg, clock=self._now, pages_per_seq=sc.pages_per_seq)
        self.workers = [variant.worker_cls(r, self.ws, GraphPlan.from_config(cfg), cfg.max_batch)
                        for r in range(self.ws)]
        self.procs = scenario.processes()
        self.proc_of = {r: p for p, ranks in enumerate(self.procs) for r in ranks}
        self.locks: list[int | None] = [None] * len(self.procs)
        self.hosts = [Host(r, self.proc_of[r]) for r in range(self.ws)]
        self.devices = [Device(r) for r in range(self.ws)]
        self.connected = [set() for _ in range(self.ws)]
        self.used = [sc.memory.weights + sc.memory.overhead(r) for r in range(self.ws)]
        self.graphs: list[dict[GraphKey, dict]] = [{} for _ in range(self.ws)]
        self.faults = {(f.rank, f.op, f.occurrence): f for f in scenario.faults}
        self.fired_faults: list = []
        self.arrivals = sorted(scenario.workload, key=lambda a: a.after_step)
        self.served_steps = 0
        self.outcome: Outcome | None = None
        self.actions = 0
        self.exiting = False
        self.events = {"replay": 0, "compaction_moves_live": 0, "fault_fired": 0}
        self._watchdog_armed = False
        self._actors = ["controller"] + [f"rank{r}" for r in range(self.ws)] + [
            f"device{r}" for r in range(self.ws)] + ["collectives"]

    def _now(self) -> float:
        return self.clock

    def _ev(self, actor: str, kind: str, what: str, seq=None, rank=None, detail="", ok=True):
        self.trace.append(TraceEvent(actor, kind, what, seq, rank, detail, ok, self.clock))

    # -- scheduling interface ---------------------------------------------------------------------

    def enabled(self) -> list[str]:
        """Actors that can make progress now, in a fixed order."""
        if self.outcome is not None:
            return []
        out = []
        if self._controller_ready():
            out.append("controller")
        for r in range(self.ws):
            if self._host_ready(r):
                out.append(f"rank{r}")
        for r in range(self.ws):
            if self._device_ready(r):
                out.append(f"device{r}")
        if self._collective_ready() is not None:
            out.append("collectives")
        return out

    def step(self, actor: str) -> None:
        """Advance ``actor`` by one action."""
        self.actions += 1
        if self.actions > self.scenario.max_actions:
            self.outcome = Outcome("livelock", f"no end after {self.scenario.max_actions} actions")
            return
        if actor == "controller":
            self._step_controller()
        elif actor == "collectives":
            self._step_collective()
        elif actor.startswith("rank"):
            self._step_host(int(actor[4:]))
        else:
            self._step_device(int(actor[6:]))

    def settle(self) -> None:
        """Called when nothing is enabled: advance time to the next timer, or end the run."""
        timers = [h.ready_at for h in self.hosts if h.ready_at is not None and h.ready_at != FOREVER]
        if self.ctrl.watchdog.deadline is not None:
            timers.append(self.ctrl.watchdog.deadline)
        if self.ctrl.step_deadline != FOREVER:
            timers.append(self.ctrl.step_deadline)
        later = [t for t in timers if t > self.clock]
        orphan = self._orphan_collective()
        if orphan is not None:
            self.outcome = orphan
            return
        cycle = self._wait_cycle()
        if cycle and self._in_teardown():
            self.outcome = Outcome("hang-at-exit", _story(cycle), "I10", cycle=tuple(cycle))
            return
        if cycle and not self.exiting:
            self.outcome = Outcome("deadlock", _story(cycle), cycle=tuple(cycle))
            return
        if later:
            self.clock = min(later)
            return
        from sim.waits import explain_blocked
        verdict = "hang-at-exit" if self.exiting or self._in_teardown() else "hang"
        self.outcome = Outcome(verdict, explain_blocked(self), cycle=tuple(cycle or ()))

    # -- controller -------------------------------------------------------------------------------

    def _feed_workload(self) -> None:
        ctrl = self.ctrl
        if ctrl.phase != "serving":
            return
        idle = not ctrl.pending and not ctrl.slots.requests() and not ctrl._to_retire
        while self.arrivals and (self.arrivals[0].after_step <= self.served_steps or idle):
            ctrl.submit(self.arrivals.pop(0).request)
            idle = False
        if not self.arrivals and idle and not ctrl._closing:
            ctrl.shutdown()

    def _controller_ready(self) -> bool:
        ctrl = self.ctrl
        if ctrl.phase in ("failed", "done"):
            return True
        if ctrl.current is not None and len(ctrl.replies) < self.ws:
            if ctrl.phase != "startup":
                return self.clock >= ctrl.step_deadline
            deadline = ctrl.watchdog.deadline
            return deadline is not None and self.clock >= deadline
        return True

    def _step_controller(self) -> None:
        ctrl = self.ctrl
        if ctrl.phase == "serving" and ctrl.current is None or (
                ctrl.phase == "serving" and not ctrl.uncollected()):
            self._feed_workload()
        before = ctrl.watchdog.armed
        action = ctrl.next_action()
        self._note_watchdog(before)
        if isinstance(action, Broadcast):
            cmd = action.command
            if isinstance(cmd, Step):
                self.served_steps += 1
                if any(m.request_id is not None for m in cmd.moves):
                    self.events["compaction_moves_live"] += len(cmd.moves)
            self._ev("controller", "send", type(cmd).__name__, cmd.seq, None, _cmd_detail(cmd))
            for host in self.hosts:
                host.inbox.append(cmd)
        elif isinstance(action, Idle):
            self._feed_workload()
        elif isinstance(action, Abort):
            self._abort(action)
        elif isinstance(action, Done):
            self._ev("controller", "done", "Done")
            from sim.checks import final_checks
            self.outcome = final_checks(self)
        elif isinstance(action, Wait):
            pass

    def _note_watchdog(self, before: bool) -> None:
        after = self.ctrl.watchdog.armed
        if after and not before:
            self._ev("controller", "watchdog-arm", "watchdog", detail=f"deadline {self.ctrl.watchdog.deadline:g}s")
        elif before and not after:
            self._ev("controller", "watchdog-disarm", "watchdog")

    def _abort(self, action: Abort) -> None:
        error = action.error
        from protocol.errors import WatchdogExpired
        if isinstance(error, WatchdogExpired):
            self._ev("controller", "watchdog-fire", "watchdog", detail=str(error))
        if action.how == "exit" and self.hz.h8_exit_teardown:
            self._ev("controller", "exit", "exit", detail=str(error))
            held = [(p, holder) for p, holder in enumerate(self.locks) if holder is not None]
            if held:
                self.exiting = True
                p, holder = held[0]
                self.outcome = Outcome(
                    "hang-at-exit",
                    f"the controller ends the process with exit() after: {error}. Exit runs driver "
                    f"teardown, which needs process {p}'s driver lock; rank {holder} holds it and "
                    "never returns, so the process hangs instead of dying loudly (H8).")
                return
        self._ev("controller", "abort", action.how, detail=str(error), ok=False)
        from sim.checks import abort_checks
        self.outcome = abort_checks(self, error)

    # -- hosts --------------------------------------------------------------------------------------

    def _host_ready(self, r: int) -> bool:
        host = self.hosts[r]
        if host.cmd is None:
            return bool(host.inbox)
        op = host.ops[host.pc]
        if op.name in ALWAYS_READY and not self.faults and host.fault_armed is None:
            return True
        return self._run_op(r, host, op, probe=True) != BLOCKED

    def _step_host(self, r: int) -> None:
        host = self.hosts[r]
        worker = self.workers[r]
        if host.cmd is None:
            cmd = host.inbox.pop(0)
            host.cmd = cmd
            try:
                ops = worker.ops_for(cmd)
            except ProtocolError as exc:
                self._reply(r, worker.fail(cmd, exc))
                return
            if not self.hz.h6_async_host:
                ops = _synchronous(ops)
            host.ops, host.pc, host.results = ops, 0, []
            if not ops:
                self._reply(r, worker.reply(cmd, []))
            return
        op = host.ops[host.pc]
        try:
            status = self._run_op(r, host, op, probe=False)
        except SimFault as exc:
            self._ev(f"rank{r}", "op", op.name, host.cmd.seq, r, f"{describe_args(op.args)}: {exc}", ok=False)
            self._release_lock(r, host)
            self._reply(r, worker.fail(host.cmd, exc))
            return
        if status == DONE:
            host.pc += 1
            if host.pc == len(host.ops):
                try:
                    reply = worker.reply(host.cmd, host.results)
                except ProtocolError as exc:
                    reply = worker.fail(host.cmd, exc)
                self._reply(r, reply)

    def _reply(self, r: int, reply) -> None:
        host = self.hosts[r]
        host.cmd, host.ops, host.pc, host.results = None, [], 0, []
        host.started, host.fault_armed, host.ready_at = False, None, None
        self._ev(f"rank{r}", "reply", "Reply", reply.seq, r, reply.error or "", reply.ok)
        if reply.ok and isinstance(self.ctrl.current, Step) and self.ctrl.current.seq == reply.seq:
            from sim.checks import slot_divergence
            outcome = slot_divergence(self, r, self.ctrl.current)
            if outcome is not None:
                self.outcome = outcome
                return
        if self.ctrl.phase in ("failed", "done"):
            return
        try:
            self.ctrl.on_reply(reply)
        except ProtocolError as exc:
            self.outcome = Outcome("invariant", f"I1/I2: controller rejected a reply: {exc}", "I1")

    def _release_lock(self, r: int, host: Host) -> None:
        if host.holding:
            self.locks[host.proc] = None
            host.holding = False

    def _run_op(self, r: int, host: Host, op: Op, probe: bool) -> int:
        """Run (or, with ``probe``, only test) one backend op, applying injected faults."""
        fault = host.fault_armed
        if not host.started:
            count = host.op_counts.get(op.name, 0) + 1
            fault = self.faults.get((r, op.name, count))
            if probe:
                if fault is not None:
                    return PROGRESS
            else:
                host.started = True
                host.op_counts[op.name] = count
                if fault is not None:
                    return self._fire(r, host, op, fault)
        if fault is not None:
            if fault.kind == "hang" or self.clock < host.ready_at:
                return BLOCKED
        status = self._dispatch(r, host, op, probe)
        if status == DONE and not probe:
            host.started, host.fault_armed, host.ready_at = False, None, None
        return status

    def _fire(self, r: int, host: Host, op: Op, fault) -> int:
        self.events["fault_fired"] += 1
        self.fired_faults.append(fault)
        self._ev(f"rank{r}", "fault", op.name, host.cmd.seq, r, f"injected {fault.kind}")
        if fault.kind in ("raise", "oom"):
            raise SimFault(f"injected {fault.kind} on rank {r} in {op.name} call {fault.occurrence}"
                           + (": out of memory" if fault.kind == "oom" else ""))
        host.fault_armed = fault
        if fault.kind == "slow":
            host.ready_at = self.clock + fault.delay_s
        else:
            host.ready_at = FOREVER
            if self.hz.h1_driver_lock and op.name in LOCKING_OPS and self.locks[host.proc] is None:
                self.locks[host.proc] = r
                host.holding = True
        return PROGRESS

    def _dispatch(self, r: int, host: Host, op: Op, probe: bool) -> int:
        handler = getattr(self, "_op_" + op.name, None)
        if handler is None:
            variant_handler = self.variant.sim_ops.get(op.name)
            if variant_handler is None:
                raise SimFault(f"the simulator models no backend op {op.name!r}")
            return variant_handler(self, r, host, op.args, probe)
        return handler(r, host, *op.args, probe=probe)

    def done(self, r: int, host: Host, op_name: str, args: tuple, value=None) -> int:
        """Finish the current op with ``value`` as its result."""
        host.results.append(value)
        self._ev(f"rank{r}", "op", op_name, host.cmd.seq if host.cmd else None, r, describe_args(args))
        return DONE

    def locked(self, r: int, host: Host, quiesce: bool, probe: bool) -> int:
        """Driver-lock discipline (H1) and device quiescence (H2) for a lock-holding call.

        Returns DONE when the call may complete now (the lock is released again), PROGRESS when
        it took the lock but must wait, BLOCKED when it can do nothing.
        """
        p = host.proc
        holder = self.locks[p]
        acquired = False
        if self.hz.h1_driver_lock:
            if holder is not None and holder != r:
                return BLOCKED
            if holder is None:
                acquired = True
                if not probe:
                    self.locks[p] = r
                    host.holding = True
        if quiesce and self.hz.h2_quiesce:
            if any(self.devices[d].busy() for d in self.procs[p]):
                return PROGRESS if acquired else BLOCKED
        if not probe:
            self._release_lock(r, host)
        return DONE

    def alloc(self, r: int, nbytes: int, what: str) -> None:
        """Take ``nbytes`` on rank ``r`` (H7); raises SimFault (OOM) past capacity."""
        if self.hz.h7_memory and self.used[r] + nbytes > self.scenario.memory.capacity:
            raise SimFault(f"out of memory on rank {r}: {what} needs {nbytes} bytes, "
                           f"{self.scenario.memory.capacity - self.used[r]} free")
        self.used[r] += nbytes

    def enqueue(self, r: int, kernel: tuple, side: bool = False) -> None:
        """Append a kernel to rank ``r``'s main (or side) stream."""
        dev = self.devices[r]
        if kernel[0] == "c":
            kernel = ("c", dev.enqueued_collectives, kernel[1])
            dev.enqueued_collectives += 1
        (dev.side if side else dev.main).append(kernel)

    # -- modelled backend ops -------------------------------------------------------------------

    def _op_synchronize(self, r, host, probe):
        if self.devices[r].busy():
            return BLOCKED
        return DONE if probe else self.done(r, host, "synchronize", ())

    def _op_warmup_collective(self, r, host, nbytes, probe):
        if probe:
            return DONE
        self.connected[r].add(nbytes)
        self.enqueue(r, ("c", ("all-reduce", 1, nbytes, "warm-up")))
        return self.done(r, host, "warmup_collective", (nbytes,))

    def _op_profile_memory(self, r, host, rows, probe):
        if probe:
            return DONE
        peak = rows * self.scenario.memory.activation_per_row
        free = self.scenario.memory.capacity - self.used[r]
        self.alloc(r, peak, "eager profile activations (kept as the activation workspace)")
        self.enqueue(r, ("c", self._eager_sig(rows, "profile")))
        return self.done(r, host, "profile_memory", (rows,), (free, peak))

    def _op_graph_memory(self, r, host, probe):
        if probe:
            return DONE
        return self.done(r, host, "graph_memory", (), sum(g["bytes"] for g in self.graphs[r].values()))

    def _op_record(self, r, host, key, probe):
        size = self.config.shape.allreduce_bytes(key.bucket)
        if self.hz.h4_lazy_connect and size not in self.connected[r]:
            if self.hz.h4_mode == "hang":
                return BLOCKED
            if not probe:
                raise SimFault(f"I5: all-reduce of {size} bytes connects lazily inside the capture of "
                               f"{key} on rank {r} (no warm-up at that size)")
            return PROGRESS
        status = self.locked(r, host, quiesce=False, probe=probe)
        if status != DONE or probe:
            return status
        nbytes = self.scenario.memory.graph_bytes(key.bucket)
        self.alloc(r, nbytes, f"graph pool for {key}")
        self.graphs[r][key] = {"bytes": nbytes, "instantiated": False, "uploaded": False}
        return self.done(r, host, "record", (key,))

    def _graph(self, r: int, key: GraphKey) -> dict:
        graph = self.graphs[r].get(key)
        if graph is None:
            raise SimFault(f"rank {r} has no recorded graph {key}")
        return graph

    def _op_instantiate(self, r, host, key, probe):
        status = self.locked(r, host, quiesce=True, probe=probe)
        if status != DONE or probe:
            return status
        self._graph(r, key)["instantiated"] = True
        return self.done(r, host, "instantiate", (key,))

    def _op_upload(self, r, host, key, probe):
        status = self.locked(r, host, quiesce=True, probe=probe)
        if status != DONE or probe:
            return status
        self._graph(r, key)["uploaded"] = True
        return self.done(r, host, "upload", (key,))

    def _op_launch(self, r, host, key, probe):
        graph = self.graphs[r].get(key)
        if graph is not None and not graph["uploaded"]:
            status = self.locked(r, host, quiesce=True, probe=probe)
            if status != DONE or probe:
                return status
            graph["uploaded"] = True
        if probe:
            return DONE
        graph = self._graph(r, key)
        shape = self.config.shape
        self.enqueue(r, ("c", ("all-reduce", shape.allreduces_per_step,
                               shape.allreduce_bytes(key.bucket), f"graph {key}")))
        self.enqueue(r, ("k", "replay", key, host.cmd.seq))
        if self.ctrl.phase == "serving":
            self.events["replay"] += 1
        return self.done(r, host, "launch", (key,))

    def _op_free_graphs(self, r, host, probe):
        if probe:
            return DONE
        self.used[r] -= sum(g["bytes"] for g in self.graphs[r].values())
        self.graphs[r].clear()
        return self.done(r, host, "free_graphs", ())

    def _op_allocate_kv(self, r, host, pages, probe):
        status = self.locked(r, host, quiesce=True, probe=probe)
        if status != DONE or probe:
            return status
        self.alloc(r, (pages + 1) * self.config.kv_page_bytes, f"KV cache of {pages} pages")
        return self.done(r, host, "allocate_kv", (pages,))

    def _op_release_slot(self, r, host, slot, probe):
        return DONE if probe else self.done(r, host, "release_slot", (slot,))

    def _op_move_slot(self, r, host, src, dst, probe):
        if probe:
            return DONE
        self.enqueue(r, ("k", "copy", src, dst))
        return self.done(r, host, "move_slot", (src, dst))

    def _op_prefill(self, r, host, admits, probe):
        if probe:
            return DONE
        tokens = sum(len(a.prompt) for a in admits)
        self.enqueue(r, ("c", self._eager_sig(tokens, "prefill")))
        self.enqueue(r, ("k", "prefill", admits, host.cmd.seq))
        return self.done(r, host, "prefill", (admits,))

    def _op_prepare_replay(self, r, host, step, probe):
        if probe:
            return DONE
        self.enqueue(r, ("k", "meta", step.seq, step.rows))
        return self.done(r, host, "prepare_replay", (step,))

    def _op_run_eager(self, r, host, step, probe):
        if probe:
            return DONE
        self.enqueue(r, ("c", self._eager_sig(len(step.rows), "eager decode")))
        self.enqueue(r, ("k", "decode", step.seq, step.rows))
        return self.done(r, host, "run_eager", (step,))

    def _op_sample(self, r, host, step, probe):
        if probe:
            return DONE
        out = self.devices[r].out
        tokens = {}
        for req in [a.request_id for a in step.admits] + [row.request_id for row in step.rows]:
            seq, token = out.get(req, (None, -1))
            tokens[req] = token if seq == step.seq else -1
        return self.done(r, host, "sample", (step,), tokens)

    def _op_destroy_communicator(self, r, host, probe):
        if self.hz.h5_comm_refcount and self.graphs[r]:
            return BLOCKED
        return DONE if probe else self.done(r, host, "destroy_communicator", ())

    def _eager_sig(self, rows: int, label: str) -> tuple:
        shape = self.config.shape
        return ("all-reduce", shape.allreduces_per_step, shape.allreduce_bytes(rows), label)

    # -- devices ----------------------------------------------------------------------------------

    def _device_ready(self, r: int) -> bool:
        dev = self.devices[r]
        if (dev.main and dev.main[0][0] == "k") or (dev.side and dev.side[0][0] == "k"):
            return True
        if not self.hz.h3_spinning_collectives and dev.collective_head() is not None:
            return True
        return False

    def _step_device(self, r: int) -> None:
        dev = self.devices[r]
        stream = dev.main if dev.main and dev.main[0][0] == "k" else (
            dev.side if dev.side and dev.side[0][0] == "k" else None)
        if stream is None:
            stream = dev.collective_head()
            kernel = stream.pop(0)
            dev.completed_collectives += 1
            self._ev(f"device{r}", "collective", kernel[2][3], rank=r, detail=_sig_text(kernel))
            return
        kernel = stream.pop(0)
        self._execute_kernel(r, dev, kernel)

    def _execute_kernel(self, r: int, dev: Device, kernel: tuple) -> None:
        label = kernel[1]
        vocab = self.scenario.vocab
        if label == "meta":
            dev.meta = (kernel[2], kernel[3])
        elif label == "decode":
            for row in kernel[3]:
                dev.out[row.request_id] = (kernel[2], token_fn(row.request_id, row.position, row.token, vocab))
        elif label == "replay":
            seq = kernel[3]
            _, rows = dev.meta
            for row in rows:
                dev.out[row.request_id] = (seq, token_fn(row.request_id, row.position, row.token, vocab))
        elif label == "prefill":
            for admit in kernel[2]:
                dev.out[admit.request_id] = (
                    kernel[3], token_fn(admit.request_id, len(admit.prompt) - 1, admit.prompt[-1], vocab))
        else:
            handler = self.variant.sim_kernels.get(label)
            if handler is not None:
                handler(self, r, dev, kernel)

    def _collective_ready(self):
        if not self.hz.h3_spinning_collectives:
            return None
        heads = [d.collective_head() for d in self.devices]
        if any(h is None for h in heads):
            return None
        return heads

    def _step_collective(self) -> None:
        heads = self._collective_ready()
        kernels = [h[0] for h in heads]
        sigs = {k[2][:3] for k in kernels}
        seqs = {k[1] for k in kernels}
        if len(sigs) > 1 or len(seqs) > 1:
            lines = "; ".join(f"rank {r} is in {_sig_text(k)}" for r, k in enumerate(kernels))
            self.outcome = Outcome("divergence",
                                   f"collective sequences differ across ranks: {lines}", "I2")
            return
        for h in heads:
            h.pop(0)
        for d in self.devices:
            d.completed_collectives += 1
        self._ev("collectives", "collective", kernels[0][2][3], detail=_sig_text(kernels[0]))

    # -- stuck states ---------------------------------------------------------------------------------

    def _orphan_collective(self) -> Outcome | None:
        """A device spins in a collective that a peer, already done with the command, never issued."""
        current = self.ctrl.current
        for r, dev in enumerate(self.devices):
            stream = dev.collective_head()
            if stream is None:
                continue
            for q, host in enumerate(self.hosts):
                peer = self.devices[q]
                if q == r or peer.busy() or host.cmd is not None or host.inbox:
                    continue
                if current is not None and q in self.ctrl.replies:
                    return Outcome(
                        "divergence",
                        f"collective sequences differ across ranks: device {r} spins in "
                        f"{_sig_text(stream[0])}, but rank {q} finished command {current.seq} "
                        f"({type(current).__name__}) after {peer.enqueued_collectives} collectives "
                        "and will issue no matching one", "I3")
        return None

    def _in_teardown(self) -> bool:
        return any(h.cmd is not None and type(h.cmd).__name__ == "Teardown" for h in self.hosts)

    def _wait_cycle(self):
        from sim.waits import wait_cycle
        return wait_cycle(self)

    def fingerprint(self, symmetric: bool = False) -> tuple:
        """Hashable state of the whole world, for state hashing in exhaustive search.

        With ``symmetric``, ranks 1..n-1 are interchangeable: their parts are sorted, so states
        that differ only by a permutation of those ranks hash alike. Sound only when nothing in
        the scenario singles one of them out (see `symmetry_is_sound`); rank 0 stays apart
        because it samples and carries the payload.
        """
        parts = [self._rank_part(r) for r in range(self.ws)]
        ctrl = self.ctrl.fingerprint()
        if symmetric:
            ctrl = ctrl[:3] + (0 in self.ctrl.replies,) + ctrl[4:]
            ranks = (parts[0], tuple(sorted(parts[1:], key=repr)))
        else:
            ranks = (tuple(parts), tuple(self.locks))
        return (ctrl, ranks, self.clock, len(self.arrivals))

    def _rank_part(self, r: int) -> tuple:
        h, d = self.hosts[r], self.devices[r]
        return (self.workers[r].fingerprint()[1:],
                (h.cmd.seq if h.cmd else None, tuple(c.seq for c in h.inbox), h.pc, h.holding,
                 h.ready_at, tuple(sorted(h.op_counts.items()))),
                (tuple(_kernel_fp(k) for k in d.main), tuple(_kernel_fp(k) for k in d.side),
                 tuple(sorted(d.out.items())), d.meta[0]),
                tuple(sorted((k, g["uploaded"]) for k, g in self.graphs[r].items())),
                self.used[r], r in self.ctrl.replies, r in self.locks)

    def symmetry_is_sound(self) -> bool:
        """True if ranks 1..n-1 are interchangeable: no fault or memory overhead names one."""
        return not self.scenario.faults and not self.scenario.memory.rank_overhead


LOCKING_OPS = frozenset({"record", "instantiate", "upload", "launch", "allocate_kv"})
ALWAYS_READY = frozenset({"warmup_collective", "profile_memory", "graph_memory", "free_graphs",
                          "release_slot", "move_slot", "prefill", "prepare_replay", "run_eager",
                          "sample"})
"""Ops that never block in the model (host-side work or a plain enqueue), probed for free."""


def _synchronous(ops: list[Op]) -> list[Op]:
    """H6 off: every enqueuing op is followed by a synchronize (host calls block)."""
    out = []
    for op in ops:
        out.append(op)
        if op.name in ("warmup_collective", "profile_memory", "launch", "prefill", "run_eager",
                       "move_slot", "prepare_replay"):
            out.append(Op("synchronize"))
    return out


def _kernel_fp(kernel: tuple) -> tuple:
    if kernel[0] == "c":
        return kernel
    return (kernel[0], kernel[1], str(kernel[2:])[:60])


def _sig_text(kernel: tuple) -> str:
    _, seq, (kind, count, nbytes, label) = kernel
    return f"{kind} #{seq} ({label}: {count} x {nbytes} bytes)"


def _cmd_detail(cmd: Command) -> str:
    name = type(cmd).__name__
    if hasattr(cmd, "key") and not isinstance(cmd, Step):
        return str(cmd.key)
    if name == "Warmup":
        return f"{len(cmd.sizes)} sizes"
    if name == "AllocateKV":
        return f"{cmd.pages} pages"
    if name == "Step":
        parts = [f"{len(cmd.rows)} rows"]
        if cmd.key:
            parts.append(f"replay {cmd.key}")
        elif cmd.rows:
            parts.append(f"eager (bucket {cmd.bucket})")
        if cmd.admits:
            parts.append(f"admit {[a.request_id for a in cmd.admits]}")
        if cmd.retires:
            parts.append(f"retire {[r.request_id for r in cmd.retires]}")
        if cmd.moves:
            parts.append("move " + ", ".join(f"r{m.request_id}:{m.src}->{m.dst}" for m in cmd.moves))
        return ", ".join(parts)
    return ""


def _story(cycle) -> str:
    return "; ".join(sentence for _, sentence in cycle) + "."
