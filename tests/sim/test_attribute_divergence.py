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


DIVERGENCES = [(name, topology) for name, variant in REGISTRY.items()
               for topology, verdict in variant.expected.items() if verdict == "divergence"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,topology", DIVERGENCES)
def test_a_replayed_minimal_divergence_gives_the_checks_outcome_once_attributed(name, topology):
    """docs/python-api.md's recipe: `check_variant`'s minimal run, replayed with `Replay` and
    passed through `attribute_divergence`, has the row's outcome, step and detail included."""
    from sim.check import check_variant
    from sim.run import run_schedule
    from sim.strategies import Replay

    variant = REGISTRY[name]
    row = check_variant(variant, CheckSpec(jobs=1), topology)[0]
    assert row.got == "divergence", row.detail
    minimal = row.minimal
    again = run_schedule(minimal.world.scenario, variant, Replay(minimal.choices))
    named = attribute_divergence(minimal.world.scenario, variant, again)
    assert named.choices == minimal.choices and named.outcome == minimal.outcome


@pytest.mark.timeout(120)
def test_a_bare_replay_of_an_end_of_run_divergence_lacks_its_step():
    """Why the recipe attributes: the end-of-run token check names no step by itself."""
    from sim.check import check_variant
    from sim.run import run_schedule
    from sim.strategies import Replay

    variant = REGISTRY["async-row-parallel"]
    minimal = check_variant(variant, CheckSpec(jobs=1), "shared")[0].minimal
    again = run_schedule(minimal.world.scenario, variant, Replay(minimal.choices))
    assert minimal.outcome.step is not None and again.outcome.step is None
