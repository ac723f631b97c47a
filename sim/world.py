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
from protocol.errors import PageError, ProtocolError
from protocol.keys import GraphKey
from protocol.trace import TraceEvent, describe_args
from sim.common import BLOCKED, DONE, FOREVER, PROGRESS, Outcome, SimFault, sig_text, token_fn
from sim.devices import DeviceModel
from sim.ops import ModelledBackend
from sim.scenario import Scenario

_sig_text = sig_text
__all__ = ["World", "Outcome", "SimFault", "token_fn", "BLOCKED", "PROGRESS", "DONE", "FOREVER"]



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


class World(ModelledBackend, DeviceModel):
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
        self.events = {"replay": 0, "compaction_moves_live": 0, "fault_fired": 0, "preemption": 0}
        self._watchdog_armed = False
        self._rank_names = [f"rank{r}" for r in range(self.ws)]
        self._device_names = [f"device{r}" for r in range(self.ws)]
        self._dispatch_table = {"controller": (self._step_controller, None),
                                "collectives": (self._step_collective, None)}
        self._dispatch_table.update({n: (self._step_host, r) for r, n in enumerate(self._rank_names)})
        self._dispatch_table.update({n: (self._step_device, r) for r, n in enumerate(self._device_names)})

    def _now(self) -> float:
        return self.clock

    def _ev(self, actor: str, kind: str, what: str, seq=None, rank=None, detail="", ok=True):
        self.trace.append(TraceEvent(actor, kind, what, seq, rank, detail, ok, self.clock))

    # -- scheduling interface ---------------------------------------------------------------------

    def enabled(self) -> list[str]:
        """Actors that can make progress now, in a fixed order."""
        if self.outcome is not None:
            return []
        out = ["controller"] if self._controller_ready() else []
        for r, name in enumerate(self._rank_names):
            if self._host_ready(r):
                out.append(name)
        for r, name in enumerate(self._device_names):
            if self._device_ready(r):
                out.append(name)
        if self._collective_ready() is not None:
            out.append("collectives")
        return out

    def step(self, actor: str) -> None:
        """Advance ``actor`` by one action."""
        self.actions += 1
        if self.actions > self.scenario.max_actions:
            self.outcome = Outcome("livelock", f"no end after {self.scenario.max_actions} actions")
            return
        method, arg = self._dispatch_table[actor]
        if arg is None:
            method()
        else:
            method(arg)

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
                self.events["preemption"] += len(cmd.preempts)
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
            except PageError as exc:
                # a rank whose pages disagree with the command, or that runs out of pages the
                # controller handed out, breaks the page rule: the verdict names it (I14)
                self._reply(r, worker.fail(cmd, exc))
                self.outcome = Outcome("invariant", f"I14 violated: rank {r} refused command "
                                                    f"{cmd.seq}: {exc}", "I14")
                return
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
            from sim.checks import page_divergence, slot_divergence
            outcome = (slot_divergence(self, r, self.ctrl.current)
                       or page_divergence(self, r, self.ctrl.current))
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
                          "release_slot", "assign_pages", "move_slot", "prefill", "prepare_replay", "run_eager",
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
        if cmd.preempts:
            parts.append(f"preempt {[p.request_id for p in cmd.preempts]}")
        if cmd.pages:
            parts.append("pages " + ", ".join(f"r{a.request_id}+{list(a.pages)}" for a in cmd.pages))
        if cmd.moves:
            parts.append("move " + ", ".join(f"r{m.request_id}:{m.src}->{m.dst}" for m in cmd.moves))
        return ", ".join(parts)
    return ""


def _story(cycle) -> str:
    return "; ".join(sentence for _, sentence in cycle) + "."
