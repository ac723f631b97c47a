"""Search strategies: exhaustive completes and finds the shortest bugs, Hypothesis shrinks,
the reducer removes switches, property (a) for the correct protocol under faults."""

import os
import time
from dataclasses import dataclass
from pathlib import Path

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

    variant = REGISTRY["unfenced-preempt-store"]  # needs 43 runs; meets 2 again in its first 8
    failing = check_bad(variant, CheckSpec(), "shared", reduce=False).minimal
    sc = failing.world.scenario
    made = []

    def counted(scenario, v, chooser):
        made.append(tuple(sorted(chooser.switches)))
        return run_schedule(scenario, v, chooser)

    monkeypatch.setattr(sim.reduce, "run_schedule", counted)
    reduced = reduce_schedule(sc, variant, failing, max_attempts=8)
    assert len(made) == len(set(made)) < 8  # 8 attempts, some of them a run made before
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


@dataclass(frozen=True)
class _LateChunk:
    """Run index -> ``family``'s scenario; in a worker process, run ``slow`` first waits until
    run ``after`` has started (a file ``marker`` written by that run) and a second more, so
    the chunk holding ``slow`` finishes after the chunk whose last run is ``after``
    (picklable)."""

    family: object
    slow: int
    after: int
    marker: str
    parent: int

    def __call__(self, index: int):
        if os.getpid() != self.parent:
            if index == self.after:
                Path(self.marker).touch()
            elif index == self.slow:
                from sim.guard import paused

                with paused():  # waiting on purpose, not a stalled hook (`sim.guard`)
                    stop = time.monotonic() + 60
                    while not Path(self.marker).exists() and time.monotonic() < stop:
                        time.sleep(0.01)
                    time.sleep(1.0)
        return self.family(index)


def _serial_and_late_parallel(tmp_path, serial_progress=None, parallel_progress=None):
    """kv-zero-unordered under PCT at seed 2 searched with ``jobs=1``, then with ``jobs=2``
    where the second pooled chunk finishes before the first, which holds the first failure
    (run 7, past the serial probe `sim.search.PROBE`): (serial result, parallel result)."""
    from sim.check import bad_search_setup
    from sim.search import CHUNK, PROBE, _chooser, run_length

    variant = REGISTRY["kv-zero-unordered"]
    spec = CheckSpec(strategy="pct", seed=2, schedules=300, fault_schedules=0)
    family, acceptable, reason = bad_search_setup(variant, spec, "shared")
    assert reason is None
    serial = sample_search(family, variant, acceptable, "pct", spec.schedules, seed=spec.seed,
                           jobs=1, progress=serial_progress)
    first = serial.stats.schedules - 1
    assert serial.failure is not None and PROBE <= first < PROBE + CHUNK
    # the last run the second pooled chunk makes: its first failing one, else its last
    steps = run_length(family(0), variant, "pct", spec.seed)
    second = range(PROBE + CHUNK, PROBE + 2 * CHUNK)
    last = next((i for i in second if not acceptable(
        run_schedule(family(i), variant, _chooser("pct", spec.seed, i, steps)))), second[-1])
    late = _LateChunk(family, first, last, str(tmp_path / "marker"), os.getpid())
    parallel = sample_search(late, variant, acceptable, "pct", spec.schedules, seed=spec.seed,
                             jobs=2, progress=parallel_progress)
    return serial, parallel


@pytest.mark.timeout(300)
def test_parallel_stats_of_a_failure_past_the_probe_are_the_serial_ones(tmp_path):
    """A later chunk that finished before the failing one used to be merged, so `lockstep
    check --jobs 2 --json` counted more schedules and states than `--jobs 1` for the same
    verdict and counterexample. Here that later chunk is made to finish first; the statistics
    are still the serial search's."""
    serial, parallel = _serial_and_late_parallel(tmp_path)
    assert parallel.failure.choices == serial.failure.choices
    for name in ("schedules", "actions", "max_depth", "failing", "verdicts", "reached"):
        assert getattr(parallel.stats, name) == getattr(serial.stats, name), name


@pytest.mark.timeout(300)
def test_parallel_progress_counts_only_the_merged_chunks(tmp_path):
    """Old behaviour: the progress bar was advanced by every chunk as it finished, so the later
    chunk that finished before the failing one was counted though its statistics are not
    merged: the bar counted that chunk's runs beyond the schedules the search reports. Now it
    counts a chunk once every chunk before it has finished, and only a merged one."""
    serial_steps, parallel_steps = [], []
    serial, parallel = _serial_and_late_parallel(tmp_path, serial_steps.append,
                                                 parallel_steps.append)
    assert sum(serial_steps) == serial.stats.schedules
    assert sum(parallel_steps) == parallel.stats.schedules == serial.stats.schedules
    steps = []  # without stop on failure every chunk is merged, and counted as it finishes
    every = sample_search(Fixed(default_scenario(**TINY)), REGISTRY["fused-sweep"], CLEAN,
                          "random", 60, stop_on_failure=False, jobs=2, progress=steps.append)
    assert sum(steps) == every.stats.schedules == 60 and every.stats.failing == 60
