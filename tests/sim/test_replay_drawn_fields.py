"""`lockstep check --replay` of a trace whose fields drawn per run (``short_context``, the
faults) were edited by hand: a one-line bad-trace error naming the field, exit 2, never a
NONDETERMINISM report of a run that was not the recording's."""

import json

import pytest

from lockstep.cli import main
from sim.check import _check_recorded_faults, _recorded_faults, drawn_short_contexts
from sim.report import to_json
from sim.run import run_schedule
from sim.scenario import (DRAWN_MAX_TOKENS, DRAWN_PROMPT_LENGTHS, default_scenario, max_tokens,
                          with_max_tokens, with_prompt_lengths)
from sim.strategies import RandomWalk
from sim.variants import REGISTRY


def _trace_of(tmp_path_factory, variant):
    out = tmp_path_factory.mktemp("trace")
    assert main(["check", "--variant", variant, "--topology", "shared", "--schedules", "50",
                 "--no-progress", "--jobs", "1", "--trace-out", str(out)]) == 0
    return json.loads((out / f"{variant}.shared.json").read_text())


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    """A counterexample of a variant that draws short_context per run."""
    return _trace_of(tmp_path_factory, "short-path-first-row")


@pytest.fixture(scope="module")
def fault_trace(tmp_path_factory):
    """A counterexample of a variant whose search draws one fault per run."""
    return _trace_of(tmp_path_factory, "watchdog-armed-on-error")


def _replay_edited(tmp_path, capsys, data, edit):
    data = json.loads(json.dumps(data))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    code = main(["check", "--replay", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip(), path


def _assert_bad_trace(code, out, err, path, words):
    assert code == 2 and out == "", out  # no NONDETERMINISM line, no narrative
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"lockstep check: error: {path}: bad scenario in trace: "), err
    assert words in err, err


def _drawn(data):
    """The short_context values the trace's variant draws, and the recorded one."""
    variant = REGISTRY[data["variant"]]
    scenario = variant.scenario(default_scenario())
    if "prompt_lengths" in data["scenario"]:
        scenario = with_prompt_lengths(scenario, data["scenario"]["prompt_lengths"])
    if "max_tokens" in data["scenario"]:
        scenario = with_max_tokens(scenario, data["scenario"]["max_tokens"])
    allowed = drawn_short_contexts(variant, scenario)
    return [v for v in allowed if v is not None], data["scenario"]["short_context"]


def test_the_unedited_traces_replay_exactly(short_trace, fault_trace, tmp_path, capsys):
    for data in (short_trace, fault_trace):
        code, out, err, _ = _replay_edited(tmp_path, capsys, data, lambda d: None)
        assert code == 0 and out.startswith("replayed ") and err == "", (out, err)


def test_another_drawn_short_context_names_the_value_that_replays(short_trace, tmp_path, capsys):
    """Old behaviour: NONDETERMINISM ("replayed trace differs from the recording at event
    1456"), exit 1, for a value the variant draws but the recording was not made at. A trace
    with a scenario_digest names the recorded value from it, before any run; one without (as
    written before 2026-12-07) finds it by replaying the values its run could draw."""
    values, recorded = _drawn(short_trace)
    assert recorded in values and len(values) >= 3
    for other in (v for v in values if v != recorded):
        code, out, err, path = _replay_edited(
            tmp_path, capsys, short_trace,
            lambda d: d["scenario"].__setitem__("short_context", other))
        _assert_bad_trace(code, out, err, path,
                          f"short_context = {other}: the recording has short_context "
                          f"{recorded} (its scenario_digest says so; the field or the digest "
                          "edited by hand?)")
    other = next(v for v in values if v != recorded)

    def edit(d):
        d["scenario"]["short_context"] = other
        del d["scenario_digest"]

    code, out, err, path = _replay_edited(tmp_path, capsys, short_trace, edit)
    _assert_bad_trace(code, out, err, path, f"short_context = {other}: the recording replays "
                                            f"exactly at short_context {recorded}")


@pytest.mark.parametrize("how", ["above", "missing", "null"])
def test_a_short_context_no_run_draws_is_refused_before_the_run(short_trace, tmp_path, capsys,
                                                                how, no_simulation):
    values, _ = _drawn(short_trace)
    span = f"draws short_context from {values[0]}..{values[-1]}"

    def edit(d):
        if how == "above":
            d["scenario"]["short_context"] = values[-1] + 1
        elif how == "missing":
            del d["scenario"]["short_context"]
        else:
            d["scenario"]["short_context"] = None

    code, out, err, path = _replay_edited(tmp_path, capsys, short_trace, edit)
    words = (f"short_context = {values[-1] + 1}: variant 'short-path-first-row' {span}"
             if how == "above" else f"short_context is missing: variant 'short-path-first-row' {span}")
    _assert_bad_trace(code, out, err, path, words)


def test_a_short_context_on_a_variant_without_the_path_is_refused(fault_trace, tmp_path, capsys,
                                                                  no_simulation):
    """Old behaviour: replayed "exactly" under a short path the run never had (the fault
    fires before the first short graph of the sweep)."""
    code, out, err, path = _replay_edited(
        tmp_path, capsys, fault_trace, lambda d: d["scenario"].__setitem__("short_context", 5))
    _assert_bad_trace(code, out, err, path,
                      "short_context = 5: variant 'watchdog-armed-on-error' runs without the "
                      "short decode path")


@pytest.mark.parametrize("field, change", [
    ("occurrence", lambda f: f["occurrence"] + 1), ("occurrence", lambda f: f["occurrence"] - 1),
    ("occurrence", lambda f: 10 ** 6), ("op", lambda f: "record"), ("kind", lambda f: "oom"),
    ("rank", lambda f: 1 - f["rank"])])
def test_an_edited_fault_names_the_fault_the_recording_fired(fault_trace, tmp_path, capsys,
                                                             field, change, no_simulation):
    """Old behaviour: NONDETERMINISM ("replay departed from its recording at action 272"),
    exit 1, for every one of these."""
    [fault] = fault_trace["scenario"]["faults"]

    def edit(d):
        d["scenario"]["faults"][0][field] = change(fault)

    code, out, err, path = _replay_edited(tmp_path, capsys, fault_trace, edit)
    fired = (f"the recording injects {fault['kind']} on rank {fault['rank']} in {fault['op']} "
             f"call {fault['occurrence']}, which its faults do not name")
    _assert_bad_trace(code, out, err, path, "faults[0] = ")
    assert fired in err


def test_dropped_or_added_faults_are_refused(fault_trace, tmp_path, capsys, no_simulation):
    code, out, err, path = _replay_edited(tmp_path, capsys, fault_trace,
                                          lambda d: d["scenario"].__setitem__("faults", []))
    _assert_bad_trace(code, out, err, path, "faults = []: the recording injects ")
    # a fault on a call the recording made without one
    extra = {"kind": "raise", "rank": 0, "op": "record", "occurrence": 2}
    code, out, err, path = _replay_edited(tmp_path, capsys, fault_trace,
                                          lambda d: d["scenario"]["faults"].append(extra))
    _assert_bad_trace(code, out, err, path, "faults[1] = ")
    assert "call 2 has no fault" in err


@pytest.mark.timeout(120)
def test_the_recorded_faults_are_read_back_exactly_for_every_kind():
    """The faults a trace shows firing are exactly the ones its run fired, whatever their
    kind, rank, op and phase: so a real trace is never refused as edited."""
    from sim.check import WithRandomFault

    family = WithRandomFault(default_scenario(), 0)
    kinds = set()
    for index in range(40):
        scenario = family(index)
        result = run_schedule(scenario, REGISTRY["correct"], RandomWalk(index))
        world, trace = result.world, to_json(result, "correct", {})["trace"]
        fired = [(f.kind, f.rank, f.op, f.occurrence) for f in world.fired_faults]
        assert _recorded_faults(trace) == fired, (index, scenario.faults)
        _check_recorded_faults(trace, scenario.faults)  # raises if it reads it as edited
        kinds.update(k for k, *_ in fired)
    assert kinds == {"raise", "oom", "slow", "hang", "die"}, kinds



def test_the_first_row_trace_records_its_drawn_workload(short_trace):
    n = len(default_scenario().workload)
    assert len(short_trace["scenario"]["prompt_lengths"]) == n
    assert len(short_trace["scenario"]["max_tokens"]) == n
    assert short_trace["scenario"]["max_tokens"] != list(max_tokens(default_scenario()))


def test_a_drawn_workload_dropped_by_hand_is_named(short_trace, tmp_path, capsys, no_simulation):
    """Without its prompt_lengths the trace's run would be the check's workload, and the replay
    depart from the recording: its scenario_digest names the dropped field."""
    code, out, err, path = _replay_edited(tmp_path, capsys, short_trace,
                                          lambda d: d["scenario"].pop("prompt_lengths"))
    _assert_bad_trace(code, out, err, path, "prompt_lengths is missing, but the recording has "
                                            "one (its scenario_digest names it; removed by hand?)")


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["scenario"]["prompt_lengths"].pop(),
     "16 value(s), but the check's workload has 17 requests"),
    (lambda d: d["scenario"]["prompt_lengths"].__setitem__(2, DRAWN_PROMPT_LENGTHS[-1] + 1),
     f"prompt_lengths[2] = {DRAWN_PROMPT_LENGTHS[-1] + 1}: variant 'short-path-first-row' "
     f"draws prompt_lengths from 1..{DRAWN_PROMPT_LENGTHS[-1]}"),
    (lambda d: d["scenario"].__setitem__("prompt_lengths", []),
     "prompt_lengths = []: [] is not a list of integers of at least 1"),
    (lambda d: d["scenario"].__setitem__("prompt_lengths", [3, "x"]),
     "is not a list of integers of at least 1"),
    (lambda d: d["scenario"]["max_tokens"].__setitem__(0, DRAWN_MAX_TOKENS[-1] + 1),
     f"max_tokens[0] = {DRAWN_MAX_TOKENS[-1] + 1}: variant 'short-path-first-row' draws "
     f"max_tokens from 1..{DRAWN_MAX_TOKENS[-1]}"),
    (lambda d: d["scenario"]["max_tokens"].append(2),
     "18 value(s), but the check's workload has 17 requests"),
    (lambda d: d["scenario"]["max_tokens"].__setitem__(0, 0),
     "is not a list of integers of at least 1"),
])
def test_an_edited_prompt_length_is_refused_before_the_run(short_trace, tmp_path, capsys, edit,
                                                          words, no_simulation):
    code, out, err, path = _replay_edited(tmp_path, capsys, short_trace, edit)
    _assert_bad_trace(code, out, err, path, words)


@pytest.mark.parametrize("field, words", [
    ("prompt_lengths", "with prompts of 3 tokens"), ("max_tokens", "with max_tokens 2..6")])
def test_a_workload_on_a_variant_that_does_not_draw_it_is_refused(fault_trace, tmp_path, capsys,
                                                                  field, words, no_simulation):
    n = len(default_scenario().workload)
    code, out, err, path = _replay_edited(
        tmp_path, capsys, fault_trace, lambda d: d["scenario"].__setitem__(field, [4] * n))
    _assert_bad_trace(code, out, err, path,
                      f"{field} = {[4] * n}: variant 'watchdog-armed-on-error' runs the "
                      f"check's workload as it is, {words}")
