"""A Hypothesis search whose time budget runs out mid-search reports an incomplete search,
never an error of the variant (it raised Hypothesis's FlakyStrategyDefinition: once the budget
was spent the property returned without drawing, and a replay drew differently)."""

from __future__ import annotations

import pytest

from sim.check import CheckSpec, check_correct
from sim.scenario import default_scenario
from sim.search import hypothesis_search
from sim.variants import REGISTRY


@pytest.mark.timeout(120)
def test_a_spent_budget_ends_the_search_incomplete():
    accept_all = lambda result: True  # noqa: E731
    res = hypothesis_search(default_scenario("shared"), REGISTRY["correct"], accept_all,
                            max_examples=10_000, time_budget=0.5)
    assert res.failure is None and res.stats.budget_reached
    assert res.stats.schedules >= 1


@pytest.mark.timeout(60)
def test_the_budget_ends_the_search_even_where_no_run_returns_to_check_it():
    """Hypothesis's shrinker sorts a long schedule's choices for minutes without calling the
    test function, where the budget used to be checked: unfenced-preempt-store's row took 151 s
    of a 60 s budget. A Python loop that never returns stands in for that work here; the
    search must end at its budget all the same, with the failures it found."""
    import time

    calls, sat_out = [], []

    def stuck_on_the_second(result):
        calls.append(result)
        if len(calls) == 1:
            return False  # one failure found
        deadline = time.perf_counter() + 30
        while time.perf_counter() < deadline:  # pure Python: no budget check in reach
            pass
        sat_out.append(True)  # reached only if nothing ended the search in 30 s
        return True

    res = hypothesis_search(default_scenario("shared"), REGISTRY["correct"],
                            stuck_on_the_second, max_examples=100, time_budget=2.0)
    assert sat_out == [] and len(calls) == 2
    assert res.stats.budget_reached and res.failure is calls[0]


@pytest.mark.timeout(60)
def test_no_budget_interrupt_outlives_its_search():
    import time

    for _ in range(20):  # budgets that end around the search's own return
        hypothesis_search(default_scenario("shared"), REGISTRY["correct"], lambda r: True,
                          max_examples=1, time_budget=0.01)
    stray = []
    deadline = time.perf_counter() + 0.5
    try:
        while time.perf_counter() < deadline:  # a late interrupt would land here
            pass
    except BaseException as exc:  # noqa: BLE001 - the budget's exception is a BaseException
        stray.append(exc)
    assert stray == []


@pytest.mark.timeout(120)
def test_the_check_row_of_a_spent_hypothesis_budget_is_incomplete():
    spec = CheckSpec(schedules=10_000, fault_schedules=0, time_budget=1, jobs=1,
                     strategy="hypothesis")
    rows = check_correct(REGISTRY["correct"], spec, "shared")
    assert rows[0].got == "incomplete", rows[0].detail


@pytest.mark.timeout(300)
def test_the_short_path_row_completes_in_the_default_budget():
    """`--strategy hypothesis` searched each of correct-short-path's drawn members (38 at the
    default configuration) with the row's whole schedule count, so the row read incomplete
    after 31 of them at the default 60 s budget. The count is now the row's, shared among the
    members at least one each (`sim.check.schedule_shares`), as a sample search's is."""
    from sim.check import _members, scenario_family, schedule_shares, variant_spec

    variant = REGISTRY["correct-short-path"]
    spec = variant_spec(variant, CheckSpec(schedules=35, fault_schedules=0, jobs=1,
                                           strategy="hypothesis"))
    base = variant.scenario(spec.scenario("shared"))
    members = len(_members(scenario_family(variant, base, spec.seed)))
    assert members > spec.planned_clean
    row = check_correct(variant, spec, "shared")[0]
    assert row.got == "clean", row.detail
    assert row.stats.scenarios == members
    assert row.stats.schedules == sum(schedule_shares(spec.planned_clean, members)) == members


@pytest.mark.parametrize("schedules, members, shares", [
    (20, 38, [1] * 38), (300, 7, [43] * 6 + [42]), (8, 3, [3, 3, 2]), (5, 1, [5])])
def test_schedule_shares_are_even_and_at_least_one(schedules, members, shares):
    from sim.check import schedule_shares

    assert schedule_shares(schedules, members) == shares


@pytest.mark.timeout(60)
def test_a_budget_interrupt_that_is_swallowed_is_delivered_again():
    """The budget's exception once landed in Hypothesis's gc callback, which printed it as
    "Exception ignored" and went on: the search would have run past its budget until the
    next example. The interrupt is delivered again until the block ends."""
    import time

    from sim.search import REDELIVER_S, _BudgetSpent, _interrupted_after

    caught, deadline = [], time.perf_counter() + 10 * REDELIVER_S + 5
    with pytest.raises(_BudgetSpent):
        with _interrupted_after(0.05):
            while time.perf_counter() < deadline:
                try:
                    while time.perf_counter() < deadline:
                        pass
                except _BudgetSpent:  # swallowed once, as a gc callback would
                    caught.append(True)
                    if len(caught) == 2:
                        raise
    assert len(caught) == 2


def test_a_budget_interrupt_lost_in_a_callback_is_not_printed_and_others_still_are():
    """A `_BudgetSpent` delivered inside a gc or weakref callback cannot propagate; Python hands
    it to `sys.unraisablehook`, which printed an "Exception ignored" traceback to a user of
    `lockstep check --strategy hypothesis` (a fresh user's trial saw it as a test warning).
    Inside `_interrupted_after` the hook drops it, passes anything else on, and is restored
    after."""
    import sys
    import types

    from sim.search import _BudgetSpent, _interrupted_after

    seen = []
    outer, record = sys.unraisablehook, seen.append
    sys.unraisablehook = record
    try:
        with _interrupted_after(60.0):
            for exc_type in (_BudgetSpent, ValueError):
                sys.unraisablehook(types.SimpleNamespace(exc_type=exc_type, exc_value=None,
                                                         exc_traceback=None, err_msg=None,
                                                         object=None))
        assert sys.unraisablehook is record
    finally:
        sys.unraisablehook = outer
    assert [u.exc_type for u in seen] == [ValueError]
