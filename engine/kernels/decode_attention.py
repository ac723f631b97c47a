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
    row_order:  optional int64 [B], a permutation of the batch rows: the order in which the
                Triton kernel's programs take them (`longest_first`). It changes no value;
                the other implementations ignore it.
Returns [B, Hq, D] in q's dtype (float64 for the reference).
"""

from __future__ import annotations

import torch

from engine.kernels.pdl import pdl_launch

try:  # Triton is optional on CPU-only machines; the torch path needs none of it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def paged_decode_attention_reference(q, k_cache, v_cache, page_table, seq_lens, slot_ids,
                                     scale: float, row_order=None) -> torch.Tensor:
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
                                 scale: float, row_order=None) -> torch.Tensor:
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
# Tokens per iteration on the split-KV path (few rows; a sequence uses one split per tile).
# H200, 2026-12-01, CUDA-graph timed, 128- against 64-token tiles: batch 1 at context 128 4.0
# against 5.7 us (one tile: no merge), 4,096 11.4 against 13.0, 16,384 32.1 against 40.6; batch
# 8 at 128 4.7 against 6.9. 64 wins at batch 8 context 1,024 (11.2 against 12.8) and batch 16
# context 512 (10.9 against 12.5); batch 1 context 1,024 is even (7.0 against 6.8).
SPLIT_TILE_TOKENS = 128
# Launch settings of the Triton kernel: Triton's defaults on the split-KV path; launches of
# one program per (row, kv head) take 2 warps. Qwen3-4B heads, a CUDA graph of 36 launches
# over rotating caches (`docs/experiments/attention-launch-settings.py`), H100, 2026-12-05, 2
# against 4 warps: batch 64 at context 128 15.9 against 16.9 us, at 1,024 90.8 against 92.0;
# batch 256 52.1 against 53.1 and 352.2 against 353.5 us; no other setting of warps, stages,
# tile or split target was faster at all four. The 4B step, same call: batch 64 4.114 against
# 4.143 ms, 256 6.673 against 6.697 (docs/benchmarks.md, 2026-12-05). The split path's
# launches (few rows) were slower with 2 warps (batch 8, context 128: 8.2 against 5.9 us).
NUM_WARPS = 4
NUM_WARPS_ONE_SPLIT = 2
NUM_STAGES = 3

# Programs the split-KV path aims for: two per SM of an H200 (132 SMs). A launch of B rows x
# Hkv heads below this splits each sequence's tiles over up to MAX_SPLITS programs.
TARGET_PROGRAMS = 264
MAX_SPLITS = 16
# Launches of at least this many rows take them longest first (`longest_first`). The block
# scheduler hands out programs in index order, so with rows in batch order a long sequence
# that comes last runs alone at the end of the launch; longest first, the short ones fill the
# tail. H200, 2026-12-01, one layer call, lengths uniform in [100, 2048] in random order:
# 256 rows 277 -> 269 us, 96 rows 130 -> 125 us, 64 rows no gain (88 against 90 us); workload
# W decode GPU time 5.07 -> 5.01 s. Smaller launches, whose few programs finish together, go
# unsorted. The order is computed on the host from the step's positions and travels with them
# in the step's one host-to-device copy: on the device, `torch.argsort` was a launch of its
# own inside the graph, 27-30 us per step at 256 rows (a one-launch Triton rank kernel was no
# faster, 29 us; H200, 2026-12-01). On the host, torch's stable sort takes about 10 us at 256
# rows (Python's `sorted` with a key, 23 us).
ORDER_MIN_ROWS = 64


def num_splits(rows: int, kv_heads: int) -> int:
    """K/V splits per (row, kv head) for a launch of `rows` rows: 1 when rows x kv_heads
    programs already fill the GPU, else the power of two (<= MAX_SPLITS) that brings the
    launch to about TARGET_PROGRAMS. Depends only on the launch shape, so a graph captured at a
    bucket and the eager step at that bucket split alike."""
    programs = rows * kv_heads
    if programs >= TARGET_PROGRAMS:
        return 1
    split = 1
    while programs * split < TARGET_PROGRAMS and split < MAX_SPLITS:
        split *= 2
    return split


def takes_rows_in_order(rows: int) -> bool:
    """Whether a decode-attention launch of `rows` rows takes them in `longest_first` order
    (from ORDER_MIN_ROWS rows on)."""
    return rows >= ORDER_MIN_ROWS


def longest_first(positions: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The batch rows of a decode step, longest sequence first and rows of one length in batch
    order (a permutation of range(B), by one stable sort on the host), for `row_order`; None
    for launches of fewer than ORDER_MIN_ROWS rows.

    Args:
        positions: int64 [B] on the CPU, each row's position (its length - 1); padding rows'
            0 puts them last.
        out: int64 [B] on the CPU to write the order into (the executor's staging row).
    Returns:
        The order (``out`` when given), int64 [B].
    """
    if not takes_rows_in_order(positions.shape[0]):
        return None
    if out is None:
        out = torch.empty_like(positions)
    torch.sort(positions, descending=True, stable=True, out=(torch.empty_like(positions), out))
    return out


class SplitWorkspace:
    """Partial results of the split-KV path: per (row, kv head, split) the running max, sum
    and unnormalised output of BLOCK_G query heads (float32), and one arrival counter per
    (row, kv head). Allocated once per device before capture; every launch leaves the
    counters at zero.

    Args:
        device: where to allocate. head_dim: D. group_block: BLOCK_G (query heads per kv
            head, rounded up to a power of two >= 16).
        programs: most (row, kv head, split) programs of a split launch (TARGET_PROGRAMS x 2
            covers every `num_splits` choice).
    """

    def __init__(self, device, head_dim: int, group_block: int = 16,
                 programs: int = 2 * TARGET_PROGRAMS):
        self.programs, self.group_block, self.head_dim = programs, group_block, head_dim
        self.acc = torch.empty(programs * group_block * head_dim, dtype=torch.float32,
                               device=device)
        self.stats = torch.empty(programs * group_block * 2, dtype=torch.float32, device=device)
        self.counters = torch.zeros(programs, dtype=torch.int32, device=device)

    @classmethod
    def for_heads(cls, device, q_heads: int, kv_heads: int, head_dim: int) -> "SplitWorkspace":
        """The workspace of a model with these head counts (any TP split: the group is the same)."""
        group = q_heads // kv_heads
        return cls(device, head_dim, max(16, 1 << (group - 1).bit_length()))


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, lens_ptr, slots_ptr, out_ptr,
                             acc_ptr, stats_ptr, count_ptr, order_ptr,
                             stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                             stride_pt, stride_ob, stride_oh, scale, NUM_KV,
                             GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                             HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                             ORDERED: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        # Before the wait (engine.kernels.pdl): the row order, slots and lengths come from the
        # step's copies at its start, two or more launches back; q and the new token's cache
        # entry are the previous launch's.
        if ORDERED:  # programs are dispatched in index order: take the longest rows first
            b = tl.load(order_ptr + b, cache_modifier=".cg")
        slot = tl.load(slots_ptr + b, cache_modifier=".cg").to(tl.int64)
        length = tl.load(lens_ptr + slot, cache_modifier=".cg")
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_N)  # BLOCK_N tokens (BLOCK_N / PAGE pages) per iteration
        gmask = g < GROUP
        # Splits this sequence uses: at most one per tile, so a short sequence is not spread
        # over programs that find nothing to read and a merge of SPLITS empty partials (the
        # launch's SPLITS is fixed by its shape for graph capture; the length is not).
        num_tiles = tl.cdiv(length, BLOCK_N)
        used = tl.minimum(num_tiles, SPLITS)
        first = split * num_tiles // used
        last = (split + 1) * num_tiles // used
        if split >= used:
            first = last  # nothing to read; such a program publishes nothing either
        if PDL:  # see engine.kernels.pdl: wait for the previous grid before touching its writes
            tl.extra.cuda.gdc_wait()
        q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for i in range(first, last):
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
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        out_rows = out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
        if SPLITS == 1:
            tl.store(out_rows, (acc / l[:, None]).to(out_ptr.dtype.element_ty),
                     mask=gmask[:, None])
        elif used == 1:  # one tile: split 0 read it all; the others have nothing to add
            if split == 0:
                tl.store(out_rows, (acc / l[:, None]).to(out_ptr.dtype.element_ty),
                         mask=gmask[:, None])
        elif split < used:
            # Publish this split's (max, sum, output); the last of the sequence's `used` splits
            # to arrive merges them in split order 0..used-1 (deterministic) and resets the
            # counter.
            pair = b * NUM_KV + h
            me = pair * SPLITS + split
            tl.store(acc_ptr + (me * BLOCK_G + g)[:, None] * HEAD_DIM + d[None, :], acc)
            tl.store(stats_ptr + (me * BLOCK_G + g) * 2, m)
            tl.store(stats_ptr + (me * BLOCK_G + g) * 2 + 1, l)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel")
            if arrived == used - 1:
                # unrolled over the launch's SPLITS (independent loads in flight at once); the
                # partials past `used` were not written this launch and are masked out
                m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
                used_g = tl.zeros([BLOCK_G], tl.int32) + used
                for j in tl.static_range(SPLITS):
                    other = pair * SPLITS + j
                    written = used_g > j  # [BLOCK_G]
                    m_j = tl.load(stats_ptr + (other * BLOCK_G + g) * 2, mask=written,
                                  other=float("-inf"), cache_modifier=".cg")
                    m_all = tl.maximum(m_all, m_j)
                total = tl.zeros([BLOCK_G], tl.float32)
                merged = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
                for j in tl.static_range(SPLITS):
                    other = pair * SPLITS + j
                    written = used_g > j
                    m_j = tl.load(stats_ptr + (other * BLOCK_G + g) * 2, mask=written,
                                  other=float("-inf"), cache_modifier=".cg")
                    l_j = tl.load(stats_ptr + (other * BLOCK_G + g) * 2 + 1, mask=written,
                                  other=0.0, cache_modifier=".cg")
                    a_j = tl.load(acc_ptr + (other * BLOCK_G + g)[:, None] * HEAD_DIM
                                  + d[None, :], mask=written[:, None], other=0.0,
                                  cache_modifier=".cg")
                    w = tl.where(l_j > 0, tl.exp(m_j - m_all), 0.0)
                    total += l_j * w
                    merged += a_j * w[:, None]
                tl.store(count_ptr + pair, 0)
                tl.store(out_rows, (merged / total[:, None]).to(out_ptr.dtype.element_ty),
                         mask=gmask[:, None])


def paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, slot_ids,
                                  scale: float, row_order: torch.Tensor | None = None,
                                  out: torch.Tensor | None = None,
                                  workspace: SplitWorkspace | None = None) -> torch.Tensor:
    """Triton kernel; see the module docstring. `out` [B, Hq, D] may be given (static buffer).

    With a `workspace`, a launch of too few (row, kv head) programs to fill the GPU splits each
    sequence's tiles over up to `num_splits(B, Hkv)` programs (flash-decoding; a sequence
    uses at most one split per tile, read from its length on the device) and merges them in
    the same launch; without one, one program walks the whole sequence.

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
    splits = 1
    if (workspace is not None and workspace.group_block == block_g
            and workspace.head_dim == D):
        splits = num_splits(B, Hkv)
        if B * Hkv * splits > workspace.programs:
            splits = 1
    acc = workspace.acc if splits > 1 else out
    stats = workspace.stats if splits > 1 else out
    counters = workspace.counters if splits > 1 else slot_ids
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, page_table, seq_lens, slot_ids, out, acc, stats, counters,
        row_order if row_order is not None else slot_ids,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), out.stride(0), out.stride(1), scale, Hkv,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=D, PAGE=P,
        BLOCK_N=max(P, SPLIT_TILE_TOKENS if splits > 1 else TILE_TOKENS),
        SPLITS=splits, IEEE=q.dtype == torch.float32, ORDERED=row_order is not None,
        num_warps=NUM_WARPS if splits > 1 else NUM_WARPS_ONE_SPLIT, num_stages=NUM_STAGES,
        **pdl_launch(q))
    return out
