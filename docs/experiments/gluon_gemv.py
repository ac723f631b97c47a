"""A one-row GEMV in Gluon whose first weight stages are requested before the PDL wait
(docs/benchmarks.md, 2026-12-07, session of 10:26 UTC; an experiment, not engine code).

The engine's looped skinny-GEMM programs start reading their weight only after
`griddepcontrol.wait`: Triton's software pipeline issues its prologue right before the loop,
and the wait has to come before the loop because the activation is read in it. Peeling the
first tile to load it earlier broke that pipeline and was slower (2026-12-02). Gluon states the
pipeline by hand, so this kernel issues its first STAGES tensor-descriptor (TMA) copies of the
weight into shared memory, then waits for the previous grid, then reads the activation and
multiplies tile by tile on the CUDA cores, refilling each stage as it is consumed. The launch
chain experiment of 2026-12-06 measured what loading before the wait is worth to an ideal
streaming kernel at one program per SM: 0.95 us a launch. Qwen3-4B's one-row plan runs qkv
(96 programs) and o_proj (40) at one program per SM.

Epilogues, as `engine.kernels.skinny_gemm` at one row: RESIDUAL (residual <- product +
residual, rounded as there, and this block's sum of squares into the row statistics) or NORM_IN
(the product scaled by 1 / sqrt(mean(x^2) + eps) from the statistics the previous residual
launch left). Compiles with Triton 3.6 (the device image's); there is no interpreter for Gluon.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from engine.kernels import skinny_gemm


@gluon.jit
def _gemv_kernel(w_desc, x_ptr, out_ptr, stats_ptr, stats_in, K, eps,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, CHUNK_K: gl.constexpr,
                 STAGES: gl.constexpr, RESIDUAL: gl.constexpr, NORM_IN: gl.constexpr,
                 STATS_BLOCK: gl.constexpr, STATS_STRIDE: gl.constexpr, PDL: gl.constexpr,
                 num_warps: gl.constexpr):
    pid = gl.program_id(0)
    row0 = pid * BLOCK_N
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    cols: gl.constexpr = gl.SliceLayout(0, tile)
    rows: gl.constexpr = gl.SliceLayout(1, tile)
    smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    num_k = gl.cdiv(K, BLOCK_K)
    # the weight is written once, at load: its first stages may be read before the wait
    for i in gl.static_range(STAGES):
        if i < num_k:
            mbarrier.expect(bars.index(i), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [row0, i * BLOCK_K], bars.index(i),
                                            smem.index(i))
    if PDL:  # x and the row statistics are the previous launches' writes
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
    kk = gl.arange(0, CHUNK_K, layout=cols)
    acc = gl.zeros([BLOCK_N], gl.float32, layout=rows)
    for k in range(num_k):
        slot = k % STAGES
        mbarrier.wait(bars.index(slot), (k // STAGES) & 1)
        stage = smem.index(slot)
        for c in gl.static_range(BLOCK_K // CHUNK_K):
            x = gl.load(x_ptr + k * BLOCK_K + c * CHUNK_K + kk).to(gl.float32)
            w = stage.slice(c * CHUNK_K, CHUNK_K, dim=1).load(tile).to(gl.float32)
            acc += gl.sum(w * gl.expand_dims(x, 0), axis=1)
        gl.thread_barrier()  # every warp has read this stage before the copy overwrites it
        if k + STAGES < num_k:
            mbarrier.expect(bars.index(slot), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [row0, (k + STAGES) * BLOCK_K],
                                            bars.index(slot), stage)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
    n = row0 + gl.arange(0, BLOCK_N, layout=rows)
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    if NORM_IN:
        b = gl.arange(0, STATS_BLOCK, layout=rows)
        ss = gl.load(stats_ptr + b * STATS_STRIDE, mask=b < stats_in, other=0.0)
        acc = acc * (1.0 / gl.sqrt(gl.sum(ss, axis=0) / K + eps))
    y = acc
    if RESIDUAL:
        res = gl.load(out_ptr + n).to(gl.float32)
        y = (acc.to(dtype).to(gl.float32) + res).to(dtype).to(gl.float32)
        gl.store(stats_ptr + pid * STATS_STRIDE, gl.sum(y * y, axis=0))
    gl.store(out_ptr + n, y.to(dtype))


def _descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    return TensorDescriptor.from_tensor(w, [block_n, block_k], layout)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, workspace: skinny_gemm.Workspace,
         block_n: int, block_k: int, stages: int, num_warps: int = 4, residual: bool = False,
         row_stats: skinny_gemm.RowStats | None = None, eps: float = 0.0,
         chunk_k: int = 64) -> int:
    """out <- x @ w^T for one bf16 row (or out += it with `residual`, leaving the row
    statistics in `workspace`); x [1, K], w [N, K] with N % block_n == 0 and K % block_k == 0.
    Returns the column blocks (the statistics' partials with `residual`)."""
    N, K = w.shape
    assert x.shape == (1, K) and N % block_n == 0 and K % block_k == 0 and x.is_contiguous()
    blocks = N // block_n
    stats_in = row_stats.partials if row_stats is not None else 0
    _gemv_kernel[(blocks,)](
        _descriptor(w, block_n, block_k), x, out, workspace.stats, stats_in, K, eps,
        BLOCK_N=block_n, BLOCK_K=block_k, CHUNK_K=chunk_k, STAGES=stages, RESIDUAL=residual,
        NORM_IN=row_stats is not None, STATS_BLOCK=triton.next_power_of_2(max(stats_in, 1)),
        STATS_STRIDE=skinny_gemm.MAX_ROWS, PDL=True, num_warps=num_warps,
        launch_pdl=True)
    return blocks
