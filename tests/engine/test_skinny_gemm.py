"""Skinny decode GEMM (engine.kernels.skinny_gemm): the Triton kernel in the interpreter against
a float64 oracle (plain, SwiGLU epilogue, split-K fix-up), the measured table's reading and
the per-call choice, and the engine setting that turns it off."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.errors import ParallelConfigError
from engine.kernels import skinny_gemm as sg
from engine.testing import run_in_triton_interpreter

_TRITON_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.getcwd())
from engine.kernels import skinny_gemm as sg
torch.manual_seed(0)
ws = sg.Workspace("cpu", 512, 8, 64)
cases = [(1, 96, 512, False, sg.TileConfig(16, 64, 4)),    # split-K fix-up, M = 1
         (5, 200, 300, True, sg.TileConfig(16, 64, 2)),    # SwiGLU + split, ragged N and K
         (17, 64, 128, False, None),                       # default config, BLOCK_M 32
         (3, 48, 1000, False, sg.TileConfig(32, 128, 3)),  # odd split count
         # one tile per program (weights loaded before the PDL wait): split, ragged, SwiGLU
         (1, 96, 512, False, sg.TileConfig(16, 128, 4)),
         (2, 80, 300, False, sg.TileConfig(16, 64, 5)),
         (5, 200, 256, True, sg.TileConfig(16, 128, 2)),
         (4, 64, 100, True, sg.TileConfig(32, 128, 1)),
         # tensor-descriptor weight reads (rows of K % 8 == 0: 16-byte aligned in bfloat16)
         (1, 96, 512, False, sg.TileConfig(64, 64, 4, tma=True)),    # split, ragged N
         (5, 200, 296, True, sg.TileConfig(64, 64, 2, tma=True)),    # SwiGLU past N's end
         (3, 48, 1000, False, sg.TileConfig(16, 128, 3, tma=True)),  # odd split count
         (2, 80, 296, False, sg.TileConfig(16, 64, 5, tma=True)),    # one tile, split
         (4, 64, 104, True, sg.TileConfig(32, 128, 1, tma=True)),    # one tile, SwiGLU
         # the activation through a descriptor too: K past its end reads as zeros (rows past M
         # feed only output rows never stored); each must build x's descriptor (counted below)
         (5, 200, 296, True, sg.TileConfig(64, 64, 2, tma=True, x_tma=True)),
         (17, 96, 512, False, sg.TileConfig(64, 64, 4, tma=True, x_tma=True)),
         (3, 48, 1000, False, sg.TileConfig(16, 128, 3, tma=True, x_tma=True)),
         (4, 64, 104, True, sg.TileConfig(32, 128, 1, tma=True, x_tma=True)),
         # products on the CUDA cores (gemv): 1-8 rows unpadded, tiles narrower than 16
         (1, 96, 512, False, sg.TileConfig(8, 64, 4, gemv=True)),     # split, one row
         (3, 200, 300, True, sg.TileConfig(4, 128, 2, gemv=True)),    # SwiGLU, ragged
         (1, 200, 300, True, sg.TileConfig(4, 64, 2, gemv=True)),     # one row's K sums
         (8, 48, 1000, False, sg.TileConfig(16, 256, 1, gemv=True)),  # loop, no split
         (2, 80, 296, False, sg.TileConfig(16, 64, 5, gemv=True)),    # one tile, split
         (5, 200, 296, True, sg.TileConfig(64, 64, 2, tma=True, gemv=True))]
real_from_tensor = sg.TensorDescriptor.from_tensor
described = []  # the data pointers of every tensor a descriptor was built over
sg.TensorDescriptor.from_tensor = staticmethod(
    lambda t, block: described.append(t.data_ptr()) or real_from_tensor(t, block))
for M, N, K, swiglu, cfg in cases:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(M, K, dtype=dtype)
        w = torch.randn(N, K, dtype=dtype) / K ** 0.5
        for _ in range(2):  # the second launch needs the counters the first left at zero
            del described[:]
            y = sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu)
            assert (x.data_ptr() in described) == bool(cfg and cfg.x_tma), (M, N, K, cfg)
            ref = sg.skinny_gemm_torch(x.double(), w.double(), swiglu)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert y.shape == ref.shape and y.dtype == dtype, (y.shape, ref.shape, y.dtype)
            assert err < tol, (M, N, K, swiglu, dtype, err)
        assert int(ws.counters.abs().sum()) == 0, "a counter was left non-zero"
print("ok", len(cases))
"""


def test_triton_kernel_in_interpreter_matches_float64():
    res = run_in_triton_interpreter(_TRITON_CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok 23" in res.stdout


def test_torch_path_swiglu_matches_its_definition():
    torch.manual_seed(1)
    x, w = torch.randn(3, 32, dtype=torch.float64), torch.randn(20, 32, dtype=torch.float64)
    y = sg.skinny_gemm_torch(x, w, swiglu=True)
    g, u = (x @ w.T).chunk(2, -1)
    torch.testing.assert_close(y, g * torch.sigmoid(g) * u)


def test_table_round_trip_and_choice(tmp_path):
    path = tmp_path / "table.json"
    cfg = {"block_n": 32, "block_k": 128, "split_k": 4, "num_warps": 4, "num_stages": 4}
    other = dict(cfg, block_n=64)
    path.write_text(json.dumps({sg.shape_key(1024, 2048, False): {
        "1": {"skinny": cfg, "skinny_us": 4.0, "cublas_us": 5.0},
        "8": {"skinny": other, "skinny_us": 6.0, "cublas_us": 5.0},
        "64": {"skinny": cfg, "skinny_us": 4.0, "cublas_us": 5.0}}}))
    table = sg.load_table(str(path))
    want = sg.TileConfig(**cfg)
    assert sg.choose(table, 1024, 2048, False, 1) == want
    assert sg.choose(table, 1024, 2048, False, 5) is None      # 8's entry: cuBLAS won there
    assert sg.table_entry(table, 1024, 2048, False, 5).config == sg.TileConfig(**other)
    assert sg.choose(table, 1024, 2048, False, 9) == want      # served by the 64 entry
    assert sg.choose(table, 1024, 2048, False, 65) is None     # past MAX_ROWS
    assert sg.table_entry(table, 1024, 2048, False, 65) is None
    assert sg.choose(table, 1024, 2048, True, 1) is None       # SwiGLU is another shape
    assert sg.choose(table, 999, 2048, False, 1) is None       # not measured
    assert sg.table_entry(table, 999, 2048, False, 1) is None


def test_shipped_table_parses_and_names_real_configs():
    table = sg.load_table()
    assert table, "engine/kernels/skinny_gemm_table.json is missing or empty"
    for rows in table.values():
        assert all(e.config.split_k >= 1 and e.config.block_n >= 16 and e.skinny_us > 0
                   and e.cublas_us > 0 for e in rows.values())


def test_shipped_table_is_the_sweep_json_in_docs(tmp_path):
    """The table is rebuilt from the sweep's measurements in docs by `--from-json`."""
    from engine.bench import gemm_sweep

    out = tmp_path / "t.json"
    assert gemm_sweep.main(["--from-json", "docs/benchmarks-gemm-sweep-h200.json",
                            "--table", str(out)]) == 0
    assert sg.load_table(str(out)) == sg.load_table()


@pytest.mark.parametrize("argv, message", [
    (["--from-json", "docs/benchmarks-gemm-sweep-h200.json"], "--from-json needs --table"),
    (["--from-json", "no/such.json", "--table", "{tmp}/t.json"], "no/such.json: No such file"),
    (["--from-json", "README.md", "--table", "{tmp}/t.json"], "README.md: not a gemm_sweep --json"),
    (["--from-json", "{tmp}/rows.json", "--table", "{tmp}/t.json"], "rows.json: not a gemm_sweep --json"),
    (["--from-json", "{tmp}/nan.json", "--table", "{tmp}/t.json"], "nan.json: not a gemm_sweep --json"),
    (["--from-json", "{tmp}/empty.json", "--table", "{tmp}/t.json"], "measured no shape"),
    (["--from-json", "{tmp}/deep.json", "--table", "{tmp}/t.json"],
     "deep.json: not a gemm_sweep --json (nested too deep)"),
    # a fresh user's finding: the reason read "(KeyError('results'))"
    (["--from-json", "{tmp}/noresults.json", "--table", "{tmp}/t.json"],
     "noresults.json: not a gemm_sweep --json (no 'results' field)"),
    (["--from-json", "{tmp}/t.json", "--table", "{tmp}/t.json"], "is the --from-json file"),
    (["--from-json", "{tmp}/empty.json", "--table", "{tmp}/t.json", "--rows", "1"],
     "--rows does not apply"),
    (["--from-json", "{tmp}/nope.json", "--table", "{tmp}/t.json"], "nope.json: No such file"),
    (["--from-json", "{tmp}/t.json", "--table", "{tmp}/link.json"], "is the --from-json file"),
    (["--from-json", "docs/benchmarks-gemm-sweep-h200.json", "--table", "{tmp}/fifo"],
     "is not a regular file"),
])
def test_table_from_json_bad_input_is_one_line(tmp_path, capsys, argv, message):
    from engine.bench import gemm_sweep

    good = json.load(open("docs/benchmarks-gemm-sweep-h200.json"))
    (tmp_path / "rows.json").write_text(json.dumps({"results": [dict(good["results"][0],
                                                                     rows=[1])]}))
    bad_tile = json.loads(json.dumps(good))
    bad_tile["results"][0]["rows"]["1"]["best"] = {"config": {"bogus": 1}, "us": "fast"}
    (tmp_path / "nan.json").write_text(json.dumps(bad_tile))
    (tmp_path / "empty.json").write_text(json.dumps({"results": []}))
    (tmp_path / "noresults.json").write_text("{}")
    (tmp_path / "deep.json").write_text('{"results": ' + "[" * 100000 + "]" * 100000 + "}")
    argv = [a.format(tmp=tmp_path) for a in argv]
    (tmp_path / "t.json").write_text(json.dumps(good))  # an existing file, never damaged
    (tmp_path / "link.json").symlink_to(tmp_path / "t.json")
    os.mkfifo(tmp_path / "fifo")
    before = (tmp_path / "t.json").read_text() if (tmp_path / "t.json").exists() else None
    assert gemm_sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    after = (tmp_path / "t.json").read_text() if (tmp_path / "t.json").exists() else None
    assert after == before  # nothing written, nothing destroyed


def test_table_from_json_writes_through_a_symlink_and_keeps_the_mode(tmp_path, capsys):
    from engine.bench import gemm_sweep

    target = tmp_path / "real.json"
    target.write_text("{}")
    target.chmod(0o644)
    (tmp_path / "link.json").symlink_to(target)
    assert gemm_sweep.main(["--from-json", "docs/benchmarks-gemm-sweep-h200.json",
                            "--table", str(tmp_path / "link.json")]) == 0
    assert f"wrote {len(sg.load_table())} shapes" in capsys.readouterr().out
    assert (tmp_path / "link.json").is_symlink()
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sg.load_table(str(target)) == sg.load_table()


def test_sweep_refuses_one_file_for_measurements_and_table(tmp_path, capsys):
    from engine.bench import gemm_sweep

    out = str(tmp_path / "x.json")
    assert gemm_sweep.main(["--json", out, "--table", out]) == 2
    assert "--json and --table name one file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3", "--presets", "qwen3-0.6b"],
     "--tp 3: qwen3-0.6b's num_attention_heads 16 is not divisible by it"),
    (["--kinds", "rope", "--tp", "2"], "the rope launch is timed at TP 1 only"),
    (["--rows", "1,128"], "--rows 128: the skinny GEMM serves at most 64 rows"),
    (["--rows", "8,8"], "--rows '8,8': 8 is given twice"),
    # refused as --rows and --tp refuse a repeat (accepted before, and timed once)
    (["--presets", "qwen3-4b,qwen3-0.6b,qwen3-4b"],
     "--presets 'qwen3-4b,qwen3-0.6b,qwen3-4b': 'qwen3-4b' is given twice"),
    (["--layers", "qkv, qkv"], "--layers 'qkv, qkv': 'qkv' is given twice"),
    (["--kinds", "gemm,gemm"], "--kinds 'gemm,gemm': 'gemm' is given twice"),
    (["--table", "{tmp}/sweep.json"], "--table {tmp}/sweep.json: not a skinny GEMM table"),
])
def test_sweep_bad_arguments_are_one_line_before_the_gpu(tmp_path, capsys, argv, message):
    from engine.bench import gemm_sweep

    (tmp_path / "sweep.json").write_text(open("docs/benchmarks-gemm-sweep-h200.json").read())
    assert gemm_sweep.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and err.count("\n") == 1, err


def test_table_merges_into_the_file_keeping_what_was_not_measured(tmp_path, capsys):
    from engine.bench import gemm_sweep

    sweep = json.load(open("docs/benchmarks-gemm-sweep-h200.json"))
    first = sweep["results"][0]
    partial = dict(first, rows={"8": first["rows"]["8"]})
    (tmp_path / "partial.json").write_text(json.dumps({"results": [partial]}))
    table = tmp_path / "t.json"
    other = {"1x2": {"1": {"skinny": None, "skinny_us": None, "cublas_us": 1.5}}}
    key = sg.shape_key(first["N"], first["K"], first["swiglu"], bool(first.get("rope")))
    stale = {"skinny": {"block_n": 16, "block_k": 128, "split_k": 1}, "skinny_us": 99.0,
             "cublas_us": 99.0}
    table.write_text(json.dumps(other | {key: {"1": stale, "8": stale}}))
    assert gemm_sweep.main(["--from-json", str(tmp_path / "partial.json"),
                            "--table", str(table)]) == 0
    assert "kept 1 other shape it held" in capsys.readouterr().out
    merged = sg.load_table(str(table))
    assert merged["1x2"][1].cublas_us == 1.5                       # another shape: kept
    assert merged[key][1].skinny_us == 99.0                         # a row not measured: kept
    assert merged[key][8] == sg.load_table()[key][8]                # the row measured: replaced


def test_a_corrupt_table_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"1024x2048": {"1": {"skinny": {"block_n": 32, "colour": 3},
                                                     "skinny_us": 1, "cublas_us": 2}}}))
    with pytest.raises(ValueError, match="bad.json: not a skinny GEMM table"):
        sg.load_table(str(path))
    path.write_text(json.dumps({"1024x2048": {"1": None}}))  # the format before the times
    with pytest.raises(ValueError, match="bad.json: not a skinny GEMM table"):
        sg.load_table(str(path))
    for skinny, us, message in (({"block_n": 0, "block_k": 128, "split_k": 1}, 1.0,
                                 "tile block_n 0: expected a positive integer"),
                                ({"block_n": 16, "block_k": 128, "split_k": 1}, float("nan"),
                                 "skinny_us nan is not a positive finite time")):
        path.write_text(json.dumps({"1024x2048": {"1": {"skinny": skinny, "skinny_us": us,
                                                        "cublas_us": 2}}}))
        with pytest.raises(ValueError, match=f"bad.json: not a skinny GEMM table.*{message}"):
            sg.load_table(str(path))
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="bad.json: not a skinny GEMM table"):
        sg.load_table(str(path))


@pytest.mark.parametrize("m", ["abc", "0", "65", "1.5", "-1", "+8", " 8", "08", "1_0", ""])
def test_a_table_row_count_outside_1_to_64_is_one_line_naming_the_file_shape_and_key(m,
                                                                                     tmp_path):
    """Old behaviour: "0" and "65" were loaded as row counts (a "65" served the rows above
    the shape's largest row count <= 64 with the tile measured at 65), "abc" and "1.5" gave
    int()'s words and no shape, and " 8", "+8" and "08" were read as 8."""
    entry = {"skinny": None, "cublas_us": 2.0}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"1024x2048": {"8": entry}, "2048x1024": {"8": entry, m: entry}}))
    with pytest.raises(ValueError) as info:
        sg.load_table(str(path))
    assert str(info.value) == (f"{path}: shape '2048x1024': row count {m!r}: expected an "
                               "integer in 1..64")
    path.write_text(json.dumps({"2048x1024": {"1": entry, "64": entry}}))
    assert sorted(sg.load_table(str(path))["2048x1024"]) == [1, 64]


def test_a_gemv_tile_past_its_rows_is_refused_on_load_and_at_launch(tmp_path):
    """A gemv tile serves at most GEMV_MAX_ROWS rows: a table or plans file naming one at a
    larger row count is refused when read (one line naming the file, shape and row count),
    not at the first step of that size; a launch of more rows is refused before the kernel."""
    from engine.layers.linear import FUSED_PLANS_PATH, load_fused_plans

    tile = {"block_n": 8, "block_k": 512, "split_k": 1, "num_warps": 8, "num_stages": 1,
            "gemv": True}
    entry = {"skinny": tile, "skinny_us": 5.0, "cublas_us": 6.0}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"2560x4096": {"8": entry, "16": entry}}))
    with pytest.raises(ValueError) as info:
        sg.load_table(str(path))
    assert str(info.value) == (f"{path}: not a skinny GEMM table (shape '2560x4096': row count "
                               f"16: a gemv tile serves at most {sg.GEMV_MAX_ROWS} rows)")
    path.write_text(json.dumps({"2560x4096": {"8": entry}}))
    assert sg.load_table(str(path))["2560x4096"][8].config.gemv
    with open(FUSED_PLANS_PATH) as f:
        plans = json.load(f)
    layer = next(iter(plans))
    rows = max(plans[layer], key=int)
    plans[layer][rows]["down"] = tile
    plans_path = tmp_path / "plans.json"
    plans_path.write_text(json.dumps(plans))
    with pytest.raises(ValueError, match=rf"layer {layer!r} down: row count {rows}: a gemv "
                                         "tile serves at most 8 rows"):
        load_fused_plans(str(plans_path))
    if sg.triton is None:
        return
    ws = sg.Workspace("cpu", 64, 1, 16)
    with pytest.raises(ValueError, match="a gemv tile serves at most 8 rows, x has 9"):
        sg.skinny_gemm(torch.zeros(9, 32), torch.zeros(64, 32), ws,
                       sg.TileConfig(**tile))
    with pytest.raises(ValueError, match="gemv true with x_tma true"):
        sg.TileConfig(64, 64, 1, tma=True, x_tma=True, gemv=True)
    with pytest.raises(ValueError, match="tile gemv 1: expected true or false"):
        sg.TileConfig(8, 64, 1, gemv=1)


def test_skinny_gemm_rejects_more_rows_than_it_serves():
    ws = sg.Workspace("cpu", 64, 1, 4)
    if sg.triton is None:
        pytest.skip("needs triton for the argument check")
    with pytest.raises(ValueError, match=r"x \(65, 32\)"):
        sg.skinny_gemm(torch.zeros(65, 32), torch.zeros(64, 32), ws)


def test_decode_gemm_setting_is_checked(tiny_dir):
    with pytest.raises(ParallelConfigError, match="decode_gemm = 'fast'"):
        EngineConfig(model_dir=str(tiny_dir), decode_gemm="fast").validate()


def test_decode_gemm_is_cublas_off_cuda_and_when_asked(tiny_dir):
    from engine.config import load_model_config
    from engine.layers.linear import DecodeGemm
    from engine.model import Qwen3ForCausalLM
    from engine.parallel import TPGroup

    model = Qwen3ForCausalLM(load_model_config(str(tiny_dir)), TPGroup(), torch.bfloat16, "cpu")
    assert DecodeGemm.for_model(model, "cpu") is None
    assert DecodeGemm.for_model(model, "cuda", mode="cublas") is None
    linears = [m for m in model.modules() if hasattr(m, "gemm")]
    assert linears and all(m.gemm is None for m in linears)


def test_decode_gemm_workspace_holds_every_tile_of_the_shipped_table():
    from engine.layers.linear import DecodeGemm

    table = sg.load_table()
    widths = [int(key.split("x")[0]) for key in table]
    gemm = DecodeGemm.from_table(table, widths, "cpu")
    for key, rows in table.items():
        n = int(key.split("x")[0])
        for e in rows.values():
            blocks = -(-(n // 2 if "swiglu" in key else n) // e.config.block_n)
            assert gemm.workspace.fits(n, e.config.split_k, blocks), (key, e)
    assert DecodeGemm.from_table({}, widths, "cpu") is None


def test_programmatic_dependent_launch_is_off_on_cpu_and_when_disabled(monkeypatch):
    from engine.kernels import pdl

    assert pdl.use_pdl(torch.zeros(1)) is False
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}
    monkeypatch.setenv("LOCKSTEP_PDL", "0")
    assert pdl.use_pdl(torch.zeros(1)) is False



_RESIDUAL_NORM_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.getcwd())
from engine.kernels import fused
from engine.kernels import skinny_gemm as sg
torch.manual_seed(0)
ws = sg.Workspace("cpu", 1024, 8, 64)
eps = 1e-6
# (M, hidden, K of the producer, N of the consumer, swiglu, producer tile, consumer tile)
cases = [(1, 96, 256, 80, False, sg.TileConfig(16, 64, 4), sg.TileConfig(16, 32, 2)),
         (5, 200, 300, 96, True, sg.TileConfig(32, 64, 1), sg.TileConfig(16, 64, 3)),
         # one tile per program on both sides (the weights loaded before the PDL wait)
         (3, 96, 256, 80, True, sg.TileConfig(16, 64, 4), sg.TileConfig(16, 128, 1)),
         # tensor-descriptor weight reads on both sides, split and one tile
         (3, 96, 256, 80, True, sg.TileConfig(64, 64, 4, tma=True),
          sg.TileConfig(16, 128, 1, tma=True)),
         (5, 200, 296, 96, False, sg.TileConfig(32, 64, 1, tma=True),
          sg.TileConfig(64, 64, 3, tma=True)),
         (5, 200, 296, 96, True, sg.TileConfig(32, 64, 2, tma=True, x_tma=True),
          sg.TileConfig(64, 64, 1, tma=True, x_tma=True)),
         # gemv tiles on both sides: narrow columns (more partial sums per row), split-K
         (3, 96, 256, 80, True, sg.TileConfig(4, 64, 2, gemv=True),
          sg.TileConfig(8, 128, 1, gemv=True)),
         (17, 64, 128, 48, False, None, None)]  # last: the row-count check below uses it
for M, H, K, N, swiglu, pcfg, ccfg in cases:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        a = torch.randn(M, K, dtype=dtype)
        wo = torch.randn(H, K, dtype=dtype) / K ** 0.5
        res0 = torch.randn(M, H, dtype=dtype)
        norm_w = 1.0 + 0.1 * torch.randn(H, dtype=dtype)
        wq = torch.randn(2 * N if swiglu else N, H, dtype=dtype) / H ** 0.5
        folded = wq.clone()
        sg.fold_norm_weight(folded, norm_w)
        for _ in range(2):  # the second launch needs the counters the first left at zero
            res = res0.clone()
            ws.stats.fill_(float("nan"))  # partials past the producer's must never be read
            stats = sg.skinny_gemm_add_residual(a, wo, res, ws, pcfg)
            assert stats.rows == M
            # the same roundings as the unfused pair, both in the interpreter (which rounds to
            # bf16 its own way): the product to the dtype, then the sum
            _, unfused = fused.add_rms_norm(sg.skinny_gemm(a, wo, ws, pcfg), res0.clone(),
                                            norm_w, eps)
            assert torch.equal(res, unfused), ("residual rounding", M, dtype)
            want_res = a.double() @ wo.double().T + res0.double()
            err = ((res.double() - want_res).norm() / want_res.norm()).item()
            assert err < tol, ("residual", M, dtype, err)
            sums = ws.stats.view(-1, sg.MAX_ROWS)[:stats.partials, :M].double().sum(0)
            want_sums = res.double().pow(2).sum(1)
            assert torch.allclose(sums, want_sums, rtol=1e-5), ("stats", sums, want_sums)
            y = sg.skinny_gemm(res, folded, ws, ccfg, swiglu=swiglu, row_stats=stats, eps=eps)
            r64 = res.double()
            normed = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()
            ref = sg.skinny_gemm_torch(normed, wq.double(), swiglu)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert y.shape == ref.shape and y.dtype == dtype, (y.shape, ref.shape)
            assert err < tol, ("norm in", M, swiglu, dtype, err)
        assert int(ws.counters.abs().sum()) == 0, "a counter was left non-zero"
try:
    sg.skinny_gemm(res[:1], folded, ws, ccfg, row_stats=stats, eps=eps)
except ValueError as exc:
    assert "row statistics of 17 rows for x of 1" in str(exc), exc
else:
    raise AssertionError("row statistics of another row count were accepted")
print("ok", len(cases))
"""


def test_residual_epilogue_and_folded_norm_in_interpreter_match_float64():
    """A residual launch (o_proj / down) updates the residual and leaves its rows' sums of
    squares; the next launch over the norm-folded weight (QKV / gate_up, with and without
    SwiGLU, split-K on either side) equals RMSNorm then GEMM in float64."""
    res = run_in_triton_interpreter(_RESIDUAL_NORM_CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok 8" in res.stdout


_ROPE_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.getcwd())
from engine.kernels import fused
from engine.kernels import skinny_gemm as sg
torch.manual_seed(0)
ws = sg.Workspace("cpu", 1024, 8, 64)
D, P, eps = 32, 4, 1e-6
inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
angles = torch.outer(torch.arange(64).float(), inv).repeat(1, 2)
cos, sin = angles.cos(), angles.sin()
# (M, nq, nkv, K, tile, normed input): split-K fix-up, one unsplit loop, one tile per program
cases = [(1, 4, 2, 128, sg.TileConfig(16, 32, 4), False),
         (5, 2, 1, 96, sg.TileConfig(16, 64, 1), True),
         (3, 4, 2, 64, sg.TileConfig(16, 64, 1), False),
         (2, 2, 2, 128, sg.TileConfig(16, 64, 2), True),
         (2, 2, 1, 128, sg.TileConfig(16, 32, 2), False),  # two tiles in each split
         # tensor-descriptor weight reads: split-K, one unsplit loop, two tiles per split
         (1, 4, 2, 128, sg.TileConfig(16, 32, 4, tma=True), False),
         (5, 2, 1, 96, sg.TileConfig(16, 64, 1, tma=True), True),
         (2, 2, 1, 128, sg.TileConfig(16, 32, 2, tma=True), False),
         (5, 2, 1, 96, sg.TileConfig(16, 32, 3, tma=True, x_tma=True), True),
         (1, 4, 2, 128, sg.TileConfig(16, 64, 1, tma=True, x_tma=True), False),
         # the products on the CUDA cores (gemv): split-K, and one unsplit loop
         (1, 4, 2, 128, sg.TileConfig(16, 32, 4, gemv=True), True),
         (5, 2, 1, 96, sg.TileConfig(16, 32, 1, gemv=True), False)]
for M, nq, nkv, K, cfg, normed in cases:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        N = (nq + 2 * nkv) * D
        x = torch.randn(M, K, dtype=dtype)
        w = torch.randn(N, K, dtype=dtype) / K ** 0.5
        qw, kw = (1 + 0.1 * torch.randn(2, D)).to(dtype)
        pos = torch.tensor([5, 17, 0, 31, 9][:M])
        slots = torch.randperm(8)[:M].to(torch.int32)
        pt = torch.randperm(64).to(torch.int32).reshape(8, 8)
        def caches():  # entries a launch does not write stay NaN
            return [torch.full((65, P, nkv, D), float("nan"), dtype=dtype) for _ in range(2)]
        stats = None
        if normed:  # x is the residual; its sums of squares come from a residual launch
            res = torch.randn(M, K, dtype=dtype)
            stats = sg.skinny_gemm_add_residual(torch.randn(M, 48, dtype=dtype),
                                                torch.randn(K, 48, dtype=dtype) / 7, res, ws,
                                                sg.TileConfig(16, 32, 2))
            x = res
        k1, v1 = caches()
        y = (sg.skinny_gemm(x, w, ws, sg.TileConfig(16, 32, 1), row_stats=stats, eps=eps)
             if normed else sg.skinny_gemm(x, w, ws, sg.TileConfig(16, 32, 1)))
        q1 = fused.qk_norm_rope_kv(y, qw, kw, cos, sin, pos, slots, pt, k1, v1, nq, nkv, eps)
        k2, v2 = caches()
        rope = sg.RopeKV(qw, kw, cos, sin, pos, slots, pt, k2, v2, nq, nkv, eps)
        for _ in range(2):  # the second launch needs the counters the first left at zero
            q2 = sg.skinny_gemm_qkv_rope(x, w, ws, cfg, rope, row_stats=stats, eps=eps)
            assert q2.shape == (M, nq, D) and q2.dtype == dtype
            # the same entries written, to what the two launches write (the halves' sums of
            # squares may round differently in float32)
            for a, b in ((q2, q1), (k2, k1), (v2, v1)):
                assert torch.equal(a.isnan(), b.isnan()), "another cache entry was written"
                diff = (a.double() - b.double()).nan_to_num().abs().max().item()
                assert diff <= (1e-5 if dtype == torch.float32 else 0.0), (M, dtype, diff)
        # float64 oracle: GEMM (after the input RMSNorm) then the torch q/k norm + RoPE
        x64 = x.double()
        if normed:
            x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
        k3, v3 = [c.double() for c in caches()]
        q3 = fused.qk_norm_rope_kv_torch(x64 @ w.double().T, qw.double(), kw.double(),
                                         cos.double(), sin.double(), pos, slots, pt, k3, v3,
                                         nq, nkv, eps)
        for a, b in ((q2, q3), (k2, k3), (v2, v3)):
            a, b = a.double().nan_to_num(), b.nan_to_num()
            err = ((a - b).norm() / b.norm()).item()
            assert err < tol, (M, nq, nkv, dtype, err)
        assert int(ws.counters.abs().sum()) == 0, "a counter was left non-zero"
try:
    sg.skinny_gemm_qkv_rope(x, w, ws, sg.TileConfig(32, 64, 1), rope)
except ValueError as exc:
    assert "block_n 32" in str(exc) and "expected block_n = 16" in str(exc), exc
else:
    raise AssertionError("a tile of another width than half a head was accepted")
print("ok", len(cases))
"""


def test_qkv_rope_epilogue_in_interpreter_matches_the_two_launches_and_float64():
    """`skinny_gemm_qkv_rope` (the QKV GEMM doing the q/k norm + RoPE + KV write) writes q and
    exactly the cache entries `skinny_gemm` then `fused.qk_norm_rope_kv` write, bit for bit in
    bfloat16, with and without the folded input norm and split-K; and equals the float64
    oracle. A tile whose block_n is not half a head is refused."""
    res = run_in_triton_interpreter(_ROPE_CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok 12" in res.stdout


_ATTEND_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.getcwd())
from engine.kernels import skinny_gemm as sg
from engine.kernels.decode_attention import paged_decode_attention_reference
torch.manual_seed(0)
ws = sg.Workspace("cpu", 1024, 8, 64)
D, P, eps, tile = 32, 4, 1e-6, 16
inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
angles = torch.outer(torch.arange(64).float(), inv).repeat(1, 2)
cos, sin = angles.cos(), angles.sin()
# (M, nq, nkv, K, tile): split-K fix-up (group 2), one unsplit loop (group 4), tensor
# descriptors, a group of 1
cases = [(1, 4, 2, 128, sg.TileConfig(16, 32, 4)),
         (3, 4, 1, 96, sg.TileConfig(16, 64, 1)),
         (2, 4, 2, 128, sg.TileConfig(16, 32, 2, tma=True)),
         (1, 2, 2, 64, sg.TileConfig(16, 64, 1, tma=True))]
for M, nq, nkv, K, cfg in cases:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        N = (nq + 2 * nkv) * D
        x = torch.randn(M, K, dtype=dtype)
        w = torch.randn(N, K, dtype=dtype) / K ** 0.5
        qw, kw = (1 + 0.1 * torch.randn(2, D)).to(dtype)
        # the last row's context is longer than the tile: only its first `tile` tokens count
        pos = torch.tensor([5, 11, 15][:M - 1] + [21])
        slots = torch.randperm(8)[:M].to(torch.int32)
        pt = torch.randperm(64).to(torch.int32).reshape(8, 8)
        lens = torch.zeros(8, dtype=torch.int32)
        lens[slots.long()] = (pos + 1).to(torch.int32)
        old = [torch.randn(65, P, nkv, D).to(dtype) for _ in range(2)]
        def run(attend):
            kc, vc = [c.clone() for c in old]
            rope = sg.RopeKV(qw, kw, cos, sin, pos, slots, pt, kc, vc, nq, nkv, eps)
            q = sg.skinny_gemm_qkv_rope(x, w, ws, cfg, rope, attend=attend)
            return q, kc, vc
        q1, k1, v1 = run(None)
        for _ in range(2):  # the second launch needs the counters the first left at zero
            o = torch.full((M, nq * D), float("nan"), dtype=dtype)
            q2, k2, v2 = run(sg.AttendTail(o, lens, D ** -0.5, tile))
            assert torch.equal(q2, q1) and torch.equal(k2, k1) and torch.equal(v2, v1)
            assert int(ws.group_counters.abs().sum()) == 0, "a group counter was left non-zero"
            assert int(ws.counters.abs().sum()) == 0, "a counter was left non-zero"
        # float64 oracle over each row's first `tile` tokens of the launch's q and caches
        ref = paged_decode_attention_reference(q1, k1, v1, pt, lens.clamp(max=tile), slots,
                                               D ** -0.5).reshape(M, nq * D)
        err = ((o.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (M, nq, nkv, dtype, err)
        # the long row differs from attention over its whole context
        full = paged_decode_attention_reference(q1, k1, v1, pt, lens, slots, D ** -0.5)
        assert (o[-1].double() - full[-1].reshape(-1)).abs().max() > 10 * tol
# A q-head program as the last arrival: kv head 1's counter starts at GROUP + 1, so the
# group's first program to arrive (query head 2) attends, before query head 3, K head 1 and
# V head 1 stored theirs: it sees q of head 3 as the buffer held it (zeros) and the caches
# as they were; the counter is left at GROUP + 1 by the three arrivals after its reset. (The
# interpreter runs programs in order, so otherwise the V head always arrives last.)
nq, nkv, K, cfg = 4, 2, 64, sg.TileConfig(16, 64, 1)
M, pos, slots = 1, torch.tensor([9]), torch.tensor([3], dtype=torch.int32)
lens = torch.zeros(8, dtype=torch.int32)
lens[3] = 10
x = torch.randn(M, K)
w = torch.randn((nq + 2 * nkv) * D, K) / K ** 0.5
qw, kw = 1 + 0.1 * torch.randn(2, D)
old = [torch.randn(65, P, nkv, D) for _ in range(2)]
kc, vc = [c.clone() for c in old]
rope = sg.RopeKV(qw, kw, cos, sin, pos, slots, pt, kc, vc, nq, nkv, eps)
o = torch.full((M, nq * D), float("nan"))
ws.group_counters[1] = 3
q = sg.skinny_gemm_qkv_rope(x, w, ws, cfg, rope, out=torch.zeros(M, nq, D),
                            attend=sg.AttendTail(o, lens, D ** -0.5, tile))
assert int(ws.group_counters[1]) == 3 and int(ws.group_counters[0]) == 0
ws.group_counters.zero_()
seen = q.clone()
seen[:, 3] = 0
stale = paged_decode_attention_reference(seen, *old, pt, lens, slots, D ** -0.5).reshape(M, -1)
fresh = paged_decode_attention_reference(q, kc, vc, pt, lens, slots, D ** -0.5).reshape(M, -1)
group = slice(2 * D, 4 * D)  # kv head 1's query heads 2 and 3
assert (o[:, group].double() - stale[:, group]).abs().max() < 1e-5
assert (o[:, :2 * D].double() - fresh[:, :2 * D]).abs().max() < 1e-5
assert (stale[:, group] - fresh[:, group]).abs().max() > 1e-3
# the engine's sizes: heads of 128, pages of 16, a 128-token tile, group 4, a full tile
D2, P2 = 128, 16
ws = sg.Workspace("cpu", 12 * D2, 8, 64)
inv2 = 1.0 / (10000 ** (torch.arange(0, D2, 2).float() / D2))
angles2 = torch.outer(torch.arange(256).float(), inv2).repeat(1, 2)
for cfg in (sg.TileConfig(64, 128, 1, tma=True), sg.TileConfig(64, 128, 2)):
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    w = (torch.randn(12 * D2, 256) / 16).to(torch.bfloat16)
    qw2, kw2 = (1 + 0.1 * torch.randn(2, D2)).to(torch.bfloat16)
    lens2 = torch.zeros(4, dtype=torch.int32)
    lens2[2] = 128
    kc, vc = [torch.randn(65, P2, 2, D2).to(torch.bfloat16) for _ in range(2)]
    rope = sg.RopeKV(qw2, kw2, angles2.cos(), angles2.sin(), torch.tensor([127]),
                     torch.tensor([2], dtype=torch.int32), pt[:4], kc, vc, 8, 2, eps)
    o = torch.full((1, 8 * D2), float("nan"), dtype=torch.bfloat16)
    q = sg.skinny_gemm_qkv_rope(x, w, ws, cfg, rope,
                                attend=sg.AttendTail(o, lens2, D2 ** -0.5, 128))
    ref = paged_decode_attention_reference(q, kc, vc, pt[:4], lens2, rope.slot_ids,
                                           D2 ** -0.5).reshape(1, -1)
    assert ((o.double() - ref).norm() / ref.norm()).item() < 2e-2
    assert int(ws.group_counters.abs().sum()) == 0
# refusals: (AttendTail change, query heads, kv heads, workspace)
small_ws = sg.Workspace("cpu", 1024, 8, 1)
bad = [(dict(out=torch.zeros(1, 4 * D + 1)), 4, 2, ws),
       (dict(out=torch.zeros(1, 4 * D, dtype=torch.bfloat16)), 4, 2, ws),
       (dict(tile_tokens=24), 4, 2, ws), (dict(tile_tokens=2), 4, 2, ws),
       (dict(tile_tokens=8), 4, 2, ws),
       (dict(out=torch.zeros(1, 3 * D)), 3, 2, ws), ({}, 4, 2, small_ws)]
for change, nq, nkv, space in bad:
    args = dict(out=torch.zeros(1, nq * D), seq_lens=lens, scale=1.0, tile_tokens=tile)
    args.update(change)
    kc, vc = [c.clone() for c in old]
    rope = sg.RopeKV(qw, kw, cos, sin, pos, slots, pt, kc, vc, nq, nkv, eps)
    try:
        sg.skinny_gemm_qkv_rope(torch.randn(1, 64), torch.randn((nq + 2 * nkv) * D, 64), space,
                                sg.TileConfig(16, 64, 1), rope, attend=sg.AttendTail(**args))
    except ValueError as exc:
        print("refused:", exc)
    else:
        raise AssertionError(f"accepted {change}, {nq} / {nkv} heads")
print("ok", len(cases))
"""


def test_attention_in_the_qkv_tail_matches_float64_and_leaves_the_rest_unchanged():
    """`skinny_gemm_qkv_rope(..., attend=AttendTail(...))`: the last program of each kv head's
    group attends it, in the interpreter, equal to the float64 decode attention over each row's
    first tile of tokens (a row past the tile is cut there), with q, K and V bit-identical to
    the launch without it and every counter back at zero, also at the engine's sizes (heads
    of 128, a 128-token tile of pages of 16, group 4); a query-head program arriving last
    attends its own group (a counter started at 2 makes it last); a bad output (shape,
    dtype), tile (not a power of two, not whole pages, under 16), group or workspace is
    refused with a one-line error."""
    res = run_in_triton_interpreter(_ATTEND_CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok 4" in res.stdout
    refusals = [line for line in res.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 7
    assert "attention output (1, 129)" in refusals[0]
    assert "torch.bfloat16" in refusals[1] and "expected (1, 128) contiguous in torch.float32" \
        in refusals[1]
    for line, tokens in zip(refusals[2:5], (24, 2, 8)):
        assert f"tile of {tokens} tokens" in line
    assert "3 query heads over 2 kv heads" in refusals[5]
    assert "2 kv heads with 1 group counters" in refusals[6]


def test_fold_norm_weight_scales_columns_in_float32():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.bfloat16)
    sg.fold_norm_weight(w, torch.tensor([0.5, 1.0, 2.0], dtype=torch.bfloat16))
    assert w.tolist() == [[0.5, 2.0, 6.0], [2.0, 5.0, 12.0]]


def test_residual_launch_rejects_a_residual_of_another_shape():
    if sg.triton is None:
        pytest.skip("needs triton for the argument check")
    ws = sg.Workspace("cpu", 64, 1, 4)
    with pytest.raises(ValueError, match=r"residual \(2, 63\)"):
        sg.skinny_gemm_add_residual(torch.zeros(2, 32), torch.zeros(64, 32),
                                    torch.zeros(2, 63), ws)
    with pytest.raises(ValueError, match=r"residual \(2, 64\) torch.float64"):
        sg.skinny_gemm_add_residual(torch.zeros(2, 32), torch.zeros(64, 32),
                                    torch.zeros(2, 64, dtype=torch.float64), ws)
    with pytest.raises(ValueError, match="8 column blocks exceed the workspace's 4 rows"):
        sg.skinny_gemm_add_residual(torch.zeros(2, 32), torch.zeros(128, 32),
                                    torch.zeros(2, 128), ws, sg.TileConfig(16, 32, 1))


def test_residual_epilogue_refuses_an_unreduced_row_parallel_output():
    from engine.layers.linear import RowParallelLinear
    from engine.parallel import TPGroup

    layer = RowParallelLinear(64, 32, TPGroup(rank=0, world_size=2), torch.float32)
    with pytest.raises(ValueError, match="residual epilogue at world size 2"):
        layer(torch.zeros(1, 32), residual=torch.zeros(1, 32), tile=sg.TileConfig(16, 32, 1))


def test_fused_layer_plan_weighs_the_table_times_against_the_fusion_saving():
    """A layer fuses while its skinny GEMMs lose less to cuBLAS, summed, than the fusion saves;
    a missing shape or row count means unfused."""
    from engine.layers.linear import FUSED_LAYER_SAVING_US, DecodeGemm, LayerShapes

    tile = sg.TileConfig(32, 128, 1)
    shapes = LayerShapes((96, 64, False), (64, 80, False), (256, 64, True), (64, 128, False))
    loss = FUSED_LAYER_SAVING_US / 4

    def table(extra_loss):
        out = {}
        for i, (n, k, sw) in enumerate((shapes.qkv, shapes.o_proj, shapes.gate_up, shapes.down)):
            lost = loss + (extra_loss if i == 3 else 0.0)
            out[sg.shape_key(n, k, sw)] = {8: sg.TableEntry(tile, 5.0 + lost, 5.0),
                                           64: sg.TableEntry(tile, 4.0, 5.0)}
        return out

    plan = DecodeGemm(table(-0.01), None).fused_layer_plan(shapes, 8)
    assert plan is not None and plan.down == tile
    at_saving = DecodeGemm(table(0.0), None)
    assert at_saving.fused_layer_plan(shapes, 8) is None
    assert at_saving.fused_layer_plan(shapes, 9) is not None   # the 64 entry: skinny wins
    assert at_saving.fused_layer_plan(shapes, 65) is None
    missing = table(-1.0)
    del missing[sg.shape_key(*shapes.down)]
    assert DecodeGemm(missing, None).fused_layer_plan(shapes, 1) is None
    offset = table(0.0)  # a big skinny win on QKV does not pay for the others' losses
    offset[sg.shape_key(*shapes.qkv)][8] = sg.TableEntry(tile, 1.0, 5.0)
    assert DecodeGemm(offset, None).fused_layer_plan(shapes, 8) is not None  # 3 x loss left
    offset[sg.shape_key(*shapes.down)][8] = sg.TableEntry(tile, 5.0 + FUSED_LAYER_SAVING_US, 5.0)
    assert DecodeGemm(offset, None).fused_layer_plan(shapes, 8) is None
    untimed = table(-1.0)  # no tile ran at 8 rows for one shape
    untimed[sg.shape_key(*shapes.o_proj)][8] = sg.TableEntry(None, float("inf"), 5.0)
    assert DecodeGemm(untimed, None).fused_layer_plan(shapes, 8) is None
    assert sg.choose(untimed, *shapes.o_proj, 8) is None


def test_sweep_time_tiles_records_failures_and_keeps_the_fastest(monkeypatch):
    """The sweep's per-tile loop (gemm and rope kinds): a tile whose check raises is recorded
    with its error, the others with their time per call (graph time over the copies)."""
    from engine.bench import gemm_sweep

    tiles = [sg.TileConfig(16, 64, s) for s in (1, 2, 4)]
    launched = []

    def fake_graph(fn, repeats):
        fn()
        return {1: 0.006, 4: 0.003}[launched[-1][0].split_k]  # ms for both copies

    monkeypatch.setattr(gemm_sweep, "time_graph", fake_graph)

    def check(cfg):
        if cfg.split_k == 2:
            raise AssertionError("relative error 0.5")

    entry = {"triton": []}
    best = gemm_sweep.time_tiles(entry, tiles, check, lambda cfg, w: launched.append((cfg, w)),
                                 ["w0", "w1"], repeats=3)
    assert best == entry["best"] == {"config": tiles[2].__dict__, "us": 1.5}
    assert entry["triton"][1] == {"config": tiles[1].__dict__, "error": "relative error 0.5"}
    assert entry["triton"][0]["us"] == 3.0
    assert [w for _, w in launched] == ["w0", "w1", "w0", "w1"]
    assert gemm_sweep.time_tiles({"triton": []}, tiles[1:2], check, None, [], 1) is None


@pytest.mark.parametrize("fields, message", [
    (dict(tma="yes"), "tile tma 'yes': expected true or false"),
    (dict(tma=1), "tile tma 1: expected true or false"),
    (dict(tma=True, block_k=512), "block_k 512 with tma: a tensor descriptor's tile is 16..256"),
    (dict(tma=True, block_n=8), "block_n 8 x block_k 128 with tma"),
    (dict(x_tma=1, tma=True), "tile x_tma 1: expected true or false"),
    (dict(x_tma=True), "tile x_tma true with tma false"),
])
def test_a_tma_tile_the_descriptor_cannot_hold_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        sg.TileConfig(**{"block_n": 64, "block_k": 128, "split_k": 1, **fields})


def test_a_tma_tile_over_a_misaligned_weight_is_one_error():
    """A bulk copy needs the weight's start and row stride 16-byte aligned: a slice that
    breaks either is refused before any launch (the table's shapes all have K % 8 == 0)."""
    if sg.triton is None:
        pytest.skip("needs triton")
    w = torch.zeros(64, 100, dtype=torch.bfloat16)  # rows of 200 bytes
    cfg = sg.TileConfig(64, 64, 1, tma=True)
    with pytest.raises(ValueError, match="w's start and rows 16-byte aligned"):
        sg._weight_descriptor(w, cfg)
    with pytest.raises(ValueError, match="16-byte aligned"):
        sg._weight_descriptor(torch.zeros(64, 129, dtype=torch.bfloat16)[:, 1:], cfg)
    assert sg._weight_descriptor(torch.zeros(64, 128, dtype=torch.bfloat16), cfg) is not None


def test_old_tables_without_tma_still_load_as_pointer_tiles():
    table = sg.load_table()
    tiles = [e.config for rows in table.values() for e in rows.values() if e.config]
    assert tiles and all(type(t.tma) is bool for t in tiles)


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "4b qkv,4b mlp"], "--shapes '4b qkv,4b mlp': unknown shape '4b mlp'"),
    (["--rows", "0"], "--rows 0: expected 1..64"),
    (["--rows", "1,65"], "--rows 65: expected 1..64"),
    (["--rows", "x"], "--rows"),
    (["--repeats", "0"], "--repeats 0: expected 1..1000"),
])
def test_tma_probe_bad_arguments_are_one_line_before_the_gpu(capsys, argv, message):
    from engine.bench import tma_probe

    assert tma_probe.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tma_probe: error: ") and message in err and err.count("\n") == 1, err


def test_tma_probe_refuses_a_bad_environment_switch_before_the_gpu(capsys, monkeypatch):
    from engine.bench import tma_probe

    monkeypatch.setenv("LOCKSTEP_PDL", "off")
    assert tma_probe.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tma_probe: error: LOCKSTEP_PDL = 'off'") and err.count("\n") == 1, err


@pytest.mark.parametrize("k, swiglu", [(2560, True), (2560, False), (9728, False), (256, False)])
def test_gemm_space_holds_activation_descriptor_tiles_that_fit_shared_memory(k, swiglu):
    """Each x_tma tile's stages (weights, paired for SwiGLU, and a 64-row activation tile) fit
    the budget; the widest paired tile with 5 stages does not and is left out; no split is
    shorter than its block_k."""
    from engine.bench.gemm_sweep import TMA_SMEM_BYTES, gemm_space

    space = gemm_space(k, swiglu)
    x_tma = [t for t in space if t.x_tma]
    assert x_tma and all(t.tma for t in x_tma)
    pair = 2 if swiglu else 1
    assert all((t.block_n * pair + sg.MAX_ROWS) * t.block_k * 2 * t.num_stages
               <= TMA_SMEM_BYTES for t in x_tma)
    assert sg.TileConfig(128, 128, 1, 4, 5, tma=True, x_tma=True) not in space
    assert all(t.split_k == 1 or k // t.split_k >= t.block_k for t in space)
    assert len(set(space)) == len(space)


def test_rope_sweep_leaves_out_tma_tiles_narrower_than_a_descriptor_holds():
    """The tiny presets' heads are 16 wide, so the rope tile's block_n is 8: no TMA tile then
    (building one would raise in `TileConfig` after every GEMM shape was timed)."""
    from engine.bench.gemm_sweep import rope_space

    assert rope_space(64, 8) and not any(t.tma for t in rope_space(64, 8))
    assert any(t.tma for t in rope_space(2560, 64))


_NO_TMA_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.getcwd())
from engine.kernels import skinny_gemm as sg
torch.manual_seed(0)
ws = sg.Workspace("cpu", 512, 8, 64)
x = torch.randn(3, 296, dtype=torch.bfloat16)
w = torch.randn(200, 296, dtype=torch.bfloat16) / 296 ** 0.5
cfg = sg.TileConfig(64, 64, 2, tma=True)
with_tma = sg.skinny_gemm(x, w, ws, cfg, swiglu=True)
made = []
real = sg._weight_descriptor
sg._weight_descriptor = lambda *a: made.append(1) or real(*a)
sg.tma_supported = lambda device: False  # a GPU before Hopper
without = sg.skinny_gemm(x, w, ws, cfg, swiglu=True)
assert not made, "a descriptor was built where the bulk copy does not exist"
ref = sg.skinny_gemm_torch(x.double(), w.double(), True)
for y in (with_tma, without):
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-2
print("ok")
"""


def test_a_tma_tile_runs_with_pointer_loads_where_the_gpu_has_no_bulk_copy():
    res = run_in_triton_interpreter(_NO_TMA_CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok" in res.stdout


@pytest.mark.parametrize("key, entry, words", [
    ("garbage", {}, "shape 'garbage' is not a shape_key"),
    ("1024 x 2048", {}, "shape '1024 x 2048' is not a shape_key"),
    ("1024x2048 gelu", {}, "shape '1024x2048 gelu' is not a shape_key"),
    ("0x2048", {}, "shape '0x2048' is not a shape_key"),
    ("1024x2048", {"cublas_us": True}, "cublas_us True is not a number"),
    ("1024x2048", {"cublas_us": "2.5"}, "cublas_us '2.5' is not a number"),
    ("1024x2048", {"skinny_us": False}, "skinny_us False is not a number"),
])
def test_a_bad_shape_key_or_time_is_one_line_naming_it(key, entry, words, tmp_path):
    """Old behaviour: "garbage" loaded as a shape no lookup ever finds, and a time of true or
    "2.5" went through float() as 1.0 and 2.5."""
    good = {"skinny": {"block_n": 32, "block_k": 128, "split_k": 4}, "skinny_us": 4.0,
            "cublas_us": 5.0}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"2048x1024": {"1": good}, key: {"8": good | entry}}))
    with pytest.raises(ValueError) as info:
        sg.load_table(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: not a skinny GEMM table (") and words in message
    assert "\n" not in message
    path.write_text(json.dumps({"2048x1024 swiglu": {"1": good}, "2048x1024 rope": {"1": good},
                                "1x2": {"1": dict(good, cublas_us=3)}}))
    assert sorted(sg.load_table(str(path))) == ["1x2", "2048x1024 rope", "2048x1024 swiglu"]


def test_step_tune_names_a_bad_shape_key_of_the_shipped_table_in_one_line(tmp_path,
                                                                           monkeypatch, capsys):
    from engine.bench import step_tune

    path = tmp_path / "skinny_gemm_table.json"
    path.write_text(json.dumps({"garbage": {}}))
    monkeypatch.setattr(step_tune, "load_table", lambda: sg.load_table(str(path)))
    assert step_tune.main(["--preset", "qwen3-0.6b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"step_tune: error: {path}: not a skinny GEMM table (") \
        and "'garbage' is not a shape_key" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("raw, words", [
    ([1, 2], "expected an object of shape keys, each an object of row counts"),
    ({"1024x2048": []}, "expected an object of shape keys, each an object of row counts"),
    ({"1024x2048": {"1": None}}, "entry None is not an object with skinny, skinny_us and "
                                 "cublas_us"),
    ({"1024x2048": {"1": {"skinny": None}}}, "an entry has no 'cublas_us' field"),
    ({"1024x2048": {"1": {"skinny": 3, "cublas_us": 2}}},
     "tile 3 is not an object of TileConfig fields"),
    ({"1024x2048": {"1": {"skinny": {"block_n": 32, "colour": 3}, "skinny_us": 1,
                          "cublas_us": 2}}}, "tile field(s) 'colour' unknown; known: block_n"),
    ({"1024x2048": {"1": {"skinny": {"block_k": 32}, "skinny_us": 1, "cublas_us": 2}}},
     "lacks block_n, split_k"),
    ({"-5x3": {}}, "shape '-5x3' is not a shape_key"),
])
def test_a_malformed_table_says_what_is_wrong_in_words_not_an_exception_repr(raw, words,
                                                                            tmp_path):
    """Found by a fresh user: a refused table read "not a skinny GEMM table
    (ValueError("shape '-5x3' ..."))" or "(KeyError('cublas_us'))"."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as info:
        sg.load_table(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: not a skinny GEMM table (") and message.endswith(")")
    assert words in message and "Error(" not in message and "\n" not in message, message


def test_sweep_times_gemv_tiles_only_when_asked():
    """The sweep leaves the CUDA-core tiles out unless asked (they lost in the decode step),
    and with them asked still times none past GEMV_MAX_ROWS rows."""
    from engine.bench.gemm_sweep import gemm_space, sweep_tiles

    assert sweep_tiles(4096, 1, False, False) == gemm_space(4096, False)
    with_gemv = sweep_tiles(4096, 1, False, True)
    extra = [t for t in with_gemv if t.gemv]
    assert extra and with_gemv == gemm_space(4096, False) + extra
    assert not any(t.gemv for t in sweep_tiles(4096, sg.GEMV_MAX_ROWS + 1, False, True))
