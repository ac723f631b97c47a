"""Sound symmetry (issue 11 item 5): the state fingerprint holds each rank's pending ops, and a
variant whose code singles out a rank declares itself asymmetric, which turns the reduction off."""

import pytest

from protocol.backend import SYNC
from protocol.worker import Worker
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.search import exhaustive_search
from sim.strategies import RandomWalk
from sim.variants import REGISTRY, Variant
from sim.world import World

TINY = dict(buckets=(1, 2), max_batch=2)


class LastRankSkipsSync(Worker):
    """Only the last rank acks a Launch before its collectives drained."""

    def _ops_launch(self, command):
        ops = super()._ops_launch(command)
        return [op for op in ops if op is not SYNC] if self.rank == self.world_size - 1 else ops


ASYM = Variant(name="last-rank-skips-sync-test", summary="test", source="test",
               expected={"shared": "invariant:I11", "per-rank": "invariant:I11"},
               worker_cls=LastRankSkipsSync, symmetric=False)


def test_a_variant_that_singles_out_a_rank_turns_symmetry_off():
    sc = default_scenario(world_size=3, **TINY)
    assert World(sc, REGISTRY["correct"]).symmetry_is_sound()
    assert not World(sc, ASYM).symmetry_is_sound()
    assert not World(sc, REGISTRY["no-liveness"]).symmetry_is_sound()


def test_the_fingerprint_holds_pending_ops():
    sc = default_scenario(**TINY)
    world = run_schedule(sc.with_(max_actions=40), REGISTRY["correct"], RandomWalk(0)).world
    busy = next(h for h in world.hosts if h.run is not None)
    before = world.fingerprint()
    busy.run.ops = busy.run.ops[:busy.run.pc] + list(reversed(busy.run.ops[busy.run.pc:])) + [SYNC]
    assert world.fingerprint() != before


@pytest.mark.timeout(300)
def test_reduced_and_unreduced_exhaustive_agree_on_an_asymmetric_variant_at_tp3():
    sc = default_scenario(world_size=3, **TINY)
    clean = lambda r: r.outcome.verdict == "clean"  # noqa: E731
    plain = exhaustive_search(sc, ASYM, clean, time_budget=120, symmetry=False)
    reduced = exhaustive_search(sc, ASYM, clean, time_budget=120, symmetry=True)
    assert plain.failure is not None and reduced.failure is not None
    assert (plain.failure.outcome.verdict, plain.failure.outcome.invariant) == \
        (reduced.failure.outcome.verdict, reduced.failure.outcome.invariant) == ("invariant", "I11")
    assert plain.stats.unique_states == reduced.stats.unique_states
