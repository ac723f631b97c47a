"""Paged decode attention: one query token per sequence against its paged K/V (GQA).

Three implementations with one signature:
    `paged_decode_attention_triton`: the Triton kernel used on CUDA. One program per (batch
        row, kv head) computes that kv head's group of query heads with an online softmax over
        the sequence's pages, TILE_TOKENS tokens (several pages) per iteration. Lengths, the slot of each row and the page table are read from
        device memory inside the kernel (no host value changes between steps: I12).
    `paged_decode_attention_torch`: gathers the pages with torch indexing; the CPU path.
    `paged_decode_attention_reference`: float64, one row at a time; the oracle for both.

Shared arguments:
    q:          [B, Hq, D] query of each batch row (model dtype).
    k_cache, v_cache: [num_pages + 1, page_size, Hkv, D] one layer of the paged cache.
    page_table: int32 [max_slots + 1, max_pages_per_seq].
    seq_lens:   int32 [max_slots + 1]: number of cached tokens to attend to, the current
                token's own K/V included (it is written before attention runs).
    slot_ids:   int32 [B]: the slot of each batch row (padding rows use the padding slot).
    scale:      softmax scale, usually D ** -0.5.
Returns [B, Hq, D] in q's dtype (float64 for the reference).
"""

from __future__ import annotations

import torch

try:  # Triton is optional on CPU-only machines; the torch path needs none of it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def paged_decode_attention_reference(q, k_cache, v_cache, page_table, seq_lens, slot_ids,
                                     scale: float) -> torch.Tensor:
    """float64 oracle; loops over rows on the host (slow, for tests only)."""
    B, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        slot = int(slot_ids[b])
        n = int(seq_lens[slot])
        pos = torch.arange(n)
        pages = page_table[slot].long().cpu()[pos // P]
        k = k_cache.cpu()[pages, pos % P].double()  # [n, Hkv, D]
        v = v_cache.cpu()[pages, pos % P].double()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].cpu().double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def paged_decode_attention_torch(q, k_cache, v_cache, page_table, seq_lens, slot_ids,
                                 scale: float) -> torch.Tensor:
    """Vectorised torch implementation (float32 math); reads every page-table column and masks
    positions at or past the sequence length by selection, so stale non-finite K/V there never
    reach the output."""
    B, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    slots = slot_ids.long()
    pages = page_table[slots].long()                      # [B, MP]
    n = pages.shape[1] * P
    k = k_cache[pages].reshape(B, n, Hkv, D).float()
    v = v_cache[pages].reshape(B, n, Hkv, D).float()
    qg = q.float().view(B, Hkv, group, D)
    s = torch.einsum("bkgd,bnkd->bkgn", qg, k) * scale
    lens = seq_lens[slots].long()                         # [B]
    valid = torch.arange(n, device=q.device)[None, :] < lens[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    # Mask V by selection, not by its zero weight: 0 x NaN is NaN, and positions past a
    # sequence's length may hold stale NaN from an earlier occupant of the page.
    v = torch.where(valid[:, :, None, None], v, torch.zeros((), dtype=v.dtype, device=v.device))
    out = torch.einsum("bkgn,bnkd->bkgd", torch.softmax(s, dim=-1), v)
    return out.reshape(B, Hq, D).to(q.dtype)


# Tokens per loop iteration of the Triton kernel (whole pages, gathered through the page
# table in one load): one page per iteration left the kernel latency-bound at short contexts
# (11 us per layer for Qwen3-4B at batch 1, context 128, on H200; 8 dependent iterations).
TILE_TOKENS = 64
# Launch settings of the Triton kernel (Triton's defaults); `scripts/decode_attention_sweep.py`
# times the alternatives at long contexts.
NUM_WARPS = 4
NUM_STAGES = 3

if triton is not None:

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, slots_ptr, out_ptr,
                             stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                             stride_pt, stride_ob, stride_oh, scale,
                             GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                             HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             IEEE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        length = tl.load(lens_ptr + slot)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_N)  # BLOCK_N tokens (BLOCK_N / PAGE pages) per iteration
        gmask = g < GROUP
        q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        num_tiles = tl.cdiv(length, BLOCK_N)
        for i in range(0, num_tiles):
            tok = i * BLOCK_N + t
            kmask = tok < length
            page = tl.load(pt_ptr + slot * stride_pt + tok // PAGE, mask=kmask,
                           other=0).to(tl.int64)
            base = (page[:, None] * stride_kp + (tok % PAGE)[:, None] * stride_kt
                    + h * stride_kh + d[None, :])
            k = tl.load(k_ptr + base, mask=kmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + base, mask=kmask[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, slot_ids,
                                  scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton kernel; see the module docstring. `out` [B, Hq, D] may be given (static buffer).

    Requirements: D and page_size powers of two >= 16; q, caches and page_table contiguous in
    their last dimension. Every row's length must be >= 1 (the padding slot holds 1).
    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention_triton needs triton (pip install triton)")
    B, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    if out is None:
        out = torch.empty_like(q)
    block_g = max(16, triton.next_power_of_2(group))
    _paged_decode_kernel[(B, Hkv)](
        q, k_cache, v_cache, page_table, seq_lens, slot_ids, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), out.stride(0), out.stride(1), scale,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=D, PAGE=P, BLOCK_N=max(P, TILE_TOKENS),
        IEEE=q.dtype == torch.float32, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
