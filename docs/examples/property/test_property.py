"""Property-based tests of a TP step protocol with lockstep's simulator (docs/python-api.md).

Run with `python -m pytest docs/examples/property/test_property.py` from the repository's
root, with lockstep's environment (`.venv/bin/python`, or after `source .venv/bin/activate`). Hypothesis draws the configuration (ranks, buckets, max batch,
process topology); the simulator searches interleavings of each.
"""

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from protocol.errors import ConfigError
from sim.check import NOT_REACHABLE, CheckSpec, check_coverage_reachable, check_variant
from sim.checks import attribute_divergence
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.search import sample_search
from sim.strategies import Replay
from sim.variants import CORRECT, get_variant

BUCKET_SIZES = (1, 2, 4, 8, 16, 32)


@st.composite
def scenarios(draw):
    """A small serving configuration the checker can cover: a clean run of it pads a replay
    and compacts a live slot (`check_coverage_reachable`), else it is rejected."""
    buckets = tuple(sorted(draw(st.sets(st.sampled_from(BUCKET_SIZES), min_size=2))))
    max_batch = draw(st.integers(3, buckets[-1])) if buckets[-1] >= 3 else buckets[-1]
    try:
        scenario = default_scenario(topology=draw(st.sampled_from(["shared", "per-rank"])),
                                    world_size=draw(st.integers(2, 4)), buckets=buckets,
                                    max_batch=max_batch)
        check_coverage_reachable(scenario)
    except ConfigError:
        assume(False)
    return scenario


SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


@SETTINGS
@given(scenarios())
def test_the_correct_protocol_is_clean_and_not_vacuous(scenario):
    result = sample_search(lambda run: CORRECT.scenario(scenario), CORRECT,
                           lambda r: r.outcome.verdict == "clean", schedules=10)
    assert result.failure is None, result.failure.outcome.detail
    # a clean search that never replayed or compacted a live slot shows nothing
    assert result.stats.reached["replay"] and result.stats.reached["compaction_moves_live"]


@SETTINGS
@given(scenarios())
def test_a_bucket_chosen_by_each_rank_is_caught_and_replays_exactly(scenario):
    """The check `lockstep check` runs, from Python: its search, with the variant's own draws
    and faults, and the minimal counterexample, reduced."""
    bad = get_variant("local-bucket")  # each rank picks the bucket from its own row count
    config = scenario.config
    spec = CheckSpec(ranks=config.world_size, buckets=config.buckets,
                     max_batch=config.max_batch, schedules=50, jobs=1)
    row = check_variant(bad, spec, scenario.topology)[0]
    assume(row.got != NOT_REACHABLE)  # e.g. buckets 4,8 at max batch 3: every count pads to 4
    assert row.got == bad.expected[scenario.topology] == "divergence", row.detail
    minimal = row.minimal
    again = run_schedule(minimal.world.scenario, bad, Replay(minimal.choices))
    # a divergence seen only by the end-of-run token check gets its step from one more run,
    # as check_variant gave the minimal run its step
    again = attribute_divergence(minimal.world.scenario, bad, again)
    assert again.outcome == minimal.outcome and again.choices == minimal.choices
