"""Probe: do TMA weight loads (Hopper's bulk tensor copy) read a decode GEMM's weight faster
than the skinny GEMM's pointer loads?  Times, per weight shape and row count, in CUDA graphs
over >= 128 MB of weight copies (as `engine.bench.gemm_sweep`):

    skinny:   `skinny_gemm` at stages 3 and 6 and 4 or 8 warps (the sweep's stages were 4);
    tma:      x @ W^T with W (and x) read through tensor descriptors;
    tma_swap: W @ x^T (the weight's rows are the MMA's M side, x's rows its N side).

Split-K variants of the TMA kernels write one float32 partial per split and do not reduce
them (the probe measures the weight read, not a fix-up).

    python -m engine.bench.tma_probe --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from engine.bench.gemm_sweep import COPIES_BYTES, MAX_REPEATS, time_graph
from engine.bench.options import (BenchArgError, check_output_path, check_range, check_switches,
                                  cuda_missing, parse_int_list)
from engine.kernels.skinny_gemm import MAX_ROWS, TileConfig, Workspace, skinny_gemm

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

SHAPES = {  # name: (N, K, swiglu)
    "4b qkv": (6144, 2560, False), "4b o_proj": (2560, 4096, False),
    "4b gate_up": (19456, 2560, True), "4b down": (2560, 9728, False),
    "0.6b gate_up": (6144, 1024, True), "0.6b down": (1024, 3072, False),
}

if triton is not None:
    @triton.jit
    def _tma_kernel(x_desc, w_desc, part_ptr, M, N, K_SPLIT, SWAP: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        k_begin = pid_k * K_SPLIT
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(k_begin, k_begin + K_SPLIT, BLOCK_K):
            xt = x_desc.load([0, k0])
            wt = w_desc.load([n0, k0])
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            if SWAP:
                acc = tl.dot(wt, xt.T, acc)
            else:
                acc = tl.dot(xt, wt.T, acc)
        m = tl.arange(0, BLOCK_M)
        n = n0 + tl.arange(0, BLOCK_N)
        base = part_ptr + pid_k * M * N
        if SWAP:
            tl.store(base + m[None, :] * N + n[:, None], acc,
                     mask=(m[None, :] < M) & (n[:, None] < N))
        else:
            tl.store(base + m[:, None] * N + n[None, :], acc,
                     mask=(m[:, None] < M) & (n[None, :] < N))


def tma_launch(x, w, part, block_n, block_k, split, warps, stages, swap):
    M, K = x.shape
    N = w.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    k_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    xd = TensorDescriptor.from_tensor(x, [block_m, block_k])
    wd = TensorDescriptor.from_tensor(w, [block_n, block_k])
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, k_split))
    _tma_kernel[grid](xd, wd, part, M, N, k_split, SWAP=swap, UPCAST=_INTERPRETED, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def probe_shape(name, n, k, swiglu, rows, repeats, log):
    dev = "cuda"
    copies = max(2, -(-COPIES_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k ** 0.5 for _ in range(copies)]
    workspace = Workspace(dev, n, 8, n // 16)
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        ref = torch.nn.functional.linear(x.float(), ws[0].float())
        part = torch.empty(8 * m * n, dtype=torch.float32, device=dev)

        def record(kind, cfg, fn, check=None):
            try:
                if check is not None:
                    check()
                us = time_graph(lambda: [fn(w) for w in ws], repeats) * 1e3 / copies
            except Exception as exc:  # noqa: BLE001 - a config that fails is recorded
                results.append(dict(shape=name, M=m, kind=kind, cfg=cfg, error=str(exc)[:160]))
                return
            gbps = n * k * 2 / us / 1e3
            results.append(dict(shape=name, M=m, kind=kind, cfg=cfg, us=us, GBps=gbps))

        record("cublas", {}, lambda w: torch.nn.functional.linear(x, w))
        for bn, bk, sk, nw, st in itertools.product((32, 64), (128, 256), (1, 2, 4), (4, 8),
                                                    (3, 6)):
            cfg = TileConfig(bn, bk, sk, nw, st)
            record("skinny", cfg.__dict__,
                   lambda w, cfg=cfg: skinny_gemm(x, w, workspace, cfg, swiglu=swiglu))
        for swap, bn, bk, sk, nw, st in itertools.product((False, True), (64, 128), (128, 256),
                                                          (1, 2, 4), (4, 8), (3, 5)):
            cfg = dict(block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=st)

            def check(cfg=cfg, swap=swap):
                part.zero_()
                tma_launch(x, ws[0], part, bn, bk, sk, nw, st, swap)
                y = part.view(8, m, n)[:cfg["split_k"]].sum(0)
                err = ((y - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    raise AssertionError(f"relative error {err}")

            record("tma_swap" if swap else "tma", cfg,
                   lambda w, cfg=cfg, swap=swap: tma_launch(x, w, part, bn, bk, sk, nw, st,
                                                            swap), check)
        for kind in ("cublas", "skinny", "tma", "tma_swap"):
            best = min((r for r in results if r["M"] == m and r["shape"] == name
                        and r["kind"] == kind and "us" in r), key=lambda r: r["us"],
                       default=None)
            if best:
                log(f"{name} M={m} {kind:8s} {best['us']:7.2f} us {best['GBps']:6.0f} GB/s "
                    f"{best['cfg']}")
    return results


def main(argv=None) -> int:
    from engine.cli_args import integer
    from lockstep.cli import OneLineParser

    p = OneLineParser(prog="python -m engine.bench.tma_probe", error_name="tma_probe",
                      description=__doc__.split("\n\n")[0].split(" Times,")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma-separated weight shapes to time, from: {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,8",
                   help=f"comma-separated row counts M (1..{MAX_ROWS})")
    p.add_argument("--repeats", type=integer, default=50,
                   help=f"graph replays per timing (1..{MAX_REPEATS}); the median is reported")
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args(argv)
    try:  # every argument before the GPU is touched
        rows = parse_int_list(args.rows, "--rows")
        for m in rows:
            check_range("--rows", m, 1, MAX_ROWS)
        check_range("--repeats", args.repeats, 1, MAX_REPEATS)
        shapes = [x.strip() for x in args.shapes.split(",")]
        unknown = [x for x in shapes if x not in SHAPES]
        if unknown:
            raise BenchArgError(f"--shapes {args.shapes!r}: unknown shape {unknown[0]!r}; "
                                f"choose from {', '.join(SHAPES)}")
        if args.json is not None:
            check_output_path("--json", args.json)
        check_switches()
    except BenchArgError as exc:
        print(f"tma_probe: error: {exc}", file=sys.stderr)
        return 2
    if cuda_missing("tma_probe"):
        return 2
    out = []
    for name in shapes:
        out += probe_shape(name, *SHAPES[name], rows, args.repeats,
                           lambda s: print(s, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
