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


@pytest.mark.timeout(120)
def test_the_check_row_of_a_spent_hypothesis_budget_is_incomplete():
    spec = CheckSpec(schedules=10_000, fault_schedules=0, time_budget=1, jobs=1,
                     strategy="hypothesis")
    rows = check_correct(REGISTRY["correct"], spec, "shared")
    assert rows[0].got == "incomplete", rows[0].detail
