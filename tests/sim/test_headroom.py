"""The memory headroom (`ProtocolConfig.memory_headroom_bytes`) under the check: the bound the
simulator computes is the protocol's own boundary, a run that serves leaves the headroom free on
every rank (I9), a refusal passes only where the memory requires it, and the correct protocol's
rows draw the headroom (`sim.headroom.HeadroomDraw`), so that a controller which drops it,
counts it twice or takes it off another rank's report is caught by `lockstep check`."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest

from protocol.controller import Controller
from sim.check import CLEAN, CheckSpec, check_correct
from sim.hazards import HazardModel
from sim.headroom import KINDS, OVERHEAD_RANGE, HeadroomDraw, largest_headroom, refusal_expected
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import CORRECT, REGISTRY, eager_decode, get_variant

SMALL = {"buckets": (1, 2, 4, 8), "max_batch": 6}
SPEC = CheckSpec(buckets=(1, 2, 4, 8), max_batch=6, schedules=14, fault_schedules=0, jobs=1)


def _with(sc, headroom=None, overhead=None):
    if overhead is not None:
        sc = sc.with_(memory=replace(sc.memory, rank_overhead=overhead))
    if headroom is not None:
        sc = sc.with_(config=replace(sc.config, memory_headroom_bytes=headroom))
    return sc


def _run(sc, variant=CORRECT, seed=0):
    return run_schedule(sc, variant, RandomWalk(seed))


SCENARIOS = {
    "default": default_scenario(**SMALL),
    "eager": eager_decode(default_scenario(**SMALL)),
    "short-path": default_scenario(**SMALL, short_context=5),
    "numeric-cap": default_scenario(**SMALL, graph_batch_cap=3),
    "one-bucket": default_scenario(buckets=(8,), max_batch=6),
    "rank-1-busy": _with(default_scenario(**SMALL), overhead=((1, 3 << 30),)),
    "three-ranks": _with(default_scenario(**SMALL, world_size=3), overhead=((2, 1 << 30),)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_bound_is_where_the_correct_protocol_stops_serving(name):
    """At the bound the correct protocol serves, with the headroom free on every rank when
    serving starts; one byte past it, it refuses at startup. The bound comes from the memory
    model and the graph plan, not from the controller's fit, so it is a test of that fit."""
    sc = SCENARIOS[name]
    bound = largest_headroom(sc)
    assert bound > 0
    served = _run(_with(sc, headroom=bound))
    assert served.outcome.verdict == "clean", served.outcome.detail
    world = served.world
    assert world.ctrl.memory.kv_pages >= sc.pages_per_seq
    free = [sc.memory.capacity - used for used in world.used]
    assert min(free) >= bound, free
    refused = _run(_with(sc, headroom=bound + 1))
    assert refused.outcome.verdict == "startup-refused", refused.outcome.detail
    assert not refusal_expected(_with(sc, headroom=bound))
    assert refusal_expected(_with(sc, headroom=bound + 1))


class DroppingController(Controller):
    """Sizes the KV cache as if no headroom were configured."""

    def fit_memory(self, reports, graph_bytes):
        return _fit(self, reports, graph_bytes, 0)


class TwiceController(Controller):
    """Takes the headroom off twice."""

    def fit_memory(self, reports, graph_bytes):
        return _fit(self, reports, graph_bytes, 2 * self.config.memory_headroom_bytes)


class RefitDroppingController(Controller):
    """Takes the headroom off at the first fit only: a refit (after measuring the smaller set
    the first fit kept, I9) sizes the KV cache without it."""

    def fit_memory(self, reports, graph_bytes):
        headroom = self.config.memory_headroom_bytes if self.memory is None else 0
        return _fit(self, reports, graph_bytes, headroom)


class RankZeroController(Controller):
    """Fits the memory to rank 0's report alone, whichever rank is the tightest."""

    def fit_memory(self, reports, graph_bytes):
        return super().fit_memory({0: reports[0]}, graph_bytes)


def _fit(ctrl, reports, graph_bytes, headroom):
    from protocol.memory import plan_memory

    cap = ctrl.memory.batch_cap if ctrl.memory else ctrl.config.max_batch
    return plan_memory(reports, graph_bytes, ctrl.plan.buckets, cap, ctrl.config.kv_page_bytes,
                       ctrl.pages_per_seq, headroom, ctrl.config.max_kv_pages)


def _mutant(controller_cls):
    return replace(CORRECT, name=f"correct-{controller_cls.__name__}",
                   controller_cls=controller_cls)


@pytest.mark.timeout(60)
def test_a_controller_that_drops_the_headroom_breaks_i9_when_serving_starts():
    sc = _with(default_scenario(**SMALL), headroom=10 << 30)
    result = _run(sc, _mutant(DroppingController))
    assert result.outcome.verdict == "invariant" and result.outcome.invariant == "I9"
    assert "less than the memory_headroom_bytes=10737418240" in result.outcome.detail
    assert result.outcome.rank == 0 and result.outcome.step is not None
    assert _run(sc).outcome.verdict == "clean"


@pytest.mark.timeout(60)
def test_the_headroom_check_needs_the_memory_hazard():
    """Without H7 nothing is budgeted: a verdict that names I9 for memory needs it, so the
    hazard attribution (`lockstep check --explain`) names it."""
    sc = _with(default_scenario(**SMALL), headroom=10 << 30)
    off = sc.with_(hazards=HazardModel().without("h7"))
    assert _run(off, _mutant(DroppingController)).outcome.verdict == "clean"


@pytest.mark.timeout(60)
def test_a_fit_to_rank_0_alone_leaves_a_busier_rank_short_of_its_headroom():
    sc = _with(default_scenario(**SMALL), headroom=10 << 30, overhead=((1, 2 << 30),))
    result = _run(sc, _mutant(RankZeroController))
    assert result.outcome.invariant == "I9" and result.outcome.rank == 1, result.outcome.detail
    # with the ranks alike, the tightest rank is rank 0 too: the bug cannot show
    assert _run(_with(sc, overhead=()), _mutant(RankZeroController)).outcome.verdict == "clean"


@pytest.mark.timeout(60)
def test_a_refusal_passes_only_where_the_memory_requires_it():
    sc = default_scenario(**SMALL)
    bound = largest_headroom(sc)
    twice = _mutant(TwiceController)
    fits = _run(_with(sc, headroom=bound // 2 + 1), twice)
    assert fits.outcome.verdict == "startup-refused"
    assert not CLEAN(fits)  # the memory holds a plan: refusing it is the bug
    over = _run(_with(sc, headroom=bound + 1))
    assert over.outcome.verdict == "startup-refused" and CLEAN(over)
    # the known-bad variant whose verdict is a refusal still refuses a memory that fits
    for name in ("reserve-by-requested-batch",):
        variant = get_variant(name)
        assert not refusal_expected(variant.scenario(CheckSpec().scenario("shared")))


def test_the_draw_covers_every_kind_in_six_runs_and_is_a_function_of_seed_and_index():
    base = default_scenario(**SMALL)
    draw = HeadroomDraw(base, seed=3)
    assert draw(0) is base
    assert draw(5) == HeadroomDraw(base, seed=3)(5) == pickle.loads(pickle.dumps(draw))(5)
    assert draw(5) != HeadroomDraw(base, seed=4)(5)
    runs = [draw(i) for i in range(1, 13)]
    kinds = [KINDS[i % len(KINDS)] for i in range(1, 13)]
    for sc, kind in zip(runs, kinds):
        headroom, bound = sc.config.memory_headroom_bytes, largest_headroom(sc)
        assert 0 <= headroom
        assert refusal_expected(sc) == (kind == "over"), (kind, headroom, bound)
        if kind == "exact":
            assert headroom == bound
    overs = [sc for sc, kind in zip(runs, kinds) if kind == "over"]
    assert [sc.config.memory_headroom_bytes - largest_headroom(sc) for sc in overs][0] == 1
    assert overs[1].config.memory_headroom_bytes - largest_headroom(overs[1]) > 1
    assert any(sc.memory.rank_overhead for sc in runs)
    assert any(not sc.memory.rank_overhead for sc in runs)
    # roomy draws spread over the bound: below half of it and past it, where a headroom taken
    # twice no longer fits (tight and exact draws are all past it)
    roomy = [HeadroomDraw(base, seed)(i) for seed in range(4) for i in range(1, 13)
             if KINDS[i % len(KINDS)] == "roomy"]
    halves = {2 * sc.config.memory_headroom_bytes > largest_headroom(sc) for sc in roomy}
    assert halves == {False, True}
    # a one-scenario search takes two refused members, the bound, and a roomy one past half
    # of it with the last rank the tightest, which stands for the base
    one_over, far_over, exact, busy = draw.members()
    assert refusal_expected(one_over) and refusal_expected(far_over)
    assert one_over.config.memory_headroom_bytes == largest_headroom(one_over) + 1
    assert exact.config.memory_headroom_bytes == largest_headroom(exact)
    assert busy.memory.rank_overhead == ((1, 64 << 20),)
    assert largest_headroom(busy) / 2 < busy.config.memory_headroom_bytes < largest_headroom(busy)
    assert draw.members() == HeadroomDraw(base, seed=3).members()


def test_a_memory_that_holds_the_smallest_plan_with_no_byte_to_spare_is_still_drawn():
    """At a bound of exactly 0 (headroom 0 fits, one byte does not) the draw and the members
    still apply their overhead and headroom, as at any bound that is not negative; two mutants
    that took a bound of 0 for "no plan at all" (`< 0` made `<= 0`, `>= 0` made `> 0`) survived
    every test (tools/mutation.py, 2026-12-06)."""
    base = CORRECT.scenario(default_scenario())
    draw = HeadroomDraw(base, seed=3)
    spare = largest_headroom(base)
    assert spare > 0
    at_zero = draw.drawn("exact", random.Random(0), overhead=(0, spare))
    assert at_zero.memory.rank_overhead == ((0, spare),) and largest_headroom(at_zero) == 0
    assert at_zero.config.memory_headroom_bytes == 0
    # the members' busy scenario: its overhead leaves the smallest plan exactly room
    last = base.config.world_size - 1
    busy_spare = largest_headroom(draw._with_overhead((last, OVERHEAD_RANGE[0])))
    tight = base.with_(memory=replace(base.memory, capacity=base.memory.capacity - busy_spare),
                       config=replace(base.config, memory_headroom_bytes=1))  # its own: replaced
    busy = HeadroomDraw(tight, seed=3).members()[-1]
    assert busy.memory.rank_overhead == ((last, OVERHEAD_RANGE[0]),)
    assert largest_headroom(busy) == 0 and busy.config.memory_headroom_bytes == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("controller_cls", [DroppingController, TwiceController,
                                            RefitDroppingController, RankZeroController])
def test_the_correct_row_catches_a_controller_that_mishandles_the_headroom(controller_cls):
    [row] = check_correct(_mutant(controller_cls), SPEC, "shared")
    assert not row.passed and row.got in ("invariant:I9", "startup-refused", "oom"), row.detail
    if row.got == "startup-refused":
        assert "the refusal is wrong" in row.detail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["correct", "correct-eager"])
def test_the_correct_rows_draw_the_headroom_and_count_their_refusals(name):
    variant = REGISTRY[name]
    [row] = check_correct(variant, SPEC, "shared")
    assert row.got == "clean", row.detail
    refused = row.stats.verdicts["startup-refused"]
    assert 0 < refused < row.stats.schedules
    assert row.detail.startswith(f"{row.stats.schedules - refused} schedules clean, {refused} "
                                 "refused at startup, as their memory requires")
    # without the draw every run serves at headroom 0, where a dropped headroom cannot show
    [undrawn] = check_correct(replace(_mutant(DroppingController), draw=None), SPEC, "shared")
    assert undrawn.got == "clean"


DROPPING_CONTROLLER = '''
from protocol.controller import Controller
from protocol.memory import plan_memory


class Dropping(Controller):
    def fit_memory(self, reports, graph_bytes):
        cap = self.memory.batch_cap if self.memory else self.config.max_batch
        return plan_memory(reports, graph_bytes, self.plan.buckets, cap,
                           self.config.kv_page_bytes, self.pages_per_seq, 0,
                           self.config.max_kv_pages)
'''
"""A variant file's controller that sizes the KV cache without the headroom."""

DROPPING_FILE = DROPPING_CONTROLLER + '''
from sim.headroom import HeadroomDraw
from sim.variants import Variant


DROPPED = Variant(name="my-headroom-dropped", summary="sizes the KV cache without the headroom",
                  source="a test", expected={"shared": "invariant:I9", "per-rank": "invariant:I9"},
                  controller_cls=Dropping, draw=HeadroomDraw)
'''


@pytest.mark.timeout(120)
def traced_counterexample(tmp_path, file_text: str, name: str):
    """Variant ``name`` of a variant file holding ``file_text``, checked on the shared topology
    with its counterexample written by ``--trace-out``: (the file, the trace, its JSON)."""
    import json

    from lockstep.cli import main

    path = tmp_path / f"{name}.py"
    path.write_text(file_text)
    out = tmp_path / "traces"
    assert main(["check", "--variant-file", str(path), "--variant", name,
                 "--topology", "shared", "--buckets", "1,2,4,8", "--max-batch", "6",
                 "--schedules", "14", "--fault-schedules", "0", "--no-progress", "--jobs", "1",
                 "--trace-out", str(out)]) == 0
    trace = out / f"{name}.shared.json"
    return path, trace, json.loads(trace.read_text())


def test_a_trace_of_a_drawn_run_records_its_memory_and_replays(tmp_path, capsys):
    """A counterexample under a drawn headroom (and rank overhead) replays only with them: the
    trace records both where they differ from the variant's own, `--replay` applies them, and a
    variant that does not draw its memory refuses them as a bad trace."""
    import json

    from lockstep.cli import main

    path, trace, data = traced_counterexample(tmp_path, DROPPING_FILE, "my-headroom-dropped")
    assert data["scenario"]["memory_headroom_bytes"] > 0
    capsys.readouterr()
    assert main(["check", "--replay", str(trace), "--variant-file", str(path)]) == 0
    assert "==> invariant (I9)" in capsys.readouterr().out
    data["variant"] = "fused-sweep"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert main(["check", "--replay", str(edited)]) == 2
    err = capsys.readouterr().err
    assert "bad scenario in trace: memory_headroom_bytes" in err and "runs its own memory" in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("controller_cls", [DroppingController, TwiceController])
def test_a_one_scenario_search_of_the_members_catches_a_mishandled_headroom(controller_cls):
    """Exhaustive search takes the draw's members in turn (`HeadroomDraw.members`), cheapest
    first: a dropped headroom serves one byte past the bound (the first member), a doubled one
    refuses the bound itself (the third, after two refusals that are right)."""
    spec = CheckSpec(buckets=(1, 2, 4), max_batch=3, strategy="exhaustive", fault_schedules=0,
                     jobs=1)
    [row] = check_correct(_mutant(controller_cls), spec, "shared")
    assert row.got in ("invariant:I9", "startup-refused") and not row.passed, row.detail
    assert row.stats.scenarios == (1 if controller_cls is DroppingController else 3)


class _Highest:
    """An rng whose draws are the top of their range."""

    def randint(self, lo, hi):
        return hi


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["default", "rank-1-busy"])
def test_the_roomiest_draw_keeps_every_graph_of_the_full_batch_and_one_byte_more_does_not(name):
    """`KINDS`' ``roomy``: up to the most headroom that still keeps the graphs of the full batch
    cap beside one sequence. At the top of that range the correct protocol serves with the
    memory-fitted cap at max_batch; one byte more and the fit drops the cap. Mutants #1614 and
    #1621 (a sign and a product of that bound changed, docs/mutation.md) moved the top and were
    not caught: a roomy draw past it serves at a smaller cap, or is refused and read as expected."""
    draw = HeadroomDraw(SCENARIOS["default"], 0)
    overhead = ((1, 3 << 30),) if name == "rank-1-busy" else None
    top = draw.drawn("roomy", _Highest(), overhead and overhead[0])
    headroom = top.config.memory_headroom_bytes
    full = _run(top)
    assert full.outcome.verdict == "clean", full.outcome.detail
    assert full.world._fitted_cap == top.config.max_batch
    past = _run(_with(top, headroom=headroom + 1))
    assert past.outcome.verdict == "clean", past.outcome.detail
    assert past.world._fitted_cap < top.config.max_batch
