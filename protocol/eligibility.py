"""The one owner of graph eligibility (I7).

A single `GraphPlan`, built once from the configuration and refitted once to the memory the ranks
report, answers graph-or-eager for every (bucket, path). The startup sweep, the memory profile,
serving and the workers all ask it; none keeps a filter of its own. When one path enforced a cap
that the capture and replay paths did not, a disallowed request became a silent no-op and ranks'
captured sets diverged (pegainfer PR #848 review).

A batch cap counts rows, not buckets: a cap of 3 rows keeps the bucket of 4 that a full batch of
3 pads to. Comparing the cap with bucket sizes instead dropped that bucket, so every full batch
ran eagerly and the retained graph set differed from the one measured (issue 13, item 1).

A second path, `SHORT`, holds the short-context decode form (attention fused into o_proj, one
tile of at most ``short_context`` cached tokens per row). Which path a step replays is decided
here, for the whole step, from the controller's count of its longest decode context -- the
position + 1 of its furthest row, the token the step writes included (I22). A rank that chose
the path from its own state, or a choice made from a stale or partial view (positions before
this step's token, one row instead of every row), replays a kernel that silently drops the
tokens past its tile on some rows, or replays a graph its peers do not: the public analogue is
a per-rank CUDA-graph dispatch decision (vLLM PR #25906; SGLang #30242, cited in
`protocol.buckets` for the bucket itself).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from protocol.buckets import select_bucket
from protocol.config import SHORT_MAX_BUCKET, ProtocolConfig
from protocol.errors import ConfigError, EligibilityError
from protocol.keys import DECODE, SHORT, GraphKey


@dataclass(frozen=True)
class GraphPlan:
    """Which decode graphs -- (bucket, path) keys -- are captured and replayed.

    Attributes:
        buckets: all decode buckets (ascending); batches map to these even when eager.
        cuda_graphs: False makes every key ineligible.
        batch_cap: most decode rows a step may have and still replay (None: no cap), the
            smaller of the numeric policy's cap and the memory fit. The captured buckets are
            those up to the bucket that holds ``batch_cap`` rows.
        paths: attention paths with graphs: `DECODE`, and `SHORT` when ``short_context`` is set.
        short_context: most context tokens (position + 1) a row of a `SHORT` replay may have;
            None: no short path.
        short_max_bucket: the largest bucket with a `SHORT` graph (rows).
    """

    buckets: tuple[int, ...]
    cuda_graphs: bool = True
    batch_cap: int | None = None
    paths: tuple[str, ...] = (DECODE,)
    short_context: int | None = None
    short_max_bucket: int = SHORT_MAX_BUCKET

    def __post_init__(self) -> None:
        if (SHORT in self.paths) != (self.short_context is not None):
            raise ConfigError(f"graph plan with paths {self.paths} and short_context="
                              f"{self.short_context}: the short path needs a short_context "
                              "and a short_context needs the short path")
        # asked for at every command of the sweep: kept on the plan, not looked up by its hash
        object.__setattr__(self, "_keys", _keys(self))

    @classmethod
    def from_config(cls, config: ProtocolConfig) -> "GraphPlan":
        """Plan before memory is known: buckets up to max_batch and the numeric policy's cap."""
        cap = config.graph_batch_cap
        buckets = tuple(b for b in config.buckets if b <= select_bucket(config.max_batch, config.buckets))
        short = config.short_context
        return cls(buckets=buckets, cuda_graphs=config.cuda_graphs, batch_cap=cap,
                   paths=(DECODE,) if short is None else (DECODE, SHORT), short_context=short,
                   short_max_bucket=config.short_max_bucket)

    def fitted(self, memory_batch_cap: int) -> "GraphPlan":
        """The same plan with eligibility also capped by what fits in memory."""
        cap = memory_batch_cap if self.batch_cap is None else min(self.batch_cap, memory_batch_cap)
        return replace(self, batch_cap=cap)

    @property
    def largest_bucket(self) -> int:
        """The largest captured bucket: the one that holds ``batch_cap`` rows (rows)."""
        if self.batch_cap is None or self.batch_cap >= self.buckets[-1]:
            return self.buckets[-1]
        return select_bucket(self.batch_cap, self.buckets)

    def is_eligible(self, key: GraphKey) -> bool:
        """True if ``key`` is captured at startup (and replayed by steps within the cap); a
        `SHORT` key also needs its bucket within ``short_max_bucket``."""
        return (self.cuda_graphs and key.path in self.paths and key.bucket in self.buckets
                and key.bucket <= self.largest_bucket
                and (key.path != SHORT or key.bucket <= self.short_max_bucket))

    def keys(self) -> tuple[GraphKey, ...]:
        """Eligible keys in capture order: largest bucket first, so later graphs reuse its pool."""
        return self._keys

    def require_eligible(self, key: GraphKey, what: str) -> None:
        """Raise EligibilityError if ``key`` is not eligible; ``what`` names the request."""
        if not self.is_eligible(key):
            short = (f", short_context={self.short_context}, short_max_bucket="
                     f"{self.short_max_bucket}" if key.path == SHORT else "")
            raise EligibilityError(f"{what} of graph {key} refused: the plan makes it ineligible "
                                   f"(cuda_graphs={self.cuda_graphs}, batch_cap={self.batch_cap}"
                                   f"{short})")

    def key_for(self, decode_rows: int, longest_context: int) -> tuple[GraphKey | None, int]:
        """(graph key or None for eager, padded bucket) of a step's decode rows; a pure
        function of their count and of the longest context among them (tokens: the furthest
        row's position + 1, the token this step writes included).

        The path (I22): the `SHORT` key of the bucket when every row's context fits
        ``short_context`` -- ``longest_context <= short_context`` -- and that key is eligible
        (its bucket within ``short_max_bucket``); else the `DECODE` key; else eager. The short
        kernel reads one tile of ``short_context`` cached tokens per row, so a step with one
        row past it must not replay it: the rule takes the maximum over every row, counted by
        the controller, never one row's context or a rank's own view (the
        ``short-path-off-by-one`` and ``short-path-first-row`` variants).

        Decode rows, at most ``batch_cap`` of them, replay their bucket's graph when that key
        is eligible, also in a mixed step: its prefill (admissions, a chunk) is a forward of
        its own, run eagerly before the replay, and the graph covers the decode rows only. A
        prefill counted into the graph's rows would replay without its prompt's KV writes
        (vllm-project/vllm #53051: a batch holding prefills dispatched into the decode graph;
        the `prefill-dispatched-into-graph` variant). Eager mixed steps cost W's 17 mixed
        steps ~20 ms of host-bound launches each on an H200 (docs/benchmarks.md).

        Raises:
            EligibilityError: decode rows with a longest context below 1 (every row attends
                over at least the token it writes): a caller's count is wrong at serving
                time, which no configuration value causes or fixes.
        """
        if decode_rows == 0:
            return None, 0
        if longest_context < 1:
            raise EligibilityError(f"longest context {longest_context} of {decode_rows} decode "
                                   "rows: a row attends over at least the token it writes")
        bucket = select_bucket(decode_rows, self.buckets)
        if self.batch_cap is not None and decode_rows > self.batch_cap:
            return None, bucket
        if self.short_context is not None and longest_context <= self.short_context:
            key = GraphKey(bucket, SHORT)
            if self.is_eligible(key):
                return key, bucket
        key = GraphKey(bucket, DECODE)
        if not self.is_eligible(key):
            return None, bucket
        return key, bucket


@lru_cache(maxsize=256)
def _keys(plan: GraphPlan) -> tuple[GraphKey, ...]:
    return tuple(GraphKey(b, p) for b in reversed(plan.buckets) for p in plan.paths
                 if plan.is_eligible(GraphKey(b, p)))
