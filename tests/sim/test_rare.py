"""Search that works for its verdict (issue 11 item 4): per-variant failing shares, and shipped
variants whose failure needs a rare interleaving that random search misses and PCT finds."""

import pytest

from lockstep.cli import main
from protocol.errors import ConfigError
from sim.check import CheckSpec, bad_search_setup, check_bad
from sim.search import sample_search
from sim.stats import failing_shares, render_table
from sim.variants import REGISTRY, Variant

DEFAULT = CheckSpec()  # the default budget: 300 schedules, seed 0


def _search(name: str, strategy: str, schedules: int, topology: str = "shared"):
    variant = REGISTRY[name]
    scenario_for, acceptable, reason = bad_search_setup(variant, DEFAULT, topology)
    assert reason is None
    return sample_search(scenario_for, variant, acceptable, strategy, schedules,
                         time_budget=1e9, seed=DEFAULT.seed, jobs=2)


@pytest.mark.timeout(900)
def test_random_search_with_the_default_budget_misses_the_warmup_free_deadlock():
    """300 random schedules (seed 0): rank 0 must issue every warm-up all-reduce and start its
    free before rank 1 allocates -- about 2^-38 of schedules at the 36 default buckets."""
    result = _search("warmup-scratch-free", "random", DEFAULT.schedules)
    assert result.failure is None and result.stats.schedules == DEFAULT.schedules


@pytest.mark.timeout(300)
def test_pct_finds_the_warmup_free_deadlock_at_once():
    result = _search("warmup-scratch-free", "pct", 10)
    assert result.failure is not None and result.failure.outcome.verdict == "deadlock"
    assert result.stats.schedules <= 3


@pytest.mark.timeout(300)
def test_a_variant_op_waiting_for_the_driver_lock_is_seen_without_its_flag(monkeypatch):
    """A variant author's finding: an op of one's own that waits in `backend.locked` but did not
    declare ``takes_driver_lock`` left its wait for the lock out of the wait-for graph, so the
    deadlock read as the startup watchdog's abort (an acceptable verdict under faults). The wait
    is now seen from the op's own probe; the flag changes nothing."""
    from sim.variants_rare import AllocScratch, FreeScratch

    verdicts = []
    for flag in (True, False):
        for op in (AllocScratch, FreeScratch):
            monkeypatch.setattr(op, "takes_driver_lock", flag)
        found = _search("warmup-scratch-free", "pct", 10).failure
        verdicts.append((found.outcome.verdict, found.outcome.detail))
    assert verdicts[0] == verdicts[1] and verdicts[0][0] == "deadlock"
    assert "driver lock" in " ".join(why for _, why in found.outcome.cycle)


@pytest.mark.timeout(300)
def test_the_default_check_searches_it_with_its_own_strategy(capsys):
    assert main(["check", "--variant", "warmup-scratch-free", "--no-progress", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "deadlock" in out and "not reachable here" in out  # per-rank: no shared driver lock
    spec = CheckSpec(strategy="random", schedules=20, jobs=1)
    assert check_bad(REGISTRY["warmup-scratch-free"], spec, "shared").got == "clean"


def test_a_variant_strategy_is_validated():
    with pytest.raises(ConfigError, match="'bogus'"):
        Variant(name="x", summary="s", source="t", expected={"shared": "clean", "per-rank": "clean"},
                strategy="bogus")


@pytest.mark.timeout(300)
def test_failing_shares_count_every_schedule():
    shares = failing_shares(REGISTRY["single-warmup"], CheckSpec(schedules=5, jobs=1), "shared")
    assert shares.schedules == {"random": 5, "pct": 5} and shares.failing == {"random": 5, "pct": 5}
    assert "100.0% (5/5)" in render_table([shares])


@pytest.mark.timeout(300)
def test_stats_option_prints_a_share_per_strategy(capsys):
    assert main(["check", "--stats", "--variant", "warmup-scratch-free", "--topology", "shared",
                 "--schedules", "4", "--no-progress", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("| warmup-scratch-free"))
    assert "0.0% (0/4)" in line  # random
    assert main(["check", "--stats", "--strategy", "pct"]) == 2
    assert "drop --strategy" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_random_search_with_the_default_budget_misses_the_autotune_divergence():
    """The divergence class's rare variant: rank 0 must look the cache up, tune every warm-up
    size and store its tactics before rank 1's lookup -- 38 host actions of one rank before
    the other's first at the 36 default buckets. 300 random schedules (seed 0) miss it."""
    result = _search("autotune-cache-shared", "random", DEFAULT.schedules)
    assert result.failure is None and result.stats.schedules == DEFAULT.schedules


@pytest.mark.timeout(300)
def test_pct_finds_the_autotune_divergence_at_once():
    result = _search("autotune-cache-shared", "pct", 10)
    outcome = result.failure.outcome
    assert outcome.verdict == "divergence" and outcome.invariant == "I2", outcome
    assert "collective sequences differ across ranks" in outcome.detail
    assert result.stats.schedules <= 3


def test_the_autotune_divergence_needs_two_ranks_in_one_process_not_two_sizes():
    """Old behaviour: one warm-up message size (``--buckets 8``) read "not reachable here",
    though the tuning rank's extra candidate run then spins for a peer that already replied (a
    fresh helper forced the variant past the check and found that divergence)."""
    from sim.variants_rare import _no_shared_tuner

    variant = REGISTRY["autotune-cache-shared"]
    shared = variant.scenario(DEFAULT.scenario("shared"))
    assert _no_shared_tuner(shared) is None
    assert "own process" in _no_shared_tuner(variant.scenario(DEFAULT.scenario("per-rank")))
    spec = CheckSpec(buckets=(8,), max_batch=8, schedules=20, fault_schedules=0, jobs=1)
    one = variant.scenario(spec.scenario("shared"))
    assert _no_shared_tuner(one) is None
    row = check_bad(variant, spec, "shared")
    assert row.got == "divergence" and row.passed, row.detail
    assert "autotune candidate" in row.detail


@pytest.mark.timeout(300)
def test_a_variant_op_that_enqueues_blocks_the_host_with_h6_off():
    """`enqueues = True` on a variant's op: with host calls blocking (H6 off) the tuning rank
    cannot run ahead of its peer's lookup, and the divergence is gone; with H6 on it is found."""
    variant = REGISTRY["autotune-cache-shared"]
    spec = CheckSpec(schedules=30, fault_schedules=0, jobs=1)
    assert check_bad(variant, spec, "shared").got == "divergence"
    from dataclasses import replace
    assert check_bad(variant, replace(spec, hazards_off=("h6",)), "shared").got == "clean"


@pytest.mark.timeout(300)
def test_pct_spreads_its_change_points_over_a_long_run():
    """PCT's k is the run's length (`sim.search.run_length`), not a fixed 2,000 actions: at 3
    ranks and 256 buckets a run is about 7,600 actions and the memset must be delayed past the
    end of startup, so with k = 2,000 no PCT schedule caught ``kv-zero-unordered`` there (0 of
    1,167; a fresh helper's finding). With k measured, PCT catches it within a few."""
    from sim.search import PCT_STEPS, run_length

    spec = CheckSpec(ranks=3, buckets=tuple(range(2, 513, 2)), schedules=40, fault_schedules=0,
                     jobs=1)
    variant = REGISTRY["kv-zero-unordered"]
    scenario = variant.scenario(spec.scenario("shared"))
    k = run_length(scenario, variant, "pct", spec.seed)
    assert k > 3 * PCT_STEPS
    assert run_length(scenario, variant, "random", spec.seed) == PCT_STEPS
    row = check_bad(variant, spec, "shared")
    assert row.got == "invariant:I11" and row.stats.schedules <= 20, (row.got, row.detail)
