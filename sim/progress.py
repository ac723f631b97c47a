"""The `lockstep check` progress bar, whose time estimate respects the time budget.

tqdm estimates the time left from the rate so far; a search cannot run past its time budget,
so the estimate shown is the smaller of tqdm's and the budget's bound (each row left, this one
included, can take at most ``time_budget`` seconds per search it runs). A row that ends early
(a failure found, the budget spent) is topped up to its planned count, so the bar reaches
100% when the last row ends.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class CheckProgress(tqdm):
    """tqdm over planned schedules, with a budget-bounded time left (``{left}``).

    Args:
        rows: (label, planned schedules, searches the row runs) for each row, in order.
        time_budget: seconds per search.
        disable: no bar (``--no-progress``); None lets tqdm decide (no TTY: no bar).
    """

    def __init__(self, rows: list[tuple[str, int, int]], time_budget: float, disable):
        self._rows = rows
        self._budget = time_budget
        self._row = 0
        self._row_start = time.perf_counter()
        self._row_done = 0
        super().__init__(total=sum(n for _, n, _ in rows), desc="lockstep check", unit="sched",
                         file=sys.stderr, disable=disable, leave=False,
                         bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{left}{postfix}]")
        if rows:
            self.set_postfix_str(rows[0][0])

    def bound_s(self) -> float:
        """Seconds the remaining rows can take at most, given the time budget."""
        if self._row >= len(self._rows):
            return 0.0
        here = self._rows[self._row][2] * self._budget - (time.perf_counter() - self._row_start)
        later = sum(k for _, _, k in self._rows[self._row + 1:]) * self._budget
        return max(0.0, here) + later

    def step(self, n: int = 1) -> None:
        """``n`` schedules of the current row finished."""
        self._row_done += n
        self.update(n)

    def next_row(self) -> None:
        """The current row ended: count its unexplored schedules as done; go to the next."""
        if self._row < len(self._rows):
            left = self._rows[self._row][1] - self._row_done
            if left > 0:
                self.update(left)
        self._row += 1
        self._row_done = 0
        self._row_start = time.perf_counter()
        if self._row < len(self._rows):
            self.set_postfix_str(self._rows[self._row][0])

    @property
    def format_dict(self):
        d = super().format_dict
        rate = d.get("rate") or (d["n"] / d["elapsed"] if d["elapsed"] and d["n"] else None)
        estimate = (d["total"] - d["n"]) / rate if rate and d["total"] else None
        bound = self.bound_s()
        d["left"] = tqdm.format_interval(bound if estimate is None else min(estimate, bound))
        return d


__all__ = ["CheckProgress"]
