"""The memory headroom drawn in the correct protocol's rows beyond ``correct`` and
``correct-eager``: under paging pressure, chunked prefill, overlapped scheduling and the short
path (`sim.headroom.HeadroomDraw`, `HeadroomAfter`). Each drawn row stays clean and keeps what
it exists for, and catches a controller that mishandles the headroom -- one that does so
everywhere, and one that does so only under the row's own feature, which ``correct`` cannot
show and the row without its draw did not."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from protocol.controller import Controller
from sim.check import check_correct, scenario_family
from sim.headroom import HeadroomAfter, HeadroomDraw, KINDS, largest_headroom, refusal_expected
from sim.run import run_schedule
from sim.scenario import ShortPathDraw, default_scenario, short_path_on
from sim.strategies import RandomWalk
from sim.variants import REGISTRY
from tests.sim.test_headroom import (DROPPING_CONTROLLER, SPEC, DroppingController,
                                     RankZeroController, RefitDroppingController,
                                     TwiceController, _fit, traced_counterexample)

ROWS = ("paged-kv-pressure", "chunked-prefill", "chunked-prefill-pressure",
        "overlapped-scheduling", "overlapped-eager", "correct-short-path")
"""The rows this file covers, each the correct protocol under one feature."""

OWN_DRAW = {"correct-short-path": ShortPathDraw}
"""Each row's per-run draw before the headroom was drawn (None where it had none)."""


def _mutant(name, controller_cls, draw="own"):
    variant = REGISTRY[name]
    variant = replace(variant, name=f"{name}-{controller_cls.__name__}",
                      controller_cls=controller_cls)
    return variant if draw == "own" else replace(variant, draw=draw)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ROWS)
def test_each_row_draws_the_headroom_and_stays_clean(name):
    [row] = check_correct(REGISTRY[name], SPEC, "shared")
    assert row.got == "clean", row.detail
    refused = row.stats.verdicts["startup-refused"]
    assert 0 < refused < row.stats.schedules, row.detail
    assert isinstance(scenario_family(REGISTRY[name], default_scenario(), 0), HeadroomDraw)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["paged-kv-pressure", "chunked-prefill-pressure"])
def test_a_pressure_row_keeps_its_pool_of_one_sequence_in_every_run_that_serves(name):
    """What the pressure rows exist for -- a KV pool of one full-length sequence, so running
    requests are preempted -- holds at every headroom drawn: ``max_kv_pages`` caps the pool and
    every serving draw leaves room for that sequence; a ``tight`` draw lowers the batch cap
    instead (under the cap, the pages a tight draw would leave are left free anyway)."""
    variant = REGISTRY[name]
    draw = scenario_family(variant, variant.scenario(SPEC.scenario("shared")), 0)
    caps = set()
    for i in range(1, 13):
        sc = draw(i)
        result = run_schedule(sc, variant, RandomWalk(i))
        if refusal_expected(sc):
            assert result.outcome.verdict == "startup-refused"
            continue
        assert result.outcome.verdict == "clean", result.outcome.detail
        assert result.world.ctrl.memory.kv_pages == sc.pages_per_seq == sc.config.max_kv_pages
        if KINDS[i % len(KINDS)] == "tight":
            assert result.world._fitted_cap < sc.config.max_batch
        caps.add(result.world._fitted_cap)
    assert len(caps) >= 2  # the draw moves the cap, the one thing it can move here


GENERIC = [(name, cls) for name in ROWS
           for cls in (DroppingController, TwiceController, RefitDroppingController,
                       RankZeroController)
           if not (name == "overlapped-eager" and cls is RefitDroppingController)]
"""Every row with every mishandled headroom of test_headroom.py, but the refit on the eager
row: without graphs the fit keeps no graph set, so it never measures again."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, controller_cls", GENERIC)
def test_each_row_catches_a_controller_that_mishandles_the_headroom(name, controller_cls):
    [row] = check_correct(_mutant(name, controller_cls), SPEC, "shared")
    assert not row.passed and row.got in ("invariant:I9", "startup-refused", "oom"), row.detail
    if row.got == "startup-refused":
        assert "the refusal is wrong" in row.detail


def _only_under(feature, what):
    """A controller that drops the headroom where ``feature(config)`` holds (``what`` says
    where, in words), and fits it as the protocol does elsewhere."""
    class OnlyUnder(Controller):
        def fit_memory(self, reports, graph_bytes):
            if not feature(self.config):
                return super().fit_memory(reports, graph_bytes)
            return _fit(self, reports, graph_bytes, 0)

    OnlyUnder.__name__ = f"DroppedWhere{what.title().replace(' ', '')}"
    OnlyUnder.__doc__ = f"Leaves the headroom out of the memory fit where {what}, only there."
    return OnlyUnder


class CappedPoolDroppingController(Controller):
    """Leaves the headroom out where ``max_kv_pages`` caps the KV pool, reasoning that a capped
    pool leaves the rest of the device free anyway; but the graphs the fit keeps for the full
    batch cap still take the headroom's bytes."""

    def fit_memory(self, reports, graph_bytes):
        headroom = 0 if self.config.max_kv_pages is not None else self.config.memory_headroom_bytes
        return _fit(self, reports, graph_bytes, headroom)


DEFAULT_PREFILL = default_scenario().config.max_prefill_tokens

SCOPED = {
    "paged-kv-pressure": CappedPoolDroppingController,
    "chunked-prefill-pressure": CappedPoolDroppingController,
    "chunked-prefill": _only_under(lambda cfg: cfg.max_prefill_tokens < DEFAULT_PREFILL,
                                   "prompts are chunked"),
    "overlapped-scheduling": _only_under(lambda cfg: cfg.decode_overlap, "steps overlap"),
    "overlapped-eager": _only_under(lambda cfg: cfg.decode_overlap, "steps overlap"),
    "correct-short-path": _only_under(lambda cfg: cfg.short_context is not None,
                                      "the short path is on"),
}
"""Per row, a controller that mishandles the headroom only under that row's feature."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ROWS)
def test_a_headroom_dropped_only_under_a_row_s_feature_is_caught_by_that_row(name):
    """``correct`` passes such a controller (its feature is off there), and so did the row
    before it drew the headroom; now the row catches it, with the I9 headroom check."""
    controller_cls = SCOPED[name]
    [correct] = check_correct(replace(REGISTRY["correct"], name="correct-scoped",
                                      controller_cls=controller_cls), SPEC, "shared")
    assert correct.got == "clean", correct.detail
    [undrawn] = check_correct(_mutant(name, controller_cls, OWN_DRAW.get(name)), SPEC, "shared")
    assert undrawn.got == "clean", undrawn.detail
    [row] = check_correct(_mutant(name, controller_cls), SPEC, "shared")
    assert row.got == "invariant:I9" and "memory_headroom_bytes" in row.detail, row.detail


def test_the_short_path_row_draws_the_headroom_over_each_run_s_own_draw():
    """`HeadroomAfter(ShortPathDraw)`: run i has ShortPathDraw's run i (prompts, max_tokens,
    short_context) and a headroom drawn against that scenario's own bound (a short_context
    changes the graph plan); run 0 keeps the base's headroom. A one-scenario search takes the
    four headroom members over run 0, then ShortPathDraw's own members, not every pairing."""
    base = short_path_on(default_scenario(buckets=(1, 2, 4, 8), max_batch=6))
    draw = HeadroomAfter(ShortPathDraw)(base, 3)
    own = ShortPathDraw(base, 3)
    assert draw(0) == own(0)
    for i in range(1, 13):
        sc = draw(i)
        assert sc.workload == own(i).workload
        assert sc.config.short_context == own(i).config.short_context
        assert sc == HeadroomDraw(own(i), 3)(i)
        assert refusal_expected(sc) == (KINDS[i % len(KINDS)] == "over")
        if KINDS[i % len(KINDS)] == "exact":
            assert sc.config.memory_headroom_bytes == largest_headroom(sc)
    assert pickle.loads(pickle.dumps(draw))(5) == draw(5)
    members = draw.members()
    assert members[:4] == HeadroomDraw(own(0), 3).members()
    assert members[4:] == own.members()


SHORT_DROPPING_FILE = DROPPING_CONTROLLER + '''
from sim.headroom import HeadroomAfter
from sim.scenario import ShortPathDraw, short_path_on
from sim.variants import Variant


DROPPED = Variant(name="my-short-headroom-dropped", summary="drops the headroom",
                  source="a test", expected={"shared": "invariant:I9", "per-rank": "invariant:I9"},
                  controller_cls=Dropping, adjust=short_path_on,
                  draw=HeadroomAfter(ShortPathDraw))
'''


@pytest.mark.timeout(120)
def test_a_trace_of_a_run_drawn_twice_records_both_draws_and_replays(tmp_path, capsys):
    """A counterexample of a row that draws its workload and short_context and then its
    headroom records all of them, and `--replay` accepts them: the workload's fields are the
    row's own draw's, under the headroom draw (`sim.check._own_draw`); before, a replay read
    such a trace's prompt lengths as an edit of a variant that draws no workload."""
    from lockstep.cli import main

    path, trace, data = traced_counterexample(tmp_path, SHORT_DROPPING_FILE,
                                              "my-short-headroom-dropped")
    scenario = data["scenario"]
    assert scenario["memory_headroom_bytes"] > 0 and "prompt_lengths" in scenario
    assert scenario["short_context"] is not None
    capsys.readouterr()
    assert main(["check", "--replay", str(trace), "--variant-file", str(path)]) == 0
    assert "==> invariant (I9)" in capsys.readouterr().out
