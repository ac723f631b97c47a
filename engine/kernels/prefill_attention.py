"""Varlen (ragged) causal prefill attention over the paged KV cache, many sequences per launch.

A prefill step packs the new tokens of several sequences into one batch of T tokens. Sequence
s contributes q_len[s] query tokens at positions ctx[s] .. ctx[s] + q_len[s] - 1 of slot
slot[s]; their K/V were already written into the paged cache (with every earlier position:
ctx[s] > 0 is a later chunk of a chunked prefill). Query i of sequence s attends to positions
0 .. ctx[s] + i of its slot (causal), read through the page table.

Implementations with one signature:
    `prefill_attention_triton`: the CUDA path. One program per (tile of BLOCK_M query tokens
        of one sequence, query head): an online softmax over the sequence's pages, BLOCK_N
        tokens per iteration, stopping at the tile's last causal position. No host sync and
        one launch per layer, whatever the number of sequences.
    `prefill_attention_torch`: gathers each sequence's pages and runs the masked softmax in
        float32, one sequence at a time (the CPU path and the GPU tests' oracle).

Why not `F.scaled_dot_product_attention` per sequence (the engine's earlier path): one call
per sequence and layer, and on the H200 the default backend choice for a new sequence length
costs the host far more than the kernel (see docs/benchmarks.md, prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Query tokens per program; 64 x head_dim 128 keeps q, the accumulator and one K/V tile of 64
# tokens in registers with 4 warps on sm_90.
BLOCK_M = 64
BLOCK_N = 64


@dataclass
class PrefillBatch:
    """The layout of one packed prefill (every tensor on the step's device).

    Attributes:
        slot: int32 [S] slot of each sequence. q_start: int32 [S] offset of its first query
            token in the packed batch. q_len: int32 [S] its query tokens. ctx: int32 [S]
            tokens cached before them.
        tile_seq, tile_m0: int32 [n_tiles]: the sequence and first query offset (within the
            sequence) of each BLOCK_M tile.
        host: the same (slot, q_start, q_len, ctx) as Python lists, for the torch path.
    """

    slot: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    ctx: torch.Tensor
    tile_seq: torch.Tensor
    tile_m0: torch.Tensor
    host: tuple[list[int], list[int], list[int], list[int]]

    @classmethod
    def build(cls, slots: list[int], q_lens: list[int], ctxs: list[int], device) -> "PrefillBatch":
        """Layout of sequences with these slots, query lengths and cached prefixes; one
        host-to-device copy (pinned, asynchronous on CUDA)."""
        starts, tiles_s, tiles_m = [], [], []
        t = 0
        for s, n in enumerate(q_lens):
            starts.append(t)
            t += n
            m = list(range(0, n, BLOCK_M))
            tiles_s += [s] * len(m)
            tiles_m += m
        S, NT = len(slots), len(tiles_s)
        flat = torch.tensor(list(slots) + starts + list(q_lens) + list(ctxs) + tiles_s + tiles_m,
                            dtype=torch.int32)
        if torch.device(device).type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        parts = torch.split(flat, [S, S, S, S, NT, NT])
        return cls(*parts, host=(list(slots), starts, list(q_lens), list(ctxs)))

    @property
    def num_tiles(self) -> int:
        """Programs along the first grid axis."""
        return self.tile_seq.shape[0]


def prefill_attention_torch(q, k_cache, v_cache, page_table, batch: PrefillBatch,
                            scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; caches [num_pages + 1, page_size, Hkv, D] (one layer) -> [T, Hq, D]."""
    T, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.empty_like(q)
    for slot, start, n, ctx in zip(*batch.host):
        total = ctx + n
        pos = torch.arange(total, device=q.device)
        pages = page_table[slot].long()[pos // P]
        k = k_cache[pages, pos % P].float().repeat_interleave(group, dim=1)  # [total, Hq, D]
        v = v_cache[pages, pos % P].float().repeat_interleave(group, dim=1)
        qs = q[start:start + n].float()
        s = torch.einsum("ihd,jhd->hij", qs, k) * scale
        causal = pos[None, :] <= (ctx + torch.arange(n, device=q.device))[:, None]
        s = s.masked_fill(~causal[None], float("-inf"))
        out[start:start + n] = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1),
                                            v).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, slot_ptr, qs_ptr, ql_ptr, ctx_ptr,
                        tseq_ptr, tm0_ptr, out_ptr, stride_qt, stride_qh, stride_kp, stride_kt,
                        stride_kh, stride_pt, stride_ot, stride_oh, scale,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(tseq_ptr + tile)
        m0 = tl.load(tm0_ptr + tile)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        q0 = tl.load(qs_ptr + seq)
        qlen = tl.load(ql_ptr + seq)
        ctx = tl.load(ctx_ptr + seq)
        kvh = h // GROUP
        m = m0 + tl.arange(0, BM)
        mmask = m < qlen
        d = tl.arange(0, HEAD_DIM)
        rows = (q0 + m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=mmask[:, None], other=0.0)
        qpos = ctx + m  # causal limit of each query row
        mx = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, HEAD_DIM], tl.float32)
        end = ctx + tl.minimum(m0 + BM, qlen)  # keys this tile can see
        n = tl.arange(0, BN)
        for start in range(0, end, BN):
            tok = start + n
            kmask = tok < end
            page = tl.load(pt_ptr + slot * stride_pt + tok // PAGE, mask=kmask,
                           other=0).to(tl.int64)
            base = (page[:, None] * stride_kp + (tok % PAGE)[:, None] * stride_kt
                    + kvh * stride_kh + d[None, :])
            k = tl.load(k_ptr + base, mask=kmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            s = tl.where((tok[None, :] <= qpos[:, None]) & kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(mx, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(mx - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + base, mask=kmask[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            mx = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def prefill_attention_triton(q, k_cache, v_cache, page_table, batch: PrefillBatch,
                             scale: float) -> torch.Tensor:
    """Triton kernel; see the module docstring. head_dim and page_size powers of two >= 16.

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("prefill_attention_triton needs triton (pip install triton)")
    T, Hq, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    out = torch.empty_like(q)
    if batch.num_tiles == 0:
        return out
    _prefill_kernel[(batch.num_tiles, Hq)](
        q, k_cache, v_cache, page_table, batch.slot, batch.q_start, batch.q_len, batch.ctx,
        batch.tile_seq, batch.tile_m0, out, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), page_table.stride(0), out.stride(0),
        out.stride(1), scale, GROUP=Hq // Hkv, HEAD_DIM=D, PAGE=P, BM=BLOCK_M, BN=BLOCK_N,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out
