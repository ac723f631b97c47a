"""Properties (d) and (e): exact replay of counterexamples; seeds determine traces."""

import json

import pytest

from sim.check import CheckSpec, check_bad, replay_trace, scenario_spec
from sim.report import mermaid, narrative, to_json
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import PCT, RandomWalk
from sim.variants import REGISTRY

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)


def _trace(seed, strategy=RandomWalk):
    result = run_schedule(default_scenario(**SMALL), REGISTRY["correct"], strategy(seed))
    return tuple(result.choices)


def test_one_seed_gives_one_trace():
    assert _trace(7) == _trace(7)
    assert _trace(7, PCT) == _trace(7, PCT)


def test_different_seeds_give_many_traces():
    assert len({_trace(s) for s in range(12)}) >= 10


@pytest.mark.parametrize("name,topology", [("fused-sweep", "shared"), ("local-bucket", "per-rank"),
                                           ("exit-on-timeout", "shared"), ("async-row-parallel", "shared")])
def test_recorded_counterexample_replays_to_its_verdict(name, topology):
    spec = CheckSpec(schedules=50, fault_schedules=0)
    row = check_bad(REGISTRY[name], spec, topology)
    data = json.loads(json.dumps(to_json(row.minimal, name, scenario_spec(spec, topology, row.minimal.world.scenario))))
    result, problem = replay_trace(data)
    assert problem is None
    assert result.outcome.verdict == row.minimal.outcome.verdict
    assert result.choices == row.minimal.choices


def test_tampered_recording_is_reported_as_nondeterminism():
    """A schedule the code cannot follow departs. Its action count is kept in step with its
    choices: a count that is not theirs is a bad trace, refused before the replay."""
    spec = CheckSpec(schedules=50, fault_schedules=0)
    row = check_bad(REGISTRY["fused-sweep"], spec, "shared")
    data = to_json(row.minimal, "fused-sweep", scenario_spec(spec, "shared", row.minimal.world.scenario))
    del data["record_digest"]  # kept, it names the edit: a bad trace, not a departure
    data["choices"] = ["device1"] + data["choices"]
    data["actions"] += 1
    result, problem = replay_trace(data)
    assert problem is not None and "departed" in problem


def test_reports_render():
    row = check_bad(REGISTRY["fused-sweep"], CheckSpec(schedules=50, fault_schedules=0), "shared")
    text = narrative(row.minimal)
    assert "==> deadlock" in text and "controller sends command" in text
    diagram = mermaid(row.minimal)
    assert diagram.startswith("sequenceDiagram\n")
    assert "participant R0 as rank 0 host" in diagram
    assert "--x" in diagram
    for line in diagram.splitlines()[1:]:
        assert line.startswith("    "), line
        assert "#" not in line and ";" not in line


def test_a_replay_that_takes_another_actor_names_both_actions():
    """A fresh user's finding: with equal lengths the message said only the two counts."""
    spec = CheckSpec(schedules=50, fault_schedules=0)
    row = check_bad(REGISTRY["fused-sweep"], spec, "shared")
    data = to_json(row.minimal, "fused-sweep", scenario_spec(spec, "shared", row.minimal.world.scenario))
    del data["record_digest"]  # kept, it names the edit: a bad trace, not a departure
    choices = data["choices"]
    problems = []
    for i in range(len(choices) - 1):
        if choices[i] != choices[i + 1]:
            tampered = json.loads(json.dumps(data))
            tampered["choices"][i], tampered["choices"][i + 1] = choices[i + 1], choices[i]
            _, problem = replay_trace(tampered)
            if problem and "where the recording has" in problem:
                problems.append(problem)
                break
    assert problems, "no swap of two actions gave a replay that took another actor"
    assert "it took '" in problems[0]


def test_a_recording_edited_where_only_one_actor_could_move_is_nondeterminism():
    """A reader of docs/python-api.md: `Replay(["rank0"] + good[1:])` ran clean and returned
    the unedited choices, since a run asks for no choice where one actor alone is enabled.
    Those actions are checked against the recording too."""
    from sim.strategies import NondeterminismError, Replay

    sc = default_scenario(**SMALL)
    good = run_schedule(sc, REGISTRY["correct"], RandomWalk(3)).choices
    assert run_schedule(sc, REGISTRY["correct"], Replay(good)).choices == good
    other = "rank0" if good[0] != "rank0" else "rank1"
    with pytest.raises(NondeterminismError, match=r"at action 0: it took '.*', the only actor enabled, where the recording has"):
        run_schedule(sc, REGISTRY["correct"], Replay([other] + good[1:]))
