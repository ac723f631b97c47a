"""Skinny decode GEMM (engine.kernels.skinny_gemm): the Triton kernel in the interpreter against
a float64 oracle (plain, SwiGLU epilogue, split-K fix-up), the measured table's reading and
the per-call choice, and the engine setting that turns it off."""

from __future__ import annotations

import json

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
         (3, 48, 1000, False, sg.TileConfig(32, 128, 3))]  # odd split count
for M, N, K, swiglu, cfg in cases:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(M, K, dtype=dtype)
        w = torch.randn(N, K, dtype=dtype) / K ** 0.5
        for _ in range(2):  # the second launch needs the counters the first left at zero
            y = sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu)
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
    assert "ok 4" in res.stdout


def test_torch_path_swiglu_matches_its_definition():
    torch.manual_seed(1)
    x, w = torch.randn(3, 32, dtype=torch.float64), torch.randn(20, 32, dtype=torch.float64)
    y = sg.skinny_gemm_torch(x, w, swiglu=True)
    g, u = (x @ w.T).chunk(2, -1)
    torch.testing.assert_close(y, g * torch.sigmoid(g) * u)


def test_table_round_trip_and_choice(tmp_path):
    path = tmp_path / "table.json"
    cfg = {"block_n": 32, "block_k": 128, "split_k": 4, "num_warps": 4, "num_stages": 4}
    path.write_text(json.dumps({sg.shape_key(1024, 2048, False): {"1": cfg, "8": None,
                                                                   "64": cfg}}))
    table = sg.load_table(str(path))
    want = sg.TileConfig(**cfg)
    assert sg.choose(table, 1024, 2048, False, 1) == want
    assert sg.choose(table, 1024, 2048, False, 5) is None      # 8's entry: cuBLAS won there
    assert sg.choose(table, 1024, 2048, False, 9) == want      # served by the 64 entry
    assert sg.choose(table, 1024, 2048, False, 65) is None     # past MAX_ROWS
    assert sg.choose(table, 1024, 2048, True, 1) is None       # SwiGLU is another shape
    assert sg.choose(table, 999, 2048, False, 1) is None       # not measured


def test_shipped_table_parses_and_names_real_configs():
    table = sg.load_table()
    assert table, "engine/kernels/skinny_gemm_table.json is missing or empty"
    for rows in table.values():
        assert all(c is None or (c.split_k >= 1 and c.block_n >= 16) for c in rows.values())


def test_a_corrupt_table_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"1024x2048": {"1": {"block_n": 32, "colour": 3}}}))
    with pytest.raises(ValueError, match="bad.json: not a skinny GEMM table"):
        sg.load_table(str(path))


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


def test_programmatic_dependent_launch_is_off_on_cpu_and_when_disabled(monkeypatch):
    from engine.kernels import pdl

    assert pdl.use_pdl(torch.zeros(1)) is False
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}
    monkeypatch.setenv("LOCKSTEP_PDL", "0")
    assert pdl.use_pdl(torch.zeros(1)) is False

