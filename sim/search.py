"""Search over schedules: seeded random walk, PCT, bounded exhaustive, and Hypothesis.

Every strategy returns a `SearchResult` with the same statistics (schedules, actions, unique
states where hashed, depth, seconds, failing share), so `lockstep check` and the benchmarks read
them alike. Exhaustive search is stateless re-execution from choice prefixes (as CHESS and
shuttle do) with a visited set of world fingerprints: BFS would find the shortest path but needs
a copy of every frontier world; DFS with re-execution keeps one world and pays O(depth) per
backtrack. Symmetry: ranks 1..n-1 are interchangeable unless a fault or a memory overhead names
one of them; rank 0 never is (it samples and carries the payload).
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from lockstep.args import SEED_LIMIT, one_line_repr
from protocol.errors import ConfigError
from sim.guard import tick, watchdog
from sim.run import RunResult, check_scenario, check_variant_arg, collector_off, run_schedule
from sim.scenario import Scenario, is_integer, is_real
from sim.strategies import PCT, Drawn, NondeterminismError, RandomWalk
from sim.world import World


@dataclass
class SearchStats:
    """What a search did.

    Attributes:
        schedules: complete runs (each ended in a verdict).
        actions: actions taken over all runs (states visited, with repeats).
        unique_states: distinct world fingerprints (exhaustive search only; else 0).
        max_depth: most actions in one run.
        seconds: wall time.
        failing: runs whose verdict was not acceptable.
        verdicts: verdict -> count.
        reached: event -> count over all runs (graph replays, live-slot moves, faults fired).
        complete: True if an exhaustive search settled its verdict: it covered every
            reachable state, or it stopped at its first failure (``stop_on_failure``), whose
            verdict no further state can change.
        scenarios: scenarios searched one at a time (exhaustive or Hypothesis search over
            every member of a drawn or faulted family, each with its own budget of
            schedules); 0 for a sample search, which draws a scenario per run.
    """

    schedules: int = 0
    actions: int = 0
    unique_states: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    failing: int = 0
    verdicts: Counter = field(default_factory=Counter)
    reached: Counter = field(default_factory=Counter)
    complete: bool = False
    hashed: bool = False
    budget_reached: bool = False
    scenarios: int = 0

    def add(self, result: RunResult, ok: bool) -> None:
        if result.outcome.verdict == "budget":
            self.budget_reached = True
            self.actions += result.actions
            return
        self.schedules += 1
        self.actions += result.actions
        self.max_depth = max(self.max_depth, result.actions)
        self.verdicts[result.outcome.verdict] += 1
        self.reached.update({k: v for k, v in result.reached.items() if v})
        if not ok:
            self.failing += 1

    @property
    def hashed_states(self) -> str:
        """What a hashed (exhaustive) search explored, for budget notes: its distinct states
        beside the visited ones, the check table's ``states`` column."""
        return f"{self.unique_states} distinct states ({self.actions} visited, the table's states)"

    @property
    def failing_percent(self) -> float:
        return 100.0 * self.failing / self.schedules if self.schedules else 0.0

    def line(self) -> str:
        """One reporter line (as stateright prints): schedules, states, unique, depth, seconds."""
        rate = self.schedules / self.seconds if self.seconds else 0.0
        return (f"schedules={self.schedules} states={self.actions} unique={self.unique_states} "
                f"depth={self.max_depth} sec={self.seconds:.2f} sched/s={rate:.0f} "
                f"failing={self.failing_percent:.1f}%")


@dataclass
class SearchResult:
    """Statistics plus the first failing run (None if every run was acceptable)."""

    stats: SearchStats
    failure: RunResult | None = None


Acceptable = Callable[[RunResult], bool]


def is_bool(value) -> bool:
    """True for True and False, numpy's booleans included (type name ``bool`` in numpy 2,
    ``bool_`` in numpy 1)."""
    return isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")


def accepted(acceptable: Acceptable, result: RunResult) -> bool:
    """``acceptable(result)``, checked to be True or False.

    Raises:
        ConfigError: it returned anything else ("no" read as a pass), naming the value.
    """
    ok = acceptable(result)
    if ok is True or ok is False:
        return ok
    if is_bool(ok):
        return bool(ok)
    raise ConfigError(f"acceptable returned {one_line_repr(ok, 60)} for a run whose verdict "
                      f"is {result.outcome.verdict}: expected True or False")


def _tally(stats: SearchStats, result: RunResult, acceptable: Acceptable, progress) -> bool:
    """Count one finished run; returns whether it was acceptable (`accepted`)."""
    ok = accepted(acceptable, result)
    stats.add(result, ok)
    if progress:
        progress(1)
    return ok


def check_budget(time_budget, **counts) -> None:
    """Refuse a search budget that would let a search run nothing and pass, or never end: each
    of ``counts`` (schedules, states, workers, examples, seed) an integer (>= 1, but a seed
    one in [0, 2**64), `lockstep.args.SEED_LIMIT`, as ``--seed`` and `sim.check.CheckSpec`
    take: -1 drew the same schedules as 1, and 2**64 was taken only here), ``time_budget`` a
    finite number of seconds above 0 (NaN compared false with every deadline, so the search
    ran without one; 0 schedules read as "no failure").

    Raises:
        ConfigError: one line naming the argument and the value.
    """
    for name, value in counts.items():
        if name == "seed":
            if not is_integer(value) or not 0 <= value < SEED_LIMIT:
                raise ConfigError(f"seed = {one_line_repr(value, 60)}: expected an integer in "
                                  "[0, 2**64)")
        elif not is_integer(value) or value < 1:
            raise ConfigError(f"{name} = {one_line_repr(value, 60)}: expected an integer >= 1")
    if not is_real(time_budget) or not 0 < time_budget < math.inf:
        raise ConfigError(f"time_budget = {one_line_repr(time_budget, 60)}: expected a finite "
                          "number of seconds above 0")


def check_acceptable(acceptable) -> None:
    """Refuse an ``acceptable`` that cannot be called on a run's result.

    Raises:
        ConfigError: one line naming the value.
    """
    if not callable(acceptable) or isinstance(acceptable, type):
        raise ConfigError(f"acceptable = {one_line_repr(acceptable, 60)}: expected a function "
                          "of a RunResult returning True where the run passes, such as "
                          "sim.check.CLEAN_OR_ABORT")


def check_progress(progress) -> None:
    """Refuse a ``progress`` that is neither None nor a function of the runs finished (a tqdm
    bar's ``update``): 5 was taken, and the search failed after its first run with "'int'
    object is not callable" (a hostile user's trial).

    Raises:
        ConfigError: one line naming the value.
    """
    if progress is not None and (not callable(progress) or isinstance(progress, type)):
        raise ConfigError(f"progress = {one_line_repr(progress, 60)}: expected None or a "
                          "function called with the number of runs just finished (a tqdm "
                          "bar's update)")


def _check_scenario_for(scenario_for) -> None:
    if isinstance(scenario_for, Scenario) or not callable(scenario_for):
        raise ConfigError(f"scenario_for = {one_line_repr(scenario_for, 60)}: expected a "
                          "function of the run index returning a Scenario (lambda i: scenario "
                          "for one scenario in every run)")


def check_flags(**flags) -> None:
    """Refuse a search's switch (``stop_on_failure``, ``symmetry``, ``shrink``) that is not True
    or False: ``symmetry='no'`` read as true, and the search merged states it was asked to
    keep apart.

    Raises:
        ConfigError: one line naming the argument and the value.
    """
    for name, value in flags.items():
        if not is_bool(value):
            raise ConfigError(f"{name} = {one_line_repr(value)}: expected True or False")


PCT_STEPS = 2000
"""PCT's run length k (actions) where none was measured: about a default check's run."""


def _chooser(strategy: str, seed: int, index: int, run_length: int = PCT_STEPS):
    if strategy == "random":
        return RandomWalk(seed * 1_000_003 + index)
    if strategy == "pct":
        return PCT(seed * 1_000_003 + index, depth=2 + index % 3, max_steps=run_length)
    raise ValueError(f"unknown strategy {strategy!r}")


def run_length(scenario: Scenario, variant, strategy: str, seed: int) -> int:
    """PCT's k: the actions of one seeded random run of ``scenario`` (Burckhardt et al. take k
    from the program's run length; PCT_STEPS for other strategies). A fixed k placed every
    priority change point in the first PCT_STEPS actions, so at 3 ranks and 256 buckets, where
    a run is about 7,600 actions, no schedule could delay the end of startup and
    ``kv-zero-unordered`` read clean (a fresh helper's finding)."""
    if strategy != "pct":
        return PCT_STEPS
    with collector_off():
        result = run_schedule(scenario, variant, RandomWalk(seed))
    result.world.dispose()
    return max(1, result.actions)


def sample_search(scenario_for: Callable[[int], Scenario], variant, acceptable: Acceptable,
                  strategy: str = "random", schedules: int = 1000, time_budget: float = 60.0,
                  seed: int = 0, stop_on_failure: bool = True, progress=None,
                  jobs: int = 1) -> SearchResult:
    """Random-walk or PCT search: ``schedules`` runs, each from its own derived seed.

    Args:
        scenario_for: run index -> scenario (lets fault searches vary the fault per run).
        acceptable: which results pass; the first that does not is the failure.
        progress: optional callable(n) called after each run (a tqdm ``update``).
        jobs: worker processes (`sim.workers.WorkerPool`); run i has the same seed whatever
            ``jobs`` is, and with ``stop_on_failure`` the reported failure is the lowest-indexed
            failing run whatever ``jobs`` is. A job that cannot be pickled (a variant or
            scenario function defined in a closure) runs serially.
    Raises:
        ConfigError: a budget `check_budget` refuses, a strategy other than random or pct,
            a ``stop_on_failure`` other than True or False (`check_flags`), a ``progress``
            that is neither None nor a function (`check_progress`), a ``scenario_for`` that is
            no function (a Scenario, say), a ``variant`` that is no Variant, or an
            ``acceptable`` that cannot be called.
        sim.strategies.NondeterminismError: a run that failed in a worker process passed when
            run again in this one (the variant's code keeps state between runs).
    """
    check_budget(time_budget, schedules=schedules, jobs=jobs, seed=seed)
    seed = int(seed)  # a numpy seed overflowed in _chooser's arithmetic: another search
    check_flags(stop_on_failure=stop_on_failure)
    check_progress(progress)
    _check_scenario_for(scenario_for)
    check_variant_arg(variant)
    check_acceptable(acceptable)
    if strategy not in ("random", "pct"):
        raise ConfigError(f"strategy = {strategy!r}: expected 'random' or 'pct' (exhaustive "
                          "and Hypothesis search are exhaustive_search and hypothesis_search)")
    start = time.perf_counter()
    deadline = start + time_budget
    stats = SearchStats()
    parallel = jobs > 1 and schedules >= 4 * jobs
    steps = run_length(scenario_for(0), variant, strategy, seed)
    # Probe serially first: a variant that fails at once needs no worker processes.
    failure = _serial_runs(scenario_for, variant, acceptable, strategy, seed, 0,
                           PROBE if parallel else schedules, deadline, stop_on_failure, progress,
                           stats, steps)
    done = min(PROBE, schedules) if parallel else schedules
    more = not stats.budget_reached and not (failure is not None and stop_on_failure)
    if more and done < schedules:
        pooled = _parallel_sample_search(scenario_for, variant, acceptable, strategy, seed, done,
                                         schedules, deadline, stop_on_failure, progress, jobs,
                                         steps)
        if pooled is None:  # not picklable: carry on serially
            pooled_failure = _serial_runs(scenario_for, variant, acceptable, strategy, seed, done,
                                          schedules, deadline, stop_on_failure, progress, stats,
                                          steps)
        else:
            pooled_failure = pooled.failure
            _merge(stats, pooled.stats)
        failure = failure or pooled_failure
    stats.seconds = time.perf_counter() - start
    return SearchResult(stats, failure)


PROBE = 4
"""Runs a parallel sample search makes in-process before it starts worker processes."""


def _serial_runs(scenario_for, variant, acceptable, strategy, seed, lo, hi, deadline,
                 stop_on_failure, progress, stats: SearchStats,
                 steps: int = PCT_STEPS) -> RunResult | None:
    """Runs [lo, hi) in this process, tallied into ``stats``; returns the first failing one."""
    failure = None
    with collector_off() as ran:
        for i in range(lo, hi):
            result = run_schedule(scenario_for(i), variant, _chooser(strategy, seed, i, steps),
                                  deadline=deadline)
            if result.outcome.verdict == "budget":
                stats.add(result, True)
                break
            ok = _tally(stats, result, acceptable, progress)
            if not ok and failure is None:
                failure = result
                if stop_on_failure:
                    break
            else:
                result.world.dispose()
            ran()
            if time.perf_counter() > deadline:
                stats.budget_reached = i + 1 < hi
                break
    return failure


def exhaustive_search(scenario: Scenario, variant, acceptable: Acceptable,
                      time_budget: float = 60.0, max_states: int = 5_000_000,
                      stop_on_failure: bool = True, progress=None,
                      symmetry: bool = True) -> SearchResult:
    """Depth-first search over every interleaving, pruning states already visited.

    A state is the world's fingerprint (controller, workers, hosts, streams, locks, memory,
    clock); two schedules reaching one fingerprint have the same futures, so only the first is
    expanded. ``stats.complete`` is True when the frontier emptied within the budget, or when
    the search stopped at a failure (``stop_on_failure``: the verdict is settled). With
    ``symmetry`` (and only where `World.symmetry_is_sound`), states that differ by a
    permutation of ranks 1..n-1 count as one.

    Raises:
        ConfigError: a budget `check_budget` refuses, a ``stop_on_failure`` or ``symmetry``
            other than True or False (`check_flags`), a ``progress`` that is neither None nor
            a function (`check_progress`), a ``scenario`` that is no Scenario (a
            function of the run index, say), a ``variant`` that is no Variant, or an
            ``acceptable`` that cannot be called.
    """
    check_budget(time_budget, max_states=max_states)
    check_flags(stop_on_failure=stop_on_failure, symmetry=symmetry)
    check_progress(progress)
    check_scenario(scenario)
    check_variant_arg(variant)
    check_acceptable(acceptable)
    stats = SearchStats()
    start = time.perf_counter()
    visited: set = set()
    # a prefix: the actors chosen, and how many times the world settled (advanced its clock)
    # before each, so that re-executing it needs no readiness probe per action
    stack: list[tuple[list[str], list[int]]] = [([], [])]
    failure = None
    while stack:
        if time.perf_counter() - start > time_budget or len(visited) > max_states:
            break
        prefix, settled = stack.pop()
        world = World(scenario, variant)
        for actor, settles in zip(prefix, settled):
            for _ in range(settles):
                world.settle()
            world.step(actor)
            tick()
        path, settled = list(prefix), list(settled)
        settles = 0
        symmetric = symmetry and world.symmetry_is_sound()
        while world.outcome is None:
            enabled = world.enabled()
            if not enabled:
                world.settle()
                settles += 1
                continue
            if len(enabled) > 1:
                fp = world.fingerprint(symmetric)
                if fp in visited:
                    break
                visited.add(fp)
                for actor in enabled[1:]:
                    stack.append((path + [actor], settled + [settles]))
            path.append(enabled[0])
            settled.append(settles)
            settles = 0
            world.step(enabled[0])
            tick()
        else:
            result = RunResult(world.outcome, path, world.actions, dict(world.events), world)
            ok = _tally(stats, result, acceptable, progress)
            if not ok and failure is None:
                failure = result
                if stop_on_failure:
                    break
            continue
        stats.actions += world.actions
    stats.unique_states = len(visited)
    stats.hashed = True
    stats.complete = not stack or (failure is not None and stop_on_failure)
    stats.budget_reached = bool(stack) and failure is None
    stats.seconds = time.perf_counter() - start
    return SearchResult(stats, failure)


class _BudgetSpent(BaseException):
    """Raised out of a Hypothesis search whose time budget is spent: a BaseException, so that
    Hypothesis does not take it for a failing example and shrink it."""


@contextmanager
def _interrupted_after(seconds: float):
    """Raise `_BudgetSpent` in this thread once ``seconds`` of wall time have passed inside
    the block, wherever it is. Hypothesis's shrinker orders the choices of a long schedule
    (thousands of draws) for minutes without calling the test function, so a budget checked
    between runs does not end it: unfenced-preempt-store's row took 151 s of a 60 s budget,
    471 runs taking 27 s of it. The exception is delivered only while the block runs, and
    again every `REDELIVER_S` until the block ends: one that lands in a gc callback (Hypothesis
    registers one) is lost, and the search ran on. While the block runs such a lost delivery
    is not printed either (`_quiet_budget_hook`): it reached a user as an "Exception ignored"
    traceback."""
    thread, lock, live = threading.get_ident(), threading.Lock(), [True]
    timers = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_budget_hook(previous_hook)

    def interrupt():
        with lock:
            if live[0]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                           ctypes.py_object(_BudgetSpent))
                arm(REDELIVER_S)

    def arm(delay: float) -> None:
        timer = threading.Timer(delay, interrupt)
        timer.daemon = True
        timers.append(timer)
        timer.start()

    arm(max(0.0, seconds))
    try:
        yield
    finally:
        with lock:  # a call that lands in here is delivered here, inside the caller's `try`
            live[0] = False
        for timer in timers:
            timer.cancel()
        sys.unraisablehook = previous_hook


def _quiet_budget_hook(previous: Callable) -> Callable:
    """A `sys.unraisablehook` that drops a `_BudgetSpent` delivered where Python cannot raise
    it (a gc or weakref callback; `_interrupted_after` delivers it again) and hands anything
    else to ``previous``."""
    def hook(unraisable) -> None:
        if unraisable.exc_type is _BudgetSpent:
            return
        previous(unraisable)
    return hook


REDELIVER_S = 0.5
"""Seconds between deliveries of a spent budget's `_BudgetSpent` until the search ends."""


def hypothesis_search(scenario: Scenario, variant, acceptable: Acceptable, max_examples: int = 200,
                      seed: int = 0, shrink: bool = True, time_budget: float = 60.0) -> SearchResult:
    """Schedules drawn by Hypothesis; on failure its shrinker minimises the choice sequence.

    Each scheduling choice is one ``data.draw`` of an index into the enabled actors, so
    shrinking towards zero prefers the first enabled actor -- fewer context switches. The
    search, shrinking included, ends when ``time_budget`` seconds are spent (`_interrupted_after`);
    the shortest failure found by then is the result.

    Raises:
        ConfigError: a budget `check_budget` refuses, a ``shrink`` other than True or False
            (`check_flags`), a ``scenario`` that is no Scenario, a ``variant`` that is no
            Variant, or an ``acceptable`` that cannot be called.
    """
    from sim.guard import paused, resumed

    check_budget(time_budget, max_examples=max_examples, seed=seed)
    seed = int(seed)
    check_flags(shrink=shrink)
    check_scenario(scenario)
    check_variant_arg(variant)
    check_acceptable(acceptable)
    with paused():  # a slow import is not a stalled hook
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hseed
        from hypothesis import strategies as st

    stats = SearchStats()
    start = time.perf_counter()
    failures: list[RunResult] = []

    phases = (Phase.generate, Phase.shrink) if shrink else (Phase.generate,)

    @hseed(seed)
    @settings(max_examples=max_examples, database=None, deadline=None, phases=phases,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(st.data())
    def prop(data):
        if time.perf_counter() - start > time_budget:
            raise _BudgetSpent
        chooser = Drawn(lambda n: data.draw(st.integers(0, n - 1)))
        with resumed():  # the simulator's run is watched; Hypothesis's own work is not
            result = run_schedule(scenario, variant, chooser)
        ok = accepted(acceptable, result)
        if not ok:  # kept before it is counted: the budget's interrupt may come in between
            failures.append(result)
        stats.add(result, ok)
        if not ok:
            raise AssertionError(result.outcome.verdict)

    left = time_budget - (time.perf_counter() - start)
    try:
        with paused(), _interrupted_after(left):
            prop()
    except AssertionError:
        pass
    except _BudgetSpent:
        stats.budget_reached = True
    except Exception:
        # the budget ended the search (`prop`'s check or the interrupt) inside Hypothesis's own
        # bookkeeping, whose clean-up then failed (an IndexError from its span stack, or a
        # replay that drew otherwise): the search is incomplete, not the variant in error
        if time.perf_counter() - start < time_budget:
            raise
        stats.budget_reached = True
    stats.seconds = time.perf_counter() - start
    if not failures:
        return SearchResult(stats, None)
    best = min(failures, key=lambda r: (r.actions, len(r.choices)))
    return SearchResult(stats, best)


CHUNK = 25
"""Schedules per task handed to a worker process."""


@dataclass(frozen=True)
class _SampleJob:
    """What every chunk of a parallel sample search shares (pickled once per worker)."""

    scenario_for: Callable[[int], Scenario]
    variant: object
    acceptable: Acceptable
    strategy: str
    seed: int
    stop: bool
    steps: int = PCT_STEPS


def _run_chunk(job: _SampleJob, bounds: tuple[int, int], deadline: float):
    """Worker side: run schedules [lo, hi); return their stats and the first failing index."""
    with watchdog():
        return _chunk(job, bounds, deadline)


def _chunk(job: _SampleJob, bounds: tuple[int, int], deadline: float):
    lo, hi = bounds
    stats = SearchStats()
    first = None
    with collector_off() as ran:
        for i in range(lo, hi):
            result = run_schedule(job.scenario_for(i), job.variant,
                                  _chooser(job.strategy, job.seed, i, job.steps),
                                  deadline=deadline)
            if result.outcome.verdict == "budget":
                stats.add(result, True)
                break
            ok = accepted(job.acceptable, result)
            stats.add(result, ok)
            result.world.dispose()  # only the index of a failure goes back
            ran()
            if not ok:
                first = i if first is None else first
                if job.stop:
                    break
    return stats, first


def _merge(total: SearchStats, stats: SearchStats) -> None:
    total.schedules += stats.schedules
    total.actions += stats.actions
    total.max_depth = max(total.max_depth, stats.max_depth)
    total.failing += stats.failing
    total.verdicts.update(stats.verdicts)
    total.reached.update(stats.reached)
    total.budget_reached |= stats.budget_reached


def _parallel_sample_search(scenario_for, variant, acceptable, strategy, seed, lo, hi, deadline,
                            stop_on_failure, progress, jobs,
                            steps: int = PCT_STEPS) -> SearchResult | None:
    """Runs [lo, hi) in chunks on a `WorkerPool`; None if the job cannot be sent to workers.

    On a failure in chunk k, no chunk after k is handed out and the workers running one are
    killed, while chunks before k finish: the reported failure is then the lowest-indexed
    failing run whatever ``jobs`` is. With ``stop_on_failure`` the statistics are those of the
    chunks up to and including the first failing one in chunk order -- each run up to that
    failure, as a serial search counts them -- so they do not depend on ``jobs`` either: a
    chunk after it that finished first (its worker was faster) is work the search did, not
    part of its result. ``progress`` counts the same chunks: with ``stop_on_failure`` a chunk
    is counted once every chunk before it has finished, since until then an earlier one may
    still fail (the bar waits for the oldest unfinished chunk, and counts the chunks that
    finished after it when it does).
    """
    from sim.workers import JobNotPicklable, WorkerPool

    start = time.perf_counter()
    job = _SampleJob(scenario_for, variant, acceptable, strategy, seed, stop_on_failure, steps)
    total = SearchStats()
    finished: dict[int, tuple[SearchStats, int | None]] = {}  # chunk position -> (stats, first)
    cut = None  # with stop_on_failure: the position of the first failing chunk found so far
    shown = 0  # with stop_on_failure: chunks [0, shown) have finished and are counted
    chunks = [(a, min(a + CHUNK, hi)) for a in range(lo, hi, CHUNK)]
    try:
        pool = WorkerPool(_run_chunk, job, jobs, deadline)
    except JobNotPicklable:
        return None
    with pool:
        for position, _, (stats, first) in pool.results(chunks):
            finished[position] = (stats, first)
            if first is not None and stop_on_failure:
                cut = position if cut is None else min(cut, position)
                pool.cancel_after(position)
            if progress and not stop_on_failure:  # every chunk that finishes is merged
                progress(stats.schedules)
            elif progress:  # merged for sure once every chunk before it has finished
                while shown in finished and (cut is None or shown <= cut):
                    progress(finished[shown][0].schedules)
                    shown += 1
            if time.perf_counter() > deadline or stats.budget_reached:
                pool.drain()
    merged = sorted(p for p in finished if cut is None or p <= cut)
    for position in merged:
        _merge(total, finished[position][0])
        if progress and stop_on_failure and position >= shown:
            progress(finished[position][0].schedules)
    failures = [finished[p][1] for p in merged if finished[p][1] is not None]
    total.budget_reached |= total.schedules < hi - lo and not (failures and stop_on_failure)
    total.seconds = time.perf_counter() - start
    failure = None
    if failures:
        i = min(failures)
        failure = run_schedule(scenario_for(i), variant, _chooser(strategy, seed, i, steps))
        if acceptable(failure):  # a fresh user's variant kept state in a class attribute
            raise NondeterminismError(
                f"variant {variant.name!r}: run {i} failed in a worker process and passed when "
                "run again in this one: the variant's code does not behave the same on every "
                "run of a schedule (state kept between runs, such as a class attribute or a "
                "module global?)")
    return SearchResult(total, failure)
