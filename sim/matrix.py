"""The configuration matrix: every variant across world sizes, bucket sets and topologies.

A variant's catch must not depend on the default configuration. `run_matrix` checks each
variant at ranks {2, 3, 4} x four bucket sets x both topologies; a bad variant is caught with
its expected verdict, or reported "not reachable here" with the reason when the configuration
cannot hold its bug, never clean. `lockstep check --matrix` prints it; docs/matrix.md holds
one full run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from protocol.buckets import DEFAULT_DECODE_BUCKETS
from sim.check import CheckSpec, Row, check_variant
from sim.scenario import TOPOLOGIES

BUCKET_SETS: dict[str, tuple[tuple[int, ...], int]] = {
    "pegainfer-36": (DEFAULT_DECODE_BUCKETS, DEFAULT_DECODE_BUCKETS[-1]),
    "1,2,4,8": ((1, 2, 4, 8), 8),
    "pow2-1..32": ((1, 2, 4, 8, 16, 32), 32),
    "1..16-max-12": ((1, 2, 4, 8, 16), 12),
}
"""Name -> (buckets, max batch). The last has a max batch that is not a bucket."""

RANKS = (2, 3, 4)


@dataclass
class Cell:
    """One configuration's rows for one variant."""

    ranks: int
    bucket_set: str
    row: Row

    @property
    def config(self) -> str:
        return f"TP{self.ranks} {self.bucket_set} {self.row.topology}"


def run_matrix(variants, spec: CheckSpec, ranks=RANKS, bucket_sets=tuple(BUCKET_SETS),
               topologies=TOPOLOGIES, progress=None) -> list[Cell]:
    """Check every variant in every configuration; ``spec`` gives the search settings.

    Raises:
        KeyError: an unknown bucket-set name.
    """
    cells = []
    for name in bucket_sets:
        buckets, max_batch = BUCKET_SETS[name]
        for world_size in ranks:
            config_spec = replace(spec, ranks=world_size, buckets=buckets, max_batch=max_batch)
            for variant in variants:
                for topology in topologies:
                    for row in check_variant(variant, config_spec, topology, progress):
                        cells.append(Cell(world_size, name, row))
    return cells


def _mark(row: Row) -> str:
    if row.got == "not reachable here":
        return "not reachable"
    return row.got if row.passed else f"{row.got} (expected {row.expected})"


def render_markdown(cells: list[Cell]) -> str:
    """One markdown table per bucket set: a line per variant row, a column per ranks x topology."""
    out = []
    sets = list(dict.fromkeys(c.bucket_set for c in cells))
    for name in sets:
        mine = [c for c in cells if c.bucket_set == name]
        columns = list(dict.fromkeys((c.ranks, c.row.topology) for c in mine))
        names = list(dict.fromkeys(c.row.variant for c in mine))
        buckets, max_batch = BUCKET_SETS[name]
        shown = (f"buckets {','.join(map(str, buckets))}" if len(buckets) <= 8
                 else f"{len(buckets)} buckets")
        out.append(f"### {name} ({shown}; max batch {max_batch})\n")
        out.append("| variant | " + " | ".join(f"TP{r} {t}" for r, t in columns) + " |")
        out.append("|---" * (len(columns) + 1) + "|")
        for variant in names:
            by = {(c.ranks, c.row.topology): c.row for c in mine if c.row.variant == variant}
            out.append(f"| {variant} | " + " | ".join(_mark(by[k]) if k in by else "-" for k in columns)
                       + " |")
        out.append("")
    return "\n".join(out)


def unreachable_notes(cells: list[Cell]) -> list[str]:
    """One line per distinct (variant, reason) reported not reachable."""
    seen = {}
    for c in cells:
        if c.row.got == "not reachable here":
            seen.setdefault((c.row.variant, c.row.detail), []).append(c.config)
    return [f"{variant}: not reachable in {len(configs)} configuration(s) ({configs[0]}, ...): {why}"
            for (variant, why), configs in seen.items()]


__all__ = ["BUCKET_SETS", "RANKS", "Cell", "run_matrix", "render_markdown", "unreachable_notes"]
