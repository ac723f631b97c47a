"""The simulated world: controller, transport, one host thread and one device per rank.

A run is a pure function of (scenario, variant, scheduler choices): the world exposes the actors
that can make progress (`enabled`) and advances one of them (`step`). Nothing here is threaded
and nothing reads a real clock; time advances only when every actor is blocked on a timer.

Actors: ``controller``; ``rank<r>`` (host thread of rank r, running its worker's backend ops
through a `protocol.execution.CommandRun`); ``link<r>`` (the transport: hands rank r's oldest
reply in flight to the controller, one reply per action); ``device<r>`` (executes the compute
kernels at the head of rank r's streams); ``collectives`` (completes a collective once every
rank's device has it at the head of a stream: H3).

The world does not enforce the step lock: the controller runs whenever something it could act
on arrived (a reply, a request, a deadline), so a controller that sends command N+1 early is
free to, and the I1 check on the trace catches it. The world reads the controller only through
its public queries.
"""

from __future__ import annotations

import re
from operator import itemgetter
from dataclasses import dataclass, field

from protocol.backend import ENQUEUING, Op, Synchronize
from protocol.buckets import select_bucket
from protocol.commands import AllocateKV, Command, Finalize, Reply, Step, Teardown
from protocol.controller import Abort, Broadcast, Done, Idle, Wait
from protocol.eligibility import GraphPlan
from protocol.errors import ConfigError, ProtocolError, WatchdogExpired
from protocol.execution import CommandRun
from protocol.keys import GraphKey
from protocol.trace import TraceEvent
from sim.checks import abort_checks, final_checks, page_divergence, slot_divergence
from sim.common import (
    BLOCKED,
    DONE,
    FAULT_FIRED_EVENT,
    FOREVER,
    PROGRESS,
    Collective,
    Outcome,
    SimFault,
    fault_op_event,
    fault_phase_event,
    sig_text,
)
from sim.devices import Device, DeviceModel, Graph, padded_rows
from sim.kv import ModelledKV, next_token
from sim.ops import ALWAYS_READY, LOCKING_OPS, ModelledBackend
from sim.scenario import Scenario

__all__ = ["World", "Outcome", "SimFault", "next_token", "BLOCKED", "PROGRESS", "DONE", "FOREVER",
           "ACTOR", "LOCKING_OPS"]

ACTOR = re.compile(r"controller|collectives|rank\d+|device\d+|link\d+")
"""Names of the actors a schedule chooses among."""


@dataclass
class Host:
    """One rank's host thread.

    Attributes:
        inbox: commands received and not yet started.
        run: the command executing now (ops, results, reply), or None when idle.
        holding: True while this thread holds its process's driver lock.
        ready_at: when an op slowed or wedged by a fault may go on (FOREVER: never).
        op_counts: op name -> calls started, for placing faults by occurrence.
        fault_armed: the fault acting on the current op, if any.
        started: the current op has begun (its fault, if any, has been drawn).
        result: the value of the op that just finished.
        lock_blocked: the last probe of a variant's own op (`Variant.sim_ops`) found the
            driver lock held by another thread (`ModelledBackend.locked`): a wait for that
            lock, declared or not; read only for such ops (the shipped ones are known).
    """

    rank: int
    proc: int
    inbox: list = field(default_factory=list)
    run: CommandRun | None = None
    holding: bool = False
    ready_at: float | None = None
    op_counts: dict = field(default_factory=dict)
    fault_armed: object = None
    started: bool = False
    result: object = None
    lock_blocked: bool = False

    @property
    def cmd(self) -> Command | None:
        """The command executing now, or None."""
        return self.run.command if self.run is not None else None

    @property
    def op(self) -> Op | None:
        """The op executing now, or None."""
        return self.run.op if self.run is not None else None


class World:
    """One simulated run. Call `enabled()` and `step(actor)` until `outcome` is set.

    Args:
        scenario: configuration, topology, hazards, memory, workload, faults.
        variant: the protocol variant (controller and worker classes) under test.

    Attributes:
        backend: the modelled backend of every rank (`sim.ops.ModelledBackend`).
        device_model: the device and collective actors (`sim.devices.DeviceModel`).
        transit: per rank, replies sent and not yet handed to the controller.
        queued: kernels and collectives on all the devices' streams together, so that
            `enabled` skips the devices when every stream is empty. Kept by the only code that
            changes a stream: `ModelledBackend.enqueue`, the device and collectives actors, and
            a process's death; a variant enqueues through `ModelledBackend.enqueue` too.
        trace: the `TraceEvent`s of the run.
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
        self.queued = 0  # kernels on every device's streams together (see the class docstring)
        self.transit: list[list[Reply]] = [[] for _ in range(self.ws)]
        self._in_flight = 0  # replies in all of `transit`: `enabled` skips the links when none
        self.connected = [set() for _ in range(self.ws)]
        self.used = [sc.memory.weights + sc.memory.overhead(r) for r in range(self.ws)]
        self.graphs: list[dict[GraphKey, Graph]] = [{} for _ in range(self.ws)]
        self.graph_pool = [0] * self.ws  # bytes of each rank's shared graph memory pool
        self.faults = {(f.rank, f.op, f.occurrence): f for f in scenario.faults}
        self.fired_faults: list = []
        self.arrivals = sorted(scenario.workload, key=lambda a: a.after_step)
        self.served_steps = 0
        self.outcome: Outcome | None = None
        self.actions = 0
        self.exiting = False
        self.events = {"replay": 0, "padded_replay": 0, "mixed_replay": 0, "eager_decode": 0,
                       "compaction_moves_live": 0,
                       FAULT_FIRED_EVENT: 0, "preemption": 0}
        for dev in self.devices:
            dev.allocate("kv", ModelledKV(cfg.max_batch + 1))  # placeholder until allocate_kv
            dev.allocate("replay-inputs",
                         list(padded_rows((), max(cfg.buckets), cfg.max_batch)))
            dev.allocate("logits", {})
        self.comms = {c.name: c for c in scenario.communicators}
        self.host_seq: dict = {}  # (rank, host group) -> calls it completed
        self.host_arrivals: dict = {}  # (host group, call index) -> {rank: Signature}
        self.host_left: dict = {}  # (host group, call index) -> ranks that returned
        # what a variant's kernels share across ranks, by name (sets or hashable values: part
        # of the fingerprint)
        self.variant_state: dict = {}
        self.backend = ModelledBackend(self)
        self._performers = self.backend.performers
        self.device_model = DeviceModel(self)
        self._news = True  # something arrived that the controller has not looked at
        self._controller_due = -FOREVER  # see `_due_time`
        self._sent: list[int] = []  # sequence numbers of the commands broadcast so far
        self._received: set[int] = set()  # ranks whose reply to the last command was delivered
        self._fitted_cap: int | None = None  # the batch cap AllocateKV gave every rank (I9)
        self.dead: set[int] = set()  # ranks whose process died
        self._deaths: list[tuple[float, int]] = []  # (when peers see it, rank), not yet signalled
        self._sync_after = () if self.hz.h6_async_host else ENQUEUING + tuple(
            t for t in self.variant.sim_ops if getattr(t, "enqueues", False))
        self._ranks = list(range(self.ws))
        self._rank_names = [f"rank{r}" for r in range(self.ws)]
        self._link_names = [f"link{r}" for r in range(self.ws)]
        self._device_names = [f"device{r}" for r in range(self.ws)]
        # per rank, what `enabled` reads, in rank order (the lists themselves, never rebound)
        self._host_rows = tuple(zip(range(self.ws), self.hosts, self._rank_names, self.devices))
        self._readiness = self.backend.readiness
        self._h3 = self.hz.h3_spinning_collectives
        self._device_rows = tuple(zip(self.devices, self._device_names))
        self._link_rows = tuple(zip(self.transit, self._link_names))
        self._stream_rows = tuple((dev.main, dev.side, name) for dev, name in self._device_rows)
        self._dispatch_table = {"controller": (self._step_controller, None),
                                "collectives": (self.device_model.step_collective, None)}
        self._dispatch_table.update({n: (self._step_host, r) for r, n in enumerate(self._rank_names)})
        self._dispatch_table.update({n: (self._deliver, r) for r, n in enumerate(self._link_names)})
        self._dispatch_table.update({n: (self.device_model.step_device, r)
                                     for r, n in enumerate(self._device_names)})

    def _now(self) -> float:
        return self.clock

    def comm(self, name: str):
        """The `sim.comms.Communicator` called ``name``; ConfigError naming the known ones."""
        try:
            return self.comms[name]
        except KeyError:
            raise ConfigError(f"unknown communicator {name!r}; the scenario has "
                              f"{', '.join(self.comms)}") from None

    def event(self, actor: str, kind: str, what: str, seq=None, rank=None, detail="", ok=True):
        """Append a `TraceEvent` at the current time."""
        # every field given, so the tuple is built directly (no NamedTuple __new__ frame)
        self.trace.append(_tuple_new(TraceEvent, (actor, kind, what, seq, rank, detail, ok,
                                                  self.clock, ())))

    def count_event(self, name: str, n: int = 1) -> None:
        """Count ``n`` occurrences of event ``name`` in `events`: a variant's own handler counts
        what its ``reaches`` requires (`sim.variants.Variant.events`)."""
        self.events[name] = self.events.get(name, 0) + n

    def current_seq(self) -> int | None:
        """The sequence number of the controller's outstanding command, if any."""
        current = self.ctrl.current
        return current.seq if current is not None else None

    # -- scheduling interface ---------------------------------------------------------------------

    def enabled(self) -> list[str]:
        """Actors that can make progress now, in a fixed order: the controller, the ranks'
        host threads, the links, the devices, the collectives."""
        if self.outcome is not None:
            return []
        out = ["controller"] if self.clock >= self._controller_due else []
        if self.faults or self.dead:
            for r, name in enumerate(self._rank_names):
                host = self.hosts[r]
                if host.inbox if host.run is None else self._host_ready(r):
                    out.append(name)
        else:  # the common case, `_host_ready` inlined: no fault bookkeeping, nobody dead
            readiness = self._readiness
            for r, host, name, dev in self._host_rows:
                run = host.run
                if run is None:
                    if host.inbox:
                        out.append(name)
                    continue
                op = run.op
                cls = type(op)
                if cls is Synchronize:  # the most frequent probe: a rank waiting for its device
                    if not (dev.main or dev.side):
                        out.append(name)
                elif cls in _ALWAYS_READY:
                    out.append(name)
                else:
                    ready = readiness.get(cls)  # the sweep's ops, without `attempt`'s dispatch
                    if (ready(r, host, op) if ready is not None
                            else self.backend.attempt(r, host, op, True) != BLOCKED):
                        out.append(name)
        if self._in_flight:  # most actions find no reply in flight
            for transit, name in self._link_rows:
                if transit:
                    out.append(name)
        if not self.queued:  # every stream empty (most actions): no device or collective runs
            return out
        h3 = self._h3
        any_collective = False
        for main, side, name in self._stream_rows:
            # a device runs when a stream's head is a compute kernel, or (H3 off) any head
            if main:
                if type(main[0]) is Collective:
                    any_collective = True
                    if not h3 or (side and type(side[0]) is not Collective):
                        out.append(name)
                else:
                    out.append(name)
                    if side and type(side[0]) is Collective:
                        any_collective = True
            elif side:
                if type(side[0]) is Collective:
                    any_collective = True
                    if not h3:
                        out.append(name)
                else:
                    out.append(name)
        if any_collective and h3 and self.device_model.ready_collective() is not None:
            out.append("collectives")
        return out

    def enabled_by_full_probe(self) -> list[str]:
        """What `enabled` must answer, from a probe of every actor that reads none of its
        shortcuts: not the counts of replies in flight and kernels queued, the controller's
        due time, the readiness table by op class or the collectives' cached answer. For tests
        that check those shortcuts after every action (tests/sim/test_readiness.py); it asks
        the same probes as `enabled`, so it changes nothing a run does."""
        if self.outcome is not None:
            return []
        out = ["controller"] if self._controller_ready() else []
        for r, host in enumerate(self.hosts):  # every op through `attempt`, faults included
            if (host.inbox if host.run is None else r not in self.dead
                    and self._run_op(r, host, host.run.op, probe=True) != BLOCKED):
                out.append(self._rank_names[r])
        out += [name for transit, name in self._link_rows if transit]
        out += [name for r, name in enumerate(self._device_names)
                if self.device_model.device_ready(r)]
        if self._h3 and self.device_model.find_ready_collective() is not None:
            out.append("collectives")
        return out

    def step(self, actor: str) -> None:
        """Advance ``actor`` by one action."""
        self.actions += 1
        if self.actions > self.scenario.max_actions:
            self.outcome = Outcome("livelock", f"no end after {self.scenario.max_actions} actions",
                                   check="action-limit")
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
        timers += [t for t, _ in self._deaths]
        later = [t for t in timers if t > self.clock]
        wedge = self._wedge()
        if wedge is not None:
            self.outcome = wedge
            return
        orphan = self._orphan_collective()
        if orphan is not None:
            self.outcome = orphan
            return
        from sim.waits import explain_blocked, wait_cycle
        cycle = wait_cycle(self)
        if cycle and self._in_teardown():
            self.outcome = Outcome("hang-at-exit", _story(cycle), "I10", cycle=tuple(cycle),
                                   step=self.current_seq(), check="wait-cycle-in-teardown")
            return
        if cycle and not self.exiting:
            self.outcome = Outcome("deadlock", _story(cycle), cycle=tuple(cycle),
                                   step=self.current_seq(), check="wait-cycle")
            return
        if later:
            self.clock = min(later)
            self._news = True
            self._controller_due = -FOREVER
            return
        verdict = "hang-at-exit" if self.exiting or self._in_teardown() else "hang"
        self.outcome = Outcome(verdict, explain_blocked(self), cycle=tuple(cycle or ()),
                               step=self.current_seq(), check="all-blocked")

    # -- controller -------------------------------------------------------------------------------

    def _feed_workload(self) -> None:
        ctrl = self.ctrl
        if not ctrl.serving:
            return
        idle = not ctrl.has_work()
        while self.arrivals and (self.arrivals[0].after_step <= self.served_steps or idle):
            ctrl.submit(self.arrivals.pop(0).request)
            idle = False
        if not self.arrivals and idle and not ctrl.closing:
            ctrl.shutdown()

    def _due_time(self) -> float:
        """When the controller can act next, as `enabled` reads it (``_controller_due``): -inf
        when it can now whatever the clock (news, no command outstanding, failed or done),
        else its startup watchdog's deadline or its step deadline (inf: not on its own).

        Its inputs change only in the controller's own calls, which the world makes in
        `_step_controller` (and `_deliver`, which ends in it), and with ``_news``; both
        refresh it, so `enabled` asks the controller nothing per action."""
        ctrl = self.ctrl
        if self._news or ctrl.current is None:
            return -FOREVER
        phase = ctrl.phase
        if phase == "startup":
            deadline = ctrl.watchdog.deadline
            return FOREVER if deadline is None else deadline
        if phase == "failed" or phase == "done":
            return -FOREVER
        return ctrl.step_deadline

    def _controller_ready(self) -> bool:
        ctrl = self.ctrl
        if self._news or ctrl.current is None or ctrl.phase in ("failed", "done"):
            return True
        if ctrl.phase == "startup":
            deadline = ctrl.watchdog.deadline
            return deadline is not None and self.clock >= deadline
        return self.clock >= ctrl.step_deadline

    def _step_controller(self) -> None:
        try:
            self._react()
        finally:
            self._controller_due = self._due_time()

    def _react(self) -> None:
        """The controller's action: what `next_action` answers, carried out."""
        ctrl = self.ctrl
        self._news = False
        while self._deaths and self._deaths[0][0] <= self.clock:
            _, rank = self._deaths.pop(0)
            self.event("controller", "liveness", "dead", rank=rank, detail=f"rank {rank} died")
            ctrl.on_rank_dead(rank)
        if ctrl.serving and not ctrl.uncollected():
            self._feed_workload()
        before = ctrl.watchdog.armed
        action = ctrl.next_action()
        self._note_watchdog(before)
        match action:
            case Broadcast(command=cmd):
                early = ([] if len(self._received) == self.ws else  # every reply delivered
                         [r for r in range(self.ws) if r not in self._received])
                if self._sent and early:
                    self.event("controller", "send", type(cmd).__name__, cmd.seq, None,
                               _cmd_detail(cmd))
                    self.outcome = Outcome(
                        "invariant", f"I1 violated: the controller sent command {cmd.seq} "
                        f"({type(cmd).__name__}) holding no reply from rank(s) {early} to "
                        f"command {self._sent[-1]}", "I1", rank=early[0], step=cmd.seq,
                        check="sent-before-delivery")
                    return
                if not self._check_registrations(cmd):
                    return
                self._sent.append(cmd.seq)
                self._received = set()
                if isinstance(cmd, AllocateKV):
                    self._fitted_cap = cmd.batch_cap
                if isinstance(cmd, Finalize) and not self._check_retained_set(cmd):
                    self.event("controller", "send", type(cmd).__name__, cmd.seq, None,
                               _cmd_detail(cmd))
                    return
                if isinstance(cmd, Step) and not self._check_step_command(cmd):
                    self.event("controller", "send", type(cmd).__name__, cmd.seq, None,
                               _cmd_detail(cmd))
                    return
                if isinstance(cmd, Step):
                    self.served_steps += 1
                    if cmd.moves:
                        self.events["compaction_moves_live"] += len(cmd.moves)
                    self.events["preemption"] += len(cmd.preempts)
                    if cmd.overlap:
                        self.events["overlapped_step"] = self.events.get("overlapped_step", 0) + 1
                        self.events["leftover_row"] = self.ctrl.leftover_rows
                self.event("controller", "send", type(cmd).__name__, cmd.seq, None, _cmd_detail(cmd))
                for host in self.hosts:
                    if host.rank not in self.dead:
                        host.inbox.append(cmd)
            case Idle():
                self._feed_workload()
                self._news = True
            case Abort():
                self._abort(action)
            case Done():
                self.event("controller", "done", "Done")
                self.outcome = final_checks(self)
            case Wait():
                pass

    def _check_registrations(self, cmd: Command) -> bool:
        """Direct I17 check when the command after a capture is sent: for the graphs every live
        rank holds, every rank registered as many graph buffers as its peers (custom all-reduce exchanges them by index at
        the end of capture; a rank with fewer makes its peers read past its handle array:
        vllm-project/vllm #39788 / PR #39791, ROCm/aiter PR #2638). False (and an outcome naming
        the capture command and the rank) when they differ."""
        if not self._sent or self.ctrl.serving:
            return True
        live = [r for r in range(self.ws) if r not in self.dead] if self.dead else self._ranks
        if not live:
            return True
        first = self.devices[live[0]].registered
        for r in live[1:]:
            if self.devices[r].registered != first:
                break
        else:
            return True  # equal tables count alike, whatever the graph sets (the usual case)
        # graphs some rank lacks are a captured-set difference, left to I3 at Finalize
        common = set(self.graphs[live[0]])
        for r in live[1:]:
            common &= self.graphs[r].keys()
        # entries are (graph key, communicator, buffer); map keeps the count out of Python frames
        counts = {r: sum(map(common.__contains__, map(_FIRST, self.devices[r].registered)))
                  for r in live}
        if len(set(counts.values())) <= 1:
            return True
        base = counts[live[0]]
        odd = next(r for r in live if counts[r] != base)
        self.event("controller", "send", type(cmd).__name__, cmd.seq, None, _cmd_detail(cmd))
        self.outcome = Outcome(
            "invariant", f"I17 violated: at the end of command {self._sent[-1]} the ranks hold "
                         f"different numbers of registered graph buffers ("
                         + ", ".join(f"rank {r}: {n}" for r, n in counts.items())
                         + "): the exchange of IPC handles indexes a peer's table by the local "
                           "count and reads past the shorter one", "I17", rank=odd,
            step=self._sent[-1], check="registration-counts-differ")
        return False

    def _check_step_command(self, step: Step) -> bool:
        """Direct checks on a serving step as the controller sends it; False (and an outcome
        naming the step) when one breaks.

        I6: the startup watchdog was disarmed when the sweep succeeded. I9: the step keeps no
        more live requests than the memory-fitted batch cap the ranks were given in AllocateKV,
        and when serving starts every rank keeps the configured headroom free
        (`_headroom_taken`). I7: a replayed step's graph bucket holds its rows.
        """
        ctrl = self.ctrl
        live = len(step.rows) + len(step.admits)
        cap = self._fitted_cap
        broken = None
        if not self.served_steps and self.config.memory_headroom_bytes and self.hz.h7_memory:
            self.outcome = self._headroom_taken(step)
            if self.outcome is not None:
                return False
        if ctrl.watchdog.armed:
            broken = ("I6", "the startup sweep succeeded but the watchdog is still armed: it "
                            f"aborts the serving process at t={ctrl.watchdog.deadline:g}s",
                      "armed-while-serving")
        elif cap is not None and live > cap:
            broken = ("I9", f"step {step.seq} holds {live} live requests, above the memory-"
                            f"fitted batch cap {cap}: their KV and graphs were never budgeted",
                      "step-above-fitted-cap")
        elif step.key is not None and step.key.bucket < len(step.rows):
            broken = ("I7", f"step {step.seq} replays {step.key} for {len(step.rows)} rows: "
                            f"rows past {step.key.bucket} are never computed",
                      "bucket-below-rows")
        if broken is None:
            return True
        invariant, text, check = broken
        self.outcome = Outcome("invariant", f"{invariant} violated: {text}", invariant,
                               step=step.seq, check=check)
        return False

    def _headroom_taken(self, step: Step) -> Outcome | None:
        """I9 as the first serving step is sent: every live rank still has the configuration's
        ``memory_headroom_bytes`` free, now that its graphs and KV cache are in place (the
        protocol sizes the KV cache to leave it: `protocol.memory.plan_memory`; nothing is
        allocated after this in a correct run). The outcome naming the first rank short of it,
        or None. Needs H7: without the memory hazard nothing is budgeted."""
        headroom = self.config.memory_headroom_bytes
        capacity = self.scenario.memory.capacity
        for r in self._ranks:
            free = capacity - self.used[r]
            if r not in self.dead and free < headroom:
                return Outcome(
                    "invariant", f"I9 violated: serving starts with {free} bytes free on rank "
                    f"{r}, less than the memory_headroom_bytes={headroom} the memory plan must "
                    "leave free: its graphs and KV cache took the headroom that the device's "
                    "other users (non-torch allocations, other tenants) then run out of", "I9",
                    rank=r, step=step.seq, check="headroom-taken")
        return None

    def _check_retained_set(self, fin: Finalize) -> bool:
        """Direct I7 check as the sweep ends: the retained graph set holds the bucket that a
        full batch -- as many rows as the batch cap the ranks were given in AllocateKV (and the
        numeric policy's cap) allow -- pads to, so a full batch replays instead of running
        eager. False (and an outcome naming the command) when it does not."""
        cfg = self.config
        cap = self._fitted_cap
        if not cfg.cuda_graphs or cap is None or cap < 1:
            return True
        if cfg.graph_batch_cap is not None:
            cap = min(cap, cfg.graph_batch_cap)
        full = select_bucket(min(cap, max(cfg.buckets)), cfg.buckets)
        if any(key.bucket == full for key in fin.keys):
            return True
        largest = max((k.bucket for k in fin.keys), default=None)
        kept = f"up to bucket {largest}" if largest is not None else "empty"
        self.outcome = Outcome(
            "invariant", f"I7 violated: the graph set retained at command {fin.seq} ({kept}) "
            f"leaves out bucket {full}, which a full batch of {cap} rows pads to: every full "
            "batch runs eager", "I7", step=fin.seq, check="retained-set-misses-full-bucket")
        return False

    def _note_watchdog(self, before: bool) -> None:
        after = self.ctrl.watchdog.armed
        if after and not before:
            self.event("controller", "watchdog-arm", "watchdog",
                       detail=f"deadline {self.ctrl.watchdog.deadline:g}s")
        elif before and not after:
            self.event("controller", "watchdog-disarm", "watchdog")

    def _abort(self, action: Abort) -> None:
        error = action.error
        if isinstance(error, WatchdogExpired):
            self.event("controller", "watchdog-fire", "watchdog", detail=str(error))
        if action.how == "exit" and self.hz.h8_exit_teardown:
            self.event("controller", "exit", "exit", detail=str(error))
            held = [(p, holder) for p, holder in enumerate(self.locks) if holder is not None]
            if held:
                self.exiting = True
                p, holder = held[0]
                self.outcome = Outcome(
                    "hang-at-exit",
                    f"the controller ends the process with exit() after: {error}. Exit runs driver "
                    f"teardown, which needs process {p}'s driver lock; rank {holder} holds it and "
                    "never returns, so the process hangs instead of dying loudly (H8).",
                    rank=holder, step=getattr(error, "step", None),
                    check="exit-under-driver-lock")
                return
        self.event("controller", "abort", action.how, detail=str(error), ok=False)
        self.outcome = abort_checks(self, error)

    # -- transport --------------------------------------------------------------------------------

    def _deliver(self, r: int) -> None:
        """Hand rank ``r``'s oldest reply in flight to the controller."""
        reply = self.transit[r].pop(0)
        self._in_flight -= 1
        self.event("controller", "receive", "Reply", reply.seq, r, "", reply.ok)
        if self._sent and reply.seq == self._sent[-1]:
            self._received.add(r)
        if self.ctrl.phase in ("failed", "done"):
            return
        try:
            self.ctrl.on_reply(reply)
        except ProtocolError as exc:
            self.outcome = Outcome("invariant", f"I1/I2: controller rejected a reply: {exc}", "I1",
                                   rank=r, step=reply.seq, check="reply-rejected")
            return
        # The controller reacts to each reply at once: it observes nothing but replies and the
        # clock, so acting now or after other actors' steps reaches the same states, and it
        # still sees every prefix of the delivery order (so an early send is visible).
        self._step_controller()

    # -- hosts --------------------------------------------------------------------------------------

    def _host_ready(self, r: int) -> bool:
        host = self.hosts[r]
        if host.run is None:
            return bool(host.inbox)
        if r in self.dead:
            return False
        op = host.run.op
        if not self.faults:  # the common case: no fault bookkeeping at all
            cls = type(op)
            if cls is Synchronize:  # the most frequent probe: a rank waiting for its device
                return not (self.devices[r].main or self.devices[r].side)
            return cls in _ALWAYS_READY or self.backend.attempt(r, host, op, True) != BLOCKED
        return self._run_op(r, host, op, probe=True) != BLOCKED

    def _step_host(self, r: int) -> None:
        host = self.hosts[r]
        if host.run is None:
            cmd = host.inbox.pop(0)
            if self.scenario.data_parallel and isinstance(cmd, Step):
                batch = self.scenario.lane_batch(r, cmd)
                self.workers[r].rank_batch = batch
                if not batch and (cmd.rows or cmd.admits):
                    self.events["idle_rank_step"] = self.events.get("idle_rank_step", 0) + 1
            host.run = CommandRun(self.workers[r], cmd, self.trace.append, self._now,
                                  self._sync_after)
            if host.run.reply is not None:
                self._send_reply(r)
            return
        op = host.run.op
        try:
            if self.faults:
                status = self._run_op(r, host, op, probe=False)
            else:  # `_run_op` without faults, and `attempt`'s table lookup without its frame
                perform = self._performers.get(type(op))
                status = (perform(r, host, op) if perform is not None
                          else self.backend.attempt(r, host, op, False))
        except SimFault as exc:
            self.release_lock(host)
            host.run.fail(exc)
            self._send_reply(r)
            return
        if status == DONE:
            host.run.done(host.result)
            host.result = None
            if host.run.reply is not None:
                self._send_reply(r)

    def _send_reply(self, r: int) -> None:
        host = self.hosts[r]
        reply = host.run.reply
        host.run = None
        host.started, host.fault_armed, host.ready_at = False, None, None
        current = self.ctrl.current
        if reply.ok and isinstance(current, Step) and current.seq == reply.seq:
            outcome = slot_divergence(self, r, current) or page_divergence(self, r, current)
            if outcome is not None:
                self.outcome = outcome
                return
        if not reply.ok and reply.error_kind == "page":
            # a rank whose pages disagree with the command, or that runs out of pages the
            # controller handed out, breaks the page rule: the verdict names it (I14)
            self.outcome = Outcome("invariant", f"I14 violated: rank {r} refused command "
                                                f"{reply.seq}: {reply.error}", "I14",
                                   rank=r, step=reply.seq, check="page-command-refused")
            return
        self.transit[r].append(reply)
        self._in_flight += 1

    def release_lock(self, host: Host) -> None:
        """Drop the driver lock if ``host`` holds it."""
        if host.holding:
            self.locks[host.proc] = None
            host.holding = False

    def _run_op(self, r: int, host: Host, op: Op, probe: bool) -> int:
        """Run (or, with ``probe``, only test) one backend op, applying injected faults."""
        if not self.faults:
            return self.backend.attempt(r, host, op, probe)
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
        status = self.backend.attempt(r, host, op, probe)
        if status == DONE and not probe:
            host.started, host.fault_armed, host.ready_at = False, None, None
        return status

    def _fire(self, r: int, host: Host, op: Op, fault) -> int:
        self.events[FAULT_FIRED_EVENT] += 1
        phase = "serving" if self.ctrl.serving or self.served_steps else "sweep"
        for event in (fault_phase_event(phase), fault_op_event(op.name)):
            self.events[event] = self.events.get(event, 0) + 1
        self.fired_faults.append(fault)
        self.event(f"rank{r}", "fault", op.name, host.cmd.seq, r, f"injected {fault.kind}")
        if fault.kind == "die":
            return self._die(r)
        if fault.kind in ("raise", "oom"):
            raise SimFault(f"injected {fault.kind} on rank {r} in {op.name} call {fault.occurrence}"
                           + (": out of memory" if fault.kind == "oom" else ""), kind="injected")
        host.fault_armed = fault
        if fault.kind == "slow":
            host.ready_at = self.clock + fault.delay_s
        else:
            host.ready_at = FOREVER
            if self.hz.h1_driver_lock and isinstance(op, LOCKING_OPS) and self.locks[host.proc] is None:
                self.locks[host.proc] = r
                host.holding = True
        return PROGRESS

    def _die(self, r: int) -> int:
        """Rank ``r``'s process dies: every rank of it stops (host, device, replies in flight);
        peers see it after ``death_detect_s``."""
        for q in self.procs[self.proc_of[r]]:
            host, dev = self.hosts[q], self.devices[q]
            self.release_lock(host)
            host.run, host.inbox, host.fault_armed, host.ready_at = None, [], None, None
            self.queued -= len(dev.main) + len(dev.side)
            dev.main.clear()
            dev.side.clear()
            self.device_model.heads_moved()
            self._in_flight -= len(self.transit[q])
            self.transit[q].clear()
            self.dead.add(q)
            self._deaths.append((self.clock + self.scenario.death_detect_s, q))
            self.event(f"rank{q}", "death", "die", rank=q, detail=f"rank {q}'s process died")
        return PROGRESS

    # -- stuck states ---------------------------------------------------------------------------------

    def _wedge(self) -> Outcome | None:
        """A device holds two collectives of one communicator in flight at once (H9): the
        communicator's protocol mixes them up and neither ever completes, even though every
        rank issued them in the same order (I16)."""
        wedges = self.device_model.wedges()
        if not wedges:
            return None
        r, a, b = wedges[0]
        return Outcome(
            "deadlock", f"I16 violated: device {r} has two collectives of communicator "
                        f"{a.sig.comm} in flight at once -- {sig_text(a)} on the main stream and "
                        f"{sig_text(b)} on the side stream; the communicator runs one at a time "
                        "(H9), so both spin forever on every rank that issued them, in whatever "
                        "order. A second stream needs its own communicator.", "I16", rank=r,
            step=self.current_seq(), check="two-collectives-one-communicator")

    def _orphan_collective(self) -> Outcome | None:
        """A device spins in a collective that a peer, already done with the command, never issued."""
        current = self.ctrl.current
        for r, dev in enumerate(self.devices):
            stream = dev.collective_head()
            if stream is None:
                continue
            kernel = stream[0]
            members = (self.comm(kernel.sig.comm).members(self.ws) if kernel.sig.peer is None
                       else (kernel.sig.peer,))
            for q, host in enumerate(self.hosts):
                peer = self.devices[q]
                if q == r or q not in members or peer.busy() or host.run is not None or host.inbox:
                    continue
                if current is not None and (self.ctrl.holds_reply(q) or self.transit[q]):
                    return Outcome(
                        "divergence",
                        f"collective sequences differ across ranks: device {r} spins in "
                        f"{sig_text(stream[0])}, but rank {q} finished command {current.seq} "
                        f"({type(current).__name__}) after {peer.enqueued_collectives} collectives "
                        "and will issue no matching one", "I2", rank=q, step=current.seq,
                        check="orphan-collective")
        return None

    def _in_teardown(self) -> bool:
        return any(isinstance(h.cmd, Teardown) for h in self.hosts)

    def dispose(self) -> None:
        """Drop the references that tie this finished world into cycles (its parts hold it
        through bound methods), so that reference counting frees it at once instead of the
        cyclic collector later; for a search done with the run. The world is unusable
        afterwards."""
        for part in (self.backend, self.device_model, self.ctrl, self):
            state = getattr(part, "__dict__", None)  # a variant's controller may use slots
            if state is not None:
                state.clear()

    def fingerprint(self, symmetric: bool = False) -> tuple:
        """Hashable state of the whole world, for state hashing in exhaustive search.

        Each rank's part holds its worker, its host thread (command, pending ops, op counts),
        its replies in flight, its streams and buffers, its graphs and its memory. With
        ``symmetric``, ranks 1..n-1 are interchangeable: their parts are sorted, so states that
        differ only by a permutation of those ranks hash alike. Sound only when nothing in the
        scenario or the variant singles one of them out (see `symmetry_is_sound`); rank 0 stays
        apart because it samples and carries the payload.
        """
        parts = [self._rank_part(r) for r in range(self.ws)]
        ctrl = self.ctrl.fingerprint()
        if symmetric:
            ctrl = ctrl[:3] + (self.ctrl.holds_reply(0),) + ctrl[4:]
            ranks = (parts[0], tuple(sorted(parts[1:], key=repr)))
        else:
            ranks = (tuple(parts), tuple(self.locks))
        hosts = ((tuple(sorted(self.host_seq.items())),
                  tuple(sorted((k, tuple(sorted(v))) for k, v in self.host_arrivals.items())))
                 if self.host_seq or self.host_arrivals else ())
        shared = (tuple(sorted((name, tuple(sorted(v)) if isinstance(v, (set, frozenset)) else v)
                               for name, v in self.variant_state.items()))
                  if self.variant_state else ())
        return (ctrl, self._news, ranks, self.clock, len(self.arrivals), hosts, shared)

    def _rank_part(self, r: int) -> tuple:
        h, d = self.hosts[r], self.devices[r]
        run = h.run
        pending = (run.command.seq, tuple(run.ops[run.pc:]), run.op) if run is not None else None
        return (self.workers[r].fingerprint()[1:],
                (pending, tuple(c.seq for c in h.inbox), h.holding, h.ready_at,
                 tuple(sorted(h.op_counts.items()))),
                tuple((rep.seq, rep.ok) for rep in self.transit[r]),
                (tuple(d.main), tuple(d.side), d.fingerprint()),
                tuple(sorted((k, g.uploaded) for k, g in self.graphs[r].items())),
                self.used[r], self.graph_pool[r], self.ctrl.holds_reply(r), r in self.locks)

    def symmetry_is_sound(self) -> bool:
        """True if ranks 1..n-1 are interchangeable: no fault or memory overhead names one, no
        data-parallel lanes give them different batches, and the variant does not declare
        itself asymmetric (``Variant.symmetric``)."""
        return (not self.scenario.faults and not self.scenario.memory.rank_overhead
                and not self.scenario.data_parallel and getattr(self.variant, "symmetric", True))


def _cmd_detail(cmd: Command) -> str:
    match cmd:
        case Step():
            parts = [f"{len(cmd.rows)} rows"]
            if cmd.key:
                parts.append(f"replay {cmd.key}")
            elif cmd.rows:
                parts.append(f"eager (bucket {cmd.bucket})")
            if cmd.admits:
                parts.append(f"admit {[a.request_id for a in cmd.admits]}")
            if cmd.chunk is not None:
                parts.append(f"chunk r{cmd.chunk.request_id}[{cmd.chunk.start}:{cmd.chunk.end}]")
            if cmd.retires:
                parts.append(f"retire {[r.request_id for r in cmd.retires]}")
            if cmd.preempts:
                parts.append(f"preempt {[p.request_id for p in cmd.preempts]}")
            if cmd.pages:
                parts.append("pages " + ", ".join(f"r{a.request_id}+{list(a.pages)}"
                                                  for a in cmd.pages))
            if cmd.moves:
                parts.append("move " + ", ".join(f"r{m.request_id}:{m.src}->{m.dst}" for m in cmd.moves))
            return ", ".join(parts)
    if hasattr(cmd, "key"):
        return str(cmd.key)
    if hasattr(cmd, "sizes"):
        return f"{len(cmd.sizes)} sizes"
    if hasattr(cmd, "pages"):
        return f"{cmd.pages} pages"
    return ""


_ALWAYS_READY = frozenset(ALWAYS_READY)
_tuple_new = tuple.__new__
_FIRST = itemgetter(0)


def _story(cycle) -> str:
    return "; ".join(sentence for _, sentence in cycle) + "."
