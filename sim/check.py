"""`lockstep check` as a library: check variants under topologies and collect verdict rows.

The correct protocol must be clean under every explored schedule, must fail loudly and globally
(verdict ``abort``) under injected faults, and must reach the interesting events (a graph
replayed in serving, a live slot moved by compaction, a fault fired) so that a vacuous model
cannot pass. Each bad variant must be caught with its expected verdict; its first failing
schedule is reduced to a minimal one.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from lockstep.args import MAX_DIGITS, clipped, one_line_repr
from protocol.errors import ConfigError
from sim.common import INVARIANTS, OUTCOME_VERDICTS, fault_phase_event
from sim.checks import attribute_divergence
from sim.guard import Stalled, describe, locate, watchdog
from sim.limits import MAX_BUCKET, MIN_RANKS
from sim.hazards import HazardModel
from sim.headroom import HeadroomDraw, largest_headroom, refusal_expected
from sim.reduce import reduce_schedule
from sim.run import RunResult, run_schedule
from sim.scenario import Fault, Scenario, default_scenario, is_integer
from sim.faults import FaultSearch
from sim.search import (SearchResult, SearchStats, check_budget, exhaustive_search,
                        hypothesis_search, sample_search)
from sim.strategies import STRATEGIES, NondeterminismError, Replay
from sim.variants import EVENT_REACH, Variant, get_variant

from sim.world import ACTOR as _ACTOR


TRACE_REDUCE_ATTEMPTS = 40
"""Reducer attempts per counterexample when the traces are written for reading (`lockstep check
--trace-out`, the walkthroughs of `lockstep docs`): one count for both, so a walkthrough's
Reproduce command writes the story on its page. The table alone spends `CheckSpec`'s fewer."""


@dataclass(frozen=True)
class CheckSpec:
    """What `lockstep check` explores for each variant (all of it serialisable to JSON).

    Each field takes what its `lockstep check` option takes (`sim.cli`), checked when the spec
    is made (`__post_init__`), before anything runs: ``ranks`` 2 to 64, ``buckets`` and
    ``max_batch`` as ``--buckets`` and ``--max-batch`` take them (`check_scenario_value`),
    ``strategy`` None or one of `sim.strategies.STRATEGIES`, ``schedules`` and
    ``clean_schedules`` (or None) and ``jobs`` integers >= 1, ``fault_schedules`` an integer
    >= 0 (0: no faulted row), each at most its `sim.limits` bound, ``time_budget`` a finite
    number of seconds above 0 and at most a day, ``seed`` an integer in [0, 2**64),
    ``hazards_off`` hazard rule names (``h1`` ... ``h9``, each once), ``h2_scope`` and
    ``h2_calls`` one of theirs; ``reduce_attempts``, which no option sets, an integer >= 0. The
    integer fields take numpy's integers too, kept as ints; ``buckets`` takes plain ints, as
    ``--buckets`` does, and ``hazards_off`` a list or tuple of names.

    Raises:
        ConfigError: one line naming the first field refused and its value, or the fields that
            do not go together (`scenario`: a max_batch past the largest bucket, say).
    """

    ranks: int = 2
    buckets: tuple[int, ...] | None = None
    max_batch: int | None = None
    strategy: str | None = None
    schedules: int = 300
    fault_schedules: int = 100
    clean_schedules: int | None = None
    """Fault-free schedules of a protocol expected clean (None: ``schedules``). `lockstep check`
    without ``--schedules`` runs fewer of these than a bad variant's search may take (which
    stops at its first failure); see docs/simulator-figures.md."""
    time_budget: float = 60.0
    seed: int = 0
    hazards_off: tuple[str, ...] = ()
    jobs: int = 1
    reduce_attempts: int = 8
    """Attempts the reducer may spend on each counterexample (`sim.reduce.reduce_schedule`; a
    candidate it already ran counts again but is not run again): a count, not seconds, so
    that a row's minimal trace does not depend on machine speed or load. `lockstep check
    --trace-out` spends `TRACE_REDUCE_ATTEMPTS`, as the walkthroughs do."""
    h2_scope: str = "process"
    h2_calls: str = "both"

    def __post_init__(self) -> None:
        """Refuses a field its `lockstep check` option would refuse (the class docstring):
        built directly, ``schedules=0`` gave an ``incomplete`` row "after 0 of -1 schedules"
        and ``fault_schedules=-1`` dropped the faulted row without a word (a review's
        findings), where the command line refuses both before a spec is made."""
        from sim.limits import check_limits

        for name in ("ranks", "max_batch", "schedules", "clean_schedules", "fault_schedules",
                     "seed", "jobs", "reduce_attempts"):
            if is_integer(getattr(self, name)):  # numpy's too, kept as a plain int (for JSON)
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("ranks", "buckets", "max_batch", "hazards_off", "h2_scope", "h2_calls"):
            value = getattr(self, name)
            if value is None and name in ("buckets", "max_batch"):
                continue
            try:  # the rule of the option, so a spec holds what the command line would take
                object.__setattr__(self, name, check_scenario_value(name, value))
            except ConfigError as exc:
                raise ConfigError(f"{name} = {one_line_repr(value)}: {exc}") from None
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy = {one_line_repr(self.strategy)}: expected None or one "
                              f"of {', '.join(STRATEGIES)}")
        counts = dict(schedules=self.schedules, jobs=self.jobs)
        if self.clean_schedules is not None:
            counts["clean_schedules"] = self.clean_schedules
        check_budget(self.time_budget, **counts)
        for name, least in (("fault_schedules", 0), ("reduce_attempts", 0)):
            value = getattr(self, name)
            if not is_integer(value) or value < least:
                raise ConfigError(f"{name} = {one_line_repr(value)}: expected an integer >= "
                                  f"{least}")
        check_budget(self.time_budget, seed=self.seed)  # the searches' rule: [0, 2**64)
        check_limits(schedules=self.schedules, fault_schedules=self.fault_schedules,
                     jobs=self.jobs, time_budget=self.time_budget)
        if self.clean_schedules is not None:
            try:  # check_limits names its bound "schedules"; this field is another
                check_limits(schedules=self.clean_schedules)
            except ConfigError as exc:
                raise ConfigError(f"clean_schedules = {self.clean_schedules}: {exc}") from None
        # the fields together (max_batch past the largest bucket, a bucket set the model cannot
        # hold): a variant author's spec was taken, and every row blamed the variant instead
        self.scenario("shared")

    def strategy_for(self, variant) -> str:
        """The search strategy for ``variant``: the one asked for, else the variant's own
        (`Variant.strategy`, for a bug that needs a rare interleaving), else random."""
        return self.strategy or getattr(variant, "strategy", None) or "random"

    def scenario(self, topology: str) -> Scenario:
        """The base scenario; raises ConfigError for a configuration the model cannot hold
        (each field's own range and `sim.limits` bound were checked when the spec was made)."""
        kwargs = {}
        if self.buckets is not None:
            kwargs["buckets"] = self.buckets
        sc = default_scenario(topology=topology, world_size=self.ranks, max_batch=self.max_batch, **kwargs)
        if self.hazards_off or self.h2_scope != "process" or self.h2_calls != "both":
            try:
                sc = sc.with_(hazards=HazardModel(h2_scope=self.h2_scope, h2_calls=self.h2_calls)
                              .without(*self.hazards_off))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        mem, cfg = sc.memory, sc.config
        largest = max(b for b in cfg.buckets if b <= max(cfg.buckets))
        need = (mem.weights + largest * mem.activation_per_row
                + mem.graph_set_bytes(b for b in cfg.buckets if b <= cfg.max_batch)
                + (sc.pages_per_seq + 1) * cfg.kv_page_bytes)  # pages on demand: one sequence (I14)
        if need > mem.capacity:
            raise ConfigError(f"buckets up to {largest} need {need / 2**30:.0f} GiB per rank in the "
                              f"modelled memory, more than its {mem.capacity / 2**30:.0f} GiB; "
                              "use smaller buckets", fields=("buckets",))
        return sc

    @property
    def planned_clean(self) -> int:
        """Fault-free schedules a protocol expected clean gets."""
        return self.schedules if self.clean_schedules is None else self.clean_schedules

    def to_json(self) -> dict:
        return {"ranks": self.ranks, "buckets": list(self.buckets) if self.buckets else None,
                "max_batch": self.max_batch, "hazards_off": list(self.hazards_off),
                "h2_scope": self.h2_scope, "h2_calls": self.h2_calls}


@dataclass
class Row:
    """One line of the verdict table."""

    variant: str
    topology: str
    expected: str
    got: str
    stats: SearchStats
    detail: str = ""
    minimal: RunResult | None = None
    scenario: Scenario | None = None
    passed: bool = False
    notes: list[str] = field(default_factory=list)
    compared: bool = True
    missing: tuple[str, ...] = ()
    """For a vacuous clean row, the events its search never reached."""
    report: str = "same"
    """For a row reported, not compared (another model than the full one): ``"same"`` verdict
    as the full model's expected one, ``"other harm"`` (one the full model's check passes too,
    `catches`), or ``"differs"``; set by the CLI's report."""

    @property
    def minimal_length(self) -> int | None:
        return self.minimal.actions if self.minimal else None


def verdict_label(result: RunResult) -> str:
    """``deadlock``, ``invariant:I6`` ... as in `Variant.expected`."""
    outcome = result.outcome
    return f"invariant:{outcome.invariant}" if outcome.verdict == "invariant" else outcome.verdict


NOT_REACHABLE = "not reachable here"
"""Verdict of a bad variant whose bug this configuration cannot reach (with the reason)."""


def _search(spec: CheckSpec, scenario_for, variant, acceptable, schedules, progress, stop=True):
    """Search ``variant`` over ``scenario_for`` with ``spec``'s strategy for it, in
    ``spec.time_budget`` seconds, stopping at the first failure when ``stop``.

    A sample search (random, PCT) runs ``schedules`` runs, each under the scenario its index
    draws. A search of one scenario at a time (exhaustive, Hypothesis) takes every member of a
    fault search or of a drawn family in turn (`_members`; a family drawn per run would
    otherwise be searched at its run 0 alone), and the time budget is the row's, spent in
    turn. Hypothesis's ``schedules`` are the row's too, as a sample search's are, shared
    evenly among the members (`schedule_shares`: at least one each, so no member goes
    unsearched): with ``schedules`` for each member, a row with many members planned many times
    its schedules, and ``correct-short-path`` (38 members at the default configuration, 20
    schedules) ran out of the 60 s budget after 31 of them, incomplete. Exhaustive search
    covers each member's every schedule and takes no count.
    """
    strategy = spec.strategy_for(variant)
    if strategy in ("exhaustive", "hypothesis"):
        scenarios = _members(scenario_for)
        shares = schedule_shares(schedules, len(scenarios))
        start, total, result, complete = time.perf_counter(), SearchStats(), None, True
        for scenario, share in zip(scenarios, shares):
            left = spec.time_budget - (time.perf_counter() - start)
            if left <= 0:
                total.budget_reached = True
                break
            if strategy == "exhaustive":
                result = exhaustive_search(scenario, variant, acceptable, left,
                                           stop_on_failure=stop, progress=progress)
            else:
                result = hypothesis_search(scenario, variant, acceptable,
                                           max_examples=share, seed=spec.seed, time_budget=left)
            _accumulate(total, result.stats)
            total.scenarios += 1
            complete &= result.stats.complete
            if result.failure is not None and stop:
                break
        total.complete = complete and not total.budget_reached
        total.seconds = time.perf_counter() - start
        return SearchResult(total, result.failure if result else None)
    return sample_search(scenario_for, variant, acceptable, strategy, schedules,
                         spec.time_budget, spec.seed, stop_on_failure=stop, progress=progress,
                         jobs=spec.jobs)


def schedule_shares(schedules: int, members: int) -> list[int]:
    """``schedules`` shared evenly among ``members`` scenarios searched one at a time, in
    member order (the first ``schedules % members`` get one more), and at least one each: a
    member with no schedule would be a scenario the row claims and never ran."""
    base, extra = divmod(schedules, members) if members else (0, 0)
    return [max(1, base + (k < extra)) for k in range(members)]


def _accumulate(total: SearchStats, stats: SearchStats) -> None:
    for name in ("schedules", "actions", "unique_states", "failing"):
        setattr(total, name, getattr(total, name) + getattr(stats, name))
    total.max_depth = max(total.max_depth, stats.max_depth)
    total.verdicts.update(stats.verdicts)
    total.reached.update(stats.reached)
    total.hashed |= stats.hashed
    total.budget_reached |= stats.budget_reached


def random_fault(scenario: Scenario, index: int, seed: int) -> Fault:
    """A fault for run ``index`` on any op site of the whole run (`sim.faults.random_fault`)."""
    from sim.faults import random_fault as draw
    return draw(scenario, index, seed)


@dataclass(frozen=True)
class Fixed:
    """Run index -> the same scenario (picklable, for worker processes)."""

    scenario: Scenario

    def __call__(self, index: int) -> Scenario:
        return self.scenario


@dataclass(frozen=True)
class WithRandomFault:
    """Run index -> that run's scenario with `random_fault` for that index, drawn over that
    scenario's op sites (picklable). The run's scenario is ``drawn``'s for the index (a
    variant's per-run draw, `scenario_family`), else ``base``."""

    base: Scenario
    seed: int
    drawn: Callable[[int], Scenario] | None = None

    def __call__(self, index: int) -> Scenario:
        scenario = self.base if self.drawn is None else self.drawn(index)
        return scenario.with_(faults=(random_fault(scenario, index, self.seed),))


@dataclass(frozen=True)
class VerdictIn:
    """Acceptable when the run's verdict is one of ``verdicts``, or is ``startup-refused`` in a
    scenario whose memory holds no plan with its headroom (`sim.headroom.refusal_expected`):
    refusing a configuration that cannot start is the protocol's right answer, and refusing
    one that can is not (picklable)."""

    verdicts: frozenset[str]

    def __call__(self, result: RunResult) -> bool:
        verdict = result.outcome.verdict
        if verdict in self.verdicts:
            return True
        return (verdict == "startup-refused" and result.world is not None
                and refusal_expected(result.world.scenario))


DRAWN_MEMBERS = 8
"""Draws of a family without `members` that a one-scenario search (exhaustive, hypothesis)
takes in turn: runs 0..7."""


def _members(scenario_for) -> list[Scenario]:
    """The scenarios a one-scenario search (exhaustive, hypothesis) takes in turn: a fault
    search's members, a drawn family's ``members()`` (`sim.scenario.ShortContextDraw`: every
    value it draws from) or its first DRAWN_MEMBERS draws, distinct, or the one scenario of a
    fixed family."""
    if isinstance(scenario_for, FaultSearch):
        return [scenario_for(i) for i in range(len(scenario_for))]
    if isinstance(scenario_for, Fixed):
        return [scenario_for(0)]
    members = getattr(scenario_for, "members", None)
    drawn = members() if members is not None else [scenario_for(i) for i in range(DRAWN_MEMBERS)]
    return list(dict.fromkeys(drawn))


def scenario_family(variant: Variant, base: Scenario, seed: int):
    """Run index -> scenario of ``variant``'s fault-free search: its per-run draw over ``base``
    (`Variant.draw`), else ``base`` for every run (picklable either way).

    Raises:
        ConfigError: the draw is not a function of the run index, or gave something other
            than a Scenario for run 0 (a user's variant is named, not traced into the search).
    """
    if variant.draw is None:
        return Fixed(base)
    family = variant.draw(base, seed)
    first = family(0) if callable(family) else None
    if not isinstance(first, Scenario):
        raise ConfigError(f"variant {variant.name!r}: draw(scenario, seed) gave "
                          f"{one_line_repr(family, 80)}, whose run 0 is not a Scenario (return a "
                          "function of the run index that returns a Scenario, as "
                          "sim.scenario.ShortContextDraw does)")
    return family


def faulted_family(family, base: Scenario, seed: int) -> WithRandomFault:
    """Run index -> scenario of a clean design's faulted row: run i under the scenario that
    fault-free run i of ``family`` (`scenario_family`) has, with a random fault drawn over its
    op sites, so a fault meets every boundary a per-run draw moves (`Variant.draw`), not only
    the undrawn ``base``'s."""
    return WithRandomFault(base, seed, None if isinstance(family, Fixed) else family)


CLEAN = VerdictIn(frozenset({"clean"}))
CLEAN_OR_ABORT = VerdictIn(frozenset({"clean", "abort"}))


def _unreachable(variant: Variant, scenario: Scenario) -> str | None:
    """Why ``scenario`` cannot reach what ``variant`` needs (its ``unreachable`` hook), or None.

    Raises:
        ConfigError: the hook returned something other than None or a non-empty string (a
            clean variant's row as a bad one's: a bad hook is an error, not a reason).
    """
    reason = variant.unreachable(scenario) if variant.unreachable else None
    if reason is not None and not (isinstance(reason, str) and reason):
        raise ConfigError(f"variant {variant.name!r}: unreachable returned "
                          f"{one_line_repr(reason, 80)}; expected None (reachable) or a non-empty "
                          "reason string")
    return reason


def check_correct(variant: Variant, spec: CheckSpec, topology: str, progress=None) -> list[Row]:
    """Rows for a protocol that must be clean, and fail loudly under faults."""
    base = variant.scenario(spec.scenario(topology))
    reason = unreachable_here(variant, spec, topology, base)
    if reason is not None:  # what the design exists for never happens in this configuration
        return [Row(variant.name, topology, "clean", NOT_REACHABLE, SearchStats(), reason, None,
                    base, True)]
    planned = spec.planned_clean
    family = scenario_family(variant, base, spec.seed)
    result = _search(spec, family, variant, CLEAN, planned, progress)
    rows = []
    stats = result.stats
    missing: list[str] = []
    if result.failure is not None:
        got, detail = verdict_label(result.failure), _wrong_refusal(result.failure)
        minimal = reduce_schedule(result.failure.world.scenario, variant, result.failure,
                                  max_attempts=spec.reduce_attempts)
        minimal = attribute_divergence(minimal.world.scenario, variant, minimal)
    elif stats.schedules == 0 or stats.budget_reached:
        got, detail, minimal = "incomplete", _incomplete(stats, planned), None
    else:
        # served without graphs, the decode steps the row must have run are eager ones
        decode = ("replay", "replays") if base.config.cuda_graphs else ("eager_decode",
                                                                        "eager decodes")
        beyond = {e: why for e in variant.reaches
                  if e in EVENT_REACH and (why := EVENT_REACH[e](base)) is not None}
        reaches = tuple(e for e in variant.reaches if e not in beyond)
        wanted = (decode[0], "compaction_moves_live") + reaches
        missing = [e for e in wanted if not stats.reached.get(e)]
        got = "vacuous" if missing else "clean"
        reached = ", ".join((decode[1], "live compactions") + reaches)
        refused = stats.verdicts.get("startup-refused", 0)
        detail = (f"never reached: {', '.join(missing)}{_refused(refused, '; ')}" if missing
                  else f"{stats.schedules - refused} schedules clean{_refused(refused, ', ')}; "
                       f"{reached} reached")
        detail += "".join(f"; {e} not reachable here: {why}" for e, why in beyond.items())
        minimal = None
    expected = variant.expected.get(topology, "clean")
    rows.append(Row(variant.name, topology, expected, got, stats, detail, minimal, base,
                    got == expected, missing=tuple(missing)))
    if has_faulted_row(variant, spec) and expected == "clean":
        fres = sample_search(faulted_family(family, base, spec.seed), variant, CLEAN_OR_ABORT,
                             "random", spec.fault_schedules, spec.time_budget, spec.seed,
                             progress=progress, jobs=spec.jobs)
        fstats = fres.stats
        if fres.failure is not None:
            got, detail = verdict_label(fres.failure), _wrong_refusal(fres.failure)
            minimal = reduce_schedule(fres.failure.world.scenario, variant, fres.failure,
                                      max_attempts=spec.reduce_attempts)
        elif fstats.schedules == 0 or fstats.budget_reached:
            got, detail, minimal = "incomplete", _incomplete(fstats, spec.fault_schedules), None
        elif not all(fstats.reached.get(fault_phase_event(p)) for p in ("sweep", "serving")):
            from sim.faults import fault_coverage
            got, minimal = "vacuous", None
            detail = "injected faults did not fire in both the sweep and serving: " + fault_coverage(fstats.reached)
        else:
            from sim.faults import fault_coverage
            got = "abort"
            detail = (f"{fstats.verdicts.get('abort', 0)} of {fstats.schedules} faulted runs "
                      "aborted loudly on every rank"
                      f"{_refused(fstats.verdicts.get('startup-refused', 0), '; ')}; the rest "
                      "finished clean; " + fault_coverage(fstats.reached))
            minimal = None
        rows.append(Row(f"{variant.name}+faults", topology, "abort", got, fstats, detail, minimal,
                        base, got == "abort"))
    return rows


def _wrong_refusal(failure: RunResult) -> str:
    """A clean row's failure detail; for a startup refusal (one the memory did not require,
    or `VerdictIn` would have passed it), what the memory would have held."""
    detail = failure.outcome.detail
    if failure.outcome.verdict != "startup-refused":
        return detail
    scenario = failure.world.scenario
    return (f"{detail}; yet the tightest rank holds the smallest plan beside up to "
            f"{largest_headroom(scenario)} bytes of headroom, and memory_headroom_bytes is "
            f"{scenario.config.memory_headroom_bytes}: the refusal is wrong")


def _refused(refused: int, before: str) -> str:
    """For a clean row's detail, ``before`` and how many of its runs were refused at startup
    where their memory holds no plan beside their headroom (`VerdictIn`), so that the row does
    not count them as served; "" when none was."""
    return (f"{before}{refused} refused at startup, as their memory requires (the tightest "
            "rank has no room for the smallest plan beside the headroom)" if refused else "")


def bad_search_setup(variant: Variant, spec: CheckSpec, topology: str,
                     scenario: Scenario | None = None):
    """(scenario_for, acceptable, reason) of a bad variant's search: run index -> scenario
    (with one member of the variant's fault search, if it names one), which verdicts pass, and
    why this configuration cannot reach the bug (None if it can).

    Raises:
        ConfigError: ``spec`` describes a configuration the model cannot hold.
    """
    if scenario is None:
        scenario = variant.scenario(spec.scenario(topology))
    reason = _unreachable(variant, scenario)
    scenario_for, acceptable = scenario_family(variant, scenario, spec.seed), CLEAN
    if reason is None and variant.fault_search is not None:
        faults = variant.fault_search.members(scenario, variant, spec.seed)
        if not faults:
            reason = (f"no run here calls {variant.fault_search.describe()}, where the bug needs "
                      "a fault")
        # a loud abort is the right answer to a fault; the bug is anything else
        scenario_for, acceptable = FaultSearch(scenario, faults, spec.seed), CLEAN_OR_ABORT
    return scenario_for, acceptable, reason


def unreachable_here(variant: Variant, spec: CheckSpec, topology: str,
                     scenario: Scenario | None = None) -> str | None:
    """Why a check of ``variant`` in ``topology`` under ``spec`` reads "not reachable here"
    (`NOT_REACHABLE`, with this reason as its row's detail), or None where it searches: the one
    decision `check_correct` and `check_bad` make before any search, and `lockstep check
    --list` shows. For a protocol expected clean, the variant's ``unreachable`` hook on its
    scenario; for a bad one, `bad_search_setup`'s reason (the hook, then whether any run calls
    the op its fault search needs, which takes one fault-free run).

    Args:
        scenario: the variant's scenario for ``topology`` if already built (else built here).

    Raises:
        ConfigError: ``spec`` describes a configuration the model cannot hold, or the hook
            returned something other than None or a reason.
    """
    if scenario is None:
        scenario = variant.scenario(spec.scenario(topology))
    if variant.clean_everywhere:
        return _unreachable(variant, scenario)
    return bad_search_setup(variant, spec, topology, scenario)[2]


def check_bad(variant: Variant, spec: CheckSpec, topology: str, progress=None,
              reduce_attempts: int | None = None, reduce: bool = True) -> Row:
    """Row for a known-bad variant: the first schedule with a non-clean verdict, reduced in
    ``reduce_attempts`` attempts (default: ``spec.reduce_attempts``); with ``reduce`` False
    the row's ``minimal`` is the first failing run, unreduced."""
    scenario = variant.scenario(spec.scenario(topology))
    expected = variant.expected.get(topology, "?")
    scenario_for, acceptable, reason = bad_search_setup(variant, spec, topology, scenario)
    if reason is not None:
        return Row(variant.name, topology, expected, NOT_REACHABLE, SearchStats(), reason, None,
                   scenario, True)
    result = _search(spec, scenario_for, variant, acceptable, spec.schedules, progress)
    if result.failure is None:
        stats = result.stats
        if stats.schedules == 0 or stats.budget_reached:
            return Row(variant.name, topology, expected, "incomplete", stats,
                       _incomplete(stats, spec.schedules), None, scenario, False)
        return Row(variant.name, topology, expected, "clean", stats,
                   f"no failure in {stats.schedules} schedules", None, scenario, expected == "clean")
    got = verdict_label(result.failure)
    attempts = spec.reduce_attempts if reduce_attempts is None else reduce_attempts
    minimal = (reduce_schedule(result.failure.world.scenario, variant, result.failure,
                               max_attempts=attempts) if reduce else result.failure)
    minimal = attribute_divergence(minimal.world.scenario, variant, minimal)
    detail = minimal.outcome.detail
    if got.startswith("invariant:") and expected.startswith("invariant:"):
        detail = ("no deadlock or divergence manifested in this topology; the rule check flags: "
                  + detail)
    if is_other_harm(variant, topology, got):
        detail = f"{got}, this design's other harm (also_expected): {detail}"
    return Row(variant.name, topology, expected, got, result.stats, detail, minimal, scenario,
               catches(variant, topology, got))


def is_other_harm(variant: Variant, topology: str, got: str) -> bool:
    """Whether ``got`` is one of bad ``variant``'s other harms in ``topology``
    (`Variant.also_expected`): not its expected verdict, which is not clean there."""
    expected = variant.expected.get(topology, "?")
    return expected != "clean" and got != expected and got in variant.also_expected


def catches(variant: Variant, topology: str, got: str) -> bool:
    """Whether a bad ``variant``'s row in ``topology`` with verdict ``got`` is as expected:
    its expected verdict there, or one of its other harms (`is_other_harm`). The one judgement
    `check_bad` passes a row by and `sim.explain` reports an ablation's verdict by."""
    return got == variant.expected.get(topology, "?") or is_other_harm(variant, topology, got)


def _incomplete(stats: SearchStats, planned: int) -> str:
    # a search of one scenario at a time shares ``planned`` schedules among its scenarios,
    # at least one each (`schedule_shares`; a fresh reviewer saw "after 360 of 20 schedules"
    # over the drawn short-path members when each had ``planned``)
    explored = (stats.hashed_states if stats.hashed
                else f"{stats.schedules} schedules over {stats.scenarios} scenarios searched one "
                     f"at a time ({planned} shared among them, at least one each)"
                if stats.scenarios > 1
                else f"{stats.schedules} of {planned} schedules")
    return f"the time budget ended the search after {explored}, with no failure in them"


def variant_spec(variant: Variant, spec: CheckSpec) -> CheckSpec:
    """``spec`` under ``variant``'s own caps on its schedules and faulted schedules (its
    ``schedules`` and ``fault_schedules`` fields): the search settings its rows run with."""
    if variant.schedules is not None:
        spec = replace(spec, schedules=min(spec.schedules, variant.schedules),
                       clean_schedules=min(spec.planned_clean, variant.schedules))
    if variant.fault_schedules is not None:
        spec = replace(spec, fault_schedules=min(spec.fault_schedules, variant.fault_schedules))
    return spec


def has_faulted_row(variant: Variant, spec: CheckSpec) -> bool:
    """Whether a check of ``variant`` under ``spec`` gives a ``+faults`` row besides its
    fault-free one (where what the design exists for is reachable): a protocol expected clean
    with faulted schedules left once its own cap applies (``--fault-schedules 0``, or a
    design whose faults are not modelled, ``fault_schedules=0``, gives none). The one rule
    both `check_correct` and the planned row count of `lockstep check` follow."""
    return (variant.clean_everywhere
            and variant_spec(variant, spec).fault_schedules > 0)


def check_variant(variant: Variant, spec: CheckSpec, topology: str, progress=None) -> list[Row]:
    """Rows for one variant in one topology (``"shared"`` or ``"per-rank"``): one for a bad
    variant; for a design expected clean its row and, where it has one, its ``+faults`` row
    (`has_faulted_row`).

    A variant whose own code raises, or never returns (see `sim.guard.watchdog`), gets one
    row with verdict ``error`` and a one-line detail naming the variant and the place.

    Raises:
        ConfigError: a ``variant`` that is no Variant, a ``spec`` that is no `CheckSpec`, or a
            topology other than those two (a caller's mistake, which an ``error`` row blamed
            on the variant).
    """
    from sim.run import check_variant_arg
    from sim.scenario import TOPOLOGIES
    from sim.workers import WorkerError

    check_variant_arg(variant)
    if not isinstance(spec, CheckSpec):
        raise ConfigError(f"spec {one_line_repr(spec, 60)}: expected a CheckSpec "
                          "(sim.check.CheckSpec(ranks=2, ...) holds the check's settings)")
    if topology not in TOPOLOGIES:
        raise ConfigError(f"topology = {one_line_repr(topology)}: expected one of "
                          f"{', '.join(TOPOLOGIES)} (check each for 'both')")
    spec = variant_spec(variant, spec)
    try:
        with watchdog():
            if variant.clean_everywhere:
                return check_correct(variant, spec, topology, progress)
            return [check_bad(variant, spec, topology, progress)]
    except WorkerError as exc:
        problem = exc.message
    except ConfigError as exc:
        if str(exc).startswith(f"variant {variant.name!r}: "):  # a mistake the variant's own
            return [Row(variant.name, topology, variant.expected[topology], "error",
                        SearchStats(), str(exc))]                # checks name (adjust's result)
        problem = locate(exc)
    except (Exception, Stalled, SystemExit) as exc:  # noqa: BLE001 - a variant's code can
        problem = locate(exc)                         # raise anything, sys.exit included
    return [Row(variant.name, topology, variant.expected[topology], "error", SearchStats(),
                describe(variant.name, problem))]


MODEL_TEXT = re.compile(r"[0-9a-f]{12}")
"""A trace's ``model``: `sim.report.model_fingerprint`, 12 lowercase hex digits."""


def _shown(value) -> str:
    """A trace field's value as an error line repeats it: its JSON, clipped
    (`lockstep.args.clipped`), so a 400-digit number is not printed whole."""
    return clipped(json.dumps(value))


def _check_recorded_header(data: dict, choices: list[str]) -> None:
    """The trace's ``actions``, ``verdict``, ``model``, ``scenario_digest`` and
    ``record_digest``, which the replay only compares: a value no recording holds would read as
    the simulator's nondeterminism (``actions``, ``verdict``) or be taken as naming the code
    that recorded it (``model``), the scenario it was recorded under (``scenario_digest``) or
    the rest of the recording (``record_digest``). Each may be absent (``model`` is, in traces
    written before 2026-12-06, ``scenario_digest`` in those written before 2026-12-07,
    ``record_digest`` in those written before 2026-12-07, 22:40 UTC).

    Raises:
        ConfigError: naming the field and its value, clipped.
    """
    if "actions" in data:
        actions = data["actions"]
        if not _whole(actions) or actions < 0:
            raise ConfigError(f"'actions' is {_shown(actions)}: not an integer of at least 0 "
                              "(the recording's action count)")
        if actions != len(choices):  # a run records one choice per action (`sim.run._run`)
            raise ConfigError(f"'actions' is {_shown(actions)}, but the recording has "
                              f"{len(choices)} choices, one per action")
    if "verdict" in data and not (isinstance(data["verdict"], str)
                                  and data["verdict"] in OUTCOME_VERDICTS):
        raise ConfigError(f"'verdict' is {_shown(data['verdict'])}: not a verdict a run ends "
                          f"with ({', '.join(OUTCOME_VERDICTS)})")
    if data.get("invariant") is not None and not (isinstance(data["invariant"], str)
                                                  and data["invariant"] in INVARIANTS):
        raise ConfigError(f"'invariant' is {_shown(data['invariant'])}: not null or an invariant "
                          f"of docs/design.md ({INVARIANTS[0]} .. {INVARIANTS[-1]})")
    if "variant_file" in data and not (isinstance(data["variant_file"], str)
                                       and MODEL_TEXT.fullmatch(data["variant_file"])):
        raise ConfigError(f"'variant_file' is {_shown(data['variant_file'])}: not 12 lowercase "
                          "hex digits (the hash of the variant file that recorded the trace, "
                          "`sim.report.variant_file_fingerprint`)")
    if "model" in data and not (isinstance(data["model"], str)
                                and MODEL_TEXT.fullmatch(data["model"])):
        raise ConfigError(f"'model' is {_shown(data['model'])}: not 12 lowercase hex digits (the "
                          "hash of the code that recorded the trace, `sim.report."
                          "model_fingerprint`)")
    from sim.report import RECORD_FIELDS

    for key, names, of in (("scenario_digest", SCENARIO_FIELDS, "scenario fields"),
                           ("record_digest", RECORD_FIELDS, "trace fields")):
        digest = data.get(key, {})
        if not (isinstance(digest, dict)
                and all(k in names and isinstance(v, str) and MODEL_TEXT.fullmatch(v)
                        for k, v in digest.items())):
            what = "scenario" if key == "scenario_digest" else "record"
            raise ConfigError(f"'{key}' is {_shown(digest)}: not an object of {of}, each 12 "
                              f"lowercase hex digits (the hash of each field of the recording's "
                              f"{what}, `sim.report.{key}`)")


def _check_scenario_digest(data: dict, short_contexts: tuple | None) -> None:
    """The trace's ``scenario`` against the ``scenario_digest`` it was written with
    (`sim.report.scenario_digest`), where it has one: a field edited, added or dropped by hand
    (ranks, buckets, max batch, hazards off) replayed into a departure from the recording,
    reported as the simulator's NONDETERMINISM. Where a field has few possible values (ranks,
    topology, the H2 settings, hazards off in rule order, the ``short_context`` values its run
    could draw: ``short_contexts``), the error names the recorded one too.

    Raises:
        ConfigError: a bad-trace line naming the first such field (in `SCENARIO_FIELDS`
            order) and its value.
    """
    _check_digest(data["scenario"], data.get("scenario_digest"), SCENARIO_FIELDS,
                  "bad scenario in trace", "scenario_digest",
                  lambda name: _digest_candidates(name, short_contexts))


def _check_record_digest(data: dict) -> None:
    """The trace's `sim.report.RECORD_FIELDS` (the code and variant that recorded it, its
    verdict and invariant, its choices and events) against the ``record_digest`` it was written
    with, where it has one: an edited verdict or variant name replayed into a departure,
    reported as the simulator's NONDETERMINISM. A verdict, invariant or variant name edited
    away from the recording's is named with the recorded one.

    Raises:
        ConfigError: a bad-trace line naming the first such field and its value.
    """
    from sim.report import RECORD_FIELDS, model_fingerprint
    from sim.variants import REGISTRY

    candidates = {"verdict": OUTCOME_VERDICTS, "invariant": (None, *INVARIANTS),
                  "variant": tuple(REGISTRY), "model": (model_fingerprint(),)}
    _check_digest(data, data.get("record_digest"), RECORD_FIELDS, "bad trace", "record_digest",
                  lambda name: candidates.get(name, ()))


def _check_digest(values: dict, digest: dict | None, names, where: str, digest_key: str,
                  candidates) -> None:
    """Each field of ``names`` in ``values`` against ``digest`` (name -> `sim.report.
    field_digest`, a trace's ``digest_key``); none where ``digest`` is None (a trace written
    before the digest was). ``candidates(name)`` gives the values of a field few enough to
    hash each, so the error can name the recorded one.

    Raises:
        ConfigError: ``where``, then the first field added, dropped or changed since the
            digest was written, and its value.
    """
    from sim.report import field_digest

    if digest is None:
        return
    if not digest and any(name in values for name in names):
        raise ConfigError(f"{where}: its {digest_key} is empty, but every recording names its "
                          "fields there (emptied by hand?)")
    for name in names:
        recorded, present = digest.get(name), name in values
        if recorded is None and not present:
            continue
        prefix = f"{where}: {name}"
        if recorded is None:
            raise ConfigError(f"{prefix} = {clipped(repr(values[name]))}: the recording has no "
                              f"{name} (its {digest_key} names none; added by hand?)")
        if not present:
            raise ConfigError(f"{prefix} is missing, but the recording has one (its "
                              f"{digest_key} names it; removed by hand?)")
        if field_digest(name, values[name]) == recorded:
            continue
        was = [v for v in candidates(name) if field_digest(name, v) == recorded]
        what = (f"the recording has {name} {clipped(repr(was[0]))}" if was else
                f"not the recording's {name}")
        raise ConfigError(f"{prefix} = {clipped(repr(values[name]))}: {what} (its "
                          f"{digest_key} says so; the field or the digest edited by hand?)")


def _digest_candidates(name: str, short_contexts: tuple | None):
    """The values of field ``name`` few enough to hash each (`_check_scenario_digest`), as a
    trace writes them; none for the others."""
    from itertools import combinations

    from sim.hazards import H2_CALLS, H2_SCOPES, RULES
    from sim.limits import MAX_RANKS
    from sim.scenario import TOPOLOGIES

    if name == "hazards_off":  # 512 subsets, in rule order, as explain names them
        return [list(c) for n in range(len(RULES) + 1) for c in combinations(RULES, n)]
    return {"ranks": range(MIN_RANKS, MAX_RANKS + 1), "topology": TOPOLOGIES,
            "h2_scope": H2_SCOPES, "h2_calls": H2_CALLS,
            "short_context": [v for v in short_contexts or () if v is not None]}.get(name, ())


def _check_fault_ops(variant: Variant, faults: tuple[Fault, ...]) -> None:
    """Each of the trace's faults names an op ``variant``'s runs can make: one naming no op
    never fires, and the replay read "exactly" a scenario no run had.

    Raises:
        ConfigError: naming the fault and its op, clipped, and the ops there are.
    """
    known = variant.fault_ops()
    for i, fault in enumerate(faults):
        if fault.op not in known:
            raise ConfigError(f"bad scenario in trace: faults[{i}]: op {clipped(repr(fault.op))} "
                              f"is not an op of variant {variant.name!r} (ops: {', '.join(known)})")


def _check_recorded_run(data: dict, choices: list[str], ranks: int) -> None:
    """What a trace file must hold for its replay to mean anything: choices that name only
    actors of its scenario, and a list of trace events. Without this a hand-edited file reads
    as the simulator's nondeterminism.

    Raises:
        ConfigError: naming the bad choice or field.
    """
    for i, choice in enumerate(choices):
        numbered = re.fullmatch(r"[a-z]+(\d+)", choice)
        if numbered and int(numbered.group(1)) >= ranks:
            raise ConfigError(f"'choices'[{i}] is {choice!r}, but the trace's scenario has "
                              f"{ranks} ranks (0-{ranks - 1})")
    if not isinstance(data.get("trace", []), list):
        raise ConfigError(f"'trace' must be a list of events, not {json.dumps(data['trace']):.40}")


def _recorded_faults(trace: list) -> list[tuple[str, int, str, int]]:
    """(kind, rank, op, occurrence) of every fault the recorded ``trace`` shows firing, in
    order. A rank runs its ops one at a time and each call it finishes or fails records one
    ``op`` event, so a fault fired on call n of (rank, op) follows n - 1 of them."""
    calls: dict = {}
    fired = []
    for e in trace:
        if not isinstance(e, dict) or not isinstance(e.get("rank"), int):
            continue
        site = (e["rank"], e.get("what"))
        if e.get("kind") == "op":
            calls[site] = calls.get(site, 0) + 1
        elif e.get("kind") == "fault" and str(e.get("detail", "")).startswith("injected "):
            fired.append((str(e["detail"])[len("injected "):], *site, calls.get(site, 0) + 1))
    return fired


def _check_recorded_faults(trace: list, faults: tuple[Fault, ...]) -> None:
    """The trace's faults (drawn per run: `WithRandomFault`, `sim.faults.FaultSearch`) must be
    those its recording fired: every fault the recording shows firing is one of them, and none
    of them names a call the recording made without firing it. A fault edited by hand would
    otherwise replay into a departure, reported as the simulator's nondeterminism.

    Raises:
        ConfigError: naming the fault (``faults[i]`` and its value) or the fired one.
    """
    fired = _recorded_faults(trace)
    named = [(f.kind, f.rank, f.op, f.occurrence) for f in faults]
    for kind, rank, op, occurrence in fired:
        if (kind, rank, op, occurrence) not in named:
            # the edited one: the fault at the same site, else the only one, else all of them
            at = [i for i, f in enumerate(faults) if (f.rank, f.op) == (rank, op)]
            at = at or ([0] if len(faults) == 1 else [])
            field_text = (f"faults[{at[0]}] = {one_line_repr(faults[at[0]].__dict__, 200)}"
                          if at else
                          f"faults = {one_line_repr([f.__dict__ for f in faults], 200)}")
            raise ConfigError(f"bad scenario in trace: {field_text}: the recording injects "
                              f"{kind} on rank {rank} in {op} call {occurrence}, which its "
                              "faults do not name")
    calls = _recorded_calls(trace)
    for i, fault in enumerate(faults):
        made = calls.get((fault.rank, fault.op), 0)
        if named[i] not in fired and made >= fault.occurrence:
            raise ConfigError(f"bad scenario in trace: faults[{i}] = "
                              f"{one_line_repr(fault.__dict__, 200)}: the recording's rank "
                              f"{fault.rank} makes {made} {fault.op} call(s) and call "
                              f"{fault.occurrence} has no fault")


def _recorded_calls(trace: list) -> dict[tuple[int, str], int]:
    """(rank, op name) -> calls of that op the recorded ``trace`` shows the rank making."""
    calls: dict = {}
    for e in trace:
        if isinstance(e, dict) and e.get("kind") == "op" and isinstance(e.get("rank"), int):
            site = (e["rank"], e.get("what"))
            calls[site] = calls.get(site, 0) + 1
    return calls


def drawn_short_contexts(variant: Variant, scenario: Scenario) -> tuple | None:
    """Every ``short_context`` a check's run of ``variant`` over ``scenario`` (its adjusted base,
    with the run's prompt lengths) can have, ascending (None: the short path off): the base's
    own for a variant without a draw, each member's for a draw that lists its members
    (`sim.scenario.ShortContextDraw`; for a `sim.scenario.ShortPathDraw`, the short-context
    draw over ``scenario``'s own workload); None when the draw does not list them (a user's
    draw may depend on the search seed)."""
    from sim.scenario import ShortContextDraw, ShortPathDraw

    family = _own_draw(scenario_family(variant, scenario, 0))
    if isinstance(family, Fixed):
        return (scenario.config.short_context,)
    if isinstance(family, ShortPathDraw):  # ``scenario`` holds the run's own workload
        family = ShortContextDraw(scenario, 0)
    members = getattr(family, "members", None)
    if members is None:
        return None
    values = {m.config.short_context for m in members()}
    return tuple(sorted(values, key=lambda v: (v is not None, v or 0)))


def _own_draw(family):
    """``family`` (`scenario_family`), or for a headroom drawn over a row's own per-run draw
    (`sim.headroom.HeadroomDraw.within`) that draw, whose fields a trace records as any
    other's: the headroom changes no workload and no ``short_context``."""
    within = family.within if isinstance(family, HeadroomDraw) else None
    return family if within is None else within


def _short_context_refused(variant: Variant, given, allowed: tuple) -> ConfigError:
    """The one-line error for a trace whose ``short_context`` no run of ``variant`` has."""
    numbers = [v for v in allowed if v is not None]
    if not numbers:
        what = f"variant {variant.name!r} runs without the short decode path"
    elif len(numbers) == 1:
        what = f"variant {variant.name!r} runs at short_context {numbers[0]}"
    else:
        what = (f"variant {variant.name!r} draws short_context from {numbers[0]}..{numbers[-1]} "
                "for this scenario")
    if given is None:
        return ConfigError(f"bad scenario in trace: short_context is missing: {what} "
                           "(`lockstep check --trace-out` writes it)")
    return ConfigError(f"bad scenario in trace: short_context = {given!r}: {what}")


def _with_recorded_workload(variant: Variant, scenario: Scenario, data: dict) -> Scenario:
    """``scenario`` with the prompt lengths and ``max_tokens`` a trace's scenario object
    (``data``) records (absent: the check's own workload), which only a variant that draws its
    workload (`sim.scenario.WorkloadDraw`) may change, and only to one value per request within
    `sim.scenario.DRAWN_PROMPT_LENGTHS` / `DRAWN_MAX_TOKENS`.

    Raises:
        ConfigError: a bad-trace line naming the field and what the variant runs.
    """
    from sim.scenario import (DRAWN_MAX_TOKENS, DRAWN_PROMPT_LENGTHS, WorkloadDraw, max_tokens,
                              prompt_lengths, with_max_tokens, with_prompt_lengths)

    draws = isinstance(_own_draw(scenario_family(variant, scenario, 0)), WorkloadDraw)
    fields = (("prompt_lengths", prompt_lengths, with_prompt_lengths, DRAWN_PROMPT_LENGTHS,
               "prompts of", "tokens"),
              ("max_tokens", max_tokens, with_max_tokens, DRAWN_MAX_TOKENS, "max_tokens", ""))
    out = scenario
    for name, own_of, apply, drawn, before, after in fields:
        given, own = data.get(name), own_of(scenario)
        if given is None or tuple(given) == own:
            continue
        shown = f"{name} = {one_line_repr(list(given), 120)}"
        if not draws:
            raise ConfigError(f"bad scenario in trace: {shown}: variant {variant.name!r} runs "
                              f"the check's workload as it is, with {before} "
                              f"{_values_text(own)}{' ' + after if after else ''}")
        if len(given) != len(own):
            raise ConfigError(f"bad scenario in trace: {shown}: {len(given)} value(s), but the "
                              f"check's workload has {len(own)} requests")
        for i, n in enumerate(given):
            if n not in drawn:
                raise ConfigError(f"bad scenario in trace: {name}[{i}] = {n}: variant "
                                  f"{variant.name!r} draws {name} from {drawn[0]}..{drawn[-1]}")
        out = apply(out, given)
    return out


def _with_recorded_memory(variant: Variant, scenario: Scenario, data: dict) -> Scenario:
    """``scenario`` with the ``memory_headroom_bytes`` and ``rank_overhead`` a trace's scenario
    object (``data``) records (absent: the variant's own), which only a variant that draws its
    memory (`sim.headroom.HeadroomDraw`) may change; the rank overhead must name ranks of the
    world.

    Raises:
        ConfigError: a bad-trace line naming the field and what the variant runs.
    """
    draws = isinstance(scenario_family(variant, scenario, 0), HeadroomDraw)
    headroom, overhead = data.get("memory_headroom_bytes"), data.get("rank_overhead")
    own_headroom, own_overhead = scenario.config.memory_headroom_bytes, scenario.memory.rank_overhead
    for name, given, own in (("memory_headroom_bytes", headroom, own_headroom),
                             ("rank_overhead", overhead, own_overhead)):
        if given is not None and given != own and not draws:
            raise ConfigError(f"bad scenario in trace: {name} = {one_line_repr(given, 120)}: "
                              f"variant {variant.name!r} runs its own memory, with {name} "
                              f"{one_line_repr(own, 120)}")
    ranks = scenario.config.world_size
    for rank, _ in overhead or ():
        if rank >= ranks:
            raise ConfigError(f"bad scenario in trace: rank_overhead names rank {rank}, outside "
                              f"a world of {ranks}")
    if overhead is not None:
        scenario = scenario.with_(memory=replace(scenario.memory, rank_overhead=overhead))
    if headroom is not None:
        scenario = scenario.with_(config=replace(scenario.config, memory_headroom_bytes=headroom))
    return scenario


def _values_text(values: tuple[int, ...]) -> str:
    distinct = sorted(set(values))
    return " or ".join(map(str, distinct)) if len(distinct) <= 3 else \
        f"{distinct[0]}..{distinct[-1]}"


def _departure(result: RunResult, data: dict, choices: list[str]) -> str | None:
    """How the replayed ``result`` departs from the recording ``data`` (its choices, its verdict
    and trace events where it records them; its action count is its choices',
    `_check_recorded_header`), or None if it reproduces it exactly."""
    if result.choices != choices:
        first = next((i for i, (a, b) in enumerate(zip(result.choices, choices)) if a != b),
                     min(len(result.choices), len(choices)))
        where = (f"it took {result.choices[first]!r} where the recording has {choices[first]!r}"
                 if first < min(len(result.choices), len(choices)) else
                 f"the run took {len(result.choices)} actions, the recording has {len(choices)}")
        return f"replay departed from its recording at action {first}: {where}"
    if "verdict" in data and result.outcome.verdict != data["verdict"]:
        return f"replay gave verdict {result.outcome.verdict}, the recording {data['verdict']}"
    if "invariant" in data and result.outcome.invariant != data["invariant"]:
        def broke(invariant):
            return "no invariant" if invariant is None else f"invariant {invariant}"
        return (f"replay broke {broke(result.outcome.invariant)}, the recording "
                f"{broke(data['invariant'])}")
    recorded = data.get("trace")
    if recorded is not None:
        replayed = [e.to_json() for e in result.world.trace]
        if recorded != replayed:
            first = next((i for i, (a, b) in enumerate(zip(replayed, recorded)) if a != b),
                         min(len(replayed), len(recorded)))
            return f"replayed trace differs from the recording at event {first}"
    return None  # the recorded action count is the choices' (`_check_recorded_header`)


def _replays_exactly(scenario: Scenario, variant: Variant, data: dict,
                     choices: list[str]) -> bool:
    """Whether the recording ``data`` replays exactly under ``scenario``."""
    try:
        with watchdog():
            result = run_schedule(scenario, variant, Replay(list(choices)))
    except NondeterminismError:
        return False
    return _departure(result, data, choices) is None


def replay_trace(data: dict) -> tuple[RunResult | None, str | None]:
    """Re-run a recorded trace JSON exactly; returns (result, nondeterminism message or None).

    The replay must take the recorded choices and give the recorded verdict, invariant and
    trace event for event, where the trace records them; any departure is reported as
    nondeterminism, unless the scenario's fields drawn per run are what departs: a
    ``short_context`` that no run of the variant has, or one at which the recording does not
    replay while another drawn value replays it exactly, and faults that the recording's fault
    events contradict, are a bad trace (an edit by hand), not the simulator's nondeterminism;
    so is any field of its
    scenario that is not the one its ``scenario_digest`` records (`_check_scenario_digest`;
    a trace written before 2026-12-07 has none, and replays as before), and any of its
    `sim.report.RECORD_FIELDS` (variant name, verdict, invariant, choices, events, the
    fingerprints) that is not the one its ``record_digest`` records (`_check_record_digest`;
    none before 2026-12-07, 22:40 UTC).

    Raises:
        ConfigError: the file is not a lockstep trace of this format, names an unknown
            variant, hazard, fault or fault op, its ``actions``, ``model`` or
            ``scenario_digest`` is no recording's, its drawn fields (``short_context``,
            ``faults``) are not its recording's, or a field of its scenario or of its record
            is not the one its ``scenario_digest`` or ``record_digest`` records.
        Stalled: the variant's code stopped making progress (`sim.guard.watchdog`); whatever
            else the variant's code raises passes through.
    """
    from sim.report import TRACE_FORMAT

    if not isinstance(data, dict) or "choices" not in data or "variant" not in data:
        raise ConfigError("not a lockstep trace: expected a JSON object with 'variant' and 'choices'")
    if data.get("format") != TRACE_FORMAT:
        raise ConfigError(f"trace format {data.get('format')!r} is not {TRACE_FORMAT}")
    choices = data["choices"]
    actors = "actor names (controller, collectives, rank<r>, device<r>)"
    if not isinstance(choices, list):
        raise ConfigError(f"'choices' must be a list of {actors}, not {_shown(choices)}")
    bad = next((i for i, c in enumerate(choices)
                if not (isinstance(c, str) and _ACTOR.fullmatch(c))), None)
    if bad is not None:  # a fresh user's finding: the error named neither the entry nor its place
        raise ConfigError(f"'choices'[{bad}] is {_shown(choices[bad])}: not one of the {actors}")
    if not isinstance(data["variant"], str):  # a name; get_variant's close-match lookup needs one
        raise ConfigError(f"'variant' must be a string (a variant name), not "
                          f"{json.dumps(data['variant'])}")
    _check_recorded_header(data, choices)
    if "scenario" not in data:  # replaying under defaults would report a wrong verdict as fact
        raise ConfigError("not a lockstep trace: it has no 'scenario' (the configuration its run "
                          "was made under; `lockstep check --trace-out` writes it)")
    try:
        variant = get_variant(data["variant"])
    except ConfigError as exc:  # a user's variant is known only once its file is loaded
        _check_record_digest(data)  # an edited name, or path, is named as such
        path = data.get("variant_path")
        named = (f"--variant-file {clipped(json.dumps(path), 300)} (the path the trace records)"
                 if isinstance(path, str) else "--variant-file PATH")
        raise ConfigError(f"{exc}; a trace of a variant from a file replays with that file: "
                          f"--replay TRACE {named}") from None
    spec_data = data["scenario"]
    if not isinstance(spec_data, dict):
        raise ConfigError("'scenario' must be an object")
    missing = [k for k in SCENARIO_KEYS if k not in spec_data]
    spec_data = check_scenario_json(spec_data)
    if missing:  # the defaults would stand in for them and the replay "depart" from its record
        raise ConfigError(f"trace's 'scenario' lacks {', '.join(missing)} (`lockstep check "
                          "--trace-out` writes every field of the configuration)")
    spec = CheckSpec(ranks=spec_data.get("ranks", 2),
                     buckets=spec_data.get("buckets"),
                     max_batch=spec_data.get("max_batch"),
                     hazards_off=spec_data.get("hazards_off", ()),
                     h2_scope=spec_data.get("h2_scope", "process"),
                     h2_calls=spec_data.get("h2_calls", "both"))
    try:
        scenario = variant.scenario(spec.scenario(spec_data.get("topology", "shared")))
        faults = tuple(Fault(**f) for f in spec_data.get("faults", ()))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad scenario in trace: {exc}") from None
    _check_fault_ops(variant, faults)
    # the fields drawn per run (`Variant.draw`, the faulted row's and a fault search's faults)
    # must be a run's: checked here, so an edited one is a bad trace, not a departure
    scenario = _with_recorded_workload(variant, scenario, spec_data)
    scenario = _with_recorded_memory(variant, scenario, spec_data)
    allowed = drawn_short_contexts(variant, scenario)
    given = spec_data.get("short_context")
    if allowed is not None and given not in allowed:
        raise _short_context_refused(variant, given, allowed)
    if faults:
        scenario = scenario.with_(faults=faults)
    if given is not None:
        try:
            scenario = scenario.with_(config=replace(scenario.config, short_context=given))
        except ConfigError as exc:
            raise ConfigError(f"bad scenario in trace: {exc}") from None
    _check_recorded_run(data, choices, spec.ranks)
    if data.get("trace") is not None:
        _check_recorded_faults(data["trace"], faults)
    # last: a field the checks above can place (a drawn value no run has, faults the
    # recording contradicts) is named by its own rule
    _check_record_digest(data)
    _check_scenario_digest(data, allowed)
    try:
        with watchdog():  # the variant's hooks are user code, as in a search
            result = run_schedule(scenario, variant, Replay(list(choices)))
    except NondeterminismError as exc:
        result, problem = None, str(exc)
    else:
        problem = _departure(result, data, choices)
    if problem is not None:
        problem += _recorded_by_other_code(data)
        problem += _undigested(data)
        # a short_context the variant draws, but not the recording's: the value that replays
        # the recording exactly names the edit
        for other in [v for v in allowed or () if v is not None and v != given]:
            if _replays_exactly(scenario.with_(config=replace(scenario.config,
                                                              short_context=other)),
                                variant, data, choices):
                raise ConfigError(f"bad scenario in trace: short_context = {given!r}: the "
                                  f"recording replays exactly at short_context {other}, not "
                                  "at this value (edited by hand?)")
        return result, problem
    with watchdog():  # a token divergence names its step, as in the report it was written from
        result = attribute_divergence(scenario, variant, result)
    return result, None


def _undigested(data: dict) -> str:
    """What a departing replay adds when the trace lacks a digest, so that an edit by hand of
    what it covers cannot be told from a departure (a fresh user's finding: with both
    missing, the note named the scenario alone, and an edited verdict drew no note at all)."""
    missing = [(key, since, what) for key, since, what in (
        ("scenario_digest", "2026-12-07", "its scenario"),
        ("record_digest", "2026-12-07, 22:40 UTC", "its verdict, variant, choices or events"))
        if key not in data]
    if not missing:
        return ""
    keys = " or ".join(key for key, _, _ in missing)
    since = missing[-1][1]
    what = " or ".join(what for _, _, what in missing)
    return (f"; the trace has no {keys} (traces written before {since} do not), so an edit "
            f"by hand of {what} cannot be told from a departure")


def _recorded_by_other_code(data: dict) -> str:
    """What a departing replay adds when the trace was recorded by other code of `protocol/`
    and `sim/` (`sim.report.model_fingerprint`), or does not say which: a schedule recorded by
    one version need not replay on another, so that, not nondeterminism, may be the cause."""
    from sim.report import model_fingerprint, variant_file_fingerprint

    recorded, running = data.get("model"), model_fingerprint()
    file_then = data.get("variant_file")
    file_now = variant_file_fingerprint(data.get("variant"))
    if file_then is not None and file_now is not None and file_then != file_now:
        return (f"; the variant file was edited since the recording (variant_file {file_then}, "
                f"now {file_now}), and its schedule need not replay on the new code")
    if recorded == running:
        return ""
    if recorded is None:
        return ("; the trace does not name the code that recorded it (traces written before "
                "2026-12-06 do not): recorded by another version, it need not replay")
    return (f"; the trace was recorded by other code of protocol/ and sim/ (model {recorded}, "
            f"this one {running}), on which its schedule need not replay")


def check_coverage_reachable(scenario: Scenario) -> None:
    """Refuse a configuration in which no schedule can reach what a clean row must reach
    (`run_check`'s non-vacuity: live compactions and padded replays), so the check would call
    the correct protocol vacuous and every bug that needs them clean.

    Raises:
        ConfigError: a ``scenario`` that is no Scenario, max batch 1 (one slot never
            compacts) or 2 (its one compaction is the tail shift), every batch size up to max
            batch is a bucket (no replay is ever padded), or the serving workload's steps
            reach neither in this configuration, naming the values (and ``max_batch`` among
            its ``fields``).
    """
    from protocol.eligibility import GraphPlan
    from sim.run import check_scenario

    check_scenario(scenario)
    cfg = scenario.config
    if cfg.max_batch < 2:
        raise ConfigError(f"max_batch={cfg.max_batch}: a single slot never compacts, so no "
                          "schedule can show slot compaction; use max_batch 3 or more, and buckets "
                          "that reach it", fields=("max_batch", "buckets"))
    buckets = GraphPlan.from_config(cfg).buckets
    named = (f"max_batch={cfg.max_batch} with the buckets up to the one it pads to "
             f"({','.join(map(str, buckets))})")
    if all(n in buckets for n in range(1, cfg.max_batch + 1)):
        raise ConfigError(f"{named}: every batch size is a bucket, so no replay is ever "
                          "padded; use a max_batch that is not a bucket, or leave a batch "
                          "size between two buckets", fields=("max_batch",))
    if cfg.max_batch < 3:
        raise ConfigError(f"max_batch={cfg.max_batch}: with two slots a retirement can only "
                          "move the last slot into the freed one, so no schedule can tell one "
                          "compaction rule from another; use max_batch 3 or more, and buckets "
                          "that reach it", fields=("max_batch", "buckets"))
    from sim.run import correct_run
    from sim.variants import CORRECT

    run = correct_run(scenario)
    missing = [e for e in ("replay", "compaction_moves_live") + CORRECT.reaches
               if not run.reached.get(e)]
    if run.outcome.verdict == "clean" and missing:
        what = {"padded_replay": "a padded graph replay", "replay": "a graph replay",
                "mixed_replay": "a mixed step (prefill beside decode rows) that replays",
                "compaction_moves_live": "a compaction that moves a live slot"}
        raise ConfigError(f"{named}: no serving step of the check's workload reaches "
                          f"{' or '.join(what.get(e, e) for e in missing)} here, so every "
                          "clean row would be vacuous; use a max_batch that pads into a "
                          "larger bucket (for example a bucket set with a gap below it)",
                          fields=("max_batch",))




def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_scenario_value(name: str, value):
    """``value`` of the scenario setting ``name`` (``ranks``, ``buckets``, ``max_batch``,
    ``topology``, ``hazards_off``, ``h2_scope``, ``h2_calls``; ``short_context`` and
    ``prompt_lengths`` and ``max_tokens``, which only a trace carries: the run's drawn short
    path and workload,
    `Variant.draw`) checked by the rule its
    `lockstep check` option has, and returned (buckets and hazards as tuples). The options
    (after parsing their text) and `--replay`'s trace scenarios go through this one function,
    so a trace is held to what the command line would accept.

    Raises:
        ConfigError: naming the value and the rule it breaks.
    """
    from sim.hazards import H2_CALLS, H2_SCOPES, RULES
    from sim.limits import check_limits
    from sim.scenario import TOPOLOGIES
    from protocol.buckets import validate_buckets

    if name in ("ranks", "max_batch", "short_context"):
        least = MIN_RANKS if name == "ranks" else 1
        if not _whole(value):
            raise ConfigError(f"{clipped(repr(value))} is not an integer")
        if value < least:
            raise ConfigError(f"{value} must be at least {least}")
        if name != "short_context":
            check_limits(**{name: value})
        return value
    if name == "memory_headroom_bytes":
        if not _whole(value) or value < 0:
            raise ConfigError(f"{clipped(repr(value))} is not an integer of at least 0")
        return value
    if name == "rank_overhead":
        if (not isinstance(value, (list, tuple))
                or not all(isinstance(p, (list, tuple)) and len(p) == 2 and _whole(p[0])
                           and _whole(p[1]) and p[0] >= 0 and p[1] >= 0 for p in value)
                or len({p[0] for p in value}) != len(value)):
            raise ConfigError(f"{one_line_repr(value, 120)} is not a list of [rank, bytes] pairs, "
                              "one per rank, each at least 0")
        return tuple(sorted((p[0], p[1]) for p in value))
    if name in ("prompt_lengths", "max_tokens"):
        if (not isinstance(value, (list, tuple)) or not value
                or not all(_whole(n) and n >= 1 for n in value)):
            raise ConfigError(f"{one_line_repr(value, 120)} is not a list of integers of at "
                              "least 1")
        if len(value) > MAX_PROMPT_LENGTHS:
            raise ConfigError(f"{len(value)} lengths: at most {MAX_PROMPT_LENGTHS}, one per "
                              "request of the check's workload")
        return tuple(value)
    if name == "buckets":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{clipped(repr(value))} is not a list of integers")
        ints = all(type(v) is int for v in value)
        if ints:  # a bucket too large says so before the order does
            check_limits(buckets=tuple(value))
        values = validate_buckets(value)
        if not ints:
            check_limits(buckets=values)
        return values
    if name == "hazards_off":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{clipped(repr(value))} is not a list of hazard names ({', '.join(RULES)})")
        for i, hazard in enumerate(value):
            if hazard not in RULES:
                raise ConfigError(f"unknown hazard {clipped(repr(hazard))}; known: {', '.join(RULES)}")
            if hazard in value[:i]:  # a trace edited by hand took it (--hazard-off counts once)
                raise ConfigError(f"hazard {hazard!r} is named twice; name each once")
        return tuple(value)
    choices = {"topology": TOPOLOGIES, "h2_scope": H2_SCOPES, "h2_calls": H2_CALLS}[name]
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{clipped(repr(value))} is not one of {', '.join(choices)}")
    return value


SCENARIO_FIELDS = ("ranks", "buckets", "max_batch", "topology", "hazards_off", "h2_scope",
                   "h2_calls", "faults", "short_context", "prompt_lengths", "max_tokens",
                   "memory_headroom_bytes", "rank_overhead")
"""The fields of a trace's ``scenario`` object (`scenario_spec` writes them; ``short_context``
only for a run with the short decode path on, ``prompt_lengths`` and ``max_tokens`` only for a
run whose workload was drawn away from the check's, `sim.scenario.WorkloadDraw`,
``memory_headroom_bytes`` and ``rank_overhead`` only for a run whose memory was drawn away
from its variant's, `sim.headroom.HeadroomDraw`)."""

MAX_PROMPT_LENGTHS = MAX_BUCKET + 8
"""Most values a trace's ``prompt_lengths`` or ``max_tokens`` may list: the check's workload has
a first wave of at most max batch requests (`sim.scenario.first_wave`; max batch is at most the
largest bucket, `sim.limits.MAX_BUCKET`) and 8 more after it. (It was 64 while the workload had
at most 17 requests.)"""


def _holds_huge_integer(value) -> bool:
    """Whether ``value``, or any item of its lists however deep, is an integer of more than
    MAX_DIGITS digits (`lockstep.args.MAX_DIGITS`: more than any field takes). Iterative: a
    trace's lists may nest as deep as the JSON reader follows."""
    stack = [value]
    while stack:
        item = stack.pop()
        if _whole(item) and abs(item) >= 10**MAX_DIGITS:
            return True
        if isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


NULLABLE_FIELDS = ("buckets", "max_batch")
"""The scenario fields a trace writes as null: the option was not given (`CheckSpec.to_json`)."""


def check_scenario_json(data: dict) -> dict:
    """A trace's ``scenario`` object with every field checked (`check_scenario_value`; faults:
    a list of objects with a known kind, a rank of the world, a whole occurrence >= 1 and a
    finite delay >= 0). A null ``buckets`` or ``max_batch`` (the defaults, as `CheckSpec.to_json`
    writes them) is left out, as is a null field that a recording may leave out (read as
    missing). Raises ConfigError naming the field, also for a null in a field every recording
    holds (`SCENARIO_KEYS`), which would let a default stand in for the recorded value."""
    import math

    from sim.scenario import FAULT_KINDS

    unknown = [k for k in data if k not in SCENARIO_FIELDS]
    if unknown:
        raise ConfigError(f"bad scenario in trace: unknown field(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(SCENARIO_FIELDS)}")
    out = {}
    for name, value in data.items():
        if value is None and name in SCENARIO_KEYS and name not in NULLABLE_FIELDS:
            raise ConfigError(f"bad scenario in trace: {name} = null: a recording writes a "
                              f"value here (null only for {' and '.join(NULLABLE_FIELDS)}, "
                              "their defaults)")
        if value is None or name == "faults":
            continue
        shown = clipped(repr(value))
        if _holds_huge_integer(value):  # echoed whole by the rules' messages, or past float()
            raise ConfigError(f"bad scenario in trace: {name} = {shown}: an integer of more "
                              f"than {MAX_DIGITS} digits, more than any field takes")
        try:
            out[name] = check_scenario_value(name, value)
        except ConfigError as exc:
            raise ConfigError(f"bad scenario in trace: {name} = {shown}: {exc}") from None
    faults = data.get("faults", [])  # 0, "" or {} read as "no faults" when `or []` stood here
    if not isinstance(faults, list):
        raise ConfigError(f"bad scenario in trace: faults = {one_line_repr(faults, 80)}: "
                          "not a list")
    ranks = out.get("ranks", MIN_RANKS)
    for i, f in enumerate(faults):
        where = f"bad scenario in trace: faults[{i}]"
        if not isinstance(f, dict):
            raise ConfigError(f"{where} = {one_line_repr(f, 80)}: not an object")
        extra = [k for k in f if k not in ("kind", "rank", "op", "occurrence", "delay_s")]
        if extra or not {"kind", "rank", "op"} <= set(f):
            raise ConfigError(f"{where} = {one_line_repr(f, 120)}: needs kind, rank and op (and "
                              "optionally occurrence, delay_s), nothing else")
        shown = {k: clipped(repr(v)) for k, v in f.items()}
        if f["kind"] not in FAULT_KINDS:
            raise ConfigError(f"{where}: kind {shown['kind']} is not one of {', '.join(FAULT_KINDS)}")
        if not _whole(f["rank"]) or not 0 <= f["rank"] < ranks:
            raise ConfigError(f"{where}: rank {shown['rank']} is not a rank of a world of {ranks}")
        if not isinstance(f["op"], str) or not f["op"]:
            raise ConfigError(f"{where}: op {shown['op']} is not an op name")
        occurrence = f.get("occurrence", 1)
        if not _whole(occurrence) or occurrence < 1:
            raise ConfigError(f"{where}: occurrence {shown.get('occurrence')} is not an integer >= 1")
        delay = f.get("delay_s", 0.0)
        if (not isinstance(delay, (int, float)) or isinstance(delay, bool)
                or _holds_huge_integer(delay) or not math.isfinite(delay) or delay < 0):
            # math.isfinite of an integer past a float's range raises OverflowError
            raise ConfigError(f"{where}: delay_s {shown.get('delay_s')} is not a finite number >= 0")
    out["faults"] = faults
    return out


SCENARIO_KEYS = ("ranks", "buckets", "max_batch", "hazards_off", "h2_scope", "h2_calls",
                 "topology", "faults")
"""What `scenario_spec` writes and `replay_trace` requires."""


def scenario_spec(spec: CheckSpec, topology: str, scenario: Scenario,
                  base: Scenario | None = None) -> dict:
    """JSON description of a row's scenario, enough for `replay_trace`; ``base`` is the row's
    own scenario (its variant's), from which a run's drawn memory may differ."""
    data = spec.to_json()
    data["topology"] = topology
    data["faults"] = [f.__dict__ for f in scenario.faults] if scenario else []
    if scenario is not None and scenario.config.short_context is not None:
        data["short_context"] = scenario.config.short_context  # drawn per run (`Variant.draw`)
    if scenario is not None:
        from sim.scenario import max_tokens, prompt_lengths

        base = spec.scenario(topology)
        for name, values in (("prompt_lengths", prompt_lengths), ("max_tokens", max_tokens)):
            if values(scenario) != values(base):  # drawn per run (`sim.scenario.WorkloadDraw`)
                data[name] = list(values(scenario))
    if scenario is not None and base is not None:  # drawn per run (`sim.headroom.HeadroomDraw`)
        if scenario.config.memory_headroom_bytes != base.config.memory_headroom_bytes:
            data["memory_headroom_bytes"] = scenario.config.memory_headroom_bytes
        if scenario.memory.rank_overhead != base.memory.rank_overhead:
            data["rank_overhead"] = [list(p) for p in scenario.memory.rank_overhead]
    return data
