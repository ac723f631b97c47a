"""Qwen3-4B's one-row step with o_proj and / or qkv run by `gluon_gemv` (weight stages requested
before the PDL wait) instead of the plan's Triton tiles (docs/benchmarks.md, 2026-12-07, session
of 10:26 UTC).

First the kernel against float64 and against the shipped launch, at both shapes and epilogues,
on random inputs; then the graph-replayed step (`engine.bench.step_tune.StepTimer`, 100 replays
after 10, two rounds, the second with the device timeline) with one-row launches of those
shapes routed to the Gluon kernel by wrapping `skinny_gemm.skinny_gemm` and
`skinny_gemm_add_residual` (the engine's layers call them through the module). On one GPU with
Triton 3.6:

    PYTHONPATH=. python3 docs/experiments/gluon-gemv-prefetch-step.py [out.json]
"""

from __future__ import annotations

import sys

import torch
from gluon_gemv import gemv
from step_probe import probe_switches

from engine.kernels import skinny_gemm

LAYERS = 36
O_PROJ, QKV = (2560, 4096), (6144, 2560)
SHIPPED = (skinny_gemm.skinny_gemm, skinny_gemm.skinny_gemm_add_residual)
TILES = {O_PROJ: (64, 256, 5), QKV: (64, 256, 4)}  # block_n, block_k, stages


def route(shapes: set) -> None:
    """One-row launches of the weights `shapes` ([N, K]) go to `gemv` from now on."""
    plain, add_residual = SHIPPED

    def gemm(x, w, workspace, config=None, swiglu=False, out=None, row_stats=None, eps=0.0):
        if x.shape[0] != 1 or swiglu or tuple(w.shape) not in shapes:
            return plain(x, w, workspace, config, swiglu, out, row_stats, eps)
        if out is None:
            out = torch.empty(1, w.shape[0], dtype=x.dtype, device=x.device)
        gemv(x, w, out, workspace, *TILES[tuple(w.shape)], row_stats=row_stats, eps=eps)
        return out

    def gemm_add_residual(x, w, residual, workspace, config=None):
        if x.shape[0] != 1 or tuple(w.shape) not in shapes:
            return add_residual(x, w, residual, workspace, config)
        blocks = gemv(x, w, residual, workspace, *TILES[tuple(w.shape)], residual=True)
        return skinny_gemm.RowStats(blocks, 1)

    skinny_gemm.skinny_gemm = gemm if shapes else plain
    skinny_gemm.skinny_gemm_add_residual = gemm_add_residual if shapes else add_residual


def check_kernel() -> dict:
    """Max abs error of `gemv` and of the shipped launch against float64, per shape/epilogue."""
    torch.manual_seed(0)
    ws = skinny_gemm.Workspace("cuda", 2 * 19456, 16, 1024)
    out = {}
    for shape in (O_PROJ, QKV):
        n, k = shape
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        x = torch.randn(1, k, device="cuda").bfloat16()
        res = torch.randn(1, n, device="cuda").bfloat16()
        ref = x.double() @ w.double().T
        mine = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        gemv(x, w, mine, ws, *TILES[shape])
        theirs = SHIPPED[0](x, w, ws)
        out[f"{n}x{k} plain"] = {"gluon": float((mine.double() - ref).abs().max()),
                                 "shipped": float((theirs.double() - ref).abs().max())}
        r1, r2 = res.clone(), res.clone()
        ws.stats.zero_()
        blocks = gemv(x, w, r1, ws, *TILES[shape], residual=True)
        stats_mine = ws.stats.view(-1, skinny_gemm.MAX_ROWS)[:blocks, 0].sum().item()
        ws.stats.zero_()
        SHIPPED[1](x, w, r2, ws)
        stats_theirs = ws.stats.view(-1, skinny_gemm.MAX_ROWS)[:, 0].sum().item()
        refr = ref + res.double()
        out[f"{n}x{k} residual"] = {"gluon": float((r1.double() - refr).abs().max()),
                                    "shipped": float((r2.double() - refr).abs().max()),
                                    "gluon vs shipped": float((r1.double() - r2.double()).abs().max()),
                                    "stats": [stats_mine, stats_theirs,
                                              float((r1.float() ** 2).sum())]}
        torch.cuda.synchronize()
    for key, value in out.items():
        print(key, value, flush=True)
    return out


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    checked = check_kernel()
    variants = {"main": set(), "o_proj gluon": {O_PROJ}, "qkv gluon": {QKV},
                "both gluon": {O_PROJ, QKV}}
    probe_switches((1,), variants, route, set(), LAYERS, out_path,
                   extra=lambda timer, bucket: {"kernel": checked})


if __name__ == "__main__":
    main()
