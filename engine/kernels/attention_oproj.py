"""Decode attention fused into o_proj, for short contexts: one launch instead of two per layer.

`attention_oproj` computes, for a decode step of at most `MAX_ROWS` rows whose every context
holds at most `tile_tokens` cached tokens,

    residual <- residual + attention(q, K, V) @ W_o^T

in one launch, and leaves each new residual row's partial sums of squares for the next norm,
as `engine.kernels.skinny_gemm.skinny_gemm_add_residual` does (the fused layer form at world
size 1). One program per (block of BLOCK_N output features, kv head) attends that kv head's
group of query heads over the row's one tile of tokens and multiplies the result by the
weight's [BLOCK_N, group x head_dim] slice, loaded before the PDL wait; one program per
(column block, kv head, row). The kv heads' partial products are summed in kv-head order by
the last program of the column block to arrive (deterministic), which adds the residual.
Each program recomputes its kv head's attention: ceil(hidden / BLOCK_N) times the K/V reads
of the unfused launch, from L2.

Measured on one H200 (Qwen3-0.6B graph step, context 128, `lockstep bench`, 2026-12-03):
batch 1 0.780 -> 0.736 ms with BLOCK_N 128 (0.751 with 64); batch 2 0.793 -> 0.808 and
batch 4 0.802 -> 0.853 (slower: the recomputed attention and the weight slices per row
outgrow the launch saved), so the engine takes this form at batch 1 only
(`engine.engine_config.SHORT_DECODE_MAX_BATCH`).

A row with more than `tile_tokens` cached tokens is attended over its first `tile_tokens`
only: nothing on the device can tell. The controller replays this form only for steps whose
every row fits (`protocol.keys.SHORT`); longer contexts take the split-KV launch
(`engine.kernels.decode_attention`) and o_proj.
"""

from __future__ import annotations

import os

import torch

from engine.kernels import skinny_gemm
from engine.kernels.pdl import pdl_launch

try:  # Triton is optional on CPU-only machines
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

MAX_ROWS = 8
"""Most rows of a launch (the partials hold this many)."""

BLOCK_N = 128
"""Output features per program (the measured best at batch 1; module docstring)."""

NUM_WARPS = 4
"""Warps per program (the measured best at batch 1; module docstring)."""

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class AttnOprojWorkspace:
    """The kv heads' partial products, float32 [kv_heads, MAX_ROWS, hidden], and one arrival
    counter per column block (every launch leaves them at zero). Allocated once per device
    before capture.

    Args:
        device: where to allocate. kv_heads: this rank's kv heads. hidden: o_proj's output
            features. block_n: output features per program. num_warps: warps per program.
    Raises:
        torch.OutOfMemoryError: allocation failed.
    """

    def __init__(self, device, kv_heads: int, hidden: int, block_n: int = BLOCK_N,
                 num_warps: int = NUM_WARPS):
        self.kv_heads, self.hidden, self.block_n = kv_heads, hidden, block_n
        self.num_warps = num_warps
        self.partials = torch.empty(kv_heads * MAX_ROWS * hidden, dtype=torch.float32,
                                    device=device)
        self.counters = torch.zeros(-(-hidden // block_n), dtype=torch.int32, device=device)


def attention_oproj_reference(q, k_cache, v_cache, page_table, seq_lens, slot_ids, scale,
                              w, residual, tile_tokens: int) -> torch.Tensor:
    """float64 oracle of the new residual: attention over each row's first `tile_tokens`
    tokens (float64), rounded to q's dtype as the unfused launch stores it, times w^T, plus
    the residual. Shapes as `attention_oproj`; returns float64 [B, hidden]."""
    from engine.kernels.decode_attention import paged_decode_attention_reference

    lens = seq_lens.clone()
    lens[slot_ids.long()] = lens[slot_ids.long()].clamp(max=tile_tokens)
    o = paged_decode_attention_reference(q, k_cache, v_cache, page_table, lens, slot_ids,
                                         scale)
    o = o.to(q.dtype).double().reshape(q.shape[0], -1)
    product = (o @ w.double().T).to(q.dtype).double()
    return product + residual.double()


if triton is not None:
    from engine.kernels.skinny_gemm import _dot, _one_tile_attention, _skinny_epilogue

    @triton.jit
    def _attn_oproj_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, slots_ptr, w_ptr, out_ptr,
                           part_ptr, count_ptr, stats_ptr, stride_qb, stride_qh, stride_kp,
                           stride_kt, stride_kh, stride_pt, stride_wn, stride_om, scale,
                           N_OUT, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                           NUM_KV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                           GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           STATS_STRIDE: tl.constexpr, IEEE: tl.constexpr,
                           UPCAST: tl.constexpr, PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2)
        m = tl.arange(0, BLOCK_M)
        mmask = m < ROWS
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N_OUT
        d = tl.arange(0, HEAD_DIM)
        g = tl.arange(0, BLOCK_G)
        gmask = g < GROUP
        t = tl.arange(0, BLOCK_T)
        # The weight as [HEAD_DIM, GROUP_P2 x BLOCK_N]: column c holds output feature
        # c % BLOCK_N of query head c // BLOCK_N of this kv head's group, so one dot of the
        # attention output [BLOCK_G, HEAD_DIM] gives every (head, head') product and the
        # diagonal blocks (head == head') summed are the projection.
        c = tl.arange(0, GROUP_P2 * BLOCK_N)
        c_head = c // BLOCK_N
        c_n = pid_n * BLOCK_N + c % BLOCK_N
        # Before the wait (engine.kernels.pdl): the weight (written at load), the step's slots,
        # lengths and page-table entries (written two or more launches back, through L2).
        w_cols = (w_ptr + c_n.to(tl.int64)[None, :] * stride_wn
                  + ((h * GROUP + c_head) * HEAD_DIM)[None, :] + d[:, None])
        wg = tl.load(w_cols, mask=((c_head < GROUP) & (c_n < N_OUT))[None, :], other=0.0)
        slots = tl.load(slots_ptr + m, mask=mmask, other=0, cache_modifier=".cg").to(tl.int64)
        lens = tl.load(lens_ptr + slots, mask=mmask, other=0, cache_modifier=".cg")
        lens = tl.minimum(lens, BLOCK_T)
        pages = tl.load(pt_ptr + slots[:, None] * stride_pt + (t // PAGE)[None, :],
                        mask=t[None, :] < lens[:, None], other=0,
                        cache_modifier=".cg").to(tl.int64)
        if PDL:  # q and this step's K/V entries are the previous launch's writes
            tl.extra.cuda.gdc_wait()
        res = tl.load(out_ptr + m[:, None] * stride_om + n[None, :],
                      mask=mmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        row = m == r
        length = tl.sum(tl.where(row, lens, 0))
        page = tl.sum(tl.where(row[:, None], pages, 0), axis=0)
        kmask = t < length
        qr = tl.load(q_ptr + r * stride_qb + (h * GROUP + g)[:, None] * stride_qh
                     + d[None, :], mask=gmask[:, None], other=0.0)
        base = (page[:, None] * stride_kp + (t % PAGE)[:, None] * stride_kt
                + h * stride_kh + d[None, :])
        k = tl.load(k_ptr + base, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + base, mask=kmask[:, None], other=0.0)
        attended = _one_tile_attention(qr, k, v, kmask, scale, IEEE, UPCAST)
        # rounded as the unfused launch stores attention's output; padding heads zero
        o = tl.where(gmask[:, None], attended, 0.0).to(out_ptr.dtype.element_ty)
        if UPCAST:
            both = _dot(o.to(tl.float32), wg.to(tl.float32), IEEE)
        else:
            both = _dot(o, wg, IEEE)
        diag = tl.sum(tl.where(c_head[None, :] == g[:, None], both, 0.0), axis=0)
        product = tl.sum(tl.reshape(diag, [GROUP_P2, BLOCK_N]), axis=0)
        acc = tl.where(row[:, None], product[None, :], 0.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        ss = tl.zeros([1, BLOCK_M], tl.float32)
        mask = mmask[:, None] & nmask[None, :]
        if NUM_KV * ROWS == 1:
            _skinny_epilogue(acc, acc, ss, res, 1, 0.0, out_ptr, stats_ptr, pid_n,
                             m, n, mmask, nmask, stride_om, False, False, True, STATS_STRIDE)
        else:
            # the last (kv head, row) program of the column block to arrive sums the kv heads
            # in order for every row
            tl.store(part_ptr + (h * BLOCK_M + m)[:, None] * N_OUT + n[None, :], acc,
                     mask=row[:, None] & nmask[None, :])
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if arrived == NUM_KV * ROWS - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for j in tl.static_range(NUM_KV):
                    total += tl.load(part_ptr + (j * BLOCK_M + m)[:, None] * N_OUT
                                     + n[None, :], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(count_ptr + pid_n, 0)
                _skinny_epilogue(total, total, ss, res, 1, 0.0, out_ptr,
                                             stats_ptr, pid_n, m, n, mmask, nmask, stride_om,
                                             False, False, True, STATS_STRIDE)


def attention_oproj(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, seq_lens: torch.Tensor, slot_ids: torch.Tensor,
                    scale: float, w: torch.Tensor, residual: torch.Tensor,
                    workspace: AttnOprojWorkspace, gemm_workspace: skinny_gemm.Workspace,
                    tile_tokens: int) -> skinny_gemm.RowStats:
    """residual <- residual + decode_attention(q) @ w^T in place, one launch; returns the new
    rows' `skinny_gemm.RowStats` in `gemm_workspace` (as `skinny_gemm_add_residual`).

    Args:
        q: [B, Hq, D], B <= MAX_ROWS, normalised and rotated; this step's K/V in the cache.
        k_cache, v_cache, page_table, seq_lens, slot_ids, scale: as
            `engine.kernels.decode_attention`.
        w: o_proj weight [hidden, Hq * D], q's dtype, contiguous.
        residual: [B, hidden] in q's dtype, contiguous; overwritten.
        workspace: partials of `workspace.block_n` output features per program.
        gemm_workspace: the skinny GEMMs' workspace, whose statistics the next GEMM reads.
        tile_tokens: tokens attended per row, a power of two of at least 16 filled by whole
            pages; a longer row is attended over its first `tile_tokens` tokens only (module
            docstring).
    Raises:
        RuntimeError: Triton is not installed.
        ValueError: more than MAX_ROWS rows, shapes that do not match, a tile that is no
            power of two of at least 16 filled by whole pages
            (`skinny_gemm.check_tile_tokens`), or K/V caches of two layouts.
    """
    if triton is None:
        raise RuntimeError("attention_oproj needs triton (pip install triton)")
    B, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    hidden = w.shape[0]
    if (B > MAX_ROWS or w.shape[1] != Hq * D or tuple(residual.shape) != (B, hidden)
            or Hkv != workspace.kv_heads or hidden != workspace.hidden
            or w.stride(-1) != 1 or residual.stride(-1) != 1 or q.stride(-1) != 1):
        raise ValueError(f"attention_oproj: q {tuple(q.shape)}, w {tuple(w.shape)}, residual "
                         f"{tuple(residual.shape)}, {Hkv} kv heads for a workspace of "
                         f"{workspace.kv_heads} x {workspace.hidden}: expected B <= "
                         f"{MAX_ROWS}, w [hidden, Hq * D], residual [B, hidden]")
    skinny_gemm.check_tile_tokens(tile_tokens, P, "attention_oproj")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(f"attention_oproj: K/V caches of strides {k_cache.stride()} and "
                         f"{v_cache.stride()}: expected one layout, contiguous in head_dim")
    group = Hq // Hkv
    block_n = workspace.block_n
    blocks = triton.cdiv(hidden, block_n)
    if blocks > gemm_workspace.max_blocks:
        raise ValueError(f"attention_oproj: {blocks} column blocks exceed the GEMM "
                         f"workspace's {gemm_workspace.max_blocks} rows of statistics")
    _attn_oproj_kernel[(blocks, Hkv, B)](
        q, k_cache, v_cache, page_table, seq_lens, slot_ids, w, residual,
        workspace.partials, workspace.counters, gemm_workspace.stats,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), w.stride(0), residual.stride(0), scale, hidden,
        ROWS=B, BLOCK_M=triton.next_power_of_2(B), NUM_KV=Hkv, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=D, PAGE=P,
        BLOCK_T=tile_tokens, BLOCK_N=block_n, STATS_STRIDE=skinny_gemm.MAX_ROWS,
        IEEE=q.dtype == torch.float32, UPCAST=_INTERPRETED and q.dtype != torch.float32,
        num_warps=workspace.num_warps, num_stages=1, **pdl_launch(q))
    return skinny_gemm.RowStats(blocks, B)
