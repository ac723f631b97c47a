"""Step-tuned fused-layer plans (engine.bench.step_tune, engine.layers.linear.load_fused_plans):
the coordinate descent against a stand-in step timer, the candidates read from a sweep, the
plans file's round trip and merge, the engine taking a tuned plan over the table's, and the
command line's one-line refusals. The GPU timing itself runs in the benchmarks."""

from __future__ import annotations

import json

import pytest

from engine.bench import step_tune
from engine.kernels import skinny_gemm as sg
from engine.layers import linear
from engine.layers.linear import FusedLayerPlan, LayerShapes
from engine.presets import PRESETS

SHAPES = LayerShapes((96, 64, False), (64, 32, False), (256, 64, True), (64, 128, False))
A, B, C, D = (sg.TileConfig(16, 32, s) for s in (1, 2, 4, 8))


def test_descend_keeps_only_swaps_that_beat_the_current_plan_by_the_margin():
    start = FusedLayerPlan(A, A, A, A)
    # the step time of a plan: fixed costs per (role, tile); B on o_proj saves less than the
    # margin, C on gate_up saves 5%, the rope QKV 2%; D on down fails to run
    cost = {("o_proj", B): -0.0005, ("gate_up", C): -0.05, ("qkv", "rope"): -0.02}

    def time_plan(plan):
        if plan.down == D:
            raise RuntimeError("logits differ from the starting plan's by 0.5")
        ms = 1.0 + cost.get(("o_proj", plan.o_proj), 0) + cost.get(("gate_up", plan.gate_up), 0)
        return ms + (cost[("qkv", "rope")] if plan.rope else 0)

    Option = step_tune.Option
    options = {"qkv": [Option(A), Option(B, rope=True)], "o_proj": [Option(B)],
               "gate_up": [Option(B), Option(C)], "down": [Option(D)]}
    best, trials = step_tune.descend(start, options, time_plan)
    assert best == FusedLayerPlan(B, A, C, A, rope=True)
    assert [t.role for t in trials] == ["start", "qkv", "o_proj", "gate_up", "gate_up", "down"]
    assert trials[0].ms == 1.0 and trials[-1].ms is None
    assert trials[-1].error.startswith("logits differ")
    with pytest.raises(RuntimeError):  # a starting plan that fails is not a result
        step_tune.descend(FusedLayerPlan(A, A, A, D), options, time_plan)


def test_the_short_path_also_tries_each_rope_tile_attending_in_its_tail():
    """`with_tail_attention` adds, after each rope QKV tile, the same tile with attend; descend
    keeps it where the step gains by the margin, and a plan never attends without rope."""
    Option = step_tune.Option
    options = {"qkv": [Option(A), Option(B, rope=True)], "o_proj": [Option(B)]}
    tail = step_tune.with_tail_attention(options)
    assert tail["qkv"] == [Option(A), Option(B, rope=True), Option(B, rope=True, attend=True)]
    assert tail["o_proj"] == options["o_proj"]

    def time_plan(plan):
        return 1.0 - 0.02 * plan.rope - 0.03 * plan.attend

    best, trials = step_tune.descend(FusedLayerPlan(A, A, A, A), tail, time_plan)
    assert best == FusedLayerPlan(B, A, A, A, rope=True, attend=True)
    assert [t.plan.attend for t in trials if t.role == "qkv"] == [False, True]
    best, _ = step_tune.descend(FusedLayerPlan(A, A, A, A), tail,
                                lambda plan: 1.0 - 0.02 * plan.rope + 0.03 * plan.attend)
    assert best == FusedLayerPlan(B, A, A, A, rope=True)
    with pytest.raises(ValueError, match="attend true with rope false"):
        FusedLayerPlan(A, A, A, A, attend=True)


def test_a_plan_that_attends_round_trips_and_an_older_plan_reads_as_not_attending():
    plan = FusedLayerPlan(B, A, C, A, rope=True, attend=True)
    assert linear.plan_from_json(linear.plan_to_json(plan)) == plan
    older = linear.plan_to_json(FusedLayerPlan(B, A, C, A, rope=True))
    assert "attend" not in older and linear.plan_from_json(older).attend is False
    for bad, message in ((dict(older, attend=1), "attend 1 is not true or false"),
                         (dict(older, rope=False, attend=True), "attend true with rope false"),
                         (dict(older, attends=True), "'attends' unknown")):
        with pytest.raises(ValueError, match=message):
            linear.plan_from_json(bad)


def _sweep():
    def shape(n, k, swiglu, rope=False, tiles=()):
        best = min(tiles, key=lambda t: t[1], default=None)
        return {"N": n, "K": k, "swiglu": swiglu, "rope": rope, "rows": {"8": {
            "cublas_us": 10.0, "best": best and {"config": best[0].__dict__, "us": best[1]},
            "triton": [{"config": t.__dict__, "us": us} for t, us in tiles] + [
                {"config": D.__dict__, "error": "OutOfResources"}]}}}

    return [shape(96, 64, False, tiles=[(B, 3.0), (A, 2.0), (C, 4.0)]),
            shape(96, 64, False, rope=True, tiles=[(C, 5.0)]),
            shape(256, 64, True, tiles=[(D, 1.0)]),
            shape(64, 128, False, tiles=[(B, 1.0)])]


def test_sweep_options_are_the_fastest_timed_tiles_per_shape_and_the_rope_launch():
    opts = step_tune.sweep_options(_sweep(), SHAPES, 8, top=2)
    Option = step_tune.Option
    assert opts["qkv"] == [Option(A), Option(B), Option(C, rope=True)]
    assert opts["o_proj"] == []                      # a shape the sweep lacks
    assert opts["gate_up"] == [Option(D)]            # swiglu is its own shape
    assert opts["down"] == [Option(B)]
    assert step_tune.sweep_options(_sweep(), SHAPES, 1, top=2)["qkv"] == []  # no such rows


def _record(start_ms, best_ms):
    start, best = FusedLayerPlan(A, A, A, A), FusedLayerPlan(B, A, C, A, rope=True)
    return {"layer": linear.layer_key(SHAPES), "rows": {"8": {
        "start": linear.plan_to_json(start), "best": linear.plan_to_json(best),
        "confirm_start_ms": start_ms, "confirm_best_ms": best_ms}}}


def test_plans_file_round_trip_merge_and_confirmation(tmp_path):
    path = tmp_path / "plans.json"
    other = linear.layer_key(LayerShapes(*[(n * 2, k, sw) for n, k, sw in (
        SHAPES.qkv, SHAPES.o_proj, SHAPES.gate_up, SHAPES.down)]))
    path.write_text(json.dumps({other: {"1": linear.plan_to_json(FusedLayerPlan(D, D, D, D))}}))
    step_tune.write_plans(str(path), step_tune.plans_from_records([_record(1.0, 0.9)]))
    plans = linear.load_fused_plans(str(path))
    assert plans[linear.layer_key(SHAPES)] == {8: FusedLayerPlan(B, A, C, A, rope=True)}
    assert plans[other] == {1: FusedLayerPlan(D, D, D, D)}   # kept
    # a winner that did not beat the start again by the margin is not taken
    unconfirmed = step_tune.plans_from_records([_record(1.0, 0.9995)])
    assert unconfirmed[linear.layer_key(SHAPES)]["8"] == linear.plan_to_json(
        FusedLayerPlan(A, A, A, A))


def test_a_bad_plans_file_is_one_error_naming_it(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text('{"layer": {"8": {"qkv": {"block_n": 16}}}}')
    with pytest.raises(ValueError, match="plans.json: not a fused-plan file"):
        linear.load_fused_plans(str(path))
    good = linear.plan_to_json(FusedLayerPlan(A, A, A, A))
    key = linear.layer_key(SHAPES)
    for raw, message in (
            ({key: {"8": good | {"rope": "false"}}}, "rope 'false' is not true or false"),
            ({"layer": {"8": good}}, "layer 'layer' is not a layer_key"),
            ({key: {"8": good | {"down": dict(good["down"], block_n=0)}}},
             "tile block_n 0: expected a positive integer"),
            ({key: {"8": good | {"down": dict(good["down"], block_n="64")}}},
             "tile block_n '64': expected a positive integer"),
            ({key: {"8": good | {"down": dict(good["down"], block_k=96)}}},
             "tile block_k 96: expected a power of two"),
            ({key: {"8": good | {"down": dict(good["down"], split_k=-2)}}},
             "tile split_k -2: expected a positive integer"),
            ({key: {"8": good | {"down": dict(good["down"], num_warps=True)}}},
             "tile num_warps True: expected a positive integer")):
        with pytest.raises(ValueError, match=f"x: not a fused-plan file .*{message}"):
            linear.parse_fused_plans(raw, "x")
    for m in ("0", "65", "eight", "1.5", "+8", "08"):  # one line, the table's words
        with pytest.raises(ValueError) as info:
            linear.parse_fused_plans({key: {m: good}}, "x")
        assert str(info.value) == f"x: layer {key!r}: row count {m!r}: expected an integer in " \
                                  "1..64"
    assert linear.parse_fused_plans({key: {"8": good}}, "x") == {
        key: {8: FusedLayerPlan(A, A, A, A)}}
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="deep.json: not a fused-plan file"):
        linear.load_fused_plans(str(deep))
    with pytest.raises(step_tune.BenchArgError, match="--plans .*not a fused-plan file"):
        step_tune.write_plans(str(path), {})
    assert linear.load_fused_plans(str(tmp_path / "absent.json")) == {}


def test_the_engine_takes_the_tuned_plan_of_the_smallest_tuned_row_count_at_or_above():
    table = {sg.shape_key(n, k, sw): {8: sg.TableEntry(A, 1.0, 2.0),
                                      64: sg.TableEntry(A, 1.0, 2.0)}
             for n, k, sw in (SHAPES.qkv, SHAPES.o_proj, SHAPES.gate_up, SHAPES.down)}
    tuned = FusedLayerPlan(B, C, D, B, rope=True)
    gemm = linear.DecodeGemm.from_table(table, [256], "cpu",
                                        {linear.layer_key(SHAPES): {8: tuned}})
    assert gemm.fused_layer_plan(SHAPES, 8) == tuned
    assert gemm.fused_layer_plan(SHAPES, 3) == tuned               # 8 serves 1..8
    assert gemm.fused_layer_plan(SHAPES, 9) == FusedLayerPlan(A, A, A, A)   # the table's
    # a plan tuned at 64 rows serves only what the table's 64 entry serves, not 1..8
    only64 = linear.DecodeGemm.from_table(table, [256], "cpu",
                                          {linear.layer_key(SHAPES): {64: tuned}})
    assert only64.fused_layer_plan(SHAPES, 1) == FusedLayerPlan(A, A, A, A)
    assert only64.fused_layer_plan(SHAPES, 33) == tuned
    assert gemm.workspace.max_split == 8                           # D's split fits
    # a layer the table does not fuse stays unfused whatever the plans say
    slow = {k: {64: sg.TableEntry(A, 9.0, 2.0)} for k in table}
    assert linear.DecodeGemm.from_table(slow, [256], "cpu", {linear.layer_key(SHAPES): {
        8: tuned}}).fused_layer_plan(SHAPES, 8) is None


def test_without_plans_the_table_says_whether_the_qkv_gemm_takes_the_rope_epilogue():
    table = {sg.shape_key(n, k, sw): {8: sg.TableEntry(A, 1.0, 2.0)}
             for n, k, sw in (SHAPES.qkv, SHAPES.o_proj, SHAPES.gate_up, SHAPES.down)}
    rope_key = sg.shape_key(*SHAPES.qkv, rope=True)

    def plan(rope_entry):
        t = dict(table, **({rope_key: {8: rope_entry}} if rope_entry else {}))
        return linear.DecodeGemm.from_table(t, [256], "cpu").fused_layer_plan(SHAPES, 8)

    assert plan(None) == FusedLayerPlan(A, A, A, A)                          # no entry
    assert plan(sg.TableEntry(C, 3.0, 2.0)) == FusedLayerPlan(A, A, A, A)    # it lost
    assert plan(sg.TableEntry(C, 1.0, 2.0)) == FusedLayerPlan(C, A, A, A, rope=True)


def test_the_shipped_plans_file_is_the_step_tune_json_in_docs(tmp_path):
    """The engine's plans are rebuilt from the tuner's records in docs by `--from-json`, and
    name real layers of the presets they were tuned on."""
    out = tmp_path / "p.json"
    assert step_tune.main(["--from-json", "docs/benchmarks-step-tune-h200.json",
                           "--plans", str(out)]) == 0
    shipped = linear.load_fused_plans()
    assert shipped and linear.load_fused_plans(str(out)) == shipped
    records = json.load(open("docs/benchmarks-step-tune-h200.json"))["records"]
    for rec in records:  # the key each record wrote is the one the engine computes
        assert rec["layer"] == linear.layer_key(step_tune.layer_shapes(PRESETS[rec["preset"]]))
        assert rec["layer"] in shipped
    for rows in shipped.values():
        assert all(1 <= m <= sg.MAX_ROWS for m in rows)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "qwen3-0.6b", "--rows", "3"],
     "--rows 3: the table measured this layer at row counts 1, 8, 16, 32, 64 only"),
    (["--preset", "qwen3-0.6b", "--rows", "128"], "--rows 128: expected 1..64"),
    (["--preset", "qwen3-8b"], "no entry for this model's QKV shape 6144x4096"),
    (["--preset", "qwen3-0.6b", "--context", "40960"],
     "--context 40960: the model holds at most 40959 cached tokens"),
    (["--preset", "qwen3-0.6b", "--rows", "x"], "--rows"),
    (["--preset", "qwen3-9b"], "--preset 'qwen3-9b': unknown"),
    (["--model", "{tmp}/none"], "--model '{tmp}/none': not a directory"),
    ([], "give --preset or --model"),
    (["--preset", "qwen3-0.6b", "--top", "0"], "--top 0: expected 1..32"),
    (["--preset", "qwen3-0.6b", "--top", "33"], "--top 33: expected 1..32"),
    (["--top", "-1"], "--top -1: expected 1..32"),
    (["--preset", "qwen3-0.6b", "--steps", "0"], "--steps 0: expected 1..10000"),
    (["--preset", "qwen3-0.6b", "--steps", "10001"], "--steps 10001: expected 1..10000"),
    (["--preset", "qwen3-0.6b", "--warmup", "1001"], "--warmup 1001: expected 0..1000"),
    (["--preset", "qwen3-0.6b", "--rows", "1,8,1"], "--rows '1,8,1': 1 is given twice"),
    (["--preset", "qwen3-0.6b", "--json", "{tmp}/o.json", "--plans", "{tmp}/o.json"],
     "--json and --plans name one file"),
    (["--preset", "qwen3-0.6b", "--sweep", "{tmp}/sweep.json", "--json", "{tmp}/sweep.json"],
     "--sweep and --json name one file"),
    (["--preset", "qwen3-0.6b", "--sweep", "{tmp}/emptysweep.json"], "measured no shape"),
    (["--preset", "qwen3-0.6b", "--sweep", "{tmp}/zerotile.json"],
     "tile block_n 0: expected a positive integer"),
    (["--preset", "qwen3-0.6b", "--sweep", "{tmp}/deep.json"], "not a gemm_sweep --json"),
    (["--from-json", "{tmp}/deep.json", "--plans", "{tmp}/p.json"], "not a step_tune --json"),
    (["--from-json", "{tmp}/nanrec.json", "--plans", "{tmp}/p.json"],
     "records[0].rows['8'].confirm_best_ms = nan: expected a positive finite number"),
    (["--from-json", "{tmp}/keyrec.json", "--plans", "{tmp}/p.json"],
     "--from-json {tmp}/keyrec.json: not a step_tune --json"),
    # a fresh user's finding: the reason read "(KeyError('records'))"
    (["--from-json", "{tmp}/norecords.json", "--plans", "{tmp}/p.json"],
     "--from-json {tmp}/norecords.json: not a step_tune --json (no 'records' field)"),
    (["--from-json", "{tmp}/r.json", "--plans", "{tmp}/r.json"],
     "--from-json and --plans name one file"),
    (["--preset", "qwen3-0.6b", "--sweep", "{tmp}/none.json"], "none.json: No such file"),
    (["--preset", "qwen3-0.6b", "--sweep", "README.md"], "README.md: not a gemm_sweep --json"),
    (["--preset", "qwen3-0.6b", "--plans", "{tmp}/bad.json"], "not a fused-plan file"),
    (["--preset", "qwen3-0.6b", "--json", "{tmp}"], "--json"),
    (["--from-json", "{tmp}/r.json"], "--from-json needs --plans"),
    (["--from-json", "{tmp}/r.json", "--plans", "{tmp}/p.json", "--rows", "1"],
     "--rows does not apply"),
    (["--from-json", "README.md", "--plans", "{tmp}/p.json"], "not a step_tune --json"),
    (["--from-json", "{tmp}/none.json", "--plans", "{tmp}/p.json"], "No such file"),
    (["--from-json", "{tmp}/r.json", "--plans", "{tmp}/p.json", "--sweep", "x.json"],
     "--sweep does not apply"),
    (["--from-json", "{tmp}/badrec.json", "--plans", "{tmp}/p.json"],
     "--from-json {tmp}/badrec.json: not a step_tune --json"),
    (["--preset", "qwen3-0.6b", "--sweep", "{tmp}/badsweep.json"], "not a gemm_sweep --json"),
])
def test_bad_arguments_are_one_line_before_any_gpu_work(tmp_path, capsys, argv, message):
    (tmp_path / "bad.json").write_text("[1]")
    (tmp_path / "norecords.json").write_text("{}")
    bad_record = _record(1.0, 0.9)
    bad_record["rows"]["8"]["best"] = {"foo": 1}  # a record whose plan is not a plan
    (tmp_path / "badrec.json").write_text(json.dumps({"records": [bad_record]}))
    (tmp_path / "badsweep.json").write_text(json.dumps({"results": [{}]}))
    (tmp_path / "emptysweep.json").write_text(json.dumps({"results": []}))
    zero = {"results": [{"N": 96, "K": 64, "swiglu": False, "rows": {"1": {
        "cublas_us": 2.0, "best": None, "triton": [
            {"config": {"block_n": 0, "block_k": 32, "split_k": 1}, "us": 1.0}]}}}]}
    (tmp_path / "zerotile.json").write_text(json.dumps(zero))
    (tmp_path / "sweep.json").write_text(json.dumps({"results": _sweep()}))
    (tmp_path / "deep.json").write_text('{"results": ' + "[" * 100000 + "]" * 100000 + "}")
    (tmp_path / "r.json").write_text(json.dumps({"records": [_record(1.0, 0.9)]}))
    (tmp_path / "nanrec.json").write_text(json.dumps({"records": [_record(1.0, float("nan"))]}))
    (tmp_path / "keyrec.json").write_text(json.dumps({"records": [
        dict(_record(1.0, 0.9), layer="qkv everything")]}))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert step_tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("step_tune: error: ") and len(err.splitlines()) == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in err, err


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "--rows 0: expected 1..64"),
    (["--rows", "1,65"], "--rows 65: expected 1..64"),
    (["--context", "99999999"], "--context 99999999: the model holds at most 2047 cached"),
    (["--sweep", "{tmp}/none.json"], "--sweep {tmp}/none.json: No such file"),
    (["--json", "{tmp}/none/x.json"], "--json '{tmp}/none/x.json': directory"),
    (["--plans", "{tmp}/none/p.json"], "--plans '{tmp}/none/p.json': directory"),
    ([], "the skinny GEMM table has no entry for this model's QKV shape 128x64"),
])
def test_each_bad_value_is_named_before_the_table_is_asked_about_the_model(tmp_path, capsys,
                                                                          argv, message):
    """A fresh user's finding: for a preset the skinny GEMM table has no entry for, every bad
    value was answered with the table's "no entry for this model's QKV shape"; the table is
    asked last, so each value is named as it is for a model the table holds."""
    argv = ["--preset", "tiny", *(a.replace("{tmp}", str(tmp_path)) for a in argv)]
    assert step_tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("step_tune: error: ") and len(err.splitlines()) == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in err, err


@pytest.mark.parametrize("value, message", [
    ("-1", "argument --seed: -1 is outside [0, 2**64)"),
    (str(2**64), f"argument --seed: {2**64} is outside [0, 2**64)"),
])
def test_seed_takes_the_engine_s_one_range(capsys, value, message):
    """--seed took 0..2**32-1 here while bench, make-model and generate take [0, 2**64)."""
    with pytest.raises(SystemExit) as exit_:
        step_tune.main(["--preset", "qwen3-0.6b", "--seed", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("step_tune: error: ") and len(err.splitlines()) == 1, err
    assert message in err, err
    assert step_tune.build_parser().parse_args(["--seed", str(2**64 - 1)]).seed == 2**64 - 1


@pytest.mark.parametrize("argv, message", [
    (["--preset", "qwen3-4b", "--rows", "1,32"],
     "--rows 32: the engine runs this layer unfused at 32 rows"),
    (["--preset", "qwen3-4b"], "unfused at every row count the table measured (32)"),
])
def test_rows_where_the_layer_runs_unfused_are_refused(monkeypatch, capsys, argv, message):
    """A row count where the table's skinny tiles lose too much to cuBLAS for the layer to
    fuse has no plan to tune: here 4B's gate_up at 32 rows made 50 us slower than cuBLAS."""
    import dataclasses

    from engine.kernels import skinny_gemm as sg

    table = sg.load_table()
    key = sg.shape_key(19456, 2560, True)
    slow = dataclasses.replace(table[key][32], skinny_us=table[key][32].cublas_us + 50)
    qkv = sg.shape_key(6144, 2560, False)
    rows = {1: table[qkv][1], 32: table[qkv][32]} if "--rows" in argv else {32: table[qkv][32]}
    monkeypatch.setattr(step_tune, "load_table",
                        lambda: {**table, key: {**table[key], 32: slow}, qkv: rows})
    assert step_tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("step_tune: error: ") and len(err.splitlines()) == 1, err
    assert message in err, err


def test_from_json_rebuilds_the_plans_file(tmp_path, capsys):
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"records": [_record(1.0, 0.9)]}))
    out = tmp_path / "p.json"
    assert step_tune.main(["--from-json", str(src), "--plans", str(out)]) == 0
    assert linear.load_fused_plans(str(out)) == {
        linear.layer_key(SHAPES): {8: FusedLayerPlan(B, A, C, A, rope=True)}}
    assert "wrote plans for 1 row count to" in capsys.readouterr().out


def test_default_rows_are_those_the_engine_fuses(monkeypatch):
    import dataclasses

    shipped = sg.load_table()
    shapes = step_tune.layer_shapes(PRESETS["qwen3-4b"])
    measured = sorted(shipped[sg.shape_key(*shapes.qkv)])
    # the shipped table fuses 4B at every row count; one whose gate_up loses 50 us to cuBLAS
    # at 32 rows does not fuse there
    key = sg.shape_key(*shapes.gate_up)
    slow = dataclasses.replace(shipped[key][32], skinny_us=shipped[key][32].cublas_us + 50)
    for table in (shipped, {**shipped, key: {**shipped[key], 32: slow}}):
        monkeypatch.setattr(step_tune, "load_table", lambda: table)
        rows = step_tune.check_rows(PRESETS["qwen3-4b"], None)
        chooser = linear.DecodeGemm(table, None)
        assert rows == [m for m in measured if chooser.fused_layer_plan(shapes, m) is not None]
        if table is shipped:
            assert rows == measured
    assert 32 not in rows and rows and set(rows) < set(measured)


def test_an_unfused_engine_is_refused_before_any_gpu_work(monkeypatch, capsys):
    monkeypatch.setenv("LOCKSTEP_FUSED_NORM", "0")
    assert step_tune.main(["--preset", "qwen3-0.6b"]) == 2
    assert "LOCKSTEP_FUSED_NORM=0 keeps every layer unfused" in capsys.readouterr().err


def test_the_default_sweep_is_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert step_tune._load_sweep(step_tune.SWEEP_JSON)


def test_a_bad_value_is_named_before_the_model_is_looked_at(capsys):
    """A fresh user's finding: with no model, or a model the table lacks (tiny), --steps -1
    reported only the model problem."""
    from engine.bench import step_tune

    for argv in (["--steps", "-1"], ["--preset", "tiny", "--warmup", "5000"]):
        assert step_tune.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("--steps -1" in err or "--warmup 5000" in err), err


def test_step_tune_without_a_gpu_is_a_one_line_error(capsys, monkeypatch):
    import torch

    from engine.bench.step_tune import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--preset", "qwen3-0.6b", "--rows", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("step_tune: error: needs a CUDA GPU"), err


def test_the_tuner_times_the_graph_serving_replays(tiny_dir, monkeypatch):
    """At one row and a context within the short path's tile the step is tuned on the short
    graph, where the fused attention + o_proj runs; past the tile, at more rows or with the
    path switched off, on the bucket's DECODE graph."""
    from engine.engine_config import SHORT_DECODE_TOKENS
    from protocol.eligibility import GraphPlan
    from protocol.keys import SHORT, GraphKey

    def key(bucket, context):
        settings = step_tune.tuning_settings(tiny_dir, [1, 8], context)
        return step_tune.tuned_graph_key(GraphPlan.from_config(settings.protocol_config()),
                                         bucket, context)

    assert key(1, SHORT_DECODE_TOKENS) == GraphKey(1, SHORT)
    assert key(1, SHORT_DECODE_TOKENS + 1) == GraphKey(1)
    assert key(8, 64) == GraphKey(8)
    monkeypatch.setenv("LOCKSTEP_SHORT_DECODE", "0")
    assert key(1, 64) == GraphKey(1)


def test_a_bad_shipped_table_is_one_error_line(monkeypatch, capsys):
    """A hand-edited table (a row-count key "08") is refused in one line with status 2, as
    gemm_sweep --table refuses it, not with the loader's traceback."""
    from engine.bench import step_tune
    from engine.kernels.skinny_gemm import RowCountError

    def bad_table():
        raise RowCountError("skinny_gemm_table.json: shape 'x': row count '08': expected an "
                            "integer in 1..64")

    monkeypatch.setattr(step_tune, "load_table", bad_table)
    assert step_tune.main(["--preset", "qwen3-0.6b"]) == 2
    err = capsys.readouterr().err
    assert err == ("step_tune: error: skinny_gemm_table.json: shape 'x': row count '08': "
                   "expected an integer in 1..64\n"), err
