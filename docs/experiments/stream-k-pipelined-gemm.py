"""Stand-alone experiment behind docs/benchmarks.md, 2026-12-06 (session of 15:23 UTC): a
stream-K skinny GEMM whose programs keep one software pipeline across tile boundaries.

The stream-K of 2026-12-04 (`both-descriptors-gemm.py`) lost everywhere, and its notes name
two causes: each tile segment of a program started its loop, and so its pipeline, again; and
its fix-up was a float32 atomic add per segment. Here each program walks its even share of
the (column tile, K step) iterations in one flat `tl.range` loop (tile = it // K steps), so
the loads of the next tile are in flight while the current one finishes. A segment that is
a whole tile stores it; a partial one writes its float32 sum to a workspace slot and counts
in on its tile's arrival counter, and the last of a tile's segments to arrive adds them in
segment order after its loop (deterministic, like the engine's split-K fix-up) and resets the
counter. Both the count and the merge come after the loop: a barrier or an atomic inside it
stops Triton 3.6 pipelining the loop (compiled for sm_90: one 32 KB weight buffer instead of
one per stage). y[M, N] = x[M, K] @ W[N, K]^T, bf16, weights through a tensor descriptor.

Timed as `engine.bench.gemm_sweep` times (a CUDA graph cycling >= 128 MB of weight copies,
median of the replays, us per call) against cuBLAS and the engine's own tile for that
(shape, rows) from `engine/kernels/skinny_gemm_table.json`, in one process:

    python docs/experiments/stream-k-pipelined-gemm.py            # GPU: writes $OUT/stream-k.json
    TRITON_INTERPRET=1 python docs/experiments/stream-k-pipelined-gemm.py --check   # CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.getcwd())

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _finish(acc, acc_up, out_ptr, tile, nn, mm, mmask, N, stride_om, PAIRED: tl.constexpr):
    """Store one finished [BN, BM] tile; with PAIRED, silu(gate) * up rounded as the engine's
    SwiGLU epilogue rounds it."""
    dtype = out_ptr.dtype.element_ty
    if PAIRED:
        g = acc.to(dtype).to(tl.float32)
        u = acc_up.to(dtype).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u
    else:
        y = acc
    n = tile * nn.shape[0] + nn
    tl.store(out_ptr + mm[None, :] * stride_om + n[:, None], y.to(dtype),
             mask=(n[:, None] < N) & mmask[None, :])


@triton.jit
def sk_flat_kernel(w_desc, x_desc, x_ptr, out_ptr, part_ptr, count_ptr, M, N, stride_xm,
                   stride_om, KITERS, TOTAL, PROGS, MAXSEG,
                   BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
                   STAGES: tl.constexpr, X_TMA: tl.constexpr, PAIRED: tl.constexpr,
                   UPCAST: tl.constexpr, PDL: tl.constexpr):
    # PAIRED: w is [gate | up] with N rows each; the output is [M, N] = silu(gate) * up.
    pid = tl.program_id(0)
    start = pid * TOTAL // PROGS
    end = (pid + 1) * TOTAL // PROGS
    nn = tl.arange(0, BN)
    mm = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    x_rows = x_ptr + mm[:, None] * stride_xm
    mmask = mm < M
    slot_size = BN * BM * (2 if PAIRED else 1)
    part_tile = nn[:, None] * BM + mm[None, :]
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BN, BM], tl.float32)
    acc_up = tl.zeros([BN, BM], tl.float32)
    for it in tl.range(start, end, num_stages=STAGES):
        tile = it // KITERS
        ki = it - tile * KITERS
        w = w_desc.load([tile * BN, ki * BK])
        if X_TMA:
            x = x_desc.load([0, ki * BK])
        else:
            x = tl.load(x_rows + (ki * BK + kk)[None, :], mask=mmask[:, None], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
        if PAIRED:
            u = w_desc.load([N + tile * BN, ki * BK])
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = tl.dot(u, tl.trans(x), acc_up)
        tile_begin = tile * KITERS
        tile_end = tile_begin + KITERS
        # No barrier or atomic in this loop: either stops Triton pipelining it. A partial
        # segment's sum goes to its slot here; the counting is after the loop.
        if (it == tile_end - 1) | (it == end - 1):
            if (tile_begin >= start) & (it == tile_end - 1):  # the whole tile was this program's
                _finish(acc, acc_up, out_ptr, tile, nn, mm, mmask, N, stride_om, PAIRED)
            else:
                first_p = ((tile_begin + 1) * PROGS - 1) // TOTAL
                slot = part_ptr + (tile * MAXSEG + pid - first_p) * slot_size + part_tile
                tl.store(slot, acc)
                if PAIRED:
                    tl.store(slot + BN * BM, acc_up)
            acc = tl.zeros([BN, BM], tl.float32)
            acc_up = tl.zeros([BN, BM], tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.debug_barrier()  # every thread's partial stores before the counts below
    # Only a program's first and last segments can be partial tiles; count in on each and
    # merge the tiles this program completed, in segment order.
    first_tile = start // KITERS
    last_tile = (end - 1) // KITERS
    for f in tl.static_range(2):
        tile = first_tile if f == 0 else last_tile
        tile_begin = tile * KITERS
        tile_end = tile_begin + KITERS
        partial = (tile_begin < start) | (tile_end > end)
        if f == 1:
            partial = partial & (last_tile != first_tile)
        if partial:
            first_p = ((tile_begin + 1) * PROGS - 1) // TOTAL
            last_p = (tile_end * PROGS - 1) // TOTAL
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == last_p - first_p:
                total = tl.zeros([BN, BM], tl.float32)
                total_up = tl.zeros([BN, BM], tl.float32)
                for s in range(0, last_p - first_p + 1):
                    slot = part_ptr + (tile * MAXSEG + s) * slot_size + part_tile
                    total += tl.load(slot, cache_modifier=".cg")
                    if PAIRED:
                        total_up += tl.load(slot + BN * BM, cache_modifier=".cg")
                _finish(total, total_up, out_ptr, tile, nn, mm, mmask, N, stride_om, PAIRED)
                tl.store(count_ptr + tile, 0)


def segments(total: int, progs: int, kiters: int) -> int:
    """Most programs that share one tile (the workspace's slots per tile)."""
    most = 0
    for tile in range(total // kiters):
        first = ((tile * kiters + 1) * progs - 1) // total
        last = (((tile + 1) * kiters) * progs - 1) // total
        most = max(most, last - first + 1)
    return most


class StreamK:
    """One stream-K launch shape over an [N, K] weight and its workspace."""

    def __init__(self, n, k, bn, bk, progs, stages, warps, device, x_tma=False, paired=False):
        self.x_tma, self.paired = x_tma, paired
        if k % bk:
            raise ValueError(f"K {k} not a multiple of block_k {bk}")
        self.n, self.k, self.bn, self.bk, self.stages, self.warps = n, k, bn, bk, stages, warps
        self.kiters = k // bk
        self.total = triton.cdiv(n, bn) * self.kiters
        self.progs = min(progs, self.total)
        self.maxseg = segments(self.total, self.progs, self.kiters)
        tiles = triton.cdiv(n, bn)
        self.part = torch.empty(tiles * self.maxseg * bn * 64 * (2 if paired else 1),
                                dtype=torch.float32, device=device)
        self.counters = torch.zeros(tiles, dtype=torch.int32, device=device)

    def __call__(self, x, w, out):
        m = x.shape[0]
        bm = max(16, triton.next_power_of_2(m))
        desc = TensorDescriptor.from_tensor(w, [self.bn, self.bk])
        pdl = (not INTERPRETED) and x.is_cuda
        x_desc = TensorDescriptor.from_tensor(x, [bm, self.bk]) if self.x_tma else None
        sk_flat_kernel[(self.progs,)](
            desc, x_desc, x, out, self.part, self.counters, m, self.n, x.stride(0),
            out.stride(0),
            self.kiters, self.total, self.progs, self.maxseg,
            BN=self.bn, BK=self.bk, BM=bm, STAGES=self.stages, X_TMA=self.x_tma,
            PAIRED=self.paired,
            UPCAST=INTERPRETED, PDL=pdl, num_warps=self.warps,
            **({"launch_pdl": True} if pdl else {}))
        return out


def reference(x, w, paired):
    """float64 x @ w^T; with `paired`, silu(gate) * up of w = [gate | up], gate, up and silu
    rounded to x's dtype as the kernels round them."""
    y = x.double() @ w.double().T
    if not paired:
        return y
    gate, up = (h.to(x.dtype).double() for h in y.chunk(2, dim=-1))
    return torch.nn.functional.silu(gate).to(x.dtype).double() * up


def check_cpu():
    """Interpreter check on small shapes: every tile split unevenly, against float64."""
    torch.manual_seed(0)
    cases = [(96, 256, 3, 32, 64, 5), (64, 512, 1, 32, 64, 7), (100, 256, 8, 32, 32, 9),
             (64, 128, 17, 16, 32, 3), (64, 256, 2, 64, 64, 2)]
    for (n, k, m, bn, bk, progs), x_tma, paired in itertools.product(cases, [False, True],
                                                                      [False, True]):
        sk = StreamK(n, k, bn, bk, progs, 2, 4, "cpu", x_tma, paired)
        x = torch.randn(m, k, dtype=torch.bfloat16)
        w = torch.randn(n * (2 if paired else 1), k, dtype=torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        ref = reference(x, w, paired)
        for _ in range(2):  # the counters must be back at zero for the second launch
            sk(x, w, out)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, (n, k, m, bn, bk, progs, x_tma, paired, err)
            assert int(sk.counters.abs().sum()) == 0
        print(f"N={n} K={k} M={m} block {bn}x{bk} x_tma {x_tma} paired {paired} programs "
              f"{sk.progs} (<= {sk.maxseg} per tile): rel err {err:.1e}, counters reset")


SHAPES = [("o_proj", 2560, 4096, False), ("down", 2560, 9728, False),
          ("qkv", 6144, 2560, False), ("gate_up + SwiGLU", 9728, 2560, True)]
"""Qwen3-4B's decode GEMMs: (name, output features, K, [gate | up] weight)."""
ROWS = [1, 8, 32, 64]


def space(paired: bool, m: int) -> list[tuple]:
    """(block_n, block_k, programs, stages, x_tma) to time: x_tma only where M >= 32; a paired
    launch loads two weight tiles a step, so it takes K steps of 64 and 128."""
    return list(itertools.product([32, 64], [64, 128] if paired else [128, 256], [132, 264],
                                  [3, 4], [False, True] if m >= 32 else [False]))


def run_gpu(out_path, repeats=20):
    from engine.bench.gemm_sweep import COPIES_BYTES, time_graph
    from engine.kernels import fused
    from engine.kernels import skinny_gemm as sg

    table = sg.load_table()
    ws = sg.Workspace("cuda", max_n=19456 * 2, max_split=8, max_blocks=1024)
    results = {"device": torch.cuda.get_device_name(), "repeats": repeats, "shapes": []}
    torch.manual_seed(0)
    for name, n, k, paired in SHAPES:
        rows_w = n * (2 if paired else 1)
        copies = max(2, -(-COPIES_BYTES // (rows_w * k * 2)))
        weights = [torch.randn(rows_w, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                   for _ in range(copies)]

        def cublas(x, w):
            y = torch.nn.functional.linear(x, w)
            return fused.silu_mul(y) if paired else y

        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = reference(x, weights[0], paired).float()
            row = {"shape": name, "N": n, "K": k, "M": m, "paired": paired}
            row["cublas_us"] = time_graph(lambda: [cublas(x, w) for w in weights],
                                          repeats) * 1e3 / copies
            tile = sg.choose(table, rows_w, k, paired, m)
            row["engine_tile"] = tile.__dict__ if tile else None
            if tile:
                row["engine_us"] = time_graph(
                    lambda: [sg.skinny_gemm(x, w, ws, tile, swiglu=paired, out=out)
                             for w in weights], repeats) * 1e3 / copies
            row["stream_k"] = []
            for bn, bk, progs, stages, x_tma in space(paired, m):
                entry = {"block_n": bn, "block_k": bk, "programs": progs, "stages": stages,
                         "x_tma": x_tma}
                try:
                    sk = StreamK(n, k, bn, bk, progs, stages, 4, "cuda", x_tma, paired)
                    sk(x, weights[0], out)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        raise AssertionError(f"relative error {err}")
                    first = out.clone()
                    sk(x, weights[0], out)
                    if not torch.equal(first, out):
                        raise AssertionError("two launches differ")
                    entry["us"] = time_graph(lambda: [sk(x, w, out) for w in weights],
                                             repeats) * 1e3 / copies
                except Exception as exc:  # noqa: BLE001 - a setting that fails is recorded
                    entry["error"] = str(exc)[:200]
                row["stream_k"].append(entry)
            timed = [e for e in row["stream_k"] if "us" in e]
            best = min(timed, key=lambda e: e["us"]) if timed else None
            row["best"] = best
            row["floor_us_at_4.15"] = rows_w * k * 2 / 4.15e12 * 1e6
            print(f"{name} M={m}: cublas {row['cublas_us']:.2f} engine "
                  f"{row.get('engine_us', float('nan')):.2f} stream-K "
                  f"{best['us'] if best else float('nan'):.2f} {best}", flush=True)
            results["shapes"].append(row)
            with open(out_path, "w") as f:  # after every row: a call cut short keeps the rest
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="interpreter check on the CPU")
    args = parser.parse_args()
    if args.check:
        check_cpu()
    else:
        run_gpu(os.path.join(os.environ.get("OUT", "."), "stream-k.json"))
