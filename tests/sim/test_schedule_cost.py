"""tools/schedule_cost.py replays recorded schedules exactly: a replay without probes ends where
the recorded run ended, with the same trace, so the split it prints is of the same work."""

from sim.check import CheckSpec
from sim.run import run_schedule
from sim.search import _chooser
from sim.variants import get_variant
from sim.world import World
from tests.tools import load_tool

schedule_cost = load_tool("schedule_cost")


def test_a_replay_without_probes_is_the_recorded_run():
    variant = get_variant("correct")
    scenario = variant.scenario(CheckSpec(buckets=(1, 2, 4, 8), max_batch=6).scenario("shared"))
    (path,) = schedule_cost.record(scenario, variant, 1)
    recorded = run_schedule(scenario, variant, _chooser("random", 0, 0))
    assert [actor for _, actor in path] == recorded.choices
    world = World(scenario, variant)
    for settles, actor in path:
        for _ in range(settles):
            world.settle()
        world.step(actor)
    assert world.outcome == recorded.outcome and world.trace == recorded.world.trace
    for mode in schedule_cost.MODES:
        schedule_cost.run(mode, scenario, variant, [path])
