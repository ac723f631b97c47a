"""I22 in the simulator: a short-path replay reads one tile of ``short_context`` tokens per row,
the search draws ``short_context`` per run, and a wrong path choice is caught by its tokens."""

import json
import pickle

import pytest

from protocol.keys import SHORT
from protocol.requests import Request
from sim.check import CLEAN, CheckSpec, check_bad, check_correct, replay_trace, scenario_spec
from sim.devices import DeviceModel
from sim.report import to_json
from sim.run import run_schedule
from sim.scenario import (DRAWN_MAX_TOKENS, DRAWN_PROMPT_LENGTHS, Arrival, ShortContextDraw,
                          ShortPathDraw, decode_contexts, default_scenario, max_tokens,
                          prompt_lengths, short_path_on, with_max_tokens,
                          with_prompt_lengths)
from sim.search import sample_search
from sim.strategies import RandomWalk
from sim.variants import REGISTRY, Variant

BAD = ("short-path-off-by-one", "short-path-first-row")
SPEC = CheckSpec(schedules=50, fault_schedules=0, time_budget=30, jobs=1)


def _with_short(sc, short_context):
    from dataclasses import replace
    return sc.with_(config=replace(sc.config, short_context=short_context))


def _long_prompts(sc):
    """``sc`` with another workload: prompts of 9..12 tokens, 2..8 new tokens each, in two
    waves (contexts 10..16 instead of the default workload's 4..8)."""
    arrivals = tuple(Arrival(2 * (i // 6), Request(
        i, prompt=tuple(range(1, 10 + i % 4)), max_tokens=2 + (i * 5) % 7,
        stop_token_ids=frozenset({0}))) for i in range(10))
    return sc.with_(workload=arrivals)


def test_the_draw_spans_the_workload_contexts_from_none_fitting_to_all_fitting():
    sc = default_scenario()
    assert decode_contexts(sc) == (4, 8)  # prompts of 3 tokens, 2..6 new tokens
    draw = ShortContextDraw(sc, 0)
    drawn = [draw(i).config.short_context for i in range(200)]
    assert set(drawn) == set(range(3, 9))  # 3: no row fits; 8: every row does
    assert drawn == [ShortContextDraw(sc, 0)(i).config.short_context for i in range(200)]
    assert drawn != [ShortContextDraw(sc, 1)(i).config.short_context for i in range(200)]
    assert pickle.loads(pickle.dumps(draw))(7) == draw(7)  # a parallel search's workers
    assert sc.config.short_context is None and short_path_on(sc).config.short_context == 6
    long = _long_prompts(sc)
    assert decode_contexts(long) == (10, 16)
    assert {ShortContextDraw(long, 0)(i).config.short_context for i in range(200)} == set(
        range(9, 17))


def test_a_short_replay_loses_exactly_the_tokens_past_its_tile():
    """A row at short_context tokens of context reads what a full read gives; one token more
    reads only the tile, and its next token changes."""
    world = run_schedule(default_scenario(), REGISTRY["correct"], RandomWalk(0)).world
    model = DeviceModel(world)
    from sim.kv import ModelledKV, next_token

    class Row:
        def __init__(self, position):
            self.slot, self.request_id, self.token, self.position = 0, 1, 9, position

    for context, window, same in ((5, 5, True), (6, 5, False), (1, 1, True), (2, 1, False)):
        kv, logits = ModelledKV(2), {}
        for p in range(context - 1):
            kv.write(0, p, 10 + p)
        kv.lengths[0] = context - 1
        model.decode(kv, logits, 0, [Row(context - 1)], window=window)
        full = next_token(kv.read(0, context - 1), world.scenario.vocab)
        assert (logits[0][1] == full) is same, (context, window)
        # exactly the tile, positions 0..window-1: not one more or one fewer (a read past the
        # tile, or short of it, changed the token too and passed the line above)
        tile = next_token(kv.read(0, min(context, window) - 1), world.scenario.vocab)
        assert logits[0][1] == tile, (context, window)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
def test_the_correct_protocol_with_the_short_path_is_clean_on_both_sides_of_the_boundary(topology):
    rows = check_correct(REGISTRY["correct-short-path"], CheckSpec(schedules=20, fault_schedules=10,
                                                                   jobs=1), topology)
    assert [r.got for r in rows] == ["clean", "abort"], [r.detail for r in rows]
    reached = rows[0].stats.reached
    assert reached["short_replay"] > 0 and reached["short_declined"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [lambda sc: sc, _long_prompts], ids=["default", "long-prompts"])
def test_the_correct_protocol_is_clean_at_every_short_context(make):
    sc = short_path_on(make(default_scenario()))
    lo, hi = decode_contexts(sc)
    for short in range(lo - 1, hi + 2):
        result = run_schedule(_with_short(sc, short), REGISTRY["correct-short-path"],
                              RandomWalk(short))
        assert result.outcome.verdict == "clean", (short, result.outcome.detail)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
@pytest.mark.parametrize("name", BAD)
def test_each_bad_choice_is_caught_by_its_tokens(name, topology):
    row = check_bad(REGISTRY[name], SPEC, topology)
    assert row.got == "divergence", row.detail
    outcome = row.minimal.outcome
    assert outcome.invariant is None and outcome.check == "tokens"
    assert row.minimal.world.scenario.config.short_context is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", BAD)
@pytest.mark.parametrize("make", [lambda sc: sc, _long_prompts], ids=["default", "long-prompts"])
def test_the_catch_does_not_rest_on_one_configuration_number(name, make):
    """Under two workloads and three seeds of the draw, the search finds a failing
    short_context; the numbers it fails at differ, and every one lies inside the workload's
    contexts (at the ends, where no row or every row fits, no choice can be wrong)."""
    variant = REGISTRY[name]
    base = variant.scenario(make(default_scenario()))
    lo, hi = decode_contexts(base)
    failing = set()
    for seed in range(3):
        result = sample_search(ShortContextDraw(base, seed), variant, CLEAN, "random", 30,
                               time_budget=60, seed=seed)
        assert result.failure is not None, (name, seed)
        assert result.failure.outcome.verdict == "divergence"
        failing.add(result.failure.world.scenario.config.short_context)
    every = {s for s in range(lo - 1, hi + 1)
             if run_schedule(_with_short(base, s), variant, RandomWalk(0)).outcome.verdict
             == "divergence"}
    assert failing <= every and lo - 1 not in every and hi not in every
    assert len(every) >= 3, every


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", BAD)
def test_the_verdict_is_earned_from_the_modelled_tile(name, monkeypatch):
    """With the short replay reading every token (no tile), the same wrong choices are clean:
    the catch comes from the data the kernel drops, not from the path's name."""
    decode = DeviceModel.decode

    def no_tile(self, *args, window=None, **kwargs):
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(DeviceModel, "decode", no_tile)
    base = REGISTRY[name].scenario(default_scenario())
    short_replays = 0
    for short in range(3, 9):
        result = run_schedule(_with_short(base, short), REGISTRY[name], RandomWalk(0))
        assert result.outcome.verdict == "clean", (short, result.outcome.detail)
        short_replays += result.reached.get("short_replay", 0)
    assert short_replays > 0  # the wrong choices were made, and replayed


@pytest.mark.timeout(120)
def test_a_drawn_counterexample_replays_from_its_trace():
    spec = CheckSpec(schedules=50, fault_schedules=0, jobs=1)
    row = check_bad(REGISTRY["short-path-first-row"], spec, "shared")
    written = scenario_spec(spec, "shared", row.minimal.world.scenario)
    assert written["short_context"] == row.minimal.world.scenario.config.short_context
    assert written.get("prompt_lengths", list(prompt_lengths(spec.scenario("shared")))) == \
        list(prompt_lengths(row.minimal.world.scenario))
    data = json.loads(json.dumps(to_json(row.minimal, "short-path-first-row", written)))
    result, problem = replay_trace(data)
    assert problem is None
    assert result.outcome.verdict == "divergence" and result.choices == row.minimal.choices
    data["scenario"]["short_context"] = 0
    with pytest.raises(Exception, match="short_context"):
        replay_trace(data)


def test_a_draw_that_gives_no_scenario_is_an_error_row_naming_the_variant():
    from sim.check import check_variant

    bad = Variant(name="my-bad-draw", summary="s", source="t",
                  expected={"shared": "divergence", "per-rank": "divergence"},
                  draw=lambda sc, seed: (lambda i: None))
    [row] = check_variant(bad, SPEC, "shared")
    assert row.got == "error" and "my-bad-draw" in row.detail and "draw" in row.detail


def test_the_short_graphs_are_captured_only_where_the_path_is_on():
    def recorded(variant):
        sc = REGISTRY[variant].scenario(default_scenario())
        world = run_schedule(sc, REGISTRY[variant], RandomWalk(0)).world
        return {e.detail for e in world.trace if e.kind == "op" and e.what == "record"}

    assert not any(SHORT in key for key in recorded("correct"))
    short = {key for key in recorded("correct-short-path") if SHORT in key}
    assert short == {f"{SHORT}@{b}" for b in (1, 2, 4, 8)}  # the buckets up to short_max_bucket


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", BAD)
def test_the_one_scenario_strategies_search_every_drawn_short_context(name):
    """Hypothesis (like exhaustive search) takes one scenario per search: it searches every
    member of the draw in turn. Searching run 0's draw alone (seed 0: a short_context below
    every decode context) reported both bad variants clean (a fresh user's finding)."""
    spec = CheckSpec(schedules=5, fault_schedules=0, time_budget=120, jobs=1,
                     strategy="hypothesis")
    row = check_bad(REGISTRY[name], spec, "shared")
    assert row.got == "divergence", row.detail


def test_the_draw_lists_every_value_it_draws_from():
    draw = ShortContextDraw(short_path_on(default_scenario("shared")), seed=0)
    lo, hi = decode_contexts(draw.base)
    members = [m.config.short_context for m in draw.members()]
    assert members == list(range(max(1, lo - 1), hi + 1))
    assert {draw(i).config.short_context for i in range(200)} == set(members)


@pytest.mark.timeout(120)
def test_the_faulted_row_runs_each_run_under_the_short_context_drawn_for_it(monkeypatch):
    """Old behaviour: every faulted run of correct-short-path kept the undrawn base's
    short_context (the middle of the workload's contexts), so a fault never met the boundary
    at any other value. Faulted run i now runs under fault-free run i's draw (its prompts and
    short_context), with its fault on an op site of that drawn scenario."""
    import sim.check as check
    from sim.faults import fault_sites

    searched = []
    search = check.sample_search

    def spy(scenario_for, *args, **kwargs):
        searched.append(scenario_for)
        return search(scenario_for, *args, **kwargs)

    monkeypatch.setattr(check, "sample_search", spy)
    # eight: the clean row must reach first_row_behind, at run 6 of seed 0 (runs 2-4 draw a
    # headroom that refuses or lowers the batch cap, and runs 0, 1 and 5 straddle no boundary)
    spec = CheckSpec(schedules=8, fault_schedules=8, jobs=1)
    variant = REGISTRY["correct-short-path"]
    rows = check_correct(variant, spec, "shared")
    assert [r.got for r in rows] == ["clean", "abort"], [r.detail for r in rows]
    faulted = searched[-1]  # the +faults row's search comes last
    base = variant.scenario(spec.scenario("shared"))
    draw = ShortPathDraw(base, spec.seed)
    runs = [faulted(i) for i in range(spec.fault_schedules)]
    drawn = [draw(i).config.short_context for i in range(spec.fault_schedules)]
    assert [sc.config.short_context for sc in runs] == drawn
    assert len(set(drawn)) >= 3 and set(drawn) != {base.config.short_context}
    workloads = [draw(i).workload for i in range(spec.fault_schedules)]
    assert [sc.workload for sc in runs] == workloads and len(set(workloads)) >= 3
    family = check.scenario_family(variant, base, spec.seed)  # draw(i), then its headroom
    for i, sc in enumerate(runs):
        [fault] = sc.faults
        assert sc.with_(faults=()) == family(i)
        sites = fault_sites(family(i), spec.seed)
        assert any((fault.rank, fault.op, fault.occurrence) in sites[phase] for phase in sites)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("max_batch", range(3, 17))
def test_first_row_is_found_at_every_max_batch_by_drawing_the_workload(max_batch):
    """Found by a fresh user: `lockstep check --max-batch 4` read short-path-first-row clean
    (MISMATCH), and a later fix only called it "not reachable here": the check's workload gives
    every prompt one length, and at max batch 4 no step of it has a row longer than slot 0's.
    The search now draws each request's prompt length and max_tokens per run
    (`ShortPathDraw`), so it finds the divergence at every max batch; at max batch 4 the
    counterexample is a drawn workload, since the check's own never puts a longer row behind
    slot 0."""
    from sim.run import correct_run

    variant = REGISTRY["short-path-first-row"]
    spec = CheckSpec(max_batch=max_batch, schedules=300, fault_schedules=0, jobs=1)
    row = check_bad(variant, spec, "shared")
    assert row.got == "divergence", row.detail
    base = variant.scenario(spec.scenario("shared"))
    if not correct_run(base).reached.get("first_row_behind"):
        assert row.minimal.world.scenario.workload != base.workload
    if max_batch == 4:
        assert not correct_run(base).reached.get("first_row_behind")


def test_the_workload_draw_keeps_run_0_and_draws_each_later_run_from_its_seed():
    base = short_path_on(default_scenario())
    draw = ShortPathDraw(base, 0)
    assert draw(0).workload == base.workload
    drawn = [(prompt_lengths(draw(i)), max_tokens(draw(i))) for i in range(1, 40)]
    assert all(len(p) == len(m) == len(base.workload) for p, m in drawn)
    assert {n for p, _ in drawn for n in p} == set(DRAWN_PROMPT_LENGTHS)
    assert {n for _, m in drawn for n in m} == set(DRAWN_MAX_TOKENS)
    again = ShortPathDraw(base, 0)
    assert drawn == [(prompt_lengths(again(i)), max_tokens(again(i))) for i in range(1, 40)]
    other = ShortPathDraw(base, 1)
    assert drawn != [(prompt_lengths(other(i)), max_tokens(other(i))) for i in range(1, 40)]
    assert pickle.loads(pickle.dumps(draw))(7) == draw(7)
    for i in range(1, 40):  # short_context drawn over that run's own workload
        contexts = decode_contexts(draw(i))
        if contexts is not None:
            assert max(1, contexts[0] - 1) <= draw(i).config.short_context <= contexts[1]
    members = draw.members()
    assert len({prompt_lengths(m) for m in members}) == 4  # the base's and runs 1..3's
    arrivals = [[a.after_step for a in draw(i).workload] for i in range(5)]
    assert all(a == arrivals[0] for a in arrivals)  # arrival steps are the check's


def test_a_prompt_is_cut_or_extended_to_its_drawn_length():
    sc = default_scenario()
    first = sc.workload[0].request
    longer = with_prompt_lengths(sc, [5] + [3] * (len(sc.workload) - 1))
    assert longer.workload[0].request.prompt == first.prompt + (4, 5)
    assert longer.workload[0].request.max_tokens == first.max_tokens
    assert with_prompt_lengths(sc, [1] * len(sc.workload)).workload[0].request.prompt == \
        first.prompt[:1]
    from protocol.errors import ConfigError
    with pytest.raises(ConfigError, match="2 prompt length"):
        with_prompt_lengths(sc, [3, 3])
    with pytest.raises(ConfigError, match="prompt length 0 of request 1"):
        with_prompt_lengths(sc, [3, 0] + [3] * (len(sc.workload) - 2))


@pytest.mark.timeout(120)
def test_the_clean_row_without_the_prompt_draw_is_vacuous_where_no_row_outgrows_slot_0():
    """The clean row must reach a step with a longer row behind slot 0 (``first_row_behind``),
    the case the first-row bug needs: drawing only short_context over the check's workload
    (prompts of one length) never does at max batch 4, and the row says so; with the prompt
    draw it is clean there."""
    from dataclasses import replace as replace_variant

    variant = REGISTRY["correct-short-path"]
    spec = CheckSpec(max_batch=4, schedules=20, fault_schedules=0, jobs=1)
    [undrawn] = check_correct(replace_variant(variant, draw=ShortContextDraw), spec, "shared")
    assert undrawn.got == "vacuous" and "first_row_behind" in undrawn.detail, undrawn.detail
    [drawn] = check_correct(variant, spec, "shared")
    assert drawn.got == "clean" and "first_row_behind reached" in drawn.detail, drawn.detail


@pytest.mark.timeout(120)
def test_the_short_path_rows_run_where_every_bucket_is_above_short_max_bucket():
    """Found in a sweep of configurations: `lockstep check --buckets 16 --max-batch 9` gave the
    short-path rows "error: ConfigError: short_max_bucket=8 is below the smallest bucket 16"
    (FAILED). The adjust now raises short_max_bucket to the smallest bucket."""
    spec = CheckSpec(buckets=(16,), max_batch=9, schedules=50, fault_schedules=0, jobs=1)
    base = default_scenario(buckets=(16,), max_batch=9)
    assert short_path_on(base).config.short_max_bucket == 16
    assert short_path_on(default_scenario()).config.short_max_bucket == 8  # default kept
    for name in BAD:
        assert check_bad(REGISTRY[name], spec, "shared").got == "divergence", name
    [row] = check_correct(REGISTRY["correct-short-path"], spec, "shared")
    assert row.got == "clean", row.detail


def test_short_path_on_leaves_a_scenario_without_decode_rows_or_with_the_path_on_unchanged():
    """Its docstring's two exceptions: a workload whose requests end at their prefill has no
    decode context to put the boundary in (mutant #2422, ``or`` made ``and``, took the sum of
    None), and a ``short_context`` already chosen is kept, not moved to the middle."""
    sc = default_scenario()
    no_decode = with_max_tokens(sc, [1] * len(sc.workload))
    assert decode_contexts(no_decode) is None
    assert short_path_on(no_decode) is no_decode
    chosen = _with_short(sc, 4)
    assert short_path_on(chosen) is chosen and short_path_on(sc).config.short_context == 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_batch", [None, 4, 9])
def test_first_row_behind_is_reached_exactly_where_the_first_row_bug_shows(max_batch):
    """The clean row's ``first_row_behind`` is its proof that it searched the case the
    first-row bug needs. It used to count any replay with a longer row behind slot 0, short
    path or not; at the default configuration the correct protocol reached it in every one of
    30 runs of the bad variant's draw, while the first-row controller diverged in 16 and gave,
    in the other 14 (runs 0-2 among them), the correct protocol's very trace: no step there had
    slot 0 fit the short path with a longer row past it. It now counts just those steps, and
    a run reaches it exactly when the first-row controller's run of the same draw diverges."""
    from sim.check import scenario_family

    spec = CheckSpec(max_batch=max_batch)
    bad, good = REGISTRY["short-path-first-row"], REGISTRY["correct-short-path"]
    draw = scenario_family(bad, bad.scenario(spec.scenario("shared")), spec.seed)
    reached, diverged = [], []
    for i in range(16):
        sc = draw(i)
        reached.append(run_schedule(sc, good, RandomWalk(i)).reached.get("first_row_behind", 0) > 0)
        diverged.append(run_schedule(sc, bad, RandomWalk(i)).outcome.verdict == "divergence")
    assert reached == diverged
    assert 0 < sum(reached) < len(reached)
