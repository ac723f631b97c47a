"""Rank death mid-serving (issue 10 item 6): the failure names the rank that died (I13) and every
request in flight gets an error (I18)."""

import pytest

from sim.checks import abort_checks
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import REGISTRY
from sim.faults import FaultFamily

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)


def death_in_serving(sc):
    """``sc`` with the first death in serving that the fault family of the variant finds."""
    fault = FaultFamily("die", phase="serving").members(sc, REGISTRY["correct"])[0]
    return sc.with_(faults=(fault,))


@pytest.mark.timeout(60)
def test_the_correct_protocol_fails_every_request_in_flight_when_a_rank_dies():
    sc = death_in_serving(default_scenario(**SMALL))
    result = run_schedule(sc, REGISTRY["correct"], RandomWalk(0))
    ctrl = result.world.ctrl
    assert result.outcome.verdict == "abort", result.outcome.detail
    assert result.outcome.rank in result.world.dead
    in_flight = [r for r in ctrl.requests if r not in ctrl.finished]
    assert in_flight and all(ctrl.request_error(r) is ctrl.failure for r in in_flight)


@pytest.mark.timeout(60)
def test_a_death_that_drops_requests_silently_is_caught_with_its_step():
    variant = REGISTRY["death-drops-requests"]
    sc = death_in_serving(variant.scenario(default_scenario(**SMALL)))
    result = run_schedule(sc, variant, RandomWalk(0))
    out = result.outcome
    assert out.verdict == "invariant" and out.invariant == "I18"
    assert out.step is not None and out.rank in result.world.dead


@pytest.mark.timeout(60)
def test_the_i18_check_fires_only_for_requests_without_an_error():
    sc = death_in_serving(default_scenario(**SMALL))
    world = run_schedule(sc, REGISTRY["correct"], RandomWalk(0)).world
    ctrl = world.ctrl
    assert abort_checks(world, ctrl.failure).verdict == "abort"
    victim = next(r for r in ctrl.requests if r not in ctrl.finished)
    del ctrl.request_errors[victim]
    out = abort_checks(world, ctrl.failure)
    assert out.invariant == "I18" and str(victim) in out.detail


@pytest.mark.timeout(60)
def test_i18_fires_for_a_failure_without_a_death_too():
    """A rank that raises in serving (no rank dies) fails the run; a request in flight left
    without an error is I18 there as well. No shipped variant drops a request on that path (its
    `return dropped` survived a targeted mutation run, docs/mutation.md 2026-12-06)."""
    fault = FaultFamily("raise", phase="serving").members(default_scenario(**SMALL),
                                                          REGISTRY["correct"])[0]
    sc = default_scenario(**SMALL).with_(faults=(fault,))
    world = run_schedule(sc, REGISTRY["correct"], RandomWalk(0)).world
    ctrl = world.ctrl
    assert not world.dead and ctrl.failure is not None
    assert abort_checks(world, ctrl.failure).verdict == "abort"
    victim = next(r for r in ctrl.requests if r not in ctrl.finished)
    del ctrl.request_errors[victim]
    out = abort_checks(world, ctrl.failure)
    assert out.invariant == "I18" and str(victim) in out.detail
