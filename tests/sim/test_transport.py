"""The transport, not the world, hands replies to the controller (issue 11 item 1): one reply per
action, in any order, so the controller's own step lock (I1) is what is tested."""

import pytest

from protocol.controller import Controller
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import REGISTRY, Variant

SMALL = dict(buckets=(1, 2, 4), max_batch=4)


class EarlyController(Controller):
    """The mutant of issue 11: sends the next command once rank 0's reply alone is in."""

    def uncollected(self):
        missing = super().uncollected()
        return () if self.current is not None and 0 in self.replies else missing


EARLY = Variant(name="early-step-test", summary="next command after rank 0's reply alone",
                source="issue 11", expected={"shared": "invariant:I1", "per-rank": "invariant:I1"},
                controller_cls=EarlyController)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
def test_controller_that_sends_after_rank_0_alone_is_caught_by_i1(topology):
    sc = default_scenario(topology=topology, **SMALL)
    for seed in range(5):
        result = run_schedule(sc, EARLY, RandomWalk(seed))
        assert result.outcome.verdict == "invariant", result.outcome.detail
        assert result.outcome.invariant == "I1"
        assert result.outcome.rank == 1 and result.outcome.step is not None


@pytest.mark.timeout(60)
def test_replies_arrive_one_at_a_time_in_any_order():
    sc = default_scenario(**SMALL)
    orders = set()
    early_delivery = False
    for seed in range(8):
        world = run_schedule(sc, REGISTRY["correct"], RandomWalk(seed)).world
        assert world.outcome.verdict == "clean"
        trace = world.trace
        received: dict[int, list[int]] = {}
        for i, e in enumerate(trace):
            if e.kind == "receive":
                received.setdefault(e.seq, []).append(e.rank)
                # delivered while another rank still executes the same command
                if any(f.kind == "reply" and f.seq == e.seq and f.rank != e.rank
                       for f in trace[i + 1:]):
                    early_delivery = True
        orders |= {tuple(ranks) for ranks in received.values()}
    assert {(0, 1), (1, 0)} <= orders
    assert early_delivery


@pytest.mark.timeout(60)
def test_correct_controller_never_sends_early():
    sc = default_scenario(world_size=3, **SMALL)
    for seed in range(3):
        result = run_schedule(sc, REGISTRY["correct"], RandomWalk(seed))
        assert result.outcome.verdict == "clean", result.outcome.detail
