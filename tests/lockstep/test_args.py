"""How an error line repeats a user's value (`lockstep.args.clipped`, `one_line_repr`): on one
line, and cut with "..." past its limit, so a reader can tell a shown value from a cut one."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.args import SHOWN_CHARS, clipped, one_line_repr


def test_a_short_value_is_shown_whole():
    assert one_line_repr("abc") == "'abc'"
    assert one_line_repr(None) == "None"
    assert clipped("x" * SHOWN_CHARS) == "x" * SHOWN_CHARS


def test_a_long_value_is_cut_with_an_ellipsis_at_the_default_limit():
    shown = one_line_repr("x" * 100)
    assert shown == "'" + "x" * (SHOWN_CHARS - 4) + "..."
    assert len(shown) == SHOWN_CHARS
    assert clipped("y" * (SHOWN_CHARS + 1)) == "y" * (SHOWN_CHARS - 3) + "..."


@pytest.mark.parametrize("limit", [4, 40, 60, 80, 120, 200])
def test_the_limit_is_the_most_characters_shown(limit):
    """``limit`` counts the "...": a value of exactly ``limit`` characters is shown whole, one
    more is cut to ``limit``."""
    whole, over = "z" * limit, "z" * (limit + 1)
    assert clipped(whole, limit) == whole
    assert clipped(over, limit) == "z" * (limit - 3) + "..."
    assert len(clipped(over, limit)) == limit
    assert one_line_repr(list(range(100)), limit) == (repr(list(range(100)))[:limit - 3]
                                                      + "...")


def test_a_multi_line_repr_is_joined_onto_one_line():
    """A numpy array's repr spans lines; its rows are joined by single spaces, then cut."""
    value = np.arange(100).reshape(10, 10)
    assert "\n" in repr(value)
    whole = one_line_repr(value, 10_000)
    assert "\n" not in whole and "  " not in whole
    assert whole.startswith("array([[ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, ")
    assert whole.endswith("[90, 91, 92, 93, 94, 95, 96, 97, 98, 99]])")
    shown = one_line_repr(value, 60)
    assert shown == whole[:57] + "..." and "\n" not in shown


def test_the_default_limit_is_unchanged_for_existing_callers():
    value = {"key": "v" * 50}
    assert one_line_repr(value) == one_line_repr(value, SHOWN_CHARS)
    assert clipped("w" * 50) == clipped("w" * 50, SHOWN_CHARS)


def test_one_line_repr_describes_an_integer_too_long_for_repr():
    """A reviewer's finding: past 4,300 digits repr raises ValueError, so an error message
    that repeated such a value raised instead of being shown."""
    from lockstep.args import one_line_repr

    assert one_line_repr(10**5000) == "<an integer of about 5001 digits>"
    assert one_line_repr([1, 10**5000]) == "<a list holding an integer too long to print>"
    assert one_line_repr(10**400).endswith("...") and len(one_line_repr(10**400)) < 100
