"""Skinny decode GEMM on the GPU: every configuration of the shipped table at its real shape
against a float64 oracle, bit-identical across launches and inside a CUDA graph, counters
left at zero."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cases():
    from engine.kernels import skinny_gemm as sg

    for key, rows in sorted(sg.load_table().items()):
        n, k = (int(v) for v in key.split()[0].split("x"))
        for m, cfg in sorted(rows.items()):
            if cfg is not None:
                yield pytest.param(n, k, "swiglu" in key, m, cfg, id=f"{key}-M{m}")


@pytest.mark.parametrize("n, k, swiglu, m, cfg", list(_cases()))
def test_table_config_matches_float64_and_replays_identically(n, k, swiglu, m, cfg):
    from engine.kernels import skinny_gemm as sg

    torch.manual_seed(m)
    ws = sg.Workspace("cuda", n, cfg.split_k, -(-n // cfg.block_n))
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    y = sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu)
    ref = sg.skinny_gemm_torch(x.double(), w.double(), swiglu)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    again = sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu)
    assert torch.equal(y, again)
    out = torch.empty_like(y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu, out=out)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
    assert int(ws.counters.abs().sum()) == 0
