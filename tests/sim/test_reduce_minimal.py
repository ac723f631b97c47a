"""The reducer's quality: how few switches its result keeps, on real counterexamples of shipped
variants found by the real search. tests/sim/test_search.py checks that the reducer keeps the
verdict and spends its budget; these check that a switch it could remove is removed."""

from functools import cache

import pytest

from sim.check import CheckSpec, check_bad
from sim.reduce import reduce_schedule, same_failure, switch_points
from sim.run import run_schedule
from sim.strategies import Sticky
from sim.variants import REGISTRY


@cache
def counterexample(name: str, seed: int = 0):
    """(scenario, variant, first failing run) of ``name``'s shared-topology search, unreduced."""
    variant = REGISTRY[name]
    failing = check_bad(variant, CheckSpec(seed=seed), "shared", reduce=False).minimal
    return failing.world.scenario, variant, failing


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
