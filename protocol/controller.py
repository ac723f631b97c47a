"""The controller: scheduler and step loop of the TP step protocol, sans-IO.

The driver asks `next_action()` what to do and feeds every rank's reply to `on_reply()`. The
controller holds the step lock (I1): it issues command N+1 only once it holds every rank's reply
for N. Startup runs a fixed sweep under a watchdog (I5, I9, I4, I6): warm-up collectives per
message size, eager memory profile, graph measurement without launch, KV sizing from the
tightest rank (measuring again if the fit keeps fewer graphs), then per graph key -- largest first -- a Capture barrier and a Launch barrier,
and a Finalize that checks every rank captured the same keys (I3) within the reserve (I9).
Serving then sends steps whose graph key (bucket and path: the short-context path only when every
decode row's context fits it), bucket, slot moves and KV pages the controller decides
(I2, I7, I8, I14, I22): pages are handed out as sequences grow, admission is by free pages, and a
short pool preempts the most recently admitted request for recompute. Any failed reply, or an
expired watchdog, turns into one `Abort` for every rank (I13).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat
from typing import Any

from protocol.commands import (
    FED,
    NO_TOKEN,
    Admit,
    Chunk,
    DecodeRows,
    PageAssign,
    Preempt,
    Retire,
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
from protocol.config import ProtocolConfig
from protocol.eligibility import GraphPlan
from protocol.errors import (
    ConfigError,
    PageError,
    ProtocolError,
    checked_hook_result,
    is_int,
    shown,
    RankFailure,
    ReplyError,
    WatchdogExpired,
)
from protocol.keys import GraphKey
from protocol.memory import MemoryPlan, plan_memory
from protocol.pages import PagePool, pages_for
from protocol.requests import Request
from protocol.slots import SlotTable
from protocol.watchdog import Watchdog, read_clock


@dataclass(frozen=True)
class Broadcast:
    """Send ``command`` to every rank."""

    command: Command


@dataclass(frozen=True)
class Wait:
    """Replies for the current command are outstanding from ``ranks``."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Idle:
    """Serving with nothing to do: submit a request or call `shutdown`."""


ABORT_HOWS = ("abort", "exit")
"""How a controller may stop its ranks (`Abort.how`, `Controller.abort_how`)."""


@dataclass(frozen=True)
class Abort:
    """Stop every rank now. ``how`` is ``"abort"``: never exit, whose driver teardown can hang
    (H8); one of `ABORT_HOWS` (a variant's controller may say ``"exit"``)."""

    error: ProtocolError
    how: str = "abort"


@dataclass(frozen=True)
class Done:
    """Teardown completed on every rank."""


Action = Broadcast | Wait | Idle | Abort | Done


@lru_cache(maxsize=1024)
def _wait(ranks: tuple[int, ...]) -> Wait:
    """`Wait` for ``ranks``: one frozen record per set of ranks (a driver asks after every reply)."""
    return Wait(ranks)


@dataclass
class Chunking:
    """The request in chunked prefill: ``prompt`` (its prompt plus the ``generated`` tokens
    it already produced, for a recomputed request), of which ``done`` tokens are in the KV
    cache, written through the chunk slot by earlier steps' `Chunk`s."""

    request: Request
    prompt: tuple[int, ...]
    generated: int
    done: int


@dataclass
class Sampled:
    """Overlapped scheduling: a step whose sampled tokens the controller has not absorbed yet
    (they come with the next step's reply).

    Attributes:
        seq: the step's sequence number.
        ids: the request ids of its slot order (its rows, then its admissions).
        outs: their output lists, in the same order; a request found ended after this step
            was sent gets a scratch list here, so the token its leftover row samples is dropped.
        stops: stop token -> how many of its requests stop on it, when it was sent (a request
            preempted since still stops on the token it sampled here).
        ending: requests whose last token by length this step samples; they were retired in
            the next step and finish once this step's tokens are absorbed.
        dropped: requests whose token of this step is dropped (leftover rows), so a driver
            drops the side outputs (logprobs, logits) that came with it too.
    """

    seq: int
    ids: tuple[int, ...]
    outs: list
    stops: dict
    ending: list
    dropped: set = field(default_factory=set)


def _check_sampled(tokens: tuple, seq: int) -> None:
    """Raises ReplyError unless every sampled token id is an int or NO_TOKEN: a float or bool
    was stored as the request's output and fed back to the ranks, a str failed a step later
    inside a rank (a fresh engine author's finding). One C-level pass over the step's ids
    (about 10 us for 256). The sign is not checked: the protocol does not know the vocabulary,
    and the simulator's models sample -1."""
    if set(map(type, tokens)) - _SAMPLED_TYPES:
        bad = next(t for t in tokens if type(t) not in _SAMPLED_TYPES)
        raise ReplyError(f"rank 0 reply to step {seq}: sampled token id {shown(bad)} must be an "
                         "integer (or NO_TOKEN)")


_SAMPLED_TYPES = frozenset({int, type(NO_TOKEN)})


class Controller:
    """Scheduler + step loop for ``config.world_size`` ranks.

    Args:
        config: the validated protocol configuration.
        clock: returns seconds (monotonic), a finite int or float; drives the startup
            watchdog and the step timeout. Each reading is checked (`protocol.watchdog.
            read_clock`): `next_action` raises ConfigError naming any other value, before it
            changes any state.
        pages_per_seq: KV pages one full-length sequence needs, ceil(max_model_len /
            config.page_size) (memory fitting, page tables, the longest request accepted).
            The default, 1, accepts only requests of at most config.page_size tokens.

    Raises:
        ConfigError: config is no ProtocolConfig, clock not callable, pages_per_seq not a
            positive integer, or config.max_kv_pages below pages_per_seq (no sequence of full
            length would fit; found only after the startup sweep before).
    """

    abort_how = "abort"
    disarm_watchdog_on_error = True

    def __init__(self, config: ProtocolConfig, clock: Callable[[], float] = lambda: 0.0,
                 pages_per_seq: int = 1):
        if not isinstance(config, ProtocolConfig):
            raise ConfigError(f"config={shown(config)}: expected a protocol.config.ProtocolConfig")
        if not callable(clock):
            raise ConfigError(f"clock={shown(clock)}: expected a function returning seconds")
        if not is_int(pages_per_seq) or pages_per_seq < 1:  # 0 wedged every later sweep
            raise ConfigError(f"pages_per_seq={shown(pages_per_seq)} must be a positive integer")
        if config.max_kv_pages is not None and config.max_kv_pages < pages_per_seq:
            raise ConfigError(f"max_kv_pages={config.max_kv_pages} is below pages_per_seq="
                              f"{pages_per_seq}: no sequence of full length fits")
        self.config = config
        self.world_size = config.world_size
        self.plan = GraphPlan.from_config(config)
        self.pages_per_seq = pages_per_seq
        self.watchdog = Watchdog(clock, config.watchdog_timeout_s)
        self._clock = clock
        self._sent_at = 0.0
        self.seq = -1
        self.current: Command | None = None
        self.replies: dict[int, Reply] = {}
        self.phase = "startup"
        self.failure: ProtocolError | None = None
        self.memory: MemoryPlan | None = None
        stages = self.startup_stages()
        self._stages = checked_hook_result(
            stages, "Controller.startup_stages",
            isinstance(stages, (list, tuple)) and all(isinstance(n, str) for n in stages),
            "a list of stage names")
        self._stage = 0
        self._reports: dict[int, Any] = {}
        self.slots = SlotTable(config.max_batch)
        self.pending: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.outputs: dict[int, list[int]] = {}
        self.finished: list[int] = []
        self.failed_requests: set[int] = set()  # finished without a token: rank 0 said None
        self.request_errors: dict[int, ProtocolError] = {}  # in flight when the run failed
        self._to_retire: list[int] = []
        # Slot-aligned columns beside `self.slots` (index i: the request in slot i): its next
        # input token, the position its next decode row writes, its output list. A step's rows
        # are built from them and its reply folded into them without Python work per row.
        self._tokens: list[int] = []
        self._positions: list[int] = []
        self._outs: list[list[int]] = []
        # Serving steps built so far; step t's rows advance every live position by one, so
        # when a request crosses into a new page and when its last token comes are known at
        # admission: calendars keyed by step index hold them (only those rows are touched).
        self._steps = 0
        self._grow_at: dict[int, list[int]] = {}     # step -> requests whose row needs a page
        self._finish_at: dict[int, list[int]] = {}   # step -> requests whose last token comes
        self._due: dict[int, tuple[int, int]] = {}   # request -> (its grow step, finish step)
        self._stops: dict[int, int] = {}             # stop token -> live requests that stop on it
        self._sweep_index = 0
        self._closing = False
        self.pool: PagePool | None = None
        self._live: dict[int, int] = {}  # live request -> admission number, oldest first
        self._chunking: Chunking | None = None  # the request in chunked prefill, if any
        self._admission_order: dict[int, int] = {}  # request -> its latest admission number
        self._admissions = 0
        self.preemptions = 0
        self.leftover_rows = 0  # overlap: rows of requests that had already ended (dropped)
        self._overlap = config.decode_overlap
        self._unread: Sampled | None = None   # the last step sent that sampled (overlap)
        self._reading: Sampled | None = None  # the step whose tokens the outstanding reply carries

    # -- what the driver asks --------------------------------------------------------------

    def next_action(self) -> Action:
        """What the driver does next. Never issues a command while a reply is outstanding (I1).

        Raises:
            ConfigError: the clock returned something other than a finite int or float (the
                caller's clock, `protocol.watchdog.read_clock`), before any state changed.
        """
        if self.phase == "failed":
            return Abort(self.failure, self.abort_how)
        if self.phase == "done":
            return Done()
        now = read_clock(self._clock)  # first: a bad reading raises before any state changes
        uncollected = self.uncollected()
        if self.phase == "startup":
            try:
                self.watchdog.check(uncollected, now)
            except WatchdogExpired as exc:
                return self._fail(exc)
        elif uncollected and now >= self.step_deadline:
            return self._fail(RankFailure(
                f"command {self.current.seq} ({type(self.current).__name__}) timed out after "
                f"{self.config.step_timeout_s:g} s; ranks not collected: "
                f"{', '.join(map(str, uncollected))}", (), uncollected, {},
                step=self.current.seq, kind="timeout"))
        if uncollected:
            return _wait(uncollected)
        if self.current is not None:
            error = self._absorb(self.current, self.replies)
            self.current = None
            if error is not None:
                return self._fail(error)
        if self.phase == "done":
            return Done()
        command = self._next_command()
        if command is None:
            return Idle()
        self.current = command
        self.replies = {}
        self._sent_at = now
        return Broadcast(command)

    def uncollected(self) -> tuple[int, ...]:
        """Ranks whose reply to the current command has not arrived, ascending."""
        replies = self.replies
        if self.current is None or len(replies) == self.world_size:
            return ()  # `on_reply` keeps one reply per rank of the world
        missing = []
        for r in range(self.world_size):  # a loop, not a comprehension: after every reply
            if r not in replies:
                missing.append(r)
        return tuple(missing)

    def on_reply(self, reply: Reply) -> None:
        """Take one rank's reply to the current command.

        Raises:
            ReplyError: not a Reply, a rank, seq or ok of the wrong type, unknown rank,
                duplicate reply, wrong sequence number, or a rank-0 step reply without the
                sampled tokens. The controller is then failed too.
        """
        try:
            self._validate(reply)
        except ReplyError as exc:
            self._fail(exc)
            raise
        self.replies[reply.rank] = reply
        if not reply.ok:
            failed = tuple(sorted(r for r, rep in self.replies.items() if not rep.ok))
            bad = {r: rep for r, rep in self.replies.items() if not rep.ok}
            errors = {r: rep.error or "" for r, rep in bad.items()}
            uncollected = self.uncollected()
            self._fail(RankFailure(
                f"command {reply.seq} ({type(self.current).__name__}) failed on rank(s) "
                f"{', '.join(map(str, failed))}: {errors[failed[0]]}; ranks not collected: "
                f"{', '.join(map(str, uncollected)) or 'none'}", failed, uncollected, errors,
                kinds={r: rep.error_kind or "error" for r, rep in bad.items()},
                invariants={r: rep.invariant for r, rep in bad.items()}, step=reply.seq))

    def on_rank_dead(self, rank: int) -> None:
        """Liveness signal: ``rank``'s process is gone (its connection broke), so no reply will
        come from it. The failure is global and names the dead rank, not the survivors stuck
        behind it in a collective (I13; ai2cm/ace #348: every survivor reports a collective
        timeout and nothing names the rank that died). Ignored once failed or done.

        Raises:
            ConfigError: ``rank`` is no rank of this world (the run is left as it was: it
                aborted, naming a rank 9 that never existed).
        """
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ConfigError(f"on_rank_dead({shown(rank)}): not a rank of world size "
                              f"{self.world_size}")
        if self.phase in ("failed", "done"):
            return
        seq = self.current.seq if self.current is not None else self.seq
        others = tuple(r for r in self.uncollected() if r != rank)
        self._fail(RankFailure(
            f"rank {rank} died (its connection broke) during command {seq}; no reply will come "
            f"from it", (rank,), others, {rank: "process died"}, kinds={rank: "dead"},
            step=seq, kind="dead"))

    def submit(self, request: Request) -> None:
        """Queue a request for admission.

        Raises:
            ConfigError: duplicate request id, or the controller is shutting down or failed.
        """
        if not isinstance(request, Request):
            raise ConfigError(f"submit({shown(request)}): expected a protocol.requests.Request")
        if self.phase == "failed":
            raise ConfigError(f"request {request.request_id} submitted after the run failed "
                              f"({self.failure})")
        if self._closing or self.phase == "done":
            raise ConfigError(f"request {request.request_id} submitted after shutdown")
        if request.request_id in self.requests:
            raise ConfigError(f"request id {request.request_id} is already in use")
        self._check_fits(request)
        self.requests[request.request_id] = request
        self.outputs[request.request_id] = []
        self.pending.append(request)

    def shutdown(self) -> None:
        """Stop taking requests; once every queued and running request has finished, tear down:
        graphs first, then the communicator (`Teardown`)."""
        self._closing = True

    def take_finished(self, request_id: int) -> list[int]:
        """The generated tokens of a finished request, forgetting the request.

        Raises:
            ConfigError: the request is unknown or not finished.
        """
        if request_id not in self.requests:
            raise ConfigError(f"request {request_id} is unknown (or was already taken)")
        if request_id not in self.finished:
            if self.phase == "failed":  # it never will: say why, not "has not finished" for ever
                raise ConfigError(f"request {request_id} did not finish: the run failed "
                                  f"({self.failure})")
            raise ConfigError(f"request {request_id} has not finished")
        self.finished.remove(request_id)
        self.failed_requests.discard(request_id)
        self._admission_order.pop(request_id, None)
        del self.requests[request_id]
        return self.outputs.pop(request_id)

    def deadline(self) -> float:
        """The earliest time (on the injected clock) at which `next_action` will abort on its
        own -- the startup watchdog or the serving step timeout; inf if none. A transport that
        blocks while collecting replies should wake up by then."""
        watchdog = self.watchdog.deadline if self.watchdog.deadline is not None else float("inf")
        return min(watchdog, self.step_deadline)

    @property
    def step_deadline(self) -> float:
        """When the outstanding command times out outside startup (seconds on the clock)."""
        if self.current is None or self.phase == "startup":
            return float("inf")
        return self._sent_at + self.config.step_timeout_s

    @property
    def closing(self) -> bool:
        """True once `shutdown` was called."""
        return self._closing

    def has_work(self) -> bool:
        """True while a request is queued, live in a slot, or finished but not yet retired."""
        return bool(self.pending or self.slots.requests() or self._to_retire
                    or self._chunking is not None or self._unread is not None)

    def holds_reply(self, rank: int) -> bool:
        """True if the current command's reply from ``rank`` has arrived."""
        return rank in self.replies

    def chunk_holder(self) -> int | None:
        """The request in chunked prefill (it holds the chunk slot on every rank), or None."""
        return self._chunking.request.request_id if self._chunking is not None else None

    @property
    def serving(self) -> bool:
        """True once the startup sweep finished."""
        return self.phase == "serving"

    def fingerprint(self) -> tuple:
        """Hashable summary of the state, for the simulator's state hashing."""
        return (self.phase, self.seq, self._stage, tuple(sorted(self.replies)),
                self.slots.requests(), len(self.pending), tuple(self.finished),
                tuple((r, tuple(t)) for r, t in sorted(self.outputs.items())), self._closing,
                self.watchdog.armed, self.pool.fingerprint() if self.pool else (),
                (self._chunking.request.request_id, self._chunking.done)
                if self._chunking else (), self._unread.seq if self._unread else None)

    # -- hooks that variants override -----------------------------------------------------

    def startup_stages(self) -> list[str]:
        """Names of the startup stages in order; 'sweep' expands to Capture/Launch per key."""
        return ["warmup", "profile", "measure", "allocate", "sweep", "finalize"]

    def allocate_command(self, seq: int) -> AllocateKV:
        """The `AllocateKV` command numbered ``seq`` for the memory plan the fit chose: its KV
        pages and batch cap (0 pages and no cap before a fit)."""
        memory = self.memory
        return AllocateKV(seq, memory.kv_pages if memory else 0,
                          memory.batch_cap if memory else None, self.config.page_size)

    def warmup_sizes(self) -> tuple[int, ...]:
        """One message size per distinct all-reduce size the captured graphs use (I5)."""
        return tuple(sorted({self.config.shape.allreduce_bytes(k.bucket) for k in self.plan.keys()}))

    def measure_keys(self) -> tuple[GraphKey, ...]:
        """Every key the plan may keep: the whole retained set is measured and reserved (I9)."""
        return self.plan.keys()

    def fit_memory(self, reports: dict[int, MemoryReport],
                   graph_bytes: dict[GraphKey, int]) -> MemoryPlan:
        """One KV size and batch cap for every rank, from the tightest rank (I9); a refit after a
        second measurement never raises the cap the first fit chose."""
        cap = self.memory.batch_cap if self.memory else self.config.max_batch
        return plan_memory(reports, graph_bytes, self.plan.buckets, cap,
                           self.config.kv_page_bytes, self.pages_per_seq,
                           self.config.memory_headroom_bytes, self.config.max_kv_pages)

    def measure_again(self, measured: tuple[GraphKey, ...]) -> bool:
        """True if the fit kept a different graph set than ``measured``: graphs share one pool,
        so a graph's bytes depend on the graphs recorded before it, and the reserve must be
        measured on the set that is kept (I9). The refit is capped at the previous fit and the
        plan only shrinks, so this ends."""
        return self.measure_keys() != measured

    def sweep_commands(self, seq: int, index: int) -> Command | None:
        """The index-th command of the capture sweep: Capture then Launch per key, largest first."""
        keys = self.plan.keys()
        if index >= 2 * len(keys):
            return None
        key = keys[index // 2]
        return Capture(seq, key) if index % 2 == 0 else Launch(seq, key)

    def longest_context(self, rows: DecodeRows) -> int:
        """Tokens the longest of a step's decode rows attends over, the token the step writes
        included: the furthest row's position + 1, the maximum over every row (0 without
        rows). The rows are the controller's own columns, so the graph path chosen from it
        (`GraphPlan.key_for`, I22) is one decision for every rank."""
        return max(rows.positions) + 1 if rows else 0

    def drop_leftover_token(self, in_flight: Sampled, request_id: int) -> None:
        """Overlapped scheduling: request ``request_id`` ended in the step before ``in_flight``,
        which was sent before that was known and holds a leftover row of it: the token that
        row samples is dropped (its output list there becomes a scratch list)."""
        in_flight.outs[in_flight.ids.index(request_id)] = []
        in_flight.dropped.add(request_id)

    # -- internals ----------------------------------------------------------------------------

    def fail_requests(self, error: ProtocolError) -> None:
        """The run failed with ``error``: every request in flight -- queued, running, preempted
        and waiting to be recomputed, or finished but not yet retired -- gets it as its error
        (`request_error`), so no caller waits for tokens that will never come (I18; a dead
        worker that left pending requests waiting forever: AtomaAI/atoma-infer #177)."""
        for request_id in self.requests:
            if request_id not in self.finished:
                self.request_errors.setdefault(request_id, error)

    def dropped_tokens(self) -> frozenset[int]:
        """Overlapped scheduling: the requests whose token in the reply now being collected is
        dropped (leftover rows of requests that had already ended): a driver drops whatever
        else came with that token (logprobs, logits, a sampling error). Empty otherwise."""
        reading = self._reading if isinstance(self.current, Step) and self.current.overlap else None
        return frozenset(reading.dropped) if reading is not None else frozenset()

    def request_error(self, request_id: int) -> ProtocolError | None:
        """The error request ``request_id`` ended with because the run failed, or None."""
        return self.request_errors.get(request_id)

    def _fail(self, error: ProtocolError) -> Abort:
        if self.phase != "failed":
            self.phase = "failed"
            self.failure = error
            if self.disarm_watchdog_on_error:
                self.watchdog.disarm()
            self.fail_requests(error)
        return Abort(self.failure, self.abort_how)

    def _validate(self, reply: Reply) -> None:
        if not isinstance(reply, Reply):  # None was an AttributeError that left the run alive
            raise ReplyError(f"reply {shown(reply)} is not a protocol.commands.Reply")
        for name in ("rank", "seq"):
            value = getattr(reply, name)
            if not is_int(value):  # True was rank 1
                raise ReplyError(f"reply {name}={shown(value)} must be an integer")
        if not isinstance(reply.ok, bool):  # ok="no" read as success
            raise ReplyError(f"reply from rank {reply.rank}: ok={shown(reply.ok)} must be True "
                             "or False")
        if self.current is None:
            raise ReplyError(f"reply from rank {reply.rank} for command {reply.seq}, "
                             "but no command is outstanding")
        if not 0 <= reply.rank < self.world_size:
            raise ReplyError(f"reply from rank {reply.rank}, outside world size {self.world_size}")
        if reply.seq != self.current.seq:
            raise ReplyError(f"reply from rank {reply.rank} for command {reply.seq}, "
                             f"but command {self.current.seq} is outstanding")
        if reply.rank in self.replies:
            raise ReplyError(f"duplicate reply from rank {reply.rank} for command {reply.seq}")
        if reply.ok and reply.rank == 0 and isinstance(self.current, Step) and (
                self.current.read is not None if self.current.overlap
                else self.current.rows or self.current.admits):
            want = (len(self._reading.ids) if self.current.overlap
                    else len(self.current.rows) + len(self.current.admits))
            if not isinstance(reply.payload, tuple) or len(reply.payload) != want:
                got = (f"{len(reply.payload)} token ids" if isinstance(reply.payload, tuple)
                       else f"{shown(reply.payload)}, not a tuple")
                whose = (f"step {self.current.read}'s" if self.current.overlap else "its")
                raise ReplyError(f"rank 0 reply to step {reply.seq} must carry {want} token "
                                 f"ids in slot order ({whose} rows, then admissions), got {got}")
            _check_sampled(reply.payload, reply.seq)

    def _next_command(self) -> Command | None:
        if self.phase == "startup":
            command = self._next_startup_command()
            if command is not None:
                return command
            self.phase = "serving"
        if self.phase == "serving":
            if (self._closing and not self.pending and not self.slots.requests()
                    and self._chunking is None and self._unread is None):
                self.phase = "teardown"
                self.seq += 1
                return Teardown(self.seq)
            return self._next_step()
        return None

    def _next_startup_command(self) -> Command | None:
        if self.seq == -1:  # the first command of the run: the startup watchdog spans it all
            self.watchdog.arm()
        while self._stage < len(self._stages):
            name = self._stages[self._stage]
            seq = self.seq + 1
            command: Command | None
            if name == "warmup":
                sizes = self.warmup_sizes()
                checked_hook_result(sizes, "Controller.warmup_sizes",
                                    isinstance(sizes, (list, tuple)) and all(
                                        type(n) is int and n > 0 for n in sizes),
                                    "a tuple of message sizes in bytes, each an int > 0")
                command = Warmup(seq, tuple(sizes))
            elif name == "profile":
                command = ProfileMemory(seq, self.plan.buckets[-1])  # buckets are never empty
            elif name == "measure":
                keys = self.measure_keys()
                checked_hook_result(keys, "Controller.measure_keys",
                                    isinstance(keys, (list, tuple)) and all(
                                        isinstance(k, GraphKey) for k in keys),
                                    "a tuple of protocol.keys.GraphKey")
                command = MeasureGraphs(seq, tuple(keys))
            elif name == "allocate":
                command = self.allocate_command(seq)
            elif name.startswith("sweep"):
                command = self.sweep_commands(seq, self._sweep_index)
                checked_hook_result(command, "Controller.sweep_commands",
                                    command is None or isinstance(command, Command),
                                    "a protocol.commands.Command or None")
                if command is None:
                    self._stage += 1
                    continue
                self._sweep_index += 1
                self.seq = seq
                return command
            elif name == "finalize":
                command = Finalize(seq, self.plan.keys())
            else:
                raise ProtocolError(f"unknown startup stage {name!r}")
            self._stage += 1
            self.seq = seq
            return command
        self.watchdog.disarm()
        return None

    def _absorb(self, command: Command, replies: dict[int, Reply]) -> ProtocolError | None:
        """Fold a fully collected command's replies into the controller's state."""
        if isinstance(command, ProfileMemory):
            self._reports["memory"] = {r: rep.payload for r, rep in replies.items()}
        elif isinstance(command, MeasureGraphs):
            graph_bytes: dict[GraphKey, int] = {}
            for rep in replies.values():
                for key, nbytes in (rep.payload or {}).items():
                    graph_bytes[key] = max(graph_bytes.get(key, 0), nbytes)
            try:
                fitted = self.fit_memory(self._reports.get("memory", {}), graph_bytes)
                self.memory = checked_hook_result(fitted, "Controller.fit_memory",
                                                  isinstance(fitted, MemoryPlan),
                                                  "a protocol.memory.MemoryPlan")
            except ConfigError as exc:
                return exc
            self.plan = self.plan.fitted(self.memory.batch_cap)
            if self.measure_again(command.keys):
                self._stage -= 1
        elif isinstance(command, AllocateKV):
            if command.pages > 0:
                self.pool = PagePool(command.pages, command.page_size, self.pages_per_seq,
                                     min(command.pages - 1,
                                         int(self.config.kv_watermark * command.pages)))
                for request in self.pending:
                    if (error := self._check_fits(request, raise_=False)) is not None:
                        return error
        elif isinstance(command, Finalize):
            return self._check_finalize(replies)
        elif isinstance(command, Step):
            if not command.overlap:
                self._absorb_step(command, replies[0].payload or ())
            elif command.read is not None:
                self._absorb_overlapped(self._reading, replies[0].payload)
        elif isinstance(command, Teardown):
            self.phase = "done"
        return None

    def _check_finalize(self, replies: dict[int, Reply]) -> ProtocolError | None:
        reports: dict[int, FinalizeReport] = {r: rep.payload for r, rep in replies.items()}
        expected = frozenset(self.plan.keys())
        for rank, report in sorted(reports.items()):
            if report.captured != expected:
                missing = sorted(map(str, expected - report.captured))
                extra = sorted(map(str, report.captured - expected))
                return RankFailure(
                    f"I3 violated: rank {rank} captured a different graph set "
                    f"(missing {missing}, extra {extra})", (rank,), (), {rank: "captured set"},
                    step=self.seq, kind="divergence", invariant="I3")
            reserve = self.memory.graph_reserve_bytes if self.memory else 0
            if report.graph_bytes > reserve:
                return RankFailure(
                    f"I9 violated: rank {rank} holds {report.graph_bytes} graph bytes, above the "
                    f"reserve of {reserve}", (rank,), (), {rank: "graph memory"},
                    step=self.seq, kind="oom", invariant="I9")
        return None

    def _check_fits(self, request: Request, raise_: bool = True) -> ConfigError | None:
        """A request must fit the page pool alone, or it could never finish (I14). Before the
        pool exists (a request submitted during startup) the bound is one full-length
        sequence's pages, which every memory fit leaves room for (`plan_memory`), so a request
        too long for any pool is refused alone when submitted, not found at `AllocateKV`, where
        it would fail the run and every request queued beside it."""
        tokens = len(request.prompt) + request.max_tokens - 1  # the last token is never fed
        if self.pool is None:
            page_size, room = self.config.page_size, self.pages_per_seq
        else:
            page_size = self.pool.page_size
            room = min(self.pool.num_pages, self.pool.max_pages_per_seq)
        if pages_for(tokens, page_size) <= room:
            return None
        error = ConfigError(
            f"request {request.request_id}: {len(request.prompt)} prompt tokens + "
            f"{request.max_tokens} new tokens need {pages_for(tokens, page_size)} KV pages, "
            f"above the {room} one sequence may hold; shorten it or give the KV cache more "
            "memory")
        if raise_:
            raise error
        return error

    def _next_step(self) -> Step | None:
        """The next serving step: free finished requests, grow or preempt, admit by free pages.

        Pages (I14): every running request needs the page its next position writes; while the
        pool cannot cover the rows that cross into a new page in this step, the most recently
        admitted running request is preempted (its pages freed, the request queued first for
        recompute). Admission then takes queued requests in order while their prompt pages
        leave the watermark free -- none in a step that preempted, so a preempted request does
        not displace the growth it made room for.

        Per-row work is C-level passes over the slot-aligned columns; Python code runs only
        for the requests that retire, are preempted, are admitted or cross a page boundary.
        """
        pool = self.pool
        if pool is None:
            raise PageError("serving step before the KV cache was allocated")
        t = self._steps
        unread = self._unread
        if unread is not None:
            # overlap: the requests whose last token step t-1 samples leave now, and finish
            # once that token is absorbed (so they get no leftover row in this step)
            ended = set(self._to_retire)
            unread.ending = [r for r in self._finish_at.pop(t - 1, ()) if r not in ended]
        leaving = list(dict.fromkeys(self._to_retire + (unread.ending if unread else [])))
        self._to_retire = []
        freed = {r: pool.release(r) for r in leaving}
        for r in leaving:
            self._forget(r)
        growing = self._grow_at.pop(t, [])  # live rows of step t that write a new page
        victims: list[int] = []
        chunk_victim = None
        while len(growing) > pool.free_count:
            if self._chunking is not None:  # the request in chunked prefill goes first
                chunk_victim, self._chunking = self._chunking.request, None
                rid = chunk_victim.request_id
                chunk_preempt = Preempt(rid, self.slots.chunk_slot, pool.release(rid))
                continue
            victim = next(reversed(self._live))  # the most recently admitted running request
            if victim in growing:
                growing.remove(victim)
            victims.append(victim)
            freed[victim] = pool.release(victim)
            self._forget(victim)
        gone, moves = self.slots.retire(leaving + victims)
        self._compact(moves)
        retires = tuple(Retire(g.request_id, g.slot, freed[g.request_id])
                        for g in gone if g.request_id not in victims)
        preempts = tuple(Preempt(g.request_id, g.slot, freed[g.request_id])
                         for g in gone if g.request_id in victims)
        if chunk_victim is not None:
            preempts += (chunk_preempt,)
        if victims or chunk_victim is not None:
            self.preemptions += len(preempts)
            self.pending[:0] = sorted((self.requests[v] for v in victims),
                                      key=lambda q: self._admission_order[q.request_id]) + (
                [chunk_victim] if chunk_victim is not None else [])
        n = len(self.slots)
        feed = None
        if not n:
            rows = DecodeRows()
        elif self._overlap:  # input tokens come from step t-1's sampled ids, on the device
            rows = self.slots.rows(repeat(FED, n), self._positions)
            if unread is None:
                raise ProtocolError(f"step {self.seq + 1} has decode rows but no step before "
                                    "it sampled their tokens")
            index = dict(zip(unread.ids, range(len(unread.ids))))
            feed = tuple(map(index.__getitem__, rows.request_ids))
        else:
            rows = self.slots.rows(self._tokens, self._positions)
        pages = []
        for slot, r in sorted((self.slots.slot_of(r), r) for r in growing):
            pages.append(self._grow(r, slot, self._positions[slot] + 1))
            self._schedule(self._grow_at, r, t + pool.page_size, 0)
        self._positions[:n] = map((1).__add__, self._positions[:n])  # each row writes one
        admits: list[Admit] = []
        chunk: Chunk | None = None
        room = (self.memory.batch_cap if self.memory else self.config.max_batch) - len(self.slots)
        budget = self.config.max_prefill_tokens
        preempted = bool(preempts)
        if self._chunking is not None and not preempted:
            budget, room, chunk = self._next_chunk(t, budget, room, admits, pages)
        while self.pending and room > 0 and budget > 0 and not preempted:
            request = self.pending[0]
            generated = tuple(self.outputs[request.request_id])
            prompt = request.prompt + generated
            if not pool.can_admit(len(prompt), running=len(self.slots)):
                break
            if len(prompt) > budget:
                # longer than what the step has left: prefill it in chunks, one request at a
                # time, starting with the rest of this step's budget
                if self._chunking is not None or chunk is not None:
                    break
                self.pending.pop(0)
                rid = request.request_id
                self._chunking = Chunking(request, prompt, len(generated), budget)
                chunk = Chunk(rid, self.slots.chunk_slot, 0, prompt[:budget])
                pages.append(self._grow(rid, self.slots.chunk_slot, budget))
                break
            self.pending.pop(0)
            budget -= len(prompt)
            admit = self.slots.admit(request.request_id)
            admits.append(Admit(request.request_id, admit.slot, prompt, request.params,
                                output_index=len(generated)))
            pages.append(self._grow(request.request_id, admit.slot, len(prompt)))
            self._enter(request, t, len(prompt), len(generated))
            room -= 1
        if (not rows and not admits and not retires and not preempts and chunk is None
                and unread is None):
            return None
        key, bucket = self.plan.key_for(len(rows), self.longest_context(rows))
        self.seq += 1
        self._steps += 1
        step = Step(self.seq, retires=retires, moves=moves, admits=tuple(admits), rows=rows,
                    key=key, bucket=bucket, pages=tuple(p for p in pages if p is not None),
                    preempts=preempts, chunk=chunk, overlap=self._overlap, feed=feed,
                    read=unread.seq if unread is not None else None)
        if self._overlap:
            self._reading = unread
            live = len(self.slots)
            self._unread = (Sampled(step.seq, self.slots.requests(), self._outs[:live],
                                    dict(self._stops), []) if step.samples else None)
        return step

    def _next_chunk(self, t: int, budget: int, room: int, admits: list, pages: list):
        """The next piece of the chunked prefill in progress, first in the step: a `Chunk` of
        ``budget`` tokens while more than the budget remains, else its last chunk as an
        `Admit` (``start`` = tokens already cached) into the next decode slot, which samples.
        A piece whose pages the pool lacks (or a last chunk with no free decode slot) waits;
        the step then admits nothing else, so requests keep their order.

        Returns (budget left, room left, the step's `Chunk` or None).
        """
        c, pool = self._chunking, self.pool
        rid = c.request.request_id
        left = len(c.prompt) - c.done
        if left <= budget:
            if room < 1 or pool.growth(rid, len(c.prompt)) > pool.free_count:
                return 0, room, None
            slot = self.slots.admit(rid).slot
            admits.append(Admit(rid, slot, c.prompt, c.request.params, output_index=c.generated,
                                start=c.done))
            pages.append(self._grow(rid, slot, len(c.prompt)))
            self._enter(c.request, t, len(c.prompt), c.generated)
            self._chunking = None
            return budget - left, room - 1, None
        if pool.growth(rid, c.done + budget) > pool.free_count:
            return 0, room, None
        chunk = Chunk(rid, self.slots.chunk_slot, c.done, c.prompt[c.done:c.done + budget])
        pages.append(self._grow(rid, self.slots.chunk_slot, c.done + budget))
        c.done += budget
        return 0, room, chunk

    def _grow(self, request_id: int, slot: int, tokens: int) -> PageAssign | None:
        assign = self.pool.allocate(request_id, tokens)
        return None if assign is None else PageAssign(request_id, slot, assign.first_index,
                                                      assign.pages)

    def _enter(self, request: Request, t: int, tokens: int, generated: int) -> None:
        """Request ``request`` is admitted in step ``t`` with ``tokens`` prompt tokens, of
        which ``generated`` are its own earlier outputs (recompute): its slot's columns, and
        the steps at which its row first writes a new page and its last token comes."""
        rid = request.request_id
        self._tokens.append(0)  # its first input token is the one this step samples
        self._positions.append(tokens)
        self._outs.append(self.outputs[rid])
        # its row in step t + 1 + k writes position tokens + k; it holds the pages of ``tokens``
        cross = -(-tokens // self.pool.page_size) * self.pool.page_size
        self._schedule(self._grow_at, rid, t + 1 + cross - tokens, 0)
        # step t samples output ``generated``, step t + k output generated + k
        self._schedule(self._finish_at, rid, t + request.max_tokens - 1 - generated, 1)
        for token in request.stop_token_ids:
            self._stops[token] = self._stops.get(token, 0) + 1
        self._live[rid] = self._admissions
        self._admission_order[rid] = self._admissions
        self._admissions += 1

    def _schedule(self, calendar: dict[int, list[int]], rid: int, step: int, which: int) -> None:
        calendar.setdefault(step, []).append(rid)
        due = list(self._due.get(rid, (-1, -1)))
        due[which] = step
        self._due[rid] = tuple(due)

    def _forget(self, rid: int) -> None:
        """Request ``rid`` leaves its slot (retired or preempted): off the calendars and the
        stop-token counts."""
        grow, finish = self._due.pop(rid, (-1, -1))
        for calendar, step in ((self._grow_at, grow), (self._finish_at, finish)):
            if rid in calendar.get(step, ()):
                calendar[step].remove(rid)
        for token in self.requests[rid].stop_token_ids:
            self._stops[token] -= 1
            if not self._stops[token]:
                del self._stops[token]
        self._live.pop(rid, None)

    def _compact(self, moves) -> None:
        """Apply the slot table's compaction to the slot-aligned columns."""
        for column in (self._tokens, self._positions, self._outs):
            for move in moves:
                column[move.dst] = column[move.src]
            del column[len(self.slots):]

    def _absorb_step(self, step: Step, tokens: tuple) -> None:
        """Fold rank 0's tokens (slot order: the rows, then the admissions) into the columns
        and the outputs; end the requests whose last token came (by length, from the
        calendar; by a stop token, from the step's tokens that some live request stops on)."""
        live = len(step.rows) + len(step.admits)
        ending = set(self._finish_at.pop(self._steps - 1, ()))
        ids = self.slots.requests()
        outs = self._outs[:live]
        if NO_TOKEN in tokens:  # rank 0 could not sample these (non-finite logits): they end
            for slot in [i for i, token in enumerate(tokens) if token is NO_TOKEN]:
                self.failed_requests.add(ids[slot])
                ending.add(ids[slot])
                outs[slot] = []  # a scratch list: the request's outputs get no token
        list(map(list.append, outs, tokens))
        self._tokens[:live] = tokens
        ending |= self._stopped(ids, tokens, self._stops)
        for rid in sorted(ending):
            self._to_retire.append(rid)
            self.finished.append(rid)

    def _stopped(self, ids, tokens: tuple, stops: dict) -> set[int]:
        """The requests (``ids[i]`` sampled ``tokens[i]``) whose token is one of their stop
        tokens; Python work only for the tokens in ``stops`` (those some request stops on). A
        request already taken (`take_finished`: under overlap, before its leftover row's token
        came) is skipped."""
        stopped: set[int] = set()
        if stops and not stops.keys().isdisjoint(tokens):
            for token in stops.keys() & set(tokens):
                i = tokens.index(token)
                while True:
                    request = self.requests.get(ids[i])
                    if request is not None and token in request.stop_token_ids:
                        stopped.add(ids[i])
                    try:
                        i = tokens.index(token, i + 1)
                    except ValueError:
                        break
        return stopped

    def _absorb_overlapped(self, sampled: Sampled, tokens: tuple) -> None:
        """Overlapped scheduling: fold the tokens of step ``sampled.seq`` (carried by the
        next step's reply) into the outputs. The requests it ends -- by length (retired
        already), by a stop token or a token rank 0 could not sample -- finish; one that still
        holds its slot has a leftover row in the step in flight, whose token is dropped
        (tenstorrent/vllm-tt-plugin PR #76: a row whose request already ended), and it is
        retired in the next step; one preempted meanwhile leaves the queue."""
        ids, outs = sampled.ids, sampled.outs
        ending = dict.fromkeys(sampled.ending)
        if NO_TOKEN in tokens:  # rank 0 could not sample these (non-finite logits): they end
            for slot in [i for i, token in enumerate(tokens) if token is NO_TOKEN]:
                if outs[slot] is self.outputs.get(ids[slot]):
                    self.failed_requests.add(ids[slot])
                    ending[ids[slot]] = None
                outs[slot] = []  # a scratch list: the request's outputs get no token
        list(map(list.append, outs, tokens))
        for rid in sorted(self._stopped(ids, tokens, sampled.stops)):
            if outs[ids.index(rid)] is self.outputs.get(rid):  # not a leftover row's token
                ending[rid] = None
        in_flight, by_length = self._unread, set(sampled.ending)
        for rid in sorted(ending):
            self.finished.append(rid)
            if rid in self._live:
                self._to_retire.append(rid)
                if in_flight is not None and rid in in_flight.ids:
                    self.leftover_rows += 1
                    self.drop_leftover_token(in_flight, rid)
            elif rid not in by_length:  # preempted since: it leaves the recompute queue
                self.pending[:] = [q for q in self.pending if q.request_id != rid]
