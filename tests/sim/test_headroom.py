"""The memory headroom (`ProtocolConfig.memory_headroom_bytes`) under the simulator: the bound
the simulator computes is the protocol's own boundary, a run that serves leaves the headroom free
on every rank (I9, checked when serving starts), and a refusal passes a clean row only where the
memory requires it, so that a controller which drops the headroom, counts it twice or takes it
off another rank's report is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest

from protocol.controller import Controller
from sim.check import CLEAN, CheckSpec
from sim.hazards import HazardModel
from sim.headroom import largest_headroom, refusal_expected
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import CORRECT, eager_decode, get_variant

SMALL = {"buckets": (1, 2, 4, 8), "max_batch": 6}


def _with(sc, headroom=None, overhead=None):
    if overhead is not None:
        sc = sc.with_(memory=replace(sc.memory, rank_overhead=overhead))
    if headroom is not None:
        sc = sc.with_(config=replace(sc.config, memory_headroom_bytes=headroom))
    return sc


def _run(sc, variant=CORRECT, seed=0):
    return run_schedule(sc, variant, RandomWalk(seed))


SCENARIOS = {
    "default": default_scenario(**SMALL),
    "eager": eager_decode(default_scenario(**SMALL)),
    "short-path": default_scenario(**SMALL, short_context=5),
    "numeric-cap": default_scenario(**SMALL, graph_batch_cap=3),
    "one-bucket": default_scenario(buckets=(8,), max_batch=6),
    "rank-1-busy": _with(default_scenario(**SMALL), overhead=((1, 3 << 30),)),
    "three-ranks": _with(default_scenario(**SMALL, world_size=3), overhead=((2, 1 << 30),)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_bound_is_where_the_correct_protocol_stops_serving(name):
    """At the bound the correct protocol serves, with the headroom free on every rank when
    serving starts; one byte past it, it refuses at startup. The bound comes from the memory
    model and the graph plan, not from the controller's fit, so it is a test of that fit."""
    sc = SCENARIOS[name]
    bound = largest_headroom(sc)
    assert bound > 0
    served = _run(_with(sc, headroom=bound))
    assert served.outcome.verdict == "clean", served.outcome.detail
    world = served.world
    assert world.ctrl.memory.kv_pages >= sc.pages_per_seq
    free = [sc.memory.capacity - used for used in world.used]
    assert min(free) >= bound, free
    refused = _run(_with(sc, headroom=bound + 1))
    assert refused.outcome.verdict == "startup-refused", refused.outcome.detail
    assert not refusal_expected(_with(sc, headroom=bound))
    assert refusal_expected(_with(sc, headroom=bound + 1))


class DroppingController(Controller):
    """Sizes the KV cache as if no headroom were configured."""

    def fit_memory(self, reports, graph_bytes):
        return _fit(self, reports, graph_bytes, 0)


class TwiceController(Controller):
    """Takes the headroom off twice."""

    def fit_memory(self, reports, graph_bytes):
        return _fit(self, reports, graph_bytes, 2 * self.config.memory_headroom_bytes)


class RankZeroController(Controller):
    """Fits the memory to rank 0's report alone, whichever rank is the tightest."""

    def fit_memory(self, reports, graph_bytes):
        return super().fit_memory({0: reports[0]}, graph_bytes)


def _fit(ctrl, reports, graph_bytes, headroom):
    from protocol.memory import plan_memory

    cap = ctrl.memory.batch_cap if ctrl.memory else ctrl.config.max_batch
    return plan_memory(reports, graph_bytes, ctrl.plan.buckets, cap, ctrl.config.kv_page_bytes,
                       ctrl.pages_per_seq, headroom, ctrl.config.max_kv_pages)


def _mutant(controller_cls):
    return replace(CORRECT, name=f"correct-{controller_cls.__name__}",
                   controller_cls=controller_cls)


@pytest.mark.timeout(60)
def test_a_controller_that_drops_the_headroom_breaks_i9_when_serving_starts():
    sc = _with(default_scenario(**SMALL), headroom=10 << 30)
    result = _run(sc, _mutant(DroppingController))
    assert result.outcome.verdict == "invariant" and result.outcome.invariant == "I9"
    assert "less than the memory_headroom_bytes=10737418240" in result.outcome.detail
    assert result.outcome.rank == 0 and result.outcome.step is not None
    assert _run(sc).outcome.verdict == "clean"


@pytest.mark.timeout(60)
def test_the_headroom_check_needs_the_memory_hazard():
    """Without H7 nothing is budgeted: a verdict that names I9 for memory needs it, so the
    hazard attribution (`lockstep check --explain`) names it."""
    sc = _with(default_scenario(**SMALL), headroom=10 << 30)
    off = sc.with_(hazards=HazardModel().without("h7"))
    assert _run(off, _mutant(DroppingController)).outcome.verdict == "clean"


@pytest.mark.timeout(60)
def test_a_fit_to_rank_0_alone_leaves_a_busier_rank_short_of_its_headroom():
    sc = _with(default_scenario(**SMALL), headroom=10 << 30, overhead=((1, 2 << 30),))
    result = _run(sc, _mutant(RankZeroController))
    assert result.outcome.invariant == "I9" and result.outcome.rank == 1, result.outcome.detail
    # with the ranks alike, the tightest rank is rank 0 too: the bug cannot show
    assert _run(_with(sc, overhead=()), _mutant(RankZeroController)).outcome.verdict == "clean"


@pytest.mark.timeout(60)
def test_a_refusal_passes_only_where_the_memory_requires_it():
    sc = default_scenario(**SMALL)
    bound = largest_headroom(sc)
    twice = _mutant(TwiceController)
    fits = _run(_with(sc, headroom=bound // 2 + 1), twice)
    assert fits.outcome.verdict == "startup-refused"
    assert not CLEAN(fits)  # the memory holds a plan: refusing it is the bug
    over = _run(_with(sc, headroom=bound + 1))
    assert over.outcome.verdict == "startup-refused" and CLEAN(over)
    # the known-bad variant whose verdict is a refusal still refuses a memory that fits
    for name in ("reserve-by-requested-batch",):
        variant = get_variant(name)
        assert not refusal_expected(variant.scenario(CheckSpec().scenario("shared")))
