"""`sim.checks.attribute_divergence`: a token divergence is named by the step that sampled the
first wrong token, found by replaying the run; every other result comes back as it was.
These paths only shape reports, and no test reached them: a targeted mutation run
(docs/mutation.md, 2026-12-06) left three of its mutants alive."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.check import CheckSpec, check_bad
from sim.checks import attribute_divergence, first_wrong_token
from sim.variants import REGISTRY

SPEC = CheckSpec(schedules=30, fault_schedules=0, jobs=1)
SUFFIX = " (the token step {} sampled)"


@pytest.fixture(scope="module")
def token_divergence():
    variant = REGISTRY["async-row-parallel"]
    row = check_bad(variant, SPEC, "shared")
    assert row.got == "divergence" and first_wrong_token(row.minimal.world) is not None
    return variant, row.minimal


@pytest.mark.timeout(120)
def test_a_token_divergence_without_a_step_gets_the_step_that_sampled_it(token_divergence):
    variant, found = token_divergence
    step = found.outcome.step
    assert step is not None and found.outcome.detail.endswith(SUFFIX.format(step))
    bare = replace(found, outcome=replace(found.outcome, step=None,
                                          detail=found.outcome.detail[:-len(SUFFIX.format(step))]))
    named = attribute_divergence(found.world.scenario, variant, bare)
    assert named.outcome.step == step and named.outcome.detail == found.outcome.detail


@pytest.mark.timeout(120)
def test_a_result_that_names_its_step_or_is_no_divergence_comes_back_unchanged(
        token_divergence):
    variant, found = token_divergence
    assert attribute_divergence(found.world.scenario, variant, found) is found
    deadlock = check_bad(REGISTRY["fused-sweep"], SPEC, "shared").minimal
    assert deadlock.outcome.verdict == "deadlock"
    for result in (deadlock, replace(deadlock, outcome=replace(deadlock.outcome, step=None))):
        assert attribute_divergence(deadlock.world.scenario, REGISTRY["fused-sweep"],
                                    result) is result


@pytest.mark.timeout(120)
def test_a_divergence_with_no_wrong_token_comes_back_unchanged():
    """split-eligibility's ranks diverge in their collectives, not in a token."""
    variant = REGISTRY["split-eligibility"]
    found = check_bad(variant, SPEC, "shared").minimal
    assert first_wrong_token(found.world) is None
    bare = replace(found, outcome=replace(found.outcome, step=None))
    assert attribute_divergence(found.world.scenario, variant, bare) is bare


@pytest.mark.timeout(120)
def test_a_run_that_reached_done_with_a_request_unserved_is_a_divergence():
    """final_checks' last check: the controller shut down cleanly while a submitted request
    never finished. No shipped variant loses a request on the way to Done, so a targeted
    mutation run found nothing that made it fire; here one finished request is taken back from
    a clean run's controller."""
    from sim.checks import final_checks
    from sim.run import correct_run
    from sim.scenario import default_scenario

    world = correct_run(default_scenario()).world
    assert final_checks(world).verdict == "clean"
    lost = world.ctrl.finished.pop()
    outcome = final_checks(world)
    assert (outcome.verdict, outcome.check) == ("divergence", "unfinished")
    assert f"requests [{lost}] never finished" == outcome.detail
