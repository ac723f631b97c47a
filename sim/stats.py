"""Search statistics per variant: what share of random and of PCT schedules fail.

A verdict is earned by search only where search has work to do. `failing_shares` runs the same
number of schedules of a bad variant with each sampling strategy, without stopping at the first
failure, and reports the share of schedules whose verdict is not acceptable (for a variant
whose bug needs a fault, over its fault search's members, as `lockstep check` searches it).
A share near 100% means any schedule shows the bug; a share under a few percent means the bug
needs a rare interleaving, and the strategy that finds it matters (docs/search-stats.md).
`lockstep check --stats` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ConfigError
from sim.check import CheckSpec, bad_search_setup
from sim.search import sample_search

STATS_STRATEGIES = ("random", "pct")
"""Strategies whose failing share `failing_shares` measures."""


@dataclass
class Shares:
    """Failing shares of one variant in one topology.

    Attributes:
        variant, topology: what was searched.
        schedules: strategy -> schedules run.
        failing: strategy -> schedules whose verdict was not acceptable.
        verdicts: strategy -> {verdict: count}.
        note: why nothing was searched (the bug is not reachable here), else "".
        error: one line naming the variant, when its own code raised or never returned (the
            stall watchdog, `sim.guard`), else "".
    """

    variant: str
    topology: str
    schedules: dict[str, int] = field(default_factory=dict)
    failing: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, dict[str, int]] = field(default_factory=dict)
    note: str = ""
    error: str = ""

    def percent(self, strategy: str) -> float | None:
        """Failing schedules as a percentage of those run, or None if none ran."""
        n = self.schedules.get(strategy, 0)
        return 100.0 * self.failing.get(strategy, 0) / n if n else None


def failing_shares(variant, spec: CheckSpec, topology: str, progress=None) -> Shares:
    """Run ``spec.schedules`` schedules of ``variant`` with each of `STATS_STRATEGIES` (same
    seed, no stop at the first failure) and count the failing ones.

    Raises:
        ConfigError: ``spec`` describes a configuration the model cannot hold.
    """
    from sim.guard import Stalled, describe, locate, watchdog
    from sim.workers import WorkerError

    out = Shares(variant.name, topology)
    try:
        with watchdog():  # a variant's hook that loops or blocks ends its line, not the run
            scenario_for, acceptable, reason = bad_search_setup(variant, spec, topology)
            if reason is not None:
                out.note = reason
                return out
            for strategy in STATS_STRATEGIES:
                result = sample_search(scenario_for, variant, acceptable, strategy,
                                       spec.schedules, spec.time_budget, spec.seed,
                                       stop_on_failure=False, progress=progress, jobs=spec.jobs)
                out.schedules[strategy] = result.stats.schedules
                out.failing[strategy] = result.stats.failing
                out.verdicts[strategy] = dict(result.stats.verdicts)
    except WorkerError as exc:
        out.error = describe(variant.name, exc.message)
    except ConfigError as exc:  # the variant's own checks name it (adjust's result ...)
        own = str(exc).startswith(f"variant {variant.name!r}: ")
        out.error = str(exc) if own else describe(variant.name, exc)
    except (Exception, Stalled, SystemExit) as exc:  # noqa: BLE001 - a variant's code can raise
        out.error = describe(variant.name, exc)      # anything, sys.exit included
    return out


def render_table(shares: list[Shares]) -> str:
    """Markdown table: variant, topology, then schedules and failing share per strategy."""
    head = "| variant | topology | " + " | ".join(
        f"{s} failing (of schedules)" for s in STATS_STRATEGIES) + " |"
    lines = [head, "|---" * (2 + len(STATS_STRATEGIES)) + "|"]
    for s in shares:
        if s.error:
            cells = ["error"] * len(STATS_STRATEGIES)
        elif s.note:
            cells = ["not reachable here"] * len(STATS_STRATEGIES)
        else:
            cells = [f"{s.percent(k):.1f}% ({s.failing[k]}/{s.schedules[k]})"
                     if s.schedules.get(k) else "-" for k in STATS_STRATEGIES]
        lines.append(f"| {s.variant} | {s.topology} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["STATS_STRATEGIES", "Shares", "failing_shares", "render_table"]
