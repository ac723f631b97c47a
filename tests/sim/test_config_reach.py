"""What a configuration lets a check reach: `lockstep check` refuses one whose clean rows could
only be vacuous (the serving steps do not depend on the schedule, so one run tells), and a
variant whose bug needs two captured buckets reads "not reachable here" with one."""

from __future__ import annotations

import pytest

from protocol.errors import ConfigError
from sim.check import check_coverage_reachable
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import PCT, RandomWalk
from sim.variants import CORRECT, get_variant

COVERAGE = ("replay", "padded_replay", "compaction_moves_live")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("buckets, max_batch, lanes", [((2,), 2, False), ((1, 2, 4, 8), 3, False),
                                                       ((4, 8), 3, False), ((16,), 9, True),
                                                       ((16,), 8, True)])
def test_serving_steps_reach_the_same_events_whatever_the_schedule(buckets, max_batch, lanes):
    scenario = default_scenario(buckets=buckets, max_batch=max_batch).with_(data_parallel=lanes)
    seen = set()
    for chooser in [RandomWalk(s) for s in range(8)] + [PCT(s) for s in range(4)]:
        run = run_schedule(scenario, CORRECT, chooser)
        seen.add(tuple(run.reached.get(e, 0) for e in COVERAGE + ("idle_rank_step",)))
    assert len(seen) == 1, seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_data_parallel_pair_finds_an_idle_lane_by_drawing_the_workload(ranks):
    """At max batch 9 on two ranks no serving step of the check's own workload leaves a lane
    idle (a fresh user's --buckets 16 --max-batch 9 ended FAILED on this pair; a later fix
    called it "not reachable here"). The pair now draws the workload per run
    (`WorkloadDraw`), so the bug is caught there and the clean row reaches an idle lane, while
    the same clean row over the undrawn workload reads vacuous."""
    from dataclasses import replace

    from sim.check import CheckSpec, check_bad, check_correct
    from sim.run import correct_run

    spec = CheckSpec(ranks=ranks, buckets=(16,), max_batch=9, schedules=30, fault_schedules=0,
                     jobs=1)
    bad, clean = get_variant("dp-idle-rank-skips-forward"), get_variant("dp-idle-rank-dummy-batch")
    if ranks == 2:
        assert not correct_run(clean.scenario(spec.scenario("shared"))).reached.get(
            "idle_rank_step")
        [undrawn] = check_correct(replace(clean, draw=None), spec, "shared")
        assert undrawn.got == "vacuous" and "idle_rank_step" in undrawn.detail, undrawn.detail
    assert check_bad(bad, spec, "shared").got == "divergence"
    [row] = check_correct(clean, spec, "shared")
    assert row.got == "clean" and "idle_rank_step" in row.detail, row.detail


@pytest.mark.parametrize("buckets, max_batch, needle", [
    ((1, 2, 4, 8), 1, "a single slot never compacts"),
    ((1, 2, 4, 8), 2, "every batch size is a bucket"),
    ((2,), 2, "with two slots a retirement can only move the last slot"),
    ((4, 8), 2, "with two slots"),
    # every row count the check's 17 requests can make is a bucket: nothing pads
    (tuple(range(1, 18)) + (32,), 32,
     "no serving step of the check's workload reaches a padded graph replay"),
])
def test_a_configuration_that_reaches_no_padded_replay_or_compaction_is_refused(
        buckets, max_batch, needle):
    with pytest.raises(ConfigError, match=needle):
        check_coverage_reachable(default_scenario(buckets=buckets, max_batch=max_batch))


@pytest.mark.parametrize("buckets, max_batch", [((4,), 4), ((8,), 3), ((4, 8), 3),
                                                ((1, 2, 4, 8), 3)])
def test_small_configurations_that_pad_and_compact_are_accepted(buckets, max_batch):
    check_coverage_reachable(default_scenario(buckets=buckets, max_batch=max_batch))


@pytest.mark.parametrize("name", ["local-bucket", "single-warmup", "profile-largest-only",
                                  "measure-once", "row-cap-as-bucket-cap"])
def test_bugs_that_need_two_buckets_are_not_reachable_with_one(name):
    variant = get_variant(name)

    def reason(scenario):
        return variant.unreachable(variant.scenario(scenario))

    for buckets, max_batch in (((4,), 4), ((8,), 3)):
        why = reason(default_scenario(buckets=buckets, max_batch=max_batch))
        assert why and "bucket" in why, (buckets, max_batch, why)
    assert reason(default_scenario()) is None
    assert reason(default_scenario(buckets=(1, 2, 4, 8), max_batch=8)) is None


@pytest.mark.parametrize("buckets, max_batch, wave", [
    (None, 256, 9), ((1, 2, 4, 8), 3, 3), ((16,), 9, 9), ((16, 32), 20, 17),
    ((16, 32), 17, 17), ((64, 128), 100, 65), ((8, 16), 9, 9), ((8, 16), 12, 9)])
def test_the_first_wave_outgrows_the_smallest_bucket_below_max_batch(buckets, max_batch, wave):
    from protocol.buckets import DEFAULT_DECODE_BUCKETS
    from sim.scenario import first_wave

    buckets = DEFAULT_DECODE_BUCKETS if buckets is None else buckets
    assert first_wave(max_batch, buckets) == wave
    scenario = default_scenario(buckets=buckets, max_batch=max_batch)
    assert sum(a.after_step == 0 for a in scenario.workload) == wave


@pytest.mark.timeout(120)
def test_a_drawn_workload_of_a_large_first_wave_replays(tmp_path, capsys):
    """At buckets 64,128 and max batch 100 the workload has 65 + 8 requests; a trace lists each
    one's drawn prompt length, and replays refused more than 64 of them (the bound of the
    17-request workload)."""
    import json

    from lockstep.cli import main

    argv = ["check", "--variant", "short-path-first-row", "--buckets", "64,128", "--max-batch",
            "100", "--topology", "shared", "--no-progress", "--jobs", "1"]
    assert main(argv + ["--trace-out", str(tmp_path)]) == 0
    trace = tmp_path / "short-path-first-row.shared.json"
    assert len(json.loads(trace.read_text())["scenario"]["prompt_lengths"]) == 73
    capsys.readouterr()
    assert main(["check", "--replay", str(trace)]) == 0
    assert "==> divergence" in capsys.readouterr().out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("buckets, max_batch", [((4, 8), 3), ((12,), None), ((3,), None),
                                                ((2, 4), 3), ((7, 8), None), (None, None)])
def test_reserve_by_requested_batch_is_reachable_exactly_where_the_correct_fit_survives(
        buckets, max_batch):
    """The variant's memory leaves rank 1 room for every graph plus 1.5 KV pages. Where the fit
    has one candidate cap it cannot drop a graph, so the correct protocol refuses startup too
    and the variant's refusal is not its bug's (a review's finding: it read "ok" at --buckets
    4,8 --max-batch 3). Its row says "not reachable here" exactly there, which is where the
    simulator's own bound says the memory holds no plan (`sim.headroom.refusal_expected`):
    the correct protocol's refusal is then its right answer, so its row, which never served,
    reads vacuous (it read startup-refused, a failure, before refusals were judged by that
    bound)."""
    from dataclasses import replace

    from sim.check import CheckSpec, check_bad, check_correct
    from sim.headroom import refusal_expected

    spec = CheckSpec(buckets=buckets, max_batch=max_batch, schedules=5, fault_schedules=0,
                     jobs=1)
    variant = get_variant("reserve-by-requested-batch")
    scenario = variant.scenario(spec.scenario("shared"))
    why = variant.unreachable(scenario)
    tight_correct = replace(CORRECT, name="correct-under-tight-memory", adjust=variant.adjust,
                            expected={"shared": "clean", "per-rank": "clean"},
                            fault_schedules=0)
    row = check_correct(tight_correct, spec, "shared")[0]   # no faulted row: fault_schedules=0
    assert refusal_expected(scenario) == (why is not None)
    if why is None:
        assert row.got == "clean", row.detail
        assert check_bad(variant, spec, "shared").got == "startup-refused"
    else:
        assert "one candidate cap" in why
        assert row.got == "vacuous", row.detail
        assert row.stats.verdicts == {"startup-refused": 5}
        assert "5 refused at startup, as their memory requires" in row.detail


@pytest.mark.timeout(120)
def test_an_eager_forward_connects_its_all_reduce_size():
    """H4 as docs/hazards.md defines it: a record fails only where its all-reduce size never ran
    eagerly on that rank. The memory profile's eager forward at the largest bucket runs that
    size; the story used to show the profile's all-reduce complete and then a lazy connect at
    that very size (a review's finding). single-warmup warms one size, the smallest: at the
    default buckets its lazy connect is now at the next bucket below the largest; at 4,8 the
    profile and the warm-up cover both sizes, no record connects lazily, and the I5 rule check
    alone reports the skipped warm-up."""
    from sim.check import CheckSpec, check_bad
    from sim.report import narrative

    def story(buckets):
        row = check_bad(get_variant("single-warmup"), CheckSpec(
            buckets=buckets, schedules=10, fault_schedules=0, jobs=1), "shared")
        assert row.got == "invariant:I5"
        return narrative(row.minimal)

    default = story(None)
    assert "inside the capture of decode@248" in default
    assert "inside the capture of decode@256" not in default
    small = story((4, 8))
    assert "connects lazily" not in small
    assert "recorded graph decode@8 before any warm-up all-reduce" in small
