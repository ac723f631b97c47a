"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M (rows of the bucket) <= 64.

At decode batch sizes a linear layer is a weight read: M x N x K multiply-adds over N x K
weights, so the time is the weight bytes over the read bandwidth. cuBLAS's kernels for
M = 1..64 read the weights at 63-83% of the H200's bandwidth and split K with a separate
reduce launch (docs/benchmarks.md). This kernel reads each weight tile once, streams K in
BLOCK_K chunks, and when N alone gives too few programs to fill the GPU splits K over
SPLIT_K programs whose fp32 partial sums the last-arriving program of each column block adds
in a fixed order (a serial fix-up: deterministic, no second launch). An optional SwiGLU
epilogue computes silu(gate) * up of a fused [gate | up] weight in the same launch, so the
MLP's activation costs no launch of its own; the same pairing of two accumulators gives a QKV
launch whose programs each hold one head's two rotate-half halves and do the q/k RMSNorm, RoPE
and KV-cache write in the epilogue (`skinny_gemm_qkv_rope`), and on the short path may also
attend in its tail (`AttendTail`). At 1-8 rows a tile may instead
do its products as multiply-adds on the CUDA cores (`TileConfig.gemv`): no 16-row padding, and
tiles narrower than a tensor-core tile, so a small weight spreads over more programs without a
K split.

    `skinny_gemm(x, w, plan, swiglu=False)`   the Triton kernel (CUDA).
    `skinny_gemm_torch(x, w, swiglu=False)`   the same function in torch (CPU path, oracle).
    `skinny_gemm_qkv_rope(x, w, ws, tile, rope)`   QKV with the q/k norm + RoPE + KV write.

Graph safety (I12): the kernel reads no host value that changes between steps; the split-K
partials and arrival counters live in a `Workspace` allocated before capture, and the last
program of each column block resets its counter (the last program of each kv head's group
its group counter, with `AttendTail`), so every replay starts from zeros. An `AttendTail`'s
lengths are the engine's fixed `seq_lens` buffer, which each step rewrites in place.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import MISSING, dataclass

import torch

from engine.kernels.pdl import pdl_launch
from lockstep.args import one_line_repr

try:  # Triton is optional on CPU-only machines; the torch path needs none of it.
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) returns garbage for a bfloat16
# tl.dot with a float32 accumulator (triton 3.6); there the kernel upcasts its tiles first.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Rows a skinny GEMM serves; larger M goes to cuBLAS (compute, not the weight read, bounds it).
MAX_ROWS = 64


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one skinny GEMM: output features per program (block_n), K per inner
    iteration (block_k), programs along K (split_k), warps and software-pipeline stages;
    `tma`: the weight tiles come through a tensor descriptor; `x_tma` (only with `tma`): the
    activation tiles too, [rows, block_k] per bulk copy instead of per-thread loads (at 32-64
    rows an activation tile is as many bytes as a 64-row weight tile); `gemv`: the products
    as multiply-adds on the CUDA cores, each tile's sums over K reduced in registers, instead
    of a tensor-core `tl.dot` padded to 16 rows, so a tile may be narrower than 16 features
    and a program's rows of x are not padded (at most GEMV_MAX_ROWS rows)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False
    x_tma: bool = False
    gemv: bool = False

    def __post_init__(self):
        """Raises ValueError naming the first field that is not a positive int, or not a power
        of two where Triton needs one (block_n and block_k are `tl.arange` lengths; num_warps
        a warp count), or a `tma` that is not a bool or whose tile a tensor descriptor cannot
        hold (at most TMA_MAX_BOX rows and columns, at least 16 of each), an `x_tma`
        without `tma`, a `gemv` that is not a bool or a `gemv` with `x_tma`: a table or plans
        file from elsewhere is checked on load, before any launch divides by it or compiles
        it."""
        for name in ("block_n", "block_k", "split_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"tile {name} {value!r}: expected a positive integer")
            if name in ("block_n", "block_k", "num_warps") and value & (value - 1):
                raise ValueError(f"tile {name} {value}: expected a power of two")
        for name in ("tma", "x_tma", "gemv"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"tile {name} {getattr(self, name)!r}: expected true or false")
        if self.x_tma and not self.tma:
            raise ValueError("tile x_tma true with tma false: the activation's descriptor "
                             "tiles feed the weight-descriptor (tma) form of the kernel")
        if self.gemv and self.x_tma:
            raise ValueError("tile gemv true with x_tma true: a gemv tile's rows of x are not "
                             "padded to the 16 a tensor-descriptor tile of x needs")
        if self.tma and not (16 <= self.block_n <= TMA_MAX_BOX
                             and 16 <= self.block_k <= TMA_MAX_BOX):
            raise ValueError(f"tile block_n {self.block_n} x block_k {self.block_k} with tma: "
                             f"a tensor descriptor's tile is 16..{TMA_MAX_BOX} on each side")


TMA_MAX_BOX = 256
"""Most elements along one side of a tensor-descriptor (TMA) tile (the hardware's box limit)."""

GEMV_MAX_ROWS = 8
"""Most rows a `gemv` tile serves: its products are rows x block_n x block_k multiply-adds per
tile on the CUDA cores, which past a few rows cost more than the weight read they overlap."""


def default_config(n_out: int, k: int, sms: int = 132) -> TileConfig:
    """Heuristic tile for an [n_out, k] weight read: the fewest K splits that give at least
    two programs per SM (`sms` streaming multiprocessors), each split at least 4 x block_k long.

    Args:
        n_out: output features the kernel writes (for SwiGLU, the width after the product).
        k: reduction length. sms: the GPU's SM count (132 on an H200).
    """
    block_n = 32 if n_out >= 8 * sms * 32 else 16
    block_k = 256
    blocks = -(-n_out // block_n)
    split = 1
    while blocks * split < 2 * sms and k // (split * 2) >= 4 * block_k and split < 8:
        split *= 2
    return TileConfig(block_n, block_k, split)


class Workspace:
    """Split-K partial sums and per-column-block arrival counters of one device.

    One workspace serves every skinny GEMM of a model: launches on one stream run one after
    another and each leaves its counters at zero.

    It also holds the row statistics (`RowStats`) a residual launch leaves for the next norm:
    `stats`, float32 [max_blocks * MAX_ROWS], sums of squares at [block * MAX_ROWS + row]; and
    `group_counters`, int32 [max_blocks], the arrivals per kv head of a QKV launch that
    attends in its tail (`AttendTail`; every launch leaves them at zero).

    Args:
        device: CUDA device. max_n: widest partial row any launch writes (2 x width for a
            SwiGLU launch). max_split: most K splits. max_blocks: most column blocks.
    Raises:
        torch.OutOfMemoryError: allocation failed (before any capture).
    """

    def __init__(self, device: torch.device | str, max_n: int, max_split: int,
                 max_blocks: int):
        self.max_n, self.max_split, self.max_blocks = max_n, max_split, max_blocks
        self.partials = torch.empty(max_split * MAX_ROWS * max_n, dtype=torch.float32,
                                    device=device)
        self.counters = torch.zeros(max_blocks, dtype=torch.int32, device=device)
        self.group_counters = torch.zeros(max_blocks, dtype=torch.int32, device=device)
        self.stats = torch.zeros(max_blocks * MAX_ROWS, dtype=torch.float32, device=device)

    def fits(self, n: int, split: int, blocks: int) -> bool:
        """Whether a launch of `split` K splits writing `n` partial columns fits."""
        return n <= self.max_n and split <= self.max_split and blocks <= self.max_blocks


def skinny_gemm_torch(x: torch.Tensor, w: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """x: [M, K], w: [N, K] (same dtype) -> [M, N] = x @ w^T in x's dtype; with `swiglu`,
    w is [gate | up] ([2I, K]) and the result [M, I] = silu(gate) * up, silu rounded to the
    dtype before the product (as `engine.kernels.fused.silu_mul`)."""
    y = torch.nn.functional.linear(x, w)
    if not swiglu:
        return y
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


if triton is not None:

    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, stats_ptr, M, N_OUT,
                            K, HALF, stride_xm, stride_wn, stride_om, STATS_IN, eps,
                            SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SPLIT_K: tl.constexpr, K_SPLIT,
                            NORM_IN: tl.constexpr, STATS_BLOCK: tl.constexpr,
                            RESIDUAL: tl.constexpr, STATS_STRIDE: tl.constexpr,
                            UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                            ONE_TILE: tl.constexpr, PAIRED: tl.constexpr,
                            ROW_STEP: tl.constexpr, GEMV: tl.constexpr, ROW_ACC: tl.constexpr,
                            qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, pt_ptr, kc_ptr,
                            vc_ptr, stride_cos, stride_pt, stride_kp, stride_kt, stride_kh,
                            stride_qh, qk_eps, HEADS: tl.constexpr, NQ: tl.constexpr,
                            NKV: tl.constexpr, PAGE: tl.constexpr,
                            w_desc, TMA: tl.constexpr, x_desc, X_TMA: tl.constexpr,
                            o_ptr, lens_ptr, group_count_ptr, stride_ob, scale,
                            ATTEND: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_T: tl.constexpr):
        # PAIRED: two accumulators over weight rows n and n + HALF (SwiGLU's gate and up, or
        # HEADS' two rotate-half halves of head pid_n, whose rows start at pid_n * ROW_STEP).
        # TMA: the weight tiles come through the tensor descriptor w_desc (Hopper's bulk copy,
        # zeros past its edges) as [BLOCK_N, BLOCK_K], and the products are W @ x^T, the
        # weight's rows on the MMA's M side; the accumulators are transposed after the loop.
        # X_TMA (with TMA): x's [BLOCK_M, BLOCK_K] tiles through x_desc as well, transposed.
        # ATTEND (with HEADS): the last program of each kv head's group to finish its head
        # attends the group's query heads over the row's one tile of cached tokens.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        row0 = pid_n * ROW_STEP
        n = row0 + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        mmask = m < M
        nmask = n < N_OUT
        if TMA:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn
        x_rows = x_ptr + m[:, None] * stride_xm
        x_cols = x_ptr + m[None, :] * stride_xm
        k_begin = pid_k * K_SPLIT
        if ONE_TILE:
            # This program's whole K range is one tile: its weights (written at load, never by
            # the launch just before: engine.kernels.pdl) are loaded before the PDL wait,
            # behind the previous kernel's tail.
            k = k_begin + kk
            kmask = k < K
            if TMA:
                wt = w_desc.load([row0, k_begin])
                ut = wt
                if PAIRED:
                    ut = w_desc.load([row0 + HALF, k_begin])
            else:
                wt = tl.load(w_cols + k[:, None], mask=kmask[:, None] & nmask[None, :],
                             other=0.0)
                ut = wt
                if PAIRED:
                    ut = tl.load(w_cols + HALF * stride_wn + k[:, None],
                                 mask=kmask[:, None] & nmask[None, :], other=0.0)
        if HEADS:
            # the epilogue's per-row inputs: the step's positions, slots and page-table entries
            # (written two or more launches back, read through L2), the norm weights and the
            # cos/sin rows (written at load); see engine.kernels.pdl
            hd = tl.arange(0, BLOCK_N)
            pos = tl.load(pos_ptr + m, mask=mmask, other=0, cache_modifier=".cg").to(tl.int64)
            slot = tl.load(slot_ptr + m, mask=mmask, other=0, cache_modifier=".cg").to(tl.int64)
            page = tl.load(pt_ptr + slot * stride_pt + pos // PAGE, mask=mmask, other=0,
                           cache_modifier=".cg").to(tl.int64)
            is_q = pid_n < NQ
            w_lo = tl.where(is_q, tl.load(qw_ptr + hd).to(tl.float32),
                            tl.load(kw_ptr + hd).to(tl.float32))
            w_hi = tl.where(is_q, tl.load(qw_ptr + BLOCK_N + hd).to(tl.float32),
                            tl.load(kw_ptr + BLOCK_N + hd).to(tl.float32))
            rows = pos[:, None] * stride_cos + hd[None, :]
            c_lo = tl.load(cos_ptr + rows, mask=mmask[:, None], other=0.0)
            c_hi = tl.load(cos_ptr + rows + BLOCK_N, mask=mmask[:, None], other=0.0)
            s_lo = tl.load(sin_ptr + rows, mask=mmask[:, None], other=0.0)
            s_hi = tl.load(sin_ptr + rows + BLOCK_N, mask=mmask[:, None], other=0.0)
        if PDL:  # nothing before this line reads memory another kernel writes
            tl.extra.cuda.gdc_wait()
        # the epilogues' inputs are loaded before the main loop and used after it, so that
        # their latency hides behind the weight loads instead of following them
        ss = tl.zeros([STATS_BLOCK, BLOCK_M], tl.float32)
        if NORM_IN:
            b = tl.arange(0, STATS_BLOCK)
            ss = tl.load(stats_ptr + b[:, None] * STATS_STRIDE + m[None, :],
                         mask=(b[:, None] < STATS_IN) & mmask[None, :], other=0.0)
        res = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if RESIDUAL:  # only this column block's fix-up program writes it, after every load
            res = tl.load(out_ptr + m[:, None] * stride_om + n[None, :],
                          mask=mmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        if ONE_TILE and TMA:
            if X_TMA:
                xt = tl.trans(x_desc.load([0, k_begin]))
            else:
                xt = tl.load(x_cols + k[:, None], mask=kmask[:, None] & mmask[None, :],
                             other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
                ut = ut.to(tl.float32)
            acc += _dot(wt, xt, IEEE, GEMV)
            if PAIRED:
                acc_up += _dot(ut, xt, IEEE, GEMV)
        elif ONE_TILE:
            xt = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
                ut = ut.to(tl.float32)
            acc += _dot(xt, wt, IEEE, GEMV)
            if PAIRED:
                acc_up += _dot(xt, ut, IEEE, GEMV)
        elif TMA:
            for k0 in range(k_begin, k_begin + K_SPLIT, BLOCK_K):
                if X_TMA:
                    xt = tl.trans(x_desc.load([0, k0]))
                else:
                    k = k0 + kk
                    kmask = k < K
                    xt = tl.load(x_cols + k[:, None], mask=kmask[:, None] & mmask[None, :],
                                 other=0.0)
                wt = w_desc.load([row0, k0])
                if UPCAST:
                    xt = xt.to(tl.float32)
                    wt = wt.to(tl.float32)
                acc += _dot(wt, xt, IEEE, GEMV)
                if PAIRED:
                    ut = w_desc.load([row0 + HALF, k0])
                    if UPCAST:
                        ut = ut.to(tl.float32)
                    acc_up += _dot(ut, xt, IEEE, GEMV)
        else:
            # ROW_ACC (a gemv tile of one row): the [BLOCK_K, BLOCK_N] products accumulate
            # across the loop in the weight tile's layout and are summed over K once after it,
            # instead of a reduction across the program's threads per tile
            acc_k = tl.zeros([BLOCK_K if ROW_ACC else 1, BLOCK_N], tl.float32)
            acc_k_up = tl.zeros([BLOCK_K if ROW_ACC else 1, BLOCK_N], tl.float32)
            for k0 in range(k_begin, k_begin + K_SPLIT, BLOCK_K):
                k = k0 + kk
                kmask = k < K
                xt = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :],
                             other=0.0)
                wt = tl.load(w_cols + k[:, None], mask=kmask[:, None] & nmask[None, :],
                             other=0.0)
                if UPCAST:
                    xt = xt.to(tl.float32)
                    wt = wt.to(tl.float32)
                if ROW_ACC:
                    acc_k += wt.to(tl.float32) * tl.trans(xt.to(tl.float32))
                else:
                    acc += _dot(xt, wt, IEEE, GEMV)
                if PAIRED:
                    ut = tl.load(w_cols + HALF * stride_wn + k[:, None],
                                 mask=kmask[:, None] & nmask[None, :], other=0.0)
                    if UPCAST:
                        ut = ut.to(tl.float32)
                    if ROW_ACC:
                        acc_k_up += ut.to(tl.float32) * tl.trans(xt.to(tl.float32))
                    else:
                        acc_up += _dot(xt, ut, IEEE, GEMV)
            if ROW_ACC:
                acc += tl.sum(acc_k, axis=0)[None, :]
                acc_up += tl.sum(acc_k_up, axis=0)[None, :]
        if TMA:
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
        if PDL:  # the next kernel may start launching; it waits for this grid's completion
            tl.extra.cuda.gdc_launch_dependents()
        if SPLIT_K > 1:
            # Serial fix-up: publish this split's partials, count arrivals; the last program of
            # the column block sums every split in order 0..SPLIT_K-1 (deterministic).
            width = N_OUT * (2 if SWIGLU else 1)
            part = part_ptr + (pid_k * BLOCK_M + m)[:, None] * width + n[None, :]
            tl.store(part, acc, mask=mmask[:, None] & nmask[None, :])
            if PAIRED:
                tl.store(part + HALF, acc_up, mask=mmask[:, None] & nmask[None, :])
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT_K):
                    p = part_ptr + (s * BLOCK_M + m)[:, None] * width + n[None, :]
                    acc += tl.load(p, mask=mmask[:, None] & nmask[None, :], other=0.0,
                                   cache_modifier=".cg")
                    if PAIRED:
                        acc_up += tl.load(p + HALF, mask=mmask[:, None] & nmask[None, :],
                                          other=0.0, cache_modifier=".cg")
                tl.store(count_ptr + pid_n, 0)
                if HEADS:
                    _heads_epilogue(acc, acc_up, ss, K, eps, out_ptr, kc_ptr, vc_ptr, pid_n, m,
                                    hd, mmask, pos, page, w_lo, w_hi, c_lo, c_hi, s_lo, s_hi,
                                    stride_om, stride_qh, stride_kp, stride_kt, stride_kh,
                                    qk_eps, NORM_IN, NQ, NKV, PAGE, BLOCK_N)
                    if ATTEND:
                        _attend_group_tail(out_ptr, kc_ptr, vc_ptr, pt_ptr, lens_ptr, slot_ptr,
                                           group_count_ptr, o_ptr, pid_n, M, stride_om,
                                           stride_qh, stride_pt, stride_kp, stride_kt,
                                           stride_kh, stride_ob, scale, NQ, NKV, GROUP,
                                           BLOCK_G, 2 * BLOCK_N, PAGE, BLOCK_T, IEEE, UPCAST)
                else:
                    _skinny_epilogue(acc, acc_up, ss, res, K, eps, out_ptr, stats_ptr, pid_n,
                                     m, n, mmask, nmask, stride_om, SWIGLU, NORM_IN, RESIDUAL,
                                     STATS_STRIDE)
        elif HEADS:
            _heads_epilogue(acc, acc_up, ss, K, eps, out_ptr, kc_ptr, vc_ptr, pid_n, m, hd,
                            mmask, pos, page, w_lo, w_hi, c_lo, c_hi, s_lo, s_hi, stride_om,
                            stride_qh, stride_kp, stride_kt, stride_kh, qk_eps, NORM_IN, NQ,
                            NKV, PAGE, BLOCK_N)
            if ATTEND:
                _attend_group_tail(out_ptr, kc_ptr, vc_ptr, pt_ptr, lens_ptr, slot_ptr,
                                   group_count_ptr, o_ptr, pid_n, M, stride_om, stride_qh,
                                   stride_pt, stride_kp, stride_kt, stride_kh, stride_ob,
                                   scale, NQ, NKV, GROUP, BLOCK_G, 2 * BLOCK_N, PAGE, BLOCK_T,
                                   IEEE, UPCAST)
        else:
            _skinny_epilogue(acc, acc_up, ss, res, K, eps, out_ptr, stats_ptr, pid_n, m, n,
                             mmask, nmask, stride_om, SWIGLU, NORM_IN, RESIDUAL, STATS_STRIDE)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr, GEMV: tl.constexpr = False):
        if GEMV:  # [P, K] x [K, Q] as float32 multiply-adds, summed over K in registers
            # one row of x (a is x's [1, K] tile, or, in the TMA form, b is its [K, 1]
            # transpose): products in the weight tile's own layout, no 3-D intermediate
            if a.shape[0] == 1:
                return tl.sum(tl.trans(a.to(tl.float32)) * b.to(tl.float32), axis=0)[None, :]
            if b.shape[1] == 1:
                return tl.sum(a.to(tl.float32) * tl.trans(b.to(tl.float32)), axis=1)[:, None]
            # K last, the weight's contiguous axis, so the loads' layout needs no conversion
            bt = tl.trans(b.to(tl.float32))
            return tl.sum(a.to(tl.float32)[:, None, :] * bt[None, :, :], axis=2)
        if IEEE:  # float32 models: exact products, not TF32
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _one_tile_attention(q, k, v, kmask, scale, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # softmax(q k^T * scale) v over one tile: q [G, D], k and v [T, D] (tokens where kmask
        # is false masked out) -> float32 [G, D]; the probabilities rounded to v's dtype
        if UPCAST:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = _dot(q, tl.trans(k), IEEE) * scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        p = tl.exp(s - tl.max(s, 1)[:, None])
        l = tl.sum(p, 1)
        if UPCAST:
            pv = _dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), IEEE)
        else:
            pv = _dot(p.to(v.dtype), v, IEEE)
        return pv / l[:, None]

    @triton.jit
    def _skinny_epilogue(acc, acc_up, ss, res, K, eps, out_ptr, stats_ptr, pid_n, m, n, mmask,
                         nmask, stride_om, SWIGLU: tl.constexpr, NORM_IN: tl.constexpr,
                         RESIDUAL: tl.constexpr, STATS_STRIDE: tl.constexpr):
        dtype = out_ptr.dtype.element_ty
        mask = mmask[:, None] & nmask[None, :]
        offs = out_ptr + m[:, None] * stride_om + n[None, :]
        if NORM_IN:  # x @ (W * norm_weight)^T scaled per row: the RMSNorm folded in
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        if SWIGLU:
            # the same roundings as cuBLAS output + `fused.silu_mul`: gate and up rounded to
            # the dtype, silu(gate) rounded, then the product
            g = acc.to(dtype).to(tl.float32)
            u = acc_up.to(dtype).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            y = a * u
        else:
            y = acc
        if RESIDUAL:
            # residual <- GEMM output + residual, rounded as `fused.add_rms_norm` rounds them;
            # this block's sum of squares of the new residual is the next norm's partial
            y = (y.to(dtype).to(tl.float32) + res).to(dtype).to(tl.float32)
            tl.store(stats_ptr + pid_n * STATS_STRIDE + m, tl.sum(y * y, axis=1), mask=mmask)
        tl.store(offs, y.to(dtype), mask=mask)

    @triton.jit
    def _heads_epilogue(acc, acc_up, ss, K, eps, out_ptr, kc_ptr, vc_ptr, head, m, hd, mmask,
                        pos, page, w_lo, w_hi, c_lo, c_hi, s_lo, s_hi, stride_om, stride_qh,
                        stride_kp, stride_kt, stride_kh, qk_eps, NORM_IN: tl.constexpr,
                        NQ: tl.constexpr, NKV: tl.constexpr, PAGE: tl.constexpr,
                        HALF: tl.constexpr):
        # acc / acc_up: the two rotate-half halves [BLOCK_M, HALF] of one head's projection.
        # The roundings of the QKV GEMM's output followed by `fused.qk_norm_rope_kv`: the
        # projection to the dtype, the normalised head to the dtype before and after its norm
        # weight, the rotated head to the dtype.
        dtype = out_ptr.dtype.element_ty
        if NORM_IN:
            rstd_in = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            acc = acc * rstd_in[:, None]
            acc_up = acc_up * rstd_in[:, None]
        lo = acc.to(dtype).to(tl.float32)
        hi = acc_up.to(dtype).to(tl.float32)
        mask = mmask[:, None]
        cache_row = page[:, None] * stride_kp + (pos % PAGE)[:, None] * stride_kt + hd[None, :]
        if head < NQ + NKV:
            rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1))
                                 / (2 * HALF) + qk_eps)
            n_lo = ((lo * rstd[:, None]).to(dtype).to(tl.float32) * w_lo[None, :])
            n_lo = n_lo.to(dtype).to(tl.float32)
            n_hi = ((hi * rstd[:, None]).to(dtype).to(tl.float32) * w_hi[None, :])
            n_hi = n_hi.to(dtype).to(tl.float32)
            y_lo = n_lo * c_lo - n_hi * s_lo
            y_hi = n_hi * c_hi + n_lo * s_hi
            if head < NQ:
                q_row = out_ptr + m[:, None] * stride_om + head * stride_qh + hd[None, :]
                tl.store(q_row, y_lo.to(dtype), mask=mask)
                tl.store(q_row + HALF, y_hi.to(dtype), mask=mask)
            else:
                k_row = kc_ptr + cache_row + (head - NQ) * stride_kh
                tl.store(k_row, y_lo.to(dtype).to(kc_ptr.dtype.element_ty), mask=mask)
                tl.store(k_row + HALF, y_hi.to(dtype).to(kc_ptr.dtype.element_ty), mask=mask)
        else:
            v_row = vc_ptr + cache_row + (head - NQ - NKV) * stride_kh
            tl.store(v_row, lo.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(v_row + HALF, hi.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _attend_group_tail(q_ptr, kc_ptr, vc_ptr, pt_ptr, lens_ptr, slot_ptr, count_ptr, o_ptr,
                           head, M, stride_qm, stride_qh, stride_pt, stride_kp, stride_kt,
                           stride_kh, stride_ob, scale, NQ: tl.constexpr, NKV: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
                           UPCAST: tl.constexpr):
        # After this program stored its head (a query head of kv head h's group, K head h or
        # V head h): count the group's GROUP + 2 arrivals; the last attends the group for
        # every row over the row's first BLOCK_T cached tokens, reading the others' q, K and V
        # through L2 (their stores are ordered before their arrival, this load after it).
        kvh = tl.where(head < NQ, head // GROUP, tl.where(head < NQ + NKV, head - NQ,
                                                          head - NQ - NKV))
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + kvh, 1, sem="acq_rel")
        if arrived == GROUP + 1:
            tl.store(count_ptr + kvh, 0)
            d = tl.arange(0, HEAD_DIM)
            g = tl.arange(0, BLOCK_G)
            t = tl.arange(0, BLOCK_T)
            gmask = g < GROUP
            for r in range(M):
                slot = tl.load(slot_ptr + r, cache_modifier=".cg").to(tl.int64)
                length = tl.minimum(tl.load(lens_ptr + slot, cache_modifier=".cg"), BLOCK_T)
                kmask = t < length
                page = tl.load(pt_ptr + slot * stride_pt + t // PAGE, mask=kmask, other=0,
                               cache_modifier=".cg").to(tl.int64)
                qr = tl.load(q_ptr + r * stride_qm + (kvh * GROUP + g)[:, None] * stride_qh
                             + d[None, :], mask=gmask[:, None], other=0.0,
                             cache_modifier=".cg")
                base = (page[:, None] * stride_kp + (t % PAGE)[:, None] * stride_kt
                        + kvh * stride_kh + d[None, :])
                k = tl.load(kc_ptr + base, mask=kmask[:, None], other=0.0, cache_modifier=".cg")
                v = tl.load(vc_ptr + base, mask=kmask[:, None], other=0.0, cache_modifier=".cg")
                o = _one_tile_attention(qr, k, v, kmask, scale, IEEE, UPCAST)
                tl.store(o_ptr + r * stride_ob + (kvh * GROUP + g)[:, None] * HEAD_DIM
                         + d[None, :], o.to(o_ptr.dtype.element_ty), mask=gmask[:, None])


@dataclass(frozen=True)
class RowStats:
    """What `skinny_gemm_add_residual` left in its workspace: for each of its `rows` rows m,
    `partials` float32 partial sums of squares of the new residual row (one per column block,
    at `Workspace.stats.view(-1, MAX_ROWS)[b, m]`), which the next
    `skinny_gemm(..., row_stats=...)` adds up in a fixed order for its RMSNorm. Valid until the
    next residual launch on that workspace."""

    partials: int
    rows: int


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, workspace: Workspace,
                config: TileConfig | None = None, swiglu: bool = False,
                out: torch.Tensor | None = None, row_stats: RowStats | None = None,
                eps: float = 0.0) -> torch.Tensor:
    """Triton skinny GEMM; the same function as `skinny_gemm_torch`.

    With `row_stats`, x is the un-normalised residual stream and w a weight with the RMSNorm
    weight folded in (`fold_norm_weight`): each output row is scaled by
    1 / sqrt(mean(x_m^2) + eps), the mean formed from the partials the producing
    `skinny_gemm_add_residual` left, so the RMSNorm before the GEMM costs no launch.

    Args:
        x: [M, K], M <= MAX_ROWS, last dim contiguous. w: [N, K] contiguous, x's dtype.
        workspace: this device's `Workspace` (its partials when the config splits K, its
            statistics with row_stats).
        config: launch shape (None: `default_config`). swiglu: w is [gate | up].
        out: optional [M, N] (or [M, N / 2] with swiglu) buffer.
        row_stats: the sums of squares of x's rows in the workspace; eps: the norm's epsilon
            (unused without row_stats).
    Returns:
        [M, N] or [M, N / 2] in x's dtype.
    Raises:
        RuntimeError: Triton is not installed.
        ValueError: M above MAX_ROWS (above GEMV_MAX_ROWS for a `gemv` tile), mismatched K,
            a split the workspace cannot hold, or row_stats of another row count.
    """
    n_out = w.shape[0] // 2 if swiglu else w.shape[0]
    if out is None:
        out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    _launch(x, w, out, workspace, config, swiglu, row_stats, eps, residual=False)
    return out


def skinny_gemm_add_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                             workspace: Workspace, config: TileConfig | None = None
                             ) -> RowStats:
    """residual <- x @ w^T + residual, in place, with the sums of squares of the new residual
    rows left in the workspace for the next norm (`RowStats`); one launch.

    Rounds as `skinny_gemm` followed by `engine.kernels.fused.add_rms_norm` does: the product
    to the dtype, then the sum.

    Args:
        x: [M, K], M <= MAX_ROWS, last dim contiguous. w: [N, K] contiguous, x's dtype.
        residual: [M, N] in x's dtype, last dim contiguous; overwritten.
        workspace / config: as `skinny_gemm`.
    Returns:
        RowStats naming how many partials each row's sum has.
    Raises:
        RuntimeError / ValueError: as `skinny_gemm`; ValueError also for a residual of
            another shape or more column blocks than the workspace's stats hold.
    """
    if (tuple(residual.shape) != (x.shape[0], w.shape[0]) or residual.stride(-1) != 1
            or residual.dtype != x.dtype):
        raise ValueError(f"skinny_gemm_add_residual: residual {tuple(residual.shape)} "
                         f"{residual.dtype} for x {tuple(x.shape)} {x.dtype} / w "
                         f"{tuple(w.shape)}")
    return RowStats(_launch(x, w, residual, workspace, config, False, None, 0.0,
                            residual=True), x.shape[0])


@dataclass(frozen=True)
class RopeKV:
    """What `skinny_gemm_qkv_rope`'s epilogue needs of one layer's attention: the arguments of
    `engine.kernels.fused.qk_norm_rope_kv` after its qkv.

    Attributes:
        q_weight, k_weight: [D] per-head norm weights (model dtype).
        cos, sin: float32 [max_position, D] RoPE tables ("rotate half" layout), same strides.
        positions: int [T] token positions. slot_ids: int32 [T].
        page_table: int32 [slots + 1, pages_per_seq]; k_cache, v_cache: one layer's
            [num_pages + 1, page_size, nkv, D] cache, same strides, last dim contiguous.
        nq, nkv: this rank's query and kv heads. eps: the q/k norms' epsilon.
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    page_table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    nq: int
    nkv: int
    eps: float


@dataclass(frozen=True)
class AttendTail:
    """Decode attention in the tail of `skinny_gemm_qkv_rope`, for steps whose every row's
    context holds at most `tile_tokens` tokens (the short path, `protocol.keys.SHORT`): the
    last of a kv head's group of programs (its query heads, its K head, its V head) to store
    its head attends the group's query heads for every row, so attention costs no launch of
    its own and is computed once per (row, kv head). A row with more cached tokens is attended
    over its first `tile_tokens` only: nothing on the device can tell.

    Attributes:
        out: [T, nq * D] attention output, contiguous, in the dtype of the q/k norm weights
            (the model's, as q), the input of o_proj.
        seq_lens: int32, indexed by `RopeKV.slot_ids`: cached tokens per slot, the step's own
            token included, at least 1 for every row's slot (`engine.kernels.decode_attention`'s
            argument; the engine's is max_slots + 2 long).
        scale: softmax scale, usually D ** -0.5.
        tile_tokens: tokens attended per row, a power of two of at least 16 filled by whole
            pages (`check_tile_tokens`).
    """

    out: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    tile_tokens: int


def skinny_gemm_qkv_rope(x: torch.Tensor, w: torch.Tensor, workspace: Workspace,
                         config: TileConfig, rope: RopeKV, row_stats: RowStats | None = None,
                         eps: float = 0.0, out: torch.Tensor | None = None,
                         attend: AttendTail | None = None) -> torch.Tensor:
    """The QKV projection with `fused.qk_norm_rope_kv` as its epilogue, one launch: each
    program's columns are one head's two rotate-half halves, so the head's RMSNorm and RoPE
    need nothing outside the program. Rounds as the two launches do (`skinny_gemm` then
    `qk_norm_rope_kv`), except the head's sum of squares, which adds its halves' sums.

    Args:
        x: [T, K], T <= MAX_ROWS (with row_stats the un-normalised residual, as `skinny_gemm`).
        w: [(nq + 2 nkv) * D, K], rows [q heads | k heads | v heads] (the QKV weight).
        workspace / row_stats / eps: as `skinny_gemm`.
        config: block_n must be D / 2 (one head per column block); block_k, split_k, warps
            and stages as for any tile.
        rope: the layer's norms, tables, step positions and caches (`RopeKV`).
        out: optional [T, nq, D] buffer for q.
        attend: attend in the launch's tail (`AttendTail`), writing attend.out.
    Returns:
        q [T, nq, D], normalised and rotated; K (normalised, rotated) and V are stored at
        page_table[slot, pos // page_size], row pos % page_size of the caches.
    Raises:
        RuntimeError: Triton is not installed.
        ValueError: as `skinny_gemm`; also block_n != D / 2, w's rows not (nq + 2 nkv) * D,
            fewer positions or slots than rows, cos/sin not D wide, caches or tables of
            unequal strides or a strided last dim, or `out` not [T, nq, D] with a contiguous
            last dim; with `attend`, an output that is not [T, nq * D] contiguous in q's
            dtype, a tile that `check_tile_tokens` refuses, kv heads that do not divide nq,
            or more kv heads than the workspace has counters.
    """
    D = rope.q_weight.shape[0]
    if config.block_n * 2 != D or w.shape[0] != (rope.nq + 2 * rope.nkv) * D:
        raise ValueError(f"skinny_gemm_qkv_rope: block_n {config.block_n} and w "
                         f"{tuple(w.shape)} for {rope.nq} + 2 x {rope.nkv} heads of {D}: "
                         f"expected block_n = {D // 2} and {(rope.nq + 2 * rope.nkv) * D} rows")
    T = x.shape[0]
    if rope.positions.shape[0] < T or rope.slot_ids.shape[0] < T or rope.cos.shape[1] != D:
        raise ValueError(f"skinny_gemm_qkv_rope: {rope.positions.shape[0]} positions, "
                         f"{rope.slot_ids.shape[0]} slots and cos/sin {tuple(rope.cos.shape)} "
                         f"for {T} rows of heads of {D}")
    kc = rope.k_cache
    if kc.stride() != rope.v_cache.stride() or kc.stride(-1) != 1 or \
            rope.cos.stride() != rope.sin.stride() or rope.cos.stride(-1) != 1:
        raise ValueError("skinny_gemm_qkv_rope: the caches (and the cos/sin tables) need equal "
                         "strides and a contiguous last dim")
    if out is None:
        out = torch.empty(T, rope.nq, D, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (T, rope.nq, D) or out.stride(-1) != 1:
        raise ValueError(f"skinny_gemm_qkv_rope: out {tuple(out.shape)} for q of "
                         f"{(T, rope.nq, D)}, last dim contiguous")
    if attend is not None:
        _check_attend(attend, T, rope, D, workspace)
    _launch(x, w, out, workspace, config, False, row_stats, eps, residual=False, rope=rope,
            attend=attend)
    return out


def check_tile_tokens(tile, page: int, caller: str) -> None:
    """Refuse a one-tile attention's tile (`AttendTail.tile_tokens`, `attention_oproj`'s
    `tile_tokens`) that is not a power of two of at least 16 tokens (a side of its `tl.dot`s)
    filled by whole pages of `page` tokens.

    Raises:
        ValueError: "<caller>: tile of <tile> tokens over pages of <page>: ...".
    """
    if type(tile) is not int or tile < max(page, 16) or tile % page or tile & (tile - 1):
        raise ValueError(f"{caller}: tile of {tile!r} tokens over pages of {page}: expected a "
                         "power of two of at least 16 that whole pages fill")


def _check_attend(attend: AttendTail, T: int, rope: RopeKV, D: int, workspace: Workspace
                  ) -> None:
    """Raises the ValueError `skinny_gemm_qkv_rope` documents for a bad `attend`."""
    o, page, tile = attend.out, rope.k_cache.shape[1], attend.tile_tokens
    if (tuple(o.shape) != (T, rope.nq * D) or not o.is_contiguous()
            or o.dtype != rope.q_weight.dtype):
        raise ValueError(f"skinny_gemm_qkv_rope: attention output {tuple(o.shape)} {o.dtype}"
                         f" for {T} rows of {rope.nq} heads of {D}: expected "
                         f"{(T, rope.nq * D)} contiguous in {rope.q_weight.dtype}")
    check_tile_tokens(tile, page, "skinny_gemm_qkv_rope")
    if rope.nq % rope.nkv or rope.nkv > workspace.max_blocks:
        raise ValueError(f"skinny_gemm_qkv_rope: {rope.nq} query heads over {rope.nkv} kv "
                         f"heads with {workspace.max_blocks} group counters: expected kv "
                         "heads that divide the query heads, at most one per counter")


_HEAD_NAMES = ("qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "slot_ptr", "pt_ptr",
               "kc_ptr", "vc_ptr", "stride_cos", "stride_pt", "stride_kp", "stride_kt",
               "stride_kh", "stride_qh", "qk_eps")


def _attend_args(attend: AttendTail | None, rope: RopeKV | None, w: torch.Tensor,
                 workspace: Workspace) -> dict:
    """The kernel's ATTEND arguments by name (the weight as every pointer without `attend`,
    as `_head_args` does)."""
    if attend is None:
        return dict(o_ptr=w, lens_ptr=w, group_count_ptr=w, stride_ob=0, scale=1.0,
                    ATTEND=False, GROUP=1, BLOCK_G=16, BLOCK_T=16)
    group = rope.nq // rope.nkv
    return dict(o_ptr=attend.out, lens_ptr=attend.seq_lens,
                group_count_ptr=workspace.group_counters, stride_ob=attend.out.stride(0),
                scale=attend.scale, ATTEND=True, GROUP=group,
                BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_T=attend.tile_tokens)


def _head_args(rope: RopeKV | None, w: torch.Tensor, out: torch.Tensor) -> dict:
    """The kernel's HEADS arguments by name. Without a rope epilogue the pointers are the
    weight, which no launch of a step writes, so a conservative reading of the kernel's PDL
    order (`engine.kernels.pdl_order`) sees no hazard in them."""
    if rope is None:
        values = (w,) * 9 + (0,) * 6 + (0.0,)
        return dict(zip(_HEAD_NAMES, values), HEADS=False, NQ=1, NKV=1, PAGE=1)
    kc = rope.k_cache
    values = (rope.q_weight, rope.k_weight, rope.cos, rope.sin, rope.positions, rope.slot_ids,
              rope.page_table, kc, rope.v_cache, rope.cos.stride(0), rope.page_table.stride(0),
              kc.stride(0), kc.stride(1), kc.stride(2), out.stride(1), rope.eps)
    return dict(zip(_HEAD_NAMES, values), HEADS=True, NQ=rope.nq, NKV=rope.nkv,
                PAGE=kc.shape[1])


def _launch(x, w, out, workspace, config, swiglu, row_stats, eps, residual, rope=None,
            attend=None) -> int:
    """Check the shapes, launch the kernel; returns the number of column blocks."""
    if triton is None:
        raise RuntimeError("skinny_gemm needs triton (pip install triton)")
    M, K = x.shape
    N, Kw = w.shape
    if M > MAX_ROWS or Kw != K or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} / w {tuple(w.shape)}: expected "
                         f"M <= {MAX_ROWS}, equal K, last dims contiguous")
    n_out = N // 2 if swiglu else N
    cfg = config or default_config(n_out, K)
    row_step = 2 * cfg.block_n if rope is not None else cfg.block_n
    blocks = triton.cdiv(n_out, row_step)
    k_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_split)
    if split > 1 and not workspace.fits(N, split, blocks):
        raise ValueError(f"skinny_gemm: split {split} x {N} columns x {blocks} blocks exceed "
                         f"the workspace ({workspace.max_split} x {workspace.max_n} x "
                         f"{workspace.max_blocks})")
    if row_stats is not None and row_stats.rows != M:
        raise ValueError(f"skinny_gemm: row statistics of {row_stats.rows} rows for x of {M}")
    if residual and blocks > workspace.max_blocks:
        raise ValueError(f"skinny_gemm_add_residual: {blocks} column blocks exceed the "
                         f"workspace's {workspace.max_blocks} rows of statistics")
    if cfg.gemv and M > GEMV_MAX_ROWS:
        raise ValueError(f"skinny_gemm: a gemv tile serves at most {GEMV_MAX_ROWS} rows, "
                         f"x has {M}")
    stats_in = row_stats.partials if row_stats is not None else 0
    # tl.dot's operands are at least 16 rows; a gemv tile's sums need no padding
    block_m = triton.next_power_of_2(M) if cfg.gemv else max(16, triton.next_power_of_2(M))
    tma = cfg.tma and tma_supported(x.device)
    # x unaligned for a bulk copy (a view at an odd offset): per-thread loads of the same
    # values, the same products
    x_tma = tma and cfg.x_tma and _bulk_aligned(x)
    _skinny_gemm_kernel[(blocks, split)](
        x, w, out, workspace.partials, workspace.counters, workspace.stats, M, n_out, K,
        cfg.block_n if rope is not None else n_out, x.stride(0), w.stride(0), out.stride(0),
        stats_in, eps,
        SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split, K_SPLIT=k_split,
        NORM_IN=row_stats is not None, STATS_BLOCK=triton.next_power_of_2(max(stats_in, 1)),
        RESIDUAL=residual, STATS_STRIDE=MAX_ROWS,
        UPCAST=_INTERPRETED and x.dtype != torch.float32,
        IEEE=x.dtype == torch.float32,
        ONE_TILE=k_split <= cfg.block_k, PAIRED=swiglu or rope is not None,
        ROW_STEP=row_step, GEMV=cfg.gemv, ROW_ACC=cfg.gemv and block_m == 1 and not tma,
        **_head_args(rope, w, out),
        w_desc=_weight_descriptor(w, cfg) if tma else None, TMA=tma,
        x_desc=TensorDescriptor.from_tensor(x, [block_m, cfg.block_k]) if x_tma else None,
        X_TMA=x_tma, **_attend_args(attend, rope, w, workspace),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x))
    return blocks


def tma_supported(device: torch.device) -> bool:
    """Whether a `tma` tile reads through a tensor descriptor on `device`: in Triton's
    interpreter, or on a GPU of compute capability 9.0 or above (Hopper's bulk copy). Elsewhere
    the same tile runs with pointer loads, so a table measured on an H200 still runs on an
    older GPU; the choice depends on the device alone, so an eager step and its graph agree."""
    if _INTERPRETED:
        return True
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None
                       else torch.cuda.current_device()) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _bulk_aligned(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can read t: start and row stride multiples of 16 bytes."""
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def _weight_descriptor(w: torch.Tensor, cfg: TileConfig) -> "TensorDescriptor":
    """The tensor descriptor of a `tma` tile's weight reads: [block_n, block_k] tiles of w.

    Raises:
        ValueError: w's start or row stride is not a multiple of 16 bytes (the bulk copy's
            alignment).
    """
    if not _bulk_aligned(w):
        raise ValueError(f"skinny_gemm: a tma tile needs w's start and rows 16-byte aligned "
                         f"(w {tuple(w.shape)}, row stride {w.stride(0) * w.element_size()} "
                         "bytes)")
    return TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])


def fold_norm_weight(w: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """w[n, k] <- w[n, k] * norm_weight[k] in place, the product in float32 rounded once to
    w's dtype. RMSNorm(x) @ w^T = (x / rms(x)) @ (w * norm_weight)^T, so a GEMM over the
    folded weight needs only each row's 1 / rms, not the normalised row. Apply it once: a
    second call multiplies by the norm weight again. SliceGPT applies the same transform
    before rotating a model's weights ("computational invariance", arXiv:2401.15024: the
    RMSNorm scale absorbed into the next linear layer).

    Args:
        w: [N, K] weight. norm_weight: [K].
    Raises:
        RuntimeError: norm_weight's length is not K (torch's broadcasting error).
    """
    w.copy_((w.float() * norm_weight.float()[None, :]).to(w.dtype))


def shape_key(n: int, k: int, swiglu: bool, rope: bool = False) -> str:
    """Table key of a weight shape: "N x K" plus " swiglu" for a fused gate_up, " rope" for a
    QKV weight with the q/k norm + RoPE + KV-write epilogue (`skinny_gemm_qkv_rope`)."""
    return f"{n}x{k}" + (" swiglu" if swiglu else "") + (" rope" if rope else "")


TABLE_PATH = os.path.join(os.path.dirname(__file__), "skinny_gemm_table.json")


@dataclass(frozen=True)
class TableEntry:
    """One measured (shape, M) of the table: the fastest skinny tile and both times (us per
    call in a CUDA graph, weights from HBM; cuBLAS's includes the SwiGLU launch for gate_up).
    For a " rope" shape, cublas_us is the two launches it replaces: the QKV GEMM the table
    chose (cuBLAS or skinny) and `fused.qk_norm_rope_kv`.
    config None (skinny_us inf): no tile ran at that shape and M."""

    config: TileConfig | None
    skinny_us: float
    cublas_us: float

    @property
    def skinny_wins(self) -> bool:
        return self.config is not None and self.skinny_us < self.cublas_us


def load_table(path: str = TABLE_PATH) -> dict[str, dict[int, TableEntry]]:
    """The measurements per shape (`python -m engine.bench.gemm_sweep --table`):
    {shape_key: {M: TableEntry}}; {} when the file is absent.

    Raises:
        ValueError: the file is not a table written by the sweep.
    """
    if not os.path.exists(path):
        return {}
    return parse_table(read_tuning_json(path, "a skinny GEMM table"), path)


def read_tuning_json(path: str, what: str):
    """The JSON value in `path` (a table or plans file).

    Raises:
        ValueError: "<path>: not <what> (...)" for text that is not JSON or nests too deep.
    """
    with open(path) as f:
        try:
            return json.load(f)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{path}: not {what} ({exc!r})"[:300]) from None


def parse_table(raw, source: str) -> dict[str, dict[int, TableEntry]]:
    """The table in `raw` (the JSON object `load_table` reads), checked entry by entry.

    Raises:
        RowCountError: "<source>: shape '<key>': row count ..." (`row_count_key`).
        ValueError: "<source>: not a skinny GEMM table (...)" for anything else, naming the
            bad key or value: a shape key `shape_key` would not write, a time that is not a
            positive finite number (true, a string), a tile `TileConfig` refuses, a `gemv`
            tile at a row count above GEMV_MAX_ROWS (`check_tile_rows`).
    """
    def shape(key) -> str:
        if not isinstance(key, str) or not _SHAPE_KEY.fullmatch(key):
            raise ValueError(f"shape {key!r} is not a shape_key ('NxK', then ' swiglu' or "
                             "' rope' where the sweep timed one)")
        return key

    try:
        table = {shape(key): {row_count_key(m, f"{source}: shape {key!r}"): _parse_entry(e)
                              for m, e in rows.items()}
                 for key, rows in raw.items()}
        for key, rows in table.items():
            for m, e in rows.items():
                check_tile_rows(e.config, m, f"shape {key!r}")
        return table
    except RowCountError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{source}: not a skinny GEMM table ({tuning_problem(exc)})") from None


def tuning_problem(exc: Exception, keys: str = "shape keys") -> str:
    """What `parse_table` (or `engine.layers.linear.parse_fused_plans`, whose file is an
    object of `keys` too) found wrong, in words (an exception's repr read
    "ValueError(...)")."""
    if isinstance(exc, KeyError):
        return f"an entry has no {exc.args[0]!r} field"
    if isinstance(exc, AttributeError):
        return f"expected an object of {keys}, each an object of row counts"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)


class RowCountError(ValueError):
    """A row-count key of the table or of the fused-plan file that is not one the skinny GEMM
    serves; the message is the whole line, naming the file and the shape or layer."""


def row_count_key(m, where: str) -> int:
    """`m`, a row-count key of the table or of the fused-plan file (a JSON object key), as an
    int: decimal digits without a sign or leading zero (`int` would also take " 8", "+8",
    "08" and "1_0"), 1..MAX_ROWS.

    Raises:
        RowCountError: "<where>: row count <m!r>: expected an integer in 1..MAX_ROWS".
    """
    if isinstance(m, str) and m.isascii() and m.isdigit() and m[0] != "0" \
            and int(m) <= MAX_ROWS:
        return int(m)
    raise RowCountError(f"{where}: row count {m!r}: expected an integer in 1..{MAX_ROWS}")


def check_tile_rows(tile: TileConfig | None, rows: int, where: str) -> None:
    """Refuse a `gemv` tile at a table or plans row count above GEMV_MAX_ROWS (its entry would
    serve steps of more rows than the kernel takes, found only at the first such launch).

    Raises:
        ValueError: "<where>: row count <rows>: a gemv tile serves at most GEMV_MAX_ROWS rows".
    """
    if tile is not None and tile.gemv and rows > GEMV_MAX_ROWS:
        raise ValueError(f"{where}: row count {rows}: a gemv tile serves at most "
                         f"{GEMV_MAX_ROWS} rows")


def _parse_entry(e) -> TableEntry:
    if not isinstance(e, dict):
        raise ValueError(f"entry {one_line_repr(e, 60)} is not an object with skinny, "
                         "skinny_us and cublas_us")
    cublas_us = _time_us(e["cublas_us"], "cublas_us")
    tile = e["skinny"]
    if tile is None:
        return TableEntry(None, float("inf"), cublas_us)
    return TableEntry(tile_from_json(tile), _time_us(e["skinny_us"], "skinny_us"), cublas_us)


def tile_from_json(tile) -> TileConfig:
    """The tile in `tile`, a JSON object of `TileConfig` fields as the sweep and the tuner
    write one (`TileConfig.__dict__`), the form of every tile in the table, the plans file and
    the tools' --json.

    Raises:
        ValueError: naming what is wrong: not an object, a field unknown or missing, or the
            value `TileConfig` refuses.
    """
    if not isinstance(tile, dict):
        raise ValueError(f"tile {one_line_repr(tile, 60)} is not an object of TileConfig fields")
    unknown = sorted(map(str, set(tile) - set(TileConfig.__dataclass_fields__)))
    if unknown:
        raise ValueError(f"tile field(s) {', '.join(map(repr, unknown))} unknown; known: "
                         f"{', '.join(TileConfig.__dataclass_fields__)}")
    missing = [name for name, f in TileConfig.__dataclass_fields__.items()
               if f.default is MISSING and name not in tile]
    if missing:
        raise ValueError(f"tile {one_line_repr(tile, 80)} lacks {', '.join(missing)}")
    return TileConfig(**tile)


_SHAPE_KEY = re.compile(r"[1-9][0-9]*x[1-9][0-9]*(?: swiglu)?(?: rope)?")
"""What `shape_key` writes: a key of another spelling ("garbage", "1024 x 2048") names no
shape the engine looks up, so the table is refused instead of the entry lying unused."""


def _time_us(value, name: str) -> float:
    # float() alone took true (as 1.0) and "2.5"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} {value!r} is not a number")
    us = float(value)
    if not 0 < us < float("inf"):
        raise ValueError(f"{name} {value!r} is not a positive finite time")
    return us


def table_entry(table: dict, n: int, k: int, swiglu: bool, m: int,
                rope: bool = False) -> TableEntry | None:
    """The measurement that serves M rows of an [n, k] weight (with `rope`, of its
    `skinny_gemm_qkv_rope` launch): the entry of the smallest measured row count >= m; None
    past MAX_ROWS or for a shape or row count the table lacks."""
    rows = table.get(shape_key(n, k, swiglu, rope))
    if m > MAX_ROWS or not rows:
        return None
    fits = [r for r in rows if r >= m]
    return rows[min(fits)] if fits else None


def choose(table: dict, n: int, k: int, swiglu: bool, m: int) -> TileConfig | None:
    """The configuration for M rows of an [n, k] weight: the table's entry for the smallest
    measured row count >= m when the skinny GEMM beat cuBLAS there; None (use cuBLAS) where
    cuBLAS won, for M > MAX_ROWS or a shape the table lacks."""
    entry = table_entry(table, n, k, swiglu, m)
    return entry.config if entry is not None and entry.skinny_wins else None
