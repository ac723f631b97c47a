"""What a replayed trace's header and scenario may hold, checked without running a search: the
fields every recording writes refuse null (`check_scenario_json`), and a departing replay names
an edit of the variant file that recorded it (`_recorded_by_other_code`). The CLI paths are in
test_cli.py; these sit where the mutation run's simulator killer reaches them."""

import json

import pytest

import sim.variants as variants
from protocol.errors import ConfigError
from sim.check import SCENARIO_KEYS, _recorded_by_other_code, check_scenario_json
from sim.report import model_fingerprint, variant_file_fingerprint

RECORDED = {"ranks": 2, "buckets": None, "max_batch": None, "hazards_off": [],
            "h2_scope": "process", "h2_calls": "both", "topology": "shared", "faults": []}


def test_a_recorded_scenario_with_its_default_nulls_is_read():
    out = check_scenario_json(dict(RECORDED))
    assert out["topology"] == "shared" and "buckets" not in out and "max_batch" not in out


@pytest.mark.parametrize("field", [k for k in SCENARIO_KEYS if k not in ("buckets", "max_batch")])
def test_a_null_in_a_field_every_recording_holds_is_refused(field):
    with pytest.raises(ConfigError) as info:
        check_scenario_json(dict(RECORDED, **{field: None}))
    assert str(info.value).startswith(f"bad scenario in trace: {field} = null: a recording "
                                      "writes a value here")


def test_a_null_optional_field_reads_as_missing():
    out = check_scenario_json(dict(RECORDED, short_context=None, prompt_lengths=None))
    assert "short_context" not in out and "prompt_lengths" not in out


@pytest.fixture
def file_variant(tmp_path):
    path = tmp_path / "provenance_variant.py"
    path.write_text("from dataclasses import replace\n"
                    "from sim.variants import REGISTRY\n"
                    "V = replace(REGISTRY['correct'], name='test-provenance')\n")
    variants.load_variant_file(path)
    yield path
    variants.REGISTRY.pop("test-provenance", None)
    variants._ORIGIN.pop("test-provenance", None)
    variants._LOADED_FILES.pop(str(path.resolve()), None)


def test_a_departure_names_an_edit_of_the_variant_file_and_only_an_edit(file_variant):
    model = model_fingerprint()
    now = variant_file_fingerprint("test-provenance")
    assert now is not None and variant_file_fingerprint("correct") is None
    same = {"model": model, "variant": "test-provenance", "variant_file": now}
    assert _recorded_by_other_code(same) == ""
    assert _recorded_by_other_code({"model": model, "variant": "correct"}) == ""
    edited = dict(same, variant_file="0" * 12)
    assert _recorded_by_other_code(edited) == (
        f"; the variant file was edited since the recording (variant_file {'0' * 12}, now "
        f"{now}), and its schedule need not replay on the new code")


@pytest.fixture(scope="module")
def clean_trace():
    """A trace of one random schedule of the correct protocol, as `to_json` writes it."""
    from sim.check import CheckSpec, scenario_spec
    from sim.report import to_json
    from sim.run import run_schedule
    from sim.scenario import default_scenario
    from sim.strategies import RandomWalk

    spec = CheckSpec()
    result = run_schedule(spec.scenario("shared"), variants.CORRECT, RandomWalk(seed=3))
    assert result.outcome.verdict == "clean"
    return to_json(result, "correct", scenario_spec(spec, "shared", result.world.scenario))


@pytest.mark.parametrize("field, value, words", [
    ("verdict", "deadlock", "verdict = 'deadlock': the recording has verdict 'clean'"),
    ("invariant", "I4", "invariant = 'I4': the recording has invariant None"),
    ("variant", "fused-sweep", "variant = 'fused-sweep': the recording has variant 'correct'"),
])
def test_a_replay_refuses_a_record_edited_by_hand(clean_trace, field, value, words):
    """The record's fields outside its scenario are checked against its ``record_digest``
    before the replay runs: an edited one is a bad trace, not a departure."""
    from sim.check import replay_trace

    assert replay_trace(json.loads(json.dumps(clean_trace)))[1] is None  # the control
    edited = dict(json.loads(json.dumps(clean_trace)), **{field: value})
    with pytest.raises(ConfigError) as info:
        replay_trace(edited)
    assert str(info.value).startswith(f"bad trace: {words} (its record_digest says so"), info.value


def test_a_digest_reads_a_whole_float_as_its_integer():
    """jq writes 0.0 as 0 (the replay compares with ==), so the digests do too; a fraction, a
    string or a bool stays itself."""
    from sim.report import field_digest

    assert field_digest("trace", [{"time": 0.0, "n": [2.0]}]) == field_digest(
        "trace", [{"time": 0, "n": [2]}])
    assert field_digest("trace", (1.0, 2)) == field_digest("trace", [1, 2])
    assert field_digest("trace", 0.5) != field_digest("trace", 0)
    assert field_digest("trace", [1, 2]) != field_digest("trace", [1, 3])  # contents count
    assert field_digest("trace", {"t": 1}) != field_digest("trace", {"t": 2})
    # a tool that writes an object's keys in another order changes nothing
    assert field_digest("trace", {"a": 1, "b": 2}) == field_digest("trace", {"b": 2, "a": 1})
    assert field_digest("trace", "0") != field_digest("trace", 0)
    assert field_digest("trace", True) != field_digest("trace", 1.0)
    assert field_digest("trace", 1) != field_digest("verdict", 1)  # the name is hashed too
    assert len(field_digest("trace", 1)) == 12


@pytest.mark.parametrize("absent, words", [
    ((), ""),
    (("scenario_digest",), "; the trace has no scenario_digest (traces written before "
                           "2026-12-07 do not), so an edit by hand of its scenario cannot be "
                           "told from a departure"),
    (("record_digest",), "; the trace has no record_digest (traces written before 2026-12-07, "
                         "22:40 UTC do not), so an edit by hand of its verdict, variant, "
                         "choices or events cannot be told from a departure"),
    (("scenario_digest", "record_digest"), "; the trace has no scenario_digest or "
                                           "record_digest (traces written before 2026-12-07, "
                                           "22:40 UTC do not), so an edit by hand of its "
                                           "scenario or its verdict, variant, choices or "
                                           "events cannot be told from a departure"),
])
def test_a_departure_names_the_digests_the_trace_lacks(absent, words):
    from sim.check import _undigested

    data = {"scenario_digest": {}, "record_digest": {}}
    for key in absent:
        del data[key]
    assert _undigested(data) == words
