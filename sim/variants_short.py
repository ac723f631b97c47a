"""The short-context decode path (I22): its clean form and the known-bad ways to choose it.

The short path's graph (`protocol.keys.SHORT`) fuses attention into o_proj and reads one tile of
at most ``short_context`` cached tokens per row; a row with a longer context replayed on it
silently loses the tokens past the tile. The controller picks it for a whole step only when
every decode row's context -- position + 1, the token the step writes included -- fits
(`protocol.eligibility.GraphPlan.key_for`). The modelled replay reads just the tile
(`sim.devices.DeviceModel.decode`, ``window``), so a wrong choice changes a token and the token
oracle catches it: the verdict is earned from the data, not from a message.

Each variant's search draws, per run, every request's prompt length and ``max_tokens`` and then
``short_context`` from that workload's decode contexts (`sim.scenario.ShortPathDraw`), so which
step meets the boundary, and which row of the step is the longest, is found by search. Serving steps do not
depend on the schedule, so without the draw every schedule would cross the boundary at the same
step with the same rows; with it, a bug that shows only at one boundary, or only when a longer
row sits behind slot 0, is still found. The clean row must reach a step whose slot 0 fits the
short path while a row behind it does not (``first_row_behind``, counted at the replay), so its
verdict covers the case the first-row bug needs: a run reaches it exactly when the first-row
controller's run of the same draw diverges. The clean row also draws
``memory_headroom_bytes`` over each run's scenario (`sim.headroom.HeadroomAfter`), as the
``correct`` row does: the short path doubles the graphs of its buckets, and only a drawn
headroom makes the fit drop some of them and measure the kept set again.
"""

from __future__ import annotations

from protocol.commands import DecodeRows
from protocol.controller import Controller
from protocol.eligibility import GraphPlan
from protocol.keys import SHORT
from sim.headroom import HeadroomAfter
from sim.scenario import Scenario, ShortPathDraw, decode_contexts, short_path_on
from sim.variants import BOTH_CLEAN, EVENT_REACH, Variant, register


def _no_short_path(sc: Scenario) -> str | None:
    """`Variant.unreachable` of the short-path variants: why this scenario cannot replay the
    short path (served without graphs, or no request decodes), or None."""
    if not sc.config.cuda_graphs:
        return "served without CUDA graphs: no step replays either decode path"
    if decode_contexts(sc) is None:
        return "no request of the workload decodes: no step has a context to judge"
    return None


def _no_short_graph_of_two_rows(sc: Scenario) -> str | None:
    """Why no step of ``sc`` can replay the short path with a row behind slot 0 (what the
    first-row bug needs), or None: every captured bucket of two rows or more is above
    ``short_max_bucket``, so a step of two rows pads to a bucket with no short graph (a fresh
    reviewer's finding: ``--buckets 1,32`` read ``short-path-first-row`` clean, a MISMATCH,
    and the clean row counted ``first_row_behind`` at replays of bucket 32)."""
    cfg = sc.config
    buckets = {k.bucket for k in GraphPlan.from_config(cfg).keys() if k.path == SHORT}
    if not any(b >= 2 for b in buckets):
        return (f"the short path has a graph of bucket {', '.join(map(str, sorted(buckets)))} "
                f"only (short_max_bucket {cfg.short_max_bucket}): no step of two rows or more "
                "replays it")
    return None


def _no_first_row_behind(sc: Scenario) -> str | None:
    return _no_short_path(sc) or _no_short_graph_of_two_rows(sc)


EVENT_REACH["first_row_behind"] = _no_short_graph_of_two_rows


register(Variant(
    name="correct-short-path",
    summary="the protocol as specified with the short-context decode path on: a step replays "
            "the short path's graph only when every decode row's context fits its one tile",
    source="docs/design.md (I22)",
    expected=BOTH_CLEAN, adjust=short_path_on, draw=HeadroomAfter(ShortPathDraw),
    reaches=("short_replay", "short_declined", "first_row_behind"), unreachable=_no_short_path,
    schedules=20, fault_schedules=10))


# -- short-path-off-by-one ------------------------------------------------------------------------

class OffByOneContextController(Controller):
    """Judges a step's longest context from its rows' positions -- the tokens cached before
    the step -- leaving out the token the step writes: a row at exactly short_context + 1
    tokens of context is judged to fit."""

    def longest_context(self, rows: DecodeRows) -> int:
        return max(rows.positions) if rows else 0


register(Variant(
    name="short-path-off-by-one",
    summary="the controller judges a step's longest context from the tokens cached before the "
            "step, without the one it writes, so a row at exactly short_context + 1 tokens "
            "replays the short path and loses its last token",
    source="modelled on the per-step dispatch of vLLM PR #25906 and SGLang #30242 (a graph "
           "choice made from a view that is not the step's); paiml/aprender PR #2030 (a decode "
           "graph replays an attention-path choice made at another sequence length, wrong once "
           "the sequence crosses the path's threshold); nntrainer/nntrainer PR #4313 (a "
           "captured decode graph kept the dense kernel picked below the 64-key split-KV "
           "threshold after the sequence grew past it)",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy="A row's context counts the token the step writes: position + 1. The controller "
           "passes max(position) + 1 over the step's rows to GraphPlan.key_for, which picks the "
           "short path only when that is at most short_context (I22).",
    controller_cls=OffByOneContextController, adjust=short_path_on, draw=ShortPathDraw,
    unreachable=_no_short_path))


# -- short-path-first-row -------------------------------------------------------------------------

class FirstRowContextController(Controller):
    """Takes a step's longest context from its first decode row (slot 0) only. When a row
    behind slot 0 has the longer context (a request admitted later with a longer prompt, or a
    compaction that moved a young request into slot 0), that row replays the short path."""

    def longest_context(self, rows: DecodeRows) -> int:
        return rows.positions[0] + 1 if rows else 0


register(Variant(
    name="short-path-first-row",
    summary="the controller takes a step's longest context from its first decode row instead "
            "of the maximum over every row, so longer rows behind it replay the short path",
    source="modelled on the per-step dispatch of vLLM PR #25906 and SGLang #30242 (a graph "
           "choice made from part of the batch); paiml/aprender PR #2030 (an attention-path "
           "choice that does not follow every sequence's length)",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy="The path is chosen from the maximum context over every decode row of the step, "
           "never from one row (GraphPlan.key_for, I22).",
    controller_cls=FirstRowContextController, adjust=short_path_on, draw=ShortPathDraw,
    unreachable=_no_first_row_behind))
