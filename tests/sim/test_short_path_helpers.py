"""The simulator's helpers that read the plan's buckets, with the short decode path on (I22):
a bucket then holds two graphs (``decode@b``, ``decode-short@b``), which a helper that means
buckets must count once and one that means graphs must count twice."""

import pytest

from protocol.eligibility import GraphPlan
from protocol.keys import SHORT
from protocol.memory import candidate_caps
from sim.run import run_schedule
from sim.scenario import default_scenario, short_path_on
from sim.strategies import RandomWalk
from sim.variants import (REGISTRY, NeedsTwoBuckets, _graph_buckets, _policy_cap_below_largest,
                          tight_memory)
from sim.variants_admission import reserve_short_by_the_pool

CONFIGS = [{}, {"buckets": (1, 2, 4, 8, 16), "max_batch": 12},
           {"buckets": (1, 2, 4, 8), "max_batch": 6}]
IDS = ["default", "16-at-12", "8-at-6"]


def _short(**kwargs):
    sc = short_path_on(default_scenario(**kwargs))
    plan = GraphPlan.from_config(sc.config)
    assert sc.config.short_context is not None
    assert any(k.path == SHORT for k in plan.keys())  # some bucket holds both paths
    return sc, plan


@pytest.mark.parametrize("kwargs", CONFIGS, ids=IDS)
def test_the_graph_buckets_are_each_bucket_once(kwargs):
    sc, plan = _short(**kwargs)
    buckets = _graph_buckets(sc)
    assert buckets == tuple(sorted({k.bucket for k in plan.keys()}))
    assert len(set(buckets)) == len(buckets) < len(plan.keys())
    assert buckets == _graph_buckets(default_scenario(**kwargs))  # as with the path off


def test_one_bucket_with_both_paths_is_still_one_bucket():
    """Old behaviour: at max batch 1 the sweep captures decode@1 and decode-short@1, read as
    two buckets, so local-bucket, single-warmup and profile-largest-only were searched (and
    came out clean) where their bug cannot show."""
    sc, plan = _short(max_batch=1)
    assert {k.bucket for k in plan.keys()} == {1} and len(plan.keys()) == 2
    reason = NeedsTwoBuckets("why")(sc)
    assert reason == "the sweep captures one bucket (1) at max batch 1: why"
    for name in ("local-bucket", "single-warmup", "profile-largest-only"):
        variant = REGISTRY[name]
        assert variant.unreachable(variant.scenario(sc)) is not None, name


@pytest.mark.parametrize("kwargs", CONFIGS, ids=IDS)
def test_the_policy_cap_is_one_bucket_below_the_largest_the_sweep_captures(kwargs):
    """The largest captured bucket counts even where it holds more rows than max batch (16 at
    max batch 12: batches of 9-12 replay it)."""
    sc, plan = _short(**kwargs)
    captured = sorted({k.bucket for k in plan.keys()})
    cap = _policy_cap_below_largest(sc).config.graph_batch_cap
    assert cap == captured[-2] < captured[-1]  # the cap forbids the largest bucket, keeps the next
    variant = REGISTRY["split-eligibility"]
    result = run_schedule(variant.scenario(sc), variant, RandomWalk(0))
    assert result.outcome.verdict in ("divergence",) + variant.also_expected, result.outcome.detail


@pytest.mark.parametrize("kwargs", CONFIGS, ids=IDS)
def test_measure_once_is_caught_by_its_reserve_not_by_a_failed_measurement(kwargs):
    """Old behaviour: keyed by bucket, the increments of decode-short@b overwrote those of
    decode@b, so the capacity left no room to measure every graph: the correct protocol ran
    out of memory too, and measure-once's oom was not its bug's."""
    sc, plan = _short(**kwargs)
    adjusted = reserve_short_by_the_pool(sc)
    caps = candidate_caps(plan.buckets, sc.config.max_batch)
    correct = run_schedule(adjusted, REGISTRY["correct-short-path"], RandomWalk(0))
    assert correct.outcome.verdict == "clean", correct.outcome.detail
    assert correct.world.ctrl.memory.batch_cap == caps[1]  # every graph does not fit beside KV
    assert correct.reached.get("short_replay")
    bad = run_schedule(adjusted, REGISTRY["measure-once"], RandomWalk(0))
    assert bad.outcome.verdict == "oom", bad.outcome.detail
    assert bad.world.ctrl.memory.batch_cap == caps[1]  # the same fit, the smaller reserve


@pytest.mark.parametrize("kwargs", CONFIGS[:2], ids=IDS[:2])
def test_tight_memory_counts_every_graph_of_both_paths(kwargs):
    sc, plan = _short(**kwargs)
    adjusted = tight_memory(sc)
    correct = run_schedule(adjusted, REGISTRY["correct-short-path"], RandomWalk(0))
    assert correct.outcome.verdict == "clean", correct.outcome.detail
    assert correct.world.ctrl.memory.batch_cap < sc.config.max_batch
    assert correct.reached.get("short_replay")
    bad = run_schedule(adjusted, REGISTRY["reserve-by-requested-batch"], RandomWalk(0))
    assert bad.outcome.verdict == "startup-refused", bad.outcome.detail
