"""The batch-cap and graph-reserve variants (issue 13 item 1) on simulator v2: each is caught
with its rule, the correct protocol is not, and neither scenario hard-codes a size."""

from dataclasses import replace

import pytest

from protocol.buckets import DEFAULT_DECODE_BUCKETS
from sim.check import CheckSpec, check_bad, check_correct
from sim.scenario import default_scenario
from sim.variants import REGISTRY
from sim.variants_admission import off_stride_max_batch, reserve_short_by_the_pool

SPEC = CheckSpec(schedules=10, fault_schedules=0, jobs=1)
SMALL = {"buckets": (1, 2, 4, 8, 16), "max_batch": 16}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,verdict,words", [
    ("row-cap-as-bucket-cap", "invariant:I7", "leaves out bucket"),
    ("measure-once", "oom", "out of memory"),
])
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
@pytest.mark.parametrize("config", [{}, SMALL], ids=["default", "small"])
def test_variant_is_caught_with_its_rule(name, verdict, words, topology, config):
    spec = replace(SPEC, **config)
    row = check_bad(REGISTRY[name], spec, topology)
    assert row.got == verdict, row.detail
    assert words in row.minimal.outcome.detail
    assert row.minimal.outcome.step is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("adjust", [off_stride_max_batch, reserve_short_by_the_pool])
def test_correct_protocol_has_no_failure_in_those_scenarios(adjust):
    variant = replace(REGISTRY["correct"], name=f"correct-{adjust.__name__}", adjust=adjust)
    rows = check_correct(variant, CheckSpec(schedules=5, fault_schedules=0, jobs=1), "shared")
    assert rows[0].stats.schedules == 5 and rows[0].stats.failing == 0


def test_scenarios_follow_the_configuration():
    small = default_scenario(buckets=(1, 2, 4, 8, 16), max_batch=16)
    assert off_stride_max_batch(small).config.max_batch == 15
    default = default_scenario()
    assert off_stride_max_batch(default).config.max_batch == DEFAULT_DECODE_BUCKETS[-1] - 1
    adjacent = default_scenario(buckets=(1, 2), max_batch=2)
    assert off_stride_max_batch(adjacent) == adjacent  # no value between 1 and 2
    # a max batch that is no bucket is the user's to keep (it was replaced by 7, silently), and
    # one that is a bucket becomes one row less, never more
    users = default_scenario(buckets=(1, 2, 4, 8), max_batch=3)
    assert off_stride_max_batch(users) == users
    assert off_stride_max_batch(default_scenario(buckets=(1, 2, 4, 8), max_batch=4)).config.max_batch == 3
    assert off_stride_max_batch(default_scenario(buckets=(5, 10, 20), max_batch=5)).config.max_batch == 4
    assert off_stride_max_batch(default_scenario(buckets=(3, 5), max_batch=3)).config.max_batch == 2
    assert reserve_short_by_the_pool(small).memory.capacity < reserve_short_by_the_pool(default).memory.capacity
    single = default_scenario(buckets=(4,), max_batch=4)
    assert reserve_short_by_the_pool(single) == single  # one candidate cap: nothing to drop


@pytest.mark.timeout(120)
def test_row_cap_as_bucket_cap_is_caught_at_the_user_s_own_off_stride_max_batch():
    row = check_bad(REGISTRY["row-cap-as-bucket-cap"],
                    CheckSpec(buckets=(1, 2, 4, 8), max_batch=3, schedules=10, fault_schedules=0,
                              jobs=1), "shared")
    assert row.got == "invariant:I7" and "a full batch of 3 rows" in row.detail, row.detail


@pytest.mark.timeout(60)
def test_measure_once_s_memory_allows_for_headroom_and_the_busiest_rank():
    """`reserve_short_by_the_pool` sizes the device above the fit's budget by the weights, the
    largest rank overhead, the eager activations and the headroom the protocol leaves free, so
    the same fit (the second candidate cap) comes out whatever those are. The check's scenarios
    have no headroom and no overhead, so nothing else tried one: subtracting the headroom
    (mutant #3099) or the overhead (#3119) left the correct protocol a smaller cap."""
    from protocol.eligibility import GraphPlan
    from protocol.memory import candidate_caps
    from sim.run import run_schedule
    from sim.strategies import RandomWalk

    base = default_scenario(**SMALL, memory_headroom_bytes=48 << 20)
    sc = base.with_(memory=replace(base.memory, rank_overhead=((1, 40 << 20),)))
    caps = candidate_caps(GraphPlan.from_config(sc.config).buckets, sc.config.max_batch)
    adjusted = reserve_short_by_the_pool(sc)
    assert adjusted.memory.capacity == (reserve_short_by_the_pool(default_scenario(**SMALL))
                                        .memory.capacity + (48 << 20) + (40 << 20))
    correct = run_schedule(adjusted, REGISTRY["correct"], RandomWalk(0))
    assert correct.outcome.verdict == "clean", correct.outcome.detail
    assert correct.world.ctrl.memory.batch_cap == caps[1]
    bad = run_schedule(adjusted, REGISTRY["measure-once"], RandomWalk(0))
    assert bad.outcome.verdict == "oom", bad.outcome.detail
    assert bad.world.ctrl.memory.batch_cap == caps[1]
