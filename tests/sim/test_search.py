"""Search strategies: exhaustive completes and finds the shortest bugs, Hypothesis shrinks,
the reducer removes switches, property (a) for the correct protocol under faults."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.check import CLEAN, CheckSpec, Fixed, check_bad, random_fault
from sim.reduce import reduce_schedule, switch_points
from sim.run import run_schedule
from sim.scenario import Fault, default_scenario
from sim.search import exhaustive_search, hypothesis_search, sample_search
from sim.strategies import Drawn, RandomWalk, Sticky
from sim.variants import REGISTRY

TINY = dict(buckets=(1, 2), max_batch=2)
clean = lambda r: r.outcome.verdict == "clean"  # noqa: E731


@pytest.mark.timeout(120)
def test_exhaustive_correct_tiny_completes_clean():
    sc = default_scenario(**TINY)
    res = exhaustive_search(sc, REGISTRY["correct"], clean, time_budget=100)
    assert res.failure is None, res.failure and res.failure.outcome.detail
    assert res.stats.complete and res.stats.unique_states > 100


@pytest.mark.timeout(120)
def test_exhaustive_finds_fused_sweep_deadlock():
    res = exhaustive_search(default_scenario(**TINY), REGISTRY["fused-sweep"], clean, time_budget=100)
    assert res.failure is not None and res.failure.outcome.verdict == "deadlock"


@pytest.mark.timeout(120)
def test_hypothesis_search_shrinks_a_counterexample():
    sc = default_scenario(**TINY)
    res = hypothesis_search(sc, REGISTRY["fused-sweep"], clean, max_examples=50, seed=1)
    assert res.failure is not None and res.failure.outcome.verdict == "deadlock"


def test_reducer_keeps_verdict_and_removes_switches():
    sc = default_scenario()
    variant = REGISTRY["fused-sweep"]
    failing = next(r for r in (run_schedule(sc, variant, RandomWalk(s)) for s in range(50))
                   if r.outcome.verdict == "deadlock")
    reduced = reduce_schedule(sc, variant, failing, time_budget=5)
    assert reduced.outcome.verdict == "deadlock"
    assert len(switch_points(reduced.choices)) <= len(switch_points(failing.choices))


def test_reducer_runs_each_candidate_once_and_counts_a_repeat_as_an_attempt(monkeypatch):
    """A repeated candidate is looked up, not re-run; it still spends an attempt, so the
    minimal trace is the one a reducer that re-ran it finds."""
    import sim.reduce

    variant = REGISTRY["kv-zero-unordered"]  # its reduction meets candidates again
    failing = check_bad(variant, CheckSpec(), "shared", reduce=False).minimal
    sc = failing.world.scenario
    made = []

    def counted(scenario, v, chooser):
        made.append(tuple(sorted(chooser.switches)))
        return run_schedule(scenario, v, chooser)

    monkeypatch.setattr(sim.reduce, "run_schedule", counted)
    reduced = reduce_schedule(sc, variant, failing, max_attempts=8)
    assert len(made) == len(set(made)) < 9  # 8 attempts and the final run, some the same
    monkeypatch.undo()
    rerun = run_schedule(sc, variant, Sticky(switch_points(reduced.choices)))
    assert (rerun.choices, rerun.outcome.verdict) == (reduced.choices, reduced.outcome.verdict)


@pytest.mark.timeout(120)
@settings(max_examples=25)
@given(st.data(), st.sampled_from(["shared", "per-rank"]), st.integers(0, 10_000))
def test_correct_protocol_never_deadlocks_or_diverges_and_faults_fail_globally(data, topology, seed):
    """Property (a)."""
    sc = default_scenario(topology=topology, buckets=(1, 2, 4, 8), max_batch=8)
    if data.draw(st.booleans()):
        sc = sc.with_(faults=(random_fault(sc, seed, seed),))
    result = run_schedule(sc, REGISTRY["correct"], Drawn(lambda n: data.draw(st.integers(0, n - 1))))
    assert result.outcome.verdict in ("clean", "abort"), result.outcome.detail
    if sc.faults and result.reached.get("fault_fired") and sc.faults[0].kind != "slow":
        assert result.outcome.verdict == "abort"
        assert result.world.trace[-1].kind == "abort"


def test_sample_search_stats_are_consistent():
    res = sample_search(lambda i: default_scenario(**TINY), REGISTRY["correct"], clean, "pct", 20)
    s = res.stats
    assert s.schedules == 20 and s.failing == 0 and s.actions >= 20 * s.max_depth // 4
    assert "schedules=20" in s.line()


def test_fault_kinds_validated():
    from protocol.errors import ConfigError
    with pytest.raises(ConfigError, match="fault kind 'explode'"):
        Fault("explode", 0, "record")
    with pytest.raises(ConfigError, match="fault on rank 5"):
        default_scenario().with_(faults=(Fault("raise", 5, "record"),))
    with pytest.raises(ConfigError, match="topology 'ring'"):
        default_scenario(topology="ring")


def test_action_bound_gives_livelock_verdict():
    sc = default_scenario(**TINY).with_(max_actions=50)
    result = run_schedule(sc, REGISTRY["correct"], RandomWalk(0))
    assert result.outcome.verdict == "livelock"
    assert "no end after 50 actions" in result.outcome.detail


def test_three_ranks_correct_is_clean_and_fused_sweep_deadlocks():
    sc = default_scenario(world_size=3, buckets=(1, 2, 4), max_batch=4)
    assert run_schedule(sc, REGISTRY["correct"], RandomWalk(3)).outcome.verdict == "clean"
    verdicts = {run_schedule(sc, REGISTRY["fused-sweep"], RandomWalk(s)).outcome.verdict for s in range(20)}
    assert "deadlock" in verdicts


@pytest.mark.timeout(300)
def test_rank_symmetry_reduction_agrees_with_unreduced_search_on_tp3():
    sc = default_scenario(world_size=3, buckets=(1,), max_batch=1)
    plain = exhaustive_search(sc, REGISTRY["correct"], clean, time_budget=250, symmetry=False)
    sym = exhaustive_search(sc, REGISTRY["correct"], clean, time_budget=250, symmetry=True)
    assert plain.stats.complete and sym.stats.complete
    assert plain.failure is None and sym.failure is None
    assert set(plain.stats.verdicts) == set(sym.stats.verdicts) == {"clean"}
    assert sym.stats.unique_states < plain.stats.unique_states
    bad_plain = exhaustive_search(sc, REGISTRY["fused-sweep"], clean, time_budget=100, symmetry=False)
    bad_sym = exhaustive_search(sc, REGISTRY["fused-sweep"], clean, time_budget=100, symmetry=True)
    assert bad_plain.failure.outcome.verdict == bad_sym.failure.outcome.verdict == "deadlock"


def test_symmetry_is_not_applied_when_a_fault_names_a_rank():
    from sim.world import World
    sc = default_scenario(world_size=3).with_(faults=(Fault("raise", 2, "record"),))
    assert not World(sc, REGISTRY["correct"]).symmetry_is_sound()
    assert World(default_scenario(world_size=3), REGISTRY["correct"]).symmetry_is_sound()


@pytest.mark.timeout(120)
def test_parallel_search_matches_serial():
    sc = default_scenario(**TINY)
    serial = sample_search(Fixed(sc), REGISTRY["fused-sweep"], CLEAN, "random", 40, jobs=1,
                           stop_on_failure=False)
    parallel = sample_search(Fixed(sc), REGISTRY["fused-sweep"], CLEAN, "random", 40, jobs=2,
                             stop_on_failure=False)
    assert serial.stats.schedules == parallel.stats.schedules == 40
    assert serial.stats.verdicts == parallel.stats.verdicts
    assert serial.failure.choices == parallel.failure.choices


@pytest.mark.timeout(120)
def test_parallel_early_stop_reports_the_lowest_failing_run():
    """With stop on failure, the reported failure is the serial one whatever the job count."""
    sc = default_scenario(**TINY)
    serial = sample_search(Fixed(sc), REGISTRY["fused-sweep"], CLEAN, "random", 100, jobs=1)
    parallel = sample_search(Fixed(sc), REGISTRY["fused-sweep"], CLEAN, "random", 100, jobs=2)
    assert serial.failure is not None
    assert serial.failure.choices == parallel.failure.choices
