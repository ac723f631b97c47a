"""The largest values `lockstep check` accepts, so that an absurd option is refused in one line
before any search instead of hanging (issue 13).

Each bound is far above what a useful check needs and below what this pure-Python simulator can
hold: a world of a million ranks never finishes building its first schedule, a trillion
schedules would be listed before the first runs, a hundred thousand jobs would fork a hundred
thousand processes, and a time budget past a day overflows the platform's wait timeouts.
"""

from __future__ import annotations

from protocol.errors import ConfigError

MIN_RANKS = 2
"""Fewest ranks (world size) the simulator models: every hazard it models is between ranks."""

MAX_RANKS = 64
"""Most ranks (world size) the simulator models: eight 8-GPU nodes; TP groups are 2-8 wide."""

MAX_BUCKETS = 256
"""Most decode buckets in one list (the default has 36)."""

MAX_BUCKET = 1 << 20
"""Largest decode bucket, in rows (a million; the modelled memory refuses far smaller ones)."""

MAX_SCHEDULES = 1_000_000
"""Most schedules per search (`--schedules`, `--fault-schedules`): about a day of CPU."""

MAX_JOBS = 256
"""Most worker processes (`--jobs`)."""

MAX_TIME_BUDGET = 86400.0
"""Longest time budget per search, in seconds (one day)."""


def check_limits(ranks: int | None = None, buckets=None, max_batch: int | None = None,
                 schedules: int | None = None, fault_schedules: int | None = None,
                 jobs: int | None = None, time_budget: float | None = None) -> None:
    """Refuse any value past its bound (None: not given).

    Raises:
        ConfigError: one line naming the option, the value and the bound.
    """
    def above(what: str, value, bound, unit: str) -> None:
        if value is not None and value > bound:
            raise ConfigError(f"{what} {value:g} is above {bound:g}, the most {unit}"
                              if isinstance(value, float) else
                              f"{what} {value} is above {bound}, the most {unit}")

    above("ranks", ranks, MAX_RANKS, "ranks the simulator models")
    if buckets is not None:
        if len(buckets) > MAX_BUCKETS:
            raise ConfigError(f"{len(buckets)} buckets is above {MAX_BUCKETS}, the most buckets "
                              "the simulator models")
        above("bucket", max(buckets, default=None), MAX_BUCKET, "rows a bucket may have")
    above("max batch", max_batch, MAX_BUCKET, "decode rows the simulator models in one step")
    above("schedules", schedules, MAX_SCHEDULES, "schedules one search runs")
    above("fault schedules", fault_schedules, MAX_SCHEDULES, "schedules one search runs")
    above("jobs", jobs, MAX_JOBS, "worker processes")
    above("time budget", time_budget, MAX_TIME_BUDGET, "seconds per search (one day)")


__all__ = ["check_limits", "MAX_RANKS", "MAX_BUCKETS", "MAX_BUCKET", "MAX_SCHEDULES", "MAX_JOBS",
           "MAX_TIME_BUDGET"]
