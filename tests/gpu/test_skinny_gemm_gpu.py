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


def test_programmatic_dependent_launch_changes_no_result(monkeypatch):
    """A chain of PDL launches (skinny GEMM -> SwiGLU GEMM -> split-KV decode attention) inside a
    CUDA graph gives bit-identical results to the same chain launched without PDL."""
    from engine.kernels import decode_attention as da
    from engine.kernels import pdl
    from engine.kernels import skinny_gemm as sg
    from engine.testing import make_case

    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("PDL needs compute capability 9.0")
    torch.manual_seed(0)
    ws = sg.Workspace("cuda", 4096, 8, 256)
    aws = da.SplitWorkspace.for_heads("cuda", 16, 8, 128)
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    w1 = torch.randn(2048, 1024, dtype=torch.bfloat16, device="cuda") / 32
    w2 = torch.randn(4096, 1024, dtype=torch.bfloat16, device="cuda") / 32
    q, k, v, table, lens, slots = make_case([700, 33, 5], 16, 8, 128, dtype=torch.bfloat16,
                                            device="cuda")

    def chain():
        h = sg.skinny_gemm(x, w1, ws, sg.TileConfig(32, 128, 4))
        a = sg.skinny_gemm(h[:, :1024].contiguous(), w2, ws, sg.TileConfig(32, 128, 2),
                           swiglu=True)
        o = da.paged_decode_attention_triton(q + a[: q.shape[0], :1].unsqueeze(-1), k, v,
                                             table, lens, slots, 0.1, workspace=aws)
        return h, a, o

    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LOCKSTEP_PDL", flag)
        assert pdl.use_pdl(x) == (flag == "1")
        eager = chain()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain()
        g.replay()
        torch.cuda.synchronize()
        for e, r in zip(eager, out):
            assert torch.equal(e, r)
        results[flag] = eager
    for off, on in zip(results["0"], results["1"]):
        assert torch.equal(off, on)


def test_programmatic_dependent_launch_only_for_decode_sized_launches():
    from engine.kernels import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    assert pdl.use_pdl(torch.zeros(pdl.MAX_ROWS, 8, device="cuda"))
    assert not pdl.use_pdl(torch.zeros(pdl.MAX_ROWS + 1, 8, device="cuda"))
