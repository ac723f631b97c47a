"""The reducer's quality: how few switches its result keeps, on real counterexamples of shipped
variants found by the real search. tests/sim/test_search.py checks that the reducer keeps the
verdict and spends its budget; these check that a switch it could remove is removed."""

from functools import cache

import pytest

from sim.check import CheckSpec, check_bad
from sim.checks import attribute_divergence
from sim.reduce import reduce_schedule, same_failure, switch_points, switches_of
from sim.run import run_schedule
from sim.strategies import Sticky
from sim.variants import REGISTRY


@cache
def counterexample(name: str, seed: int = 0):
    """(scenario, variant, first failing run) of ``name``'s shared-topology search, unreduced."""
    variant = REGISTRY[name]
    failing = check_bad(variant, CheckSpec(seed=seed), "shared", reduce=False).minimal
    return failing.world.scenario, variant, failing


ENOUGH = 1000
"""Attempts that let every reduction here finish (they take 13-106), so its result is the
reducer's own, not where a budget cut it; a count, not seconds, so it is the same result on a
loaded machine."""


@cache
def reduced(name: str):
    scenario, variant, failing = counterexample(name)
    return reduce_schedule(scenario, variant, failing, max_attempts=ENOUGH)


REDUCED = ["profile-largest-only", "exit-on-timeout", "async-row-parallel",
           "unfenced-preempt-store"]
"""Counterexamples whose run without switches does not fail as they do, or not as soon, so the
removal passes decide the result: they end with 1, 1, 14 and 2 switches of 82, 138, 140 and
852. A reducer without its last pass, one switch at a time, keeps 3, 5, 23 and 7; one that
takes no removal that leaves the actions as they were keeps 82, 72, 140 and 506."""


@pytest.mark.timeout(60)
def test_a_tie_in_actions_goes_to_the_run_without_switches_at_its_first_attempt():
    """fused-sweep deadlocks after 365 actions however the ranks interleave, so the run with no
    switch listed ties the random walk's run in actions; the reducer must take it, not keep the
    walk's 201 switch points, even when that first attempt is its whole budget."""
    scenario, variant, failing = counterexample("fused-sweep")
    plain = run_schedule(scenario, variant, Sticky({}))
    assert same_failure(plain, failing) and plain.actions == failing.actions  # the tie
    assert len(switch_points(failing.choices)) > len(switch_points(plain.choices))
    reduced = reduce_schedule(scenario, variant, failing, max_attempts=1)
    assert reduced.choices == plain.choices


@pytest.mark.timeout(60)
def test_sticky_replays_a_run_from_its_switch_points_even_those_at_forced_steps():
    """A run asks for no choice where one actor alone is enabled; a switch point there must still
    count (comm-before-graphs's counterexample has such points: a Sticky that skipped them
    departed from the run), and the switches Sticky records as effective replay it alone."""
    scenario, variant, failing = counterexample("comm-before-graphs")
    sticky = Sticky(switch_points(failing.choices))
    assert run_schedule(scenario, variant, sticky).choices == failing.choices
    assert 0 < len(sticky.effective) < len(switch_points(failing.choices))
    again = Sticky(dict(sticky.effective))
    assert run_schedule(scenario, variant, again).choices == failing.choices
    assert again.effective == sticky.effective


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", REDUCED)
def test_a_reduced_run_is_one_minimal(name):
    """Without any one of the reduced run's switches, replayed with Sticky as the reducer
    replays, the failure is gone or comes later: every switch left is one that matters."""
    scenario, variant, failing = counterexample(name)
    minimal = reduced(name)
    switches = switches_of(scenario, variant, minimal)
    assert switches and len(switches) < len(switches_of(scenario, variant, failing))
    for step in switches:
        without = run_schedule(scenario, variant,
                               Sticky({s: a for s, a in switches.items() if s != step}))
        assert not (same_failure(without, failing) and without.actions <= minimal.actions), (
            f"the switch at step {step} can go")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", REDUCED)
def test_reducing_a_reduced_run_gives_it_back(name):
    """A fixed point: the reduced run, reduced again, is returned as it is."""
    scenario, variant, _ = counterexample(name)
    minimal = reduced(name)
    assert reduce_schedule(scenario, variant, minimal, max_attempts=ENOUGH) is minimal


@pytest.mark.timeout(60)
def test_a_reduced_divergence_keeps_its_attributed_step_when_reduced_again():
    """A run that reduces to itself comes back as the run given, so the step that
    `attribute_divergence` found for a reduced divergence survives a second reduction."""
    scenario, variant, _ = counterexample("async-row-parallel")
    minimal = attribute_divergence(scenario, variant, reduced("async-row-parallel"))
    assert minimal.outcome.step is not None
    again = reduce_schedule(scenario, variant, minimal, max_attempts=ENOUGH)
    assert again.outcome.step == minimal.outcome.step


@pytest.mark.timeout(120)
def test_a_design_claimed_clean_reduces_its_failure_in_the_drawn_scenario_that_failed():
    """A fresh reviewer's finding: `check_correct` reduced a failure of a per-run drawn scenario
    (`Variant.draw`) in the undrawn base scenario, where its switches replay nothing alike, so
    the row's trace came back unreduced (short-path-first-row claimed clean: 673 switches that
    are choices). Reduced in its own scenario, the divergence needs none."""
    import dataclasses

    from sim.check import check_correct

    claimed = dataclasses.replace(REGISTRY["short-path-first-row"], name="claims-clean",
                                  expected={"shared": "clean", "per-rank": "clean"})
    [row, *_] = check_correct(claimed, CheckSpec(), "shared")
    assert row.got == "divergence" and not row.passed
    minimal = row.minimal
    assert minimal.world.scenario != row.scenario  # a drawn member failed, not the base
    assert switches_of(minimal.world.scenario, claimed, minimal) == {}
