"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M (rows of the bucket) <= 64.

At decode batch sizes a linear layer is a weight read: M x N x K multiply-adds over N x K
weights, so the time is the weight bytes over the read bandwidth. cuBLAS's kernels for
M = 1..64 read the weights at 63-83% of the H200's bandwidth and split K with a separate
reduce launch (docs/benchmarks.md). This kernel reads each weight tile once, streams K in
BLOCK_K chunks, and when N alone gives too few programs to fill the GPU splits K over
SPLIT_K programs whose fp32 partial sums the last-arriving program of each column block adds
in a fixed order (a serial fix-up: deterministic, no second launch). An optional SwiGLU
epilogue computes silu(gate) * up of a fused [gate | up] weight in the same launch, so the
MLP's activation costs no launch of its own.

    `skinny_gemm(x, w, plan, swiglu=False)`   the Triton kernel (CUDA).
    `skinny_gemm_torch(x, w, swiglu=False)`   the same function in torch (CPU path, oracle).

Graph safety (I12): the kernel reads no host value that changes between steps; the split-K
partials and arrival counters live in a `Workspace` allocated before capture, and the last
program of each column block resets its counter, so every replay starts from zeros.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.kernels.pdl import pdl_launch

try:  # Triton is optional on CPU-only machines; the torch path needs none of it.
    import triton
    import triton.language as tl
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
    iteration (block_k), programs along K (split_k), warps and software-pipeline stages."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


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
    `stats`, float32 [max_blocks * MAX_ROWS], sums of squares at [block * MAX_ROWS + row].

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
                            ONE_TILE: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        mmask = m < M
        nmask = n < N_OUT
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn
        x_rows = x_ptr + m[:, None] * stride_xm
        k_begin = pid_k * K_SPLIT
        if ONE_TILE:
            # This program's whole K range is one tile: its weights (written at load, never by
            # the launch just before: engine.kernels.pdl) are loaded before the PDL wait,
            # behind the previous kernel's tail.
            k = k_begin + kk
            kmask = k < K
            wt = tl.load(w_cols + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            ut = wt
            if SWIGLU:
                ut = tl.load(w_cols + HALF * stride_wn + k[:, None],
                             mask=kmask[:, None] & nmask[None, :], other=0.0)
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
        if ONE_TILE:
            xt = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
                ut = ut.to(tl.float32)
            acc += _dot(xt, wt, IEEE)
            if SWIGLU:
                acc_up += _dot(xt, ut, IEEE)
        else:
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
                acc += _dot(xt, wt, IEEE)
                if SWIGLU:
                    ut = tl.load(w_cols + HALF * stride_wn + k[:, None],
                                 mask=kmask[:, None] & nmask[None, :], other=0.0)
                    if UPCAST:
                        ut = ut.to(tl.float32)
                    acc_up += _dot(xt, ut, IEEE)
        if PDL:  # the next kernel may start launching; it waits for this grid's completion
            tl.extra.cuda.gdc_launch_dependents()
        if SPLIT_K > 1:
            # Serial fix-up: publish this split's partials, count arrivals; the last program of
            # the column block sums every split in order 0..SPLIT_K-1 (deterministic).
            width = N_OUT * (2 if SWIGLU else 1)
            part = part_ptr + (pid_k * BLOCK_M + m)[:, None] * width + n[None, :]
            tl.store(part, acc, mask=mmask[:, None] & nmask[None, :])
            if SWIGLU:
                tl.store(part + N_OUT, acc_up, mask=mmask[:, None] & nmask[None, :])
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT_K):
                    p = part_ptr + (s * BLOCK_M + m)[:, None] * width + n[None, :]
                    acc += tl.load(p, mask=mmask[:, None] & nmask[None, :], other=0.0,
                                   cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(p + N_OUT, mask=mmask[:, None] & nmask[None, :],
                                          other=0.0, cache_modifier=".cg")
                tl.store(count_ptr + pid_n, 0)
                _skinny_epilogue(acc, acc_up, ss, res, K, eps, out_ptr, stats_ptr, pid_n, m, n,
                                 mmask, nmask, stride_om, SWIGLU, NORM_IN, RESIDUAL,
                                 STATS_STRIDE)
        else:
            _skinny_epilogue(acc, acc_up, ss, res, K, eps, out_ptr, stats_ptr, pid_n, m, n,
                             mmask, nmask, stride_om, SWIGLU, NORM_IN, RESIDUAL, STATS_STRIDE)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:  # float32 models: exact products, not TF32
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

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
        ValueError: M above MAX_ROWS, mismatched K, a split the workspace cannot hold, or
            row_stats of another row count.
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


def _launch(x, w, out, workspace, config, swiglu, row_stats, eps, residual) -> int:
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
    blocks = triton.cdiv(n_out, cfg.block_n)
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
    stats_in = row_stats.partials if row_stats is not None else 0
    block_m = max(16, triton.next_power_of_2(M))
    _skinny_gemm_kernel[(blocks, split)](
        x, w, out, workspace.partials, workspace.counters, workspace.stats, M, n_out, K,
        n_out, x.stride(0), w.stride(0), out.stride(0), stats_in, eps,
        SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split, K_SPLIT=k_split,
        NORM_IN=row_stats is not None, STATS_BLOCK=triton.next_power_of_2(max(stats_in, 1)),
        RESIDUAL=residual, STATS_STRIDE=MAX_ROWS,
        UPCAST=_INTERPRETED and x.dtype != torch.float32,
        IEEE=x.dtype == torch.float32,
        ONE_TILE=k_split <= cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x))
    return blocks


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


def shape_key(n: int, k: int, swiglu: bool) -> str:
    """Table key of a weight shape: "N x K" plus " swiglu" for a fused gate_up."""
    return f"{n}x{k}" + (" swiglu" if swiglu else "")


TABLE_PATH = os.path.join(os.path.dirname(__file__), "skinny_gemm_table.json")


@dataclass(frozen=True)
class TableEntry:
    """One measured (shape, M) of the table: the fastest skinny tile and both times (us per
    call in a CUDA graph, weights from HBM; cuBLAS's includes the SwiGLU launch for gate_up).
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
    import json

    with open(path) as f:
        raw = json.load(f)
    return parse_table(raw, path)


def parse_table(raw, source: str) -> dict[str, dict[int, TableEntry]]:
    """The table in `raw` (the JSON object `load_table` reads), checked entry by entry.

    Raises:
        ValueError: "<source>: not a skinny GEMM table (...)" for anything else.
    """
    try:
        return {str(key): {int(m): _parse_entry(e) for m, e in rows.items()}
                for key, rows in raw.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not a skinny GEMM table ({exc!r})") from None


def _parse_entry(e: dict) -> TableEntry:
    if e["skinny"] is None:
        return TableEntry(None, float("inf"), float(e["cublas_us"]))
    return TableEntry(TileConfig(**e["skinny"]), float(e["skinny_us"]), float(e["cublas_us"]))


def table_entry(table: dict, n: int, k: int, swiglu: bool, m: int) -> TableEntry | None:
    """The measurement that serves M rows of an [n, k] weight: the entry of the smallest
    measured row count >= m; None past MAX_ROWS or for a shape or row count the table lacks."""
    rows = table.get(shape_key(n, k, swiglu))
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
