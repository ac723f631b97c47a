"""The bench tools' own --json read back (`engine.json_fields`): `gemm_sweep --from-json`,
`step_tune --sweep` and `step_tune --from-json` refuse a missing or mistyped field in one
line naming its path, for every field the tools write, before anything is written."""

from __future__ import annotations

import json

import pytest

from engine.bench import gemm_sweep, step_tune
from engine.json_fields import Field, FieldError

TILE = {"block_n": 32, "block_k": 128, "split_k": 2, "num_warps": 4, "num_stages": 4,
        "tma": False, "x_tma": False}
PLAN = {"qkv": TILE, "o_proj": TILE, "gate_up": TILE, "down": TILE, "rope": False}
SWEEP = {"device": "NVIDIA H200", "results": [
    {"N": 4096, "K": 1024, "swiglu": False, "weight_bytes": 8388608,
     "layers": ["qwen3-0.6b tp1 qkv"], "rows": {"1": {
         "cublas_us": 6.0, "best": {"config": TILE, "us": 5.0},
         "triton": [{"config": TILE, "us": 5.0}, {"config": TILE, "error": "OutOfResources"}],
         "read_GBps_cublas": 1398.1, "read_GBps_triton": 1677.7}}},
    {"N": 4096, "K": 1024, "swiglu": False, "rope": True, "weight_bytes": 8388608,
     "layers": ["qwen3-0.6b tp1 qkv"], "rows": {"1": {
         "cublas_us": 9.0, "baseline": TILE, "best": None,
         "triton": [{"config": TILE, "error": "relative error 0.5"}]}}}]}
RECORDS = {"records": [{
    "layer": "qkv 4096x1024, o_proj 1024x2048, gate_up 6144x1024, down 1024x3072",
    "rows": {"8": {"graph": "decode/8", "start": PLAN, "best": PLAN, "start_ms": 0.8,
                   "best_ms": 0.8, "confirm_start_ms": 0.8, "confirm_best_ms": 0.8,
                   "trials": [{"role": "start", "plan": PLAN, "ms": 0.8, "error": None},
                              {"role": "qkv", "plan": PLAN, "ms": None, "error": "slow"}]}},
    "preset": "qwen3-0.6b", "model": None, "context": 128, "steps": 100,
    "device": "NVIDIA H200", "seconds": 81.7}]}

NULLABLE = {"best", "ms", "error", "model", "preset"}
FREE_TEXT = {"device", "error", "graph", "preset", "model"}
"""Fields whose value may be any string (or null: NULLABLE), so "garbage" is no fault there."""


def _fields(value, path=""):
    """(path as `Field` spells it, key, parent container) of every value inside `value`."""
    items = (value.items() if isinstance(value, dict) else
             enumerate(value) if isinstance(value, list) else ())
    for key, child in items:
        sub = (f"{path}[{key}]" if isinstance(key, int) else
               (f"{path}.{key}" if path else key) if key.isidentifier() else
               f"{path}[{key!r}]")
        yield sub, key, value
        yield from _fields(child, sub)


def _named(err: str, path: str) -> bool:
    """Whether the one-line error names `path`: itself, or the tile or plan it lies in with
    the field's own name (`tile_from_json` and `plan_from_json` name the field)."""
    if f"{path} = " in err or f"{path}: " in err:
        return True
    for cut in (".config", ".baseline", ".start", ".best", ".plan"):
        head, found, rest = path.partition(cut)
        if found and rest.startswith(".") and f"{head}{cut}: " in err:
            return rest.split(".")[-1] in err
    return False


def _mutations(doc):
    """(path, mutated document) for each field of `doc` set to a value of the wrong kind: an
    object everywhere, "garbage" where free text is no answer, null where null is none."""
    for path, key, parent in _fields(doc):
        name = key if isinstance(key, str) else ""
        bad = [{"bogus": 1}]
        if name not in FREE_TEXT and not isinstance(parent[key], str):
            bad.append("garbage")
        if name not in NULLABLE:
            bad.append(None)
        for value in bad:
            old = parent[key]
            parent[key] = value
            yield path, value, json.dumps(doc)
            parent[key] = old


def _run(main, argv, tmp_path, capsys):
    table = tmp_path / "out.json"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert not table.exists()  # nothing written
    for python in ("object has no attribute", "indices must be", "not subscriptable",
                   "invalid literal", "Error("):
        assert python not in err, err
    return err


def test_every_sweep_field_of_the_wrong_kind_is_named_by_its_path(tmp_path, capsys):
    """Old behaviour: "swiglu": "garbage" was read as true (a table keyed "... swiglu"), a
    bad weight_bytes or layers was never looked at, and the rest read as Python's words
    ("string indices must be integers, not 'str'") without the field."""
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps(SWEEP))
    assert gemm_sweep.main(["--from-json", str(src), "--table", str(tmp_path / "t.json")]) == 0
    mutations = list(_mutations(json.loads(json.dumps(SWEEP))))
    assert len(mutations) > 60
    for path, value, text in mutations:
        src.write_text(text)
        err = _run(gemm_sweep.main, ["--from-json", str(src), "--table",
                                     str(tmp_path / "out.json")], tmp_path, capsys)
        assert err.startswith(f"gemm_sweep: error: --from-json {src}: not a gemm_sweep "
                              "--json ("), err
        assert _named(err, path), (path, value, err)


def test_every_record_field_of_the_wrong_kind_is_named_by_its_path(tmp_path, capsys):
    """Old behaviour: a list read "(list indices must be integers or slices, not str)"; a
    trial or a metadata field of any kind was never looked at."""
    src = tmp_path / "records.json"
    src.write_text(json.dumps(RECORDS))
    assert step_tune.main(["--from-json", str(src), "--plans", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    for path, value, text in _mutations(json.loads(json.dumps(RECORDS))):
        src.write_text(text)
        err = _run(step_tune.main, ["--from-json", str(src), "--plans",
                                    str(tmp_path / "out.json")], tmp_path, capsys)
        assert err.startswith(f"step_tune: error: --from-json {src}: not a step_tune --json ("), err
        assert _named(err, path), (path, value, err)


@pytest.mark.parametrize("change, words", [
    # the fresh user's findings, in their words before: accepted, or Python's text
    (lambda d: d["results"][0].update(swiglu="garbage"),
     "results[0].swiglu = 'garbage': expected true or false"),
    (lambda d: d["results"][0].update(weight_bytes="garbage"),
     "results[0].weight_bytes = 'garbage': expected an integer >= 1"),
    (lambda d: d["results"][0].update(weight_bytes=-8),
     "results[0].weight_bytes = -8: expected an integer >= 1"),
    (lambda d: d["results"][0].update(layers=5), "results[0].layers = 5: expected a list"),
    (lambda d: d.update(results="abc"), "results = 'abc': expected a list"),
    (lambda d: d["results"].__setitem__(0, "x"), "results[0] = 'x': expected an object"),
    (lambda d: d["results"][0]["rows"].__setitem__("1", "x"),
     "results[0].rows['1'] = 'x': expected an object"),
    (lambda d: d["results"][0]["rows"]["1"].update(best=5),
     "results[0].rows['1'].best = 5: expected an object"),
    (lambda d: d["results"][0].update(N="garbage"),
     "results[0].N = 'garbage': expected an integer >= 1"),
    (lambda d: d["results"][0]["rows"].__setitem__("0", {}),
     "results[0].rows: row count '0': expected an integer in 1..64"),
    (lambda d: d["results"][0]["rows"]["1"]["triton"][0].pop("us"),
     "results[0].rows['1'].triton[0]: no 'us' or 'error' field"),
    (lambda d: d["results"][0]["rows"]["1"]["triton"][0]["config"].update(block_n=0),
     "results[0].rows['1'].triton[0].config: tile block_n 0: expected a positive integer"),
    # past float's range: an OverflowError traceback (a reviewer's finding)
    (lambda d: d["results"][0]["rows"]["1"].update(cublas_us=10**400),
     "results[0].rows['1'].cublas_us = 1000000000000000000000000000000000000000000000000000000"
     "00...: expected a positive finite number"),
])
def test_a_bad_sweep_is_one_line_naming_the_field(tmp_path, capsys, change, words):
    doc = json.loads(json.dumps(SWEEP))
    change(doc)
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps(doc))
    err = _run(gemm_sweep.main, ["--from-json", str(src), "--table",
                                 str(tmp_path / "out.json")], tmp_path, capsys)
    assert err == f"gemm_sweep: error: --from-json {src}: not a gemm_sweep --json ({words})\n"
    # step_tune --sweep reads the same file with the same words, before any GPU work
    err = _run(step_tune.main, ["--preset", "qwen3-0.6b", "--sweep", str(src)], tmp_path,
               capsys)
    assert err == f"step_tune: error: --sweep {src}: not a gemm_sweep --json ({words})\n"


@pytest.mark.parametrize("doc, words", [
    ([1, 2], "the top level = [1, 2]: expected an object"),
    ({"records": {}}, "records = {}: expected a list"),
    ({"records": [RECORDS["records"][0] | {"layer": "qkv everything"}]},
     "records[0].layer: layer 'qkv everything' is not a layer_key"),
    ({"records": [RECORDS["records"][0] | {"rows": {"8": {"start": PLAN}}}]},
     "records[0].rows['8']: no 'best' field"),
    ({"records": [RECORDS["records"][0] | {"rows": {"8": RECORDS["records"][0]["rows"]["8"]
                                                    | {"best": PLAN | {"rope": 1}}}}]},
     "records[0].rows['8'].best: rope 1 is not true or false"),
    ({"records": [RECORDS["records"][0] | {"rows": {"8": RECORDS["records"][0]["rows"]["8"]
                                                    | {"best": PLAN | {"down": 3}}}}]},
     "records[0].rows['8'].best: down: tile 3 is not an object of TileConfig fields"),
    ({"records": [RECORDS["records"][0] | {"rows": {"8": RECORDS["records"][0]["rows"]["8"]
                                                    | {"best": {"qkv": TILE}}}}]},
     "records[0].rows['8'].best: plan field(s) 'o_proj', 'gate_up', 'down', 'rope' missing"),
])
def test_a_bad_record_file_is_one_line_naming_the_field(tmp_path, capsys, doc, words):
    src = tmp_path / "list.json"
    src.write_text(json.dumps(doc))
    err = _run(step_tune.main, ["--from-json", str(src), "--plans", str(tmp_path / "out.json")],
               tmp_path, capsys)
    assert err.startswith(f"step_tune: error: --from-json {src}: not a step_tune --json "
                          f"({words}"), err


def test_field_paths_and_kinds():
    doc = Field({"a": [{"1": True, "b c": 2.5}]})
    leaf = doc["a"].list()[0]
    assert [(k, f.path) for k, f in leaf.items()] == [("1", "a[0]['1']"), ("b c", "a[0]['b c']")]
    assert leaf["1"].boolean() is True and leaf["b c"].positive() == 2.5
    for check, words in ((lambda: leaf["1"].integer(), "a[0]['1'] = True: expected an integer"),
                         (lambda: leaf["1"].positive(), "expected a positive finite number"),
                         (lambda: leaf["zz"], "a[0]: no 'zz' field"),
                         (lambda: doc["a"].object(), "a = [{"),
                         (lambda: Field("x" * 100).list(), "...: expected a list")):
        with pytest.raises(FieldError, match=None) as info:
            check()
        assert words in str(info.value), str(info.value)


def test_a_refused_value_is_one_line_of_at_most_60_characters():
    """`engine.json_fields` shows a value as `lockstep.args.one_line_repr` does, at its own 60
    characters: a value whose repr spans lines (a numpy array handed to `Field`) is joined onto
    one line, and a cut is marked with "..."."""
    import numpy as np

    with pytest.raises(FieldError) as info:
        Field(np.arange(100).reshape(10, 10), "rows").list()
    assert str(info.value) == ("rows = array([[ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, "
                               "...: expected a list")
    with pytest.raises(FieldError) as info:
        Field("y" * 58, "name").list()
    assert str(info.value) == f"name = {'y' * 58!r}: expected a list"  # 60 characters: whole

@pytest.mark.parametrize("raw, words", [
    ([1], "expected an object of layer keys, each an object of row counts"),
    ({RECORDS["records"][0]["layer"]: {"8": PLAN | {"qkv": TILE | {"colour": 3}}}},
     "qkv: tile field(s) 'colour' unknown"),
    ({RECORDS["records"][0]["layer"]: {"8": {"qkv": TILE}}},
     "plan field(s) 'o_proj', 'gate_up', 'down', 'rope' missing"),
])
def test_a_bad_plans_file_says_what_is_wrong_in_words(tmp_path, raw, words):
    """Old behaviour: "(AttributeError("'list' object has no attribute 'items'"))", the
    repr of TileConfig's TypeError, "(KeyError('o_proj'))"."""
    from engine.layers import linear

    path = tmp_path / "plans.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as info:
        linear.load_fused_plans(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: not a fused-plan file (") and words in message, message
    assert "Error(" not in message and "\n" not in message, message
