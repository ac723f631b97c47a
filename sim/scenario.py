"""A scenario: everything a simulated run depends on except the scheduler's choices."""

from __future__ import annotations

import math
import numbers
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from lockstep.args import one_line_repr
from protocol.buckets import DEFAULT_DECODE_BUCKETS
from protocol.config import QWEN3_4B, ProtocolConfig
from protocol.errors import ConfigError
from protocol.requests import Request
from sim.comms import DEFAULT_COMMUNICATORS, Communicator, check_communicators
from sim.hazards import HazardModel
from sim.limits import MIN_RANKS, check_limits

TOPOLOGIES = ("shared", "per-rank")
"""``shared``: every rank is a thread of one process (one driver lock), as in thread-per-rank
engines; ``per-rank``: one process per rank, as with torchrun or spawned workers."""

FAULT_KINDS = ("raise", "oom", "slow", "hang", "die")

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Fault:
    """A fault injected into one rank's backend.

    Attributes:
        kind: ``raise`` (the op raises), ``oom`` (the op fails for memory), ``slow`` (the op
            takes ``delay_s`` more seconds), ``die`` (the rank's process dies: its host threads
            and devices stop, its replies never come, a collective with it never completes;
            peers see the broken connection after ``Scenario.death_detect_s``), ``hang`` (the op
            never returns, holding whatever
            lock it holds).
        rank: the rank it hits.
        op: backend op name it hits (e.g. ``"instantiate"``).
        occurrence: which call of that op on that rank (1-based).
        delay_s: extra seconds for ``slow``.
    """

    kind: str
    rank: int
    op: str
    occurrence: int = 1
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        # every value shown on one line (an array's repr spans several), and a kind tested as a
        # string first (an array's `in` raised numpy's "truth value ... is ambiguous")
        if not isinstance(self.kind, str) or self.kind not in FAULT_KINDS:
            raise ConfigError(f"fault kind {one_line_repr(self.kind, 60)} is not one of "
                              f"{', '.join(FAULT_KINDS)}")
        if not is_integer(self.rank):
            raise ConfigError(f"fault rank {one_line_repr(self.rank, 60)} is not an integer")
        if not isinstance(self.op, str):
            raise ConfigError(f"fault op {one_line_repr(self.op, 60)} is not an op name")
        if not is_integer(self.occurrence) or self.occurrence < 1:
            # 2.5 was taken and matched no call: the fault never fired and the run read clean
            raise ConfigError(f"fault occurrence {one_line_repr(self.occurrence, 60)} must be an "
                              "integer >= 1")
        if not is_real(self.delay_s) or not 0 <= self.delay_s < math.inf:
            raise ConfigError(f"fault delay_s {one_line_repr(self.delay_s, 60)} must be a finite "
                              "number >= 0")


def is_integer(value) -> bool:
    """An integer of any kind (a numpy one too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number of any kind (numpy's, a Fraction), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class MemoryModel:
    """Per-rank memory in bytes (H7).

    Attributes:
        capacity: device memory per rank.
        weights: bytes of this rank's weight shard.
        activation_per_row: eager peak activation bytes per batch row.
        graph_base: bytes every captured graph holds.
        graph_per_row: extra graph bytes per bucket row.
        rank_overhead: extra bytes already used on a rank (NCCL buffers), rank -> bytes.
    """

    capacity: int = 141 * GiB
    weights: int = 4 * GiB
    activation_per_row: int = 2 * MiB
    graph_base: int = 6 * MiB
    graph_per_row: int = 64 * 1024
    rank_overhead: tuple[tuple[int, int], ...] = ()

    def graph_bytes(self, bucket: int) -> int:
        """Bytes one graph of ``bucket`` rows holds when recorded alone: its own bytes and a
        memory pool for its bucket."""
        return self.graph_base + self.graph_pool_bytes(bucket)

    def graph_pool_bytes(self, bucket: int) -> int:
        """Pool bytes a graph of ``bucket`` rows needs (its intermediate activations). A rank's
        graphs share one pool, as captures given one pool handle do (vLLM, SGLang), so the pool
        is as large as its largest graph needs; recorded largest first, every later graph adds
        only its own ``graph_base``."""
        return bucket * self.graph_per_row

    def graph_set_bytes(self, buckets) -> int:
        """Bytes the graphs of ``buckets`` hold together in one shared pool."""
        buckets = tuple(buckets)
        return len(buckets) * self.graph_base + max(map(self.graph_pool_bytes, buckets), default=0)

    def overhead(self, rank: int) -> int:
        """Bytes used on ``rank`` besides weights."""
        return dict(self.rank_overhead).get(rank, 0)


@dataclass(frozen=True)
class Arrival:
    """``request`` is submitted once the controller has issued ``after_step`` serving steps,
    or earlier, as soon as it has nothing to do (`sim.world.World` submits the next arrival to
    an idle controller); ``after_step`` `AFTER_IDLE` means only then."""

    after_step: int
    request: Request


AFTER_IDLE = sys.maxsize
"""An `Arrival.after_step` no run reaches: the request comes once the controller is idle."""


def in_rounds(scenario: "Scenario") -> "Scenario":
    """``scenario`` with its workload served in rounds, as a rollout loop drives an engine: the
    requests of the first serving step form the first round, and each later one arrives only
    once every request before it has finished (`AFTER_IDLE`), so the engine goes idle between
    rounds."""
    first = min((a.after_step for a in scenario.workload), default=0)
    return scenario.with_(workload=tuple(
        a if a.after_step == first else replace(a, after_step=AFTER_IDLE)
        for a in scenario.workload))


@dataclass(frozen=True)
class Scenario:
    """Configuration, topology, hazards, memory, workload and faults of one simulated run.

    ``death_detect_s`` is how long after a process dies its peers see the broken connection
    (the liveness signal the controller gets), in seconds; shorter than the step timeout.
    ``communicators`` are the groups collectives may name (`sim.comms`): by default the TP
    device communicator ``"tp"`` and the host control group ``"cpu"``.
    ``data_parallel`` gives ranks different row sets (data-parallel lanes): request ``i`` belongs
    to rank ``i mod world_size``, and before each serving step every rank's worker is told its
    own batch (`lane_batch`, as ``worker.rank_batch``: the request ids of its lane's rows and
    admissions), so a rank can be idle while another is busy. Device state stays replicated,
    so tokens are still checked against running each request alone.
    """

    config: ProtocolConfig = field(default_factory=ProtocolConfig)
    topology: str = "shared"
    hazards: HazardModel = field(default_factory=HazardModel)
    memory: MemoryModel = field(default_factory=MemoryModel)
    workload: tuple[Arrival, ...] = ()
    faults: tuple[Fault, ...] = ()
    pages_per_seq: int = 2
    vocab: int = 1000
    death_detect_s: float = 5.0
    max_actions: int = 200_000
    communicators: tuple[Communicator, ...] = DEFAULT_COMMUNICATORS
    data_parallel: bool = False

    def __post_init__(self) -> None:
        """Raises ConfigError naming the first field a run could not use as it reads: a
        death_detect_s past the step timeout (with a die fault) or not finite had the correct
        protocol read as breaking I13, a zero vocabulary divided by zero, a negative action limit read
        as a livelock (a fresh user's findings)."""
        if not isinstance(self.config, ProtocolConfig):
            raise ConfigError(f"config {one_line_repr(self.config, 60)} is not a ProtocolConfig")
        if not isinstance(self.topology, str) or self.topology not in TOPOLOGIES:
            raise ConfigError(f"topology {one_line_repr(self.topology, 60)} is not one of "
                              f"{', '.join(TOPOLOGIES)}")
        for name, kind in (("hazards", HazardModel), ("memory", MemoryModel)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name} {one_line_repr(getattr(self, name), 60)} is not a "
                                  f"{kind.__name__}")
        for name in ("workload", "faults", "communicators"):
            value = getattr(self, name)
            if isinstance(value, list):  # a list reads as the tuple it holds
                object.__setattr__(self, name, tuple(value))
            elif not isinstance(value, tuple):
                raise ConfigError(f"{name} {one_line_repr(value, 60)} is not a tuple")
        for name in ("pages_per_seq", "vocab", "max_actions"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name} {one_line_repr(getattr(self, name), 60)} is not an "
                                  "integer >= 1")
        timeout = self.config.step_timeout_s
        d = self.death_detect_s
        if not is_real(d) or not 0 < d < math.inf:
            raise ConfigError(f"death_detect_s {one_line_repr(d, 60)} must be a finite number of "
                              "seconds above 0")
        if d > timeout and any(f.kind == "die" for f in self.faults if isinstance(f, Fault)):
            # the step timeout fires first and names no failed rank: a false I13
            raise ConfigError(f"death_detect_s {d!r} is past the step timeout ({timeout:g} s): "
                              "a die fault's peers would time out before they saw the death")
        if not isinstance(self.data_parallel, bool):
            raise ConfigError(f"data_parallel {one_line_repr(self.data_parallel, 60)} is not True "
                              "or False")
        for fault in self.faults:
            if not isinstance(fault, Fault):
                raise ConfigError(f"fault {one_line_repr(fault, 60)} is not a Fault")
            if not 0 <= fault.rank < self.config.world_size:
                raise ConfigError(f"fault on rank {fault.rank}, outside world size "
                                  f"{self.config.world_size}")
        check_communicators(self.communicators, self.config.world_size)

    def processes(self) -> tuple[tuple[int, ...], ...]:
        """Ranks grouped by process."""
        ranks = tuple(range(self.config.world_size))
        return (ranks,) if self.topology == "shared" else tuple((r,) for r in ranks)

    def lane_batch(self, rank: int, step) -> tuple[int, ...]:
        """With ``data_parallel``: the request ids of ``step``'s rows and admissions in
        ``rank``'s lane (request id mod world size); without it, every one of them."""
        ids = [row.request_id for row in step.rows] + [a.request_id for a in step.admits]
        if not self.data_parallel:
            return tuple(ids)
        return tuple(i for i in ids if i % self.config.world_size == rank)

    def with_communicators(self, *comms: Communicator) -> "Scenario":
        """A copy with ``comms`` added to its communicators (ConfigError for a taken name)."""
        return replace(self, communicators=self.communicators + tuple(comms))

    def with_(self, **changes) -> "Scenario":
        """A copy with fields replaced.

        Raises:
            ConfigError: a name that is no field of Scenario, or a value its checks refuse.
        """
        unknown = [name for name in changes if name not in _SCENARIO_FIELDS]
        if unknown:
            raise ConfigError(f"Scenario has no field {unknown[0]!r}; its fields: "
                              f"{', '.join(_SCENARIO_FIELDS)}")
        return replace(self, **changes)


_SCENARIO_FIELDS = tuple(f.name for f in fields(Scenario))


FIRST_WAVE = 9
"""Requests of the check's workload that arrive before the first serving step, unless the
smallest bucket below max batch needs more (`first_wave`)."""


def first_wave(max_batch: int, buckets: tuple[int, ...]) -> int:
    """Requests that arrive before the first serving step: `FIRST_WAVE`, or one more than the
    smallest bucket below ``max_batch`` where that is more, at most ``max_batch``.

    The decode batch must outgrow some bucket before a retirement can take it back across a
    boundary (what ``local-bucket`` needs: found by a session's configuration sweep,
    ``--buckets 16,32 --max-batch 20`` read that variant clean with a first wave of 9, where no
    step ever held 17 rows). Outgrowing it is necessary, not sufficient: at ``--buckets 1,9``
    no retirement of this workload leaves exactly one row behind (its last two requests retire
    together), so ``local-bucket`` draws its workload per run (`WorkloadDraw`).
    """
    below = [b for b in buckets if b < max_batch]
    wanted = max(FIRST_WAVE, below[0] + 1) if below else FIRST_WAVE
    return min(wanted, max_batch)


def serving_workload(max_batch: int, buckets: tuple[int, ...], stop_token: int = 0) -> tuple[Arrival, ...]:
    """A workload with admissions, retirements that compact live slots, and bucket straddles.

    Requests of different lengths arrive in three waves; early finishers retire from the middle
    of the slot table, so compaction moves live slots; batch sizes cross bucket boundaries (the
    first wave outgrows the smallest bucket below max batch: `first_wave`).
    """
    arrivals = []
    rid = 0
    waves = ((0, first_wave(max_batch, buckets)), (2, min(5, max_batch)),
             (5, min(3, max_batch)))
    for after, count in waves:
        for i in range(count):
            arrivals.append(Arrival(after, Request(rid, prompt=(1 + rid, 2, 3), max_tokens=2 + (rid * 3) % 5,
                                                   stop_token_ids=frozenset({stop_token}))))
            rid += 1
    return tuple(arrivals)


_CONFIG_FIELDS = tuple(f.name for f in fields(ProtocolConfig))


def default_scenario(topology: str = "shared", world_size: int = 2,
                     buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS, max_batch: int | None = None,
                     **config_overrides) -> Scenario:
    """The `lockstep check` default: Qwen3-4B shapes, TP 2, the 36 buckets, max batch 256,
    startup sweep then a serving workload with admissions, retirements and compactions.

    ``config_overrides`` are further `ProtocolConfig` fields (``step_timeout_s=5``, or a
    ``shape`` other than Qwen3-4B's).

    Raises:
        ConfigError: a world of fewer than `sim.limits.MIN_RANKS` ranks (as `lockstep check
            --ranks` refuses), a bucket list that is empty or not a list or tuple (a set has no
            order), a keyword that is no field of `ProtocolConfig`, or a value `ProtocolConfig`
            refuses.
    """
    if is_integer(world_size) and world_size < MIN_RANKS:
        raise ConfigError(f"world_size {world_size} must be at least {MIN_RANKS}: every hazard "
                          "the simulator models is between ranks")
    if (not isinstance(buckets, Sequence) or isinstance(buckets, (str, bytes))
            or not len(buckets)):
        # a set was taken, then failed as "'set' object is not subscriptable"
        raise ConfigError(f"buckets {one_line_repr(buckets, 60)}: expected a non-empty list of "
                          "batch sizes")
    unknown = [name for name in config_overrides if name not in _CONFIG_FIELDS]
    if unknown:  # a TypeError from ProtocolConfig's constructor before
        raise ConfigError(f"default_scenario: {unknown[0]!r} is no field of ProtocolConfig; its "
                          f"fields: {', '.join(_CONFIG_FIELDS)}")
    check_limits(ranks=world_size if is_integer(world_size) else None,
                 buckets=[b for b in buckets if is_integer(b)],
                 max_batch=max_batch if is_integer(max_batch) else None)
    max_batch = buckets[-1] if max_batch is None else max_batch
    # a shape of the caller's replaces Qwen3-4B's (given twice, it was a TypeError)
    config = ProtocolConfig(world_size=world_size, buckets=buckets, max_batch=max_batch,
                            **{"shape": QWEN3_4B, **config_overrides})
    return Scenario(config=config, topology=topology,
                    workload=serving_workload(max_batch, config.buckets))


def decode_contexts(scenario: Scenario) -> tuple[int, int] | None:
    """(shortest, longest) context -- tokens a decode row attends over, its position + 1 -- that
    a decode row of the scenario's workload can have, or None if no request decodes. A request
    with a prompt of n tokens and ``max_tokens`` m has decode rows at positions n .. n + m - 2
    (its first token comes from the prefill, its last is sampled and never fed): contexts
    n + 1 .. n + m - 1."""
    spans = [(len(a.request.prompt) + 1, len(a.request.prompt) + a.request.max_tokens - 1)
             for a in scenario.workload if a.request.max_tokens >= 2]
    if not spans:
        return None
    return min(lo for lo, _ in spans), max(hi for _, hi in spans)


def short_path_on(scenario: Scenario) -> Scenario:
    """``scenario`` with the short-context decode path on, its ``short_context`` in the middle
    of the workload's decode contexts (`decode_contexts`), so some rows fit it and some do not:
    the base that a search's per-run draw (`ShortContextDraw`) varies. Where every bucket is
    larger than ``short_max_bucket`` (``--buckets 16``) it is raised to the smallest bucket, so
    some bucket still has a short-path graph (the protocol refuses a short path with none).
    Unchanged if no request decodes or the path is already on."""
    contexts = decode_contexts(scenario)
    if contexts is None or scenario.config.short_context is not None:
        return scenario
    cfg = scenario.config
    return scenario.with_(config=replace(cfg, short_context=sum(contexts) // 2,
                                         short_max_bucket=max(cfg.short_max_bucket,
                                                              min(cfg.buckets))))


@dataclass(frozen=True)
class ShortContextDraw:
    """Run index -> ``base`` with the short-context decode path on (`protocol.keys.SHORT`) and
    its ``short_context`` drawn for that run; picklable, and seeded by (``seed``, index), so run
    i draws the same number whatever the number of jobs.

    The draw is uniform over shortest - 1 .. longest of the workload's decode contexts
    (`decode_contexts`): at the low end no decode row fits the short path, at the high end
    every row of a step-locked run does (under overlap a request's last, unread row reaches
    one token further), and between them a step's rows cross the boundary as its requests grow.
    A serving step does not depend on the schedule (`sim.run.correct_run`), so this draw is
    what moves the boundary between runs: which step meets it, and with which rows, is found
    by the search, never placed by hand. A scenario whose requests never decode is returned
    unchanged.
    """

    base: Scenario
    seed: int

    def _values(self) -> range | None:
        contexts = decode_contexts(self.base)
        return None if contexts is None else range(max(1, contexts[0] - 1), contexts[1] + 1)

    def _with(self, short: int) -> Scenario:
        return self.base.with_(config=replace(self.base.config, short_context=short))

    def __call__(self, index: int) -> Scenario:
        values = self._values()
        if values is None:
            return self.base
        short = random.Random(f"short-context {self.seed} {index}").randint(values[0],
                                                                           values[-1])
        return self._with(short)

    def members(self) -> list[Scenario]:
        """Every scenario the draw can give, one per ``short_context`` value in order: what a
        search of one scenario at a time (exhaustive, hypothesis) takes in turn."""
        values = self._values()
        return [self.base] if values is None else [self._with(v) for v in values]



DRAWN_PROMPT_LENGTHS = range(1, 7)
"""Prompt lengths, in tokens, that `WorkloadDraw` gives a request: 1..6."""

DRAWN_MAX_TOKENS = range(1, 7)
"""``max_tokens`` that `WorkloadDraw` gives a request: 1..6, as the check's workload's 2..6 and a
request that ends at its prefill. With a prompt of at most 6 tokens a sequence stays within 12
tokens, inside one 16-token KV page."""

DRAWN_WORKLOADS = 4
"""Workloads a one-scenario search (exhaustive, hypothesis) takes from a `WorkloadDraw`: the
base's and the draws of runs 1..3."""


def prompt_lengths(scenario: Scenario) -> tuple[int, ...]:
    """Each request's prompt length in tokens, in workload order."""
    return tuple(len(a.request.prompt) for a in scenario.workload)


def max_tokens(scenario: Scenario) -> tuple[int, ...]:
    """Each request's ``max_tokens``, in workload order."""
    return tuple(a.request.max_tokens for a in scenario.workload)


def _per_request(scenario: Scenario, values, what: str) -> tuple[int, ...]:
    values = tuple(values)
    if len(values) != len(scenario.workload):
        raise ConfigError(f"{len(values)} {what}(s) for a workload of {len(scenario.workload)} "
                          "request(s)")
    for i, n in enumerate(values):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{what} {n!r} of request {i} is not an integer of at least 1")
    return values


def with_prompt_lengths(scenario: Scenario, lengths) -> Scenario:
    """``scenario`` with request i of its workload given a prompt of ``lengths[i]`` tokens: its
    own prompt cut to that length, or extended by the tokens len + 1, len + 2, ... (arrival
    step, ``max_tokens`` and stop tokens kept).

    Raises:
        ConfigError: ``lengths`` does not give one length per request, or a length is not an
            integer of at least 1, naming it.
    """
    lengths = _per_request(scenario, lengths, "prompt length")
    arrivals = []
    for arrival, n in zip(scenario.workload, lengths):
        prompt = arrival.request.prompt
        prompt = (prompt + tuple(range(len(prompt) + 1, n + 1)))[:n]
        arrivals.append(replace(arrival, request=replace(arrival.request, prompt=prompt)))
    return scenario.with_(workload=tuple(arrivals))


def with_max_tokens(scenario: Scenario, counts) -> Scenario:
    """``scenario`` with request i of its workload given ``max_tokens`` ``counts[i]``.

    Raises:
        ConfigError: not one count per request, or a count not an integer of at least 1.
    """
    counts = _per_request(scenario, counts, "max_tokens")
    return scenario.with_(workload=tuple(
        replace(a, request=replace(a.request, max_tokens=m))
        for a, m in zip(scenario.workload, counts)))


@dataclass(frozen=True)
class WorkloadDraw:
    """Run index -> ``base`` with every request's prompt length (`DRAWN_PROMPT_LENGTHS`) and
    ``max_tokens`` (`DRAWN_MAX_TOKENS`) drawn for that run; picklable, seeded by (``seed``,
    index). Run 0 keeps the base's workload; arrival steps and stop tokens are kept.

    Which rows a serving step holds, how long each row's context is and when a request retires
    follow from the workload alone, not from the schedule (`sim.run.correct_run`), so with one
    fixed workload a bug that needs a particular mix -- a row longer than slot 0's behind it,
    a data-parallel lane left without rows -- shows at some configurations and never at others
    (found by a fresh user: `lockstep check --max-batch 4` could not show
    ``short-path-first-row``, ``--max-batch 9`` neither of the ``dp-idle-rank`` variants).
    Drawing the mix per run makes it the search's to find.
    """

    base: Scenario
    seed: int

    def lengths(self, index: int) -> tuple[int, ...]:
        """The prompt lengths run ``index`` draws (run 0: the base's own)."""
        if index == 0:
            return prompt_lengths(self.base)
        rng = random.Random(f"prompt-lengths {self.seed} {index}")
        return tuple(rng.choice(DRAWN_PROMPT_LENGTHS) for _ in self.base.workload)

    def max_tokens(self, index: int) -> tuple[int, ...]:
        """The ``max_tokens`` run ``index`` draws (run 0: the base's own)."""
        if index == 0:
            return max_tokens(self.base)
        rng = random.Random(f"max-tokens {self.seed} {index}")
        return tuple(rng.choice(DRAWN_MAX_TOKENS) for _ in self.base.workload)

    def workload(self, index: int) -> Scenario:
        """``base`` with run ``index``'s workload."""
        if index == 0:
            return self.base
        return with_max_tokens(with_prompt_lengths(self.base, self.lengths(index)),
                               self.max_tokens(index))

    def __call__(self, index: int) -> Scenario:
        return self.workload(index)

    def members(self) -> list[Scenario]:
        """The scenarios a one-scenario search takes in turn: the first `DRAWN_WORKLOADS`
        runs'."""
        return [self.workload(k) for k in range(DRAWN_WORKLOADS)]


@dataclass(frozen=True)
class ShortPathDraw(WorkloadDraw):
    """A `WorkloadDraw`, then that run's ``short_context`` drawn over its own workload's decode
    contexts (`ShortContextDraw`): which step meets the boundary and which of its rows is the
    longest are both searched."""

    def __call__(self, index: int) -> Scenario:
        return ShortContextDraw(self.workload(index), self.seed)(index)

    def members(self) -> list[Scenario]:
        """Each of the first `DRAWN_WORKLOADS` runs' workloads at every ``short_context`` its
        draw allows."""
        return [m for k in range(DRAWN_WORKLOADS)
                for m in ShortContextDraw(self.workload(k), self.seed).members()]
