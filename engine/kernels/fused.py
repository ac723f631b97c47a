"""Fused Triton kernels of the decode step, each with a torch reference of the same function.

A Qwen3 layer written with plain torch ops launches ~60 small kernels per decode step; these
three fusions bring the non-GEMM part of a layer down to four launches (add+RMSNorm twice, the
q/k norm + RoPE + KV write, SwiGLU) beside the decode-attention kernel and the three cuBLAS
GEMMs. Every kernel reads its inputs once and writes its outputs once; none reads a host value
that changes between steps, so each is safe inside a CUDA graph (I12).

    `add_rms_norm`        residual <- x + residual (model dtype); out = RMSNorm(residual).
    `qk_norm_rope_kv`     per head of the fused qkv row: RMSNorm + RoPE on q and k, k and v
                          stored into the paged KV cache, q returned.
    `silu_mul`            SwiGLU activation: silu(gate) * up of the fused gate_up output.

Rounding follows Qwen3's modules (HF transformers): the residual sum and the normalised value
are rounded to the model dtype before the weight multiply, as `RMSNorm` does; silu(gate) is
rounded before the product. RoPE is computed in float32 from the float32 cos/sin tables and
rounded once (HF rounds cos/sin and each product to the model dtype: ours is the more exact).

The `*_torch` functions are the same functions in torch (the CPU path and the tests' mid-level
oracle); the tests also compare against float64 recomputations.
"""

from __future__ import annotations

import torch

from engine.kernels.pdl import pdl_launch

try:  # Triton is optional on CPU-only machines; the torch path needs none of it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def _need_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs triton (pip install triton)")


# -- add + RMSNorm ------------------------------------------------------------------------------


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `add_rms_norm` (same rounding); returns (out, new residual).

    Unlike the Triton version it does not write `residual` in place.
    """
    s = x if residual is None else x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N,
                             eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if PDL:  # see engine.kernels.pdl: wait for the previous grid before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * stride_r + cols, s, mask=mask)
            h = s.to(tl.float32)
        else:
            h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (h * rstd).to(x.dtype).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add and RMSNorm over the last dimension, one Triton launch.

    Args:
        x: [T, N] (model dtype), last dim contiguous.
        residual: [T, N] same dtype, or None (first layer: the residual becomes `x` itself).
            Overwritten in place with x + residual (rounded to the dtype).
        weight: [N] norm weight. eps: added to the mean square (float32 statistics).
        out: optional [T, N] output buffer.
    Returns:
        (out [T, N] = weight * RMSNorm(x + residual), residual) where residual is the updated
        residual tensor (or `x` when `residual` was None).
    Raises:
        RuntimeError: Triton is not installed.
    """
    _need_triton("add_rms_norm")
    T, N = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous()
    if out is None:
        out = torch.empty_like(x)
    res = residual if residual is not None else x
    assert res.stride(-1) == 1 and res.shape == x.shape
    block = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(T,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), N, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        **pdl_launch(x))
    return out, res


# -- q/k RMSNorm + RoPE + KV-cache write ---------------------------------------------------------


def qk_norm_rope_kv_torch(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          slot_ids: torch.Tensor, page_table: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, nq: int, nkv: int,
                          eps: float) -> torch.Tensor:
    """Torch version of `qk_norm_rope_kv` (same rounding); writes the caches, returns q."""
    T = qkv.shape[0]
    D = q_weight.shape[0]
    dtype = qkv.dtype
    q, k, v = qkv.split([nq * D, nkv * D, nkv * D], dim=-1)

    def norm(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (w * h.to(dtype)).float()

    pos = positions.long()
    c = cos[pos].unsqueeze(1)
    s = sin[pos].unsqueeze(1)

    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return (x * c + torch.cat((-x2, x1), dim=-1) * s).to(dtype)

    qo = rope(norm(q.reshape(T, nq, D), q_weight))
    ko = rope(norm(k.reshape(T, nkv, D), k_weight))
    P = k_cache.shape[1]
    pages = page_table[slot_ids.long(), pos // P].long()
    flat = pages * P + pos % P
    k_cache.view(-1, nkv, D).index_copy_(0, flat, ko.to(k_cache.dtype))
    v_cache.view(-1, nkv, D).index_copy_(0, flat, v.reshape(T, nkv, D).to(v_cache.dtype))
    return qo


if triton is not None:

    @triton.jit
    def _qk_norm_rope_kv_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                                pt_ptr, kc_ptr, vc_ptr, q_ptr, stride_qkv, stride_cos,
                                stride_pt, stride_kp, stride_kt, stride_kh, stride_qt,
                                stride_qh, eps, NQ: tl.constexpr, NKV: tl.constexpr,
                                D: tl.constexpr, PAGE: tl.constexpr, HB: tl.constexpr,
                                PDL: tl.constexpr):
        # one program: token t, heads hb * HB .. hb * HB + HB - 1 of [q heads | k heads | v heads]
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        d = tl.arange(0, D)
        HALF: tl.constexpr = D // 2
        rot = (d + HALF) % D
        is_q = h < NQ
        is_k = (h >= NQ) & (h < NQ + NKV)
        is_v = (h >= NQ + NKV) & (h < NQ + 2 * NKV)
        normed = (is_q | is_k)[:, None]
        # Before the PDL wait only what the launch just before does not write: the step's
        # positions and slots and the page table (through L2, ".cg"), the norm weights and the
        # cos/sin tables; see engine.kernels.pdl. The qkv row is read after the wait.
        pos = tl.load(pos_ptr + t, cache_modifier=".cg").to(tl.int64)
        slot = tl.load(slot_ptr + t, cache_modifier=".cg").to(tl.int64)
        page = tl.load(pt_ptr + slot * stride_pt + pos // PAGE,
                       cache_modifier=".cg").to(tl.int64)
        w = tl.where(is_q[:, None], tl.load(qw_ptr + d).to(tl.float32)[None, :],
                     tl.load(kw_ptr + d).to(tl.float32)[None, :])
        wr = tl.where(is_q[:, None], tl.load(qw_ptr + rot).to(tl.float32)[None, :],
                      tl.load(kw_ptr + rot).to(tl.float32)[None, :])
        c = tl.load(cos_ptr + pos * stride_cos + d)
        s = tl.load(sin_ptr + pos * stride_cos + d)
        if PDL:  # see engine.kernels.pdl: wait for the previous grid
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        base = qkv_ptr + t * stride_qkv + h[:, None] * D
        x = tl.load(base + d[None, :], mask=(normed | is_v[:, None]), other=0.0)
        xr = tl.load(base + rot[None, :], mask=normed, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
        xn = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w
        xn = xn.to(x.dtype).to(tl.float32)
        xrn = (xr.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * wr
        xrn = xrn.to(x.dtype).to(tl.float32)
        sign = tl.where(d < HALF, -1.0, 1.0)
        y = (xn * c[None, :] + sign[None, :] * xrn * s[None, :]).to(x.dtype)
        y = tl.where(normed, y, x)  # V passes through unchanged
        tl.store(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
                 y.to(q_ptr.dtype.element_ty), mask=is_q[:, None])
        off = page * stride_kp + (pos % PAGE) * stride_kt + d[None, :]
        tl.store(kc_ptr + off + (h - NQ)[:, None] * stride_kh, y.to(kc_ptr.dtype.element_ty),
                 mask=is_k[:, None])
        tl.store(vc_ptr + off + (h - NQ - NKV)[:, None] * stride_kh,
                 y.to(vc_ptr.dtype.element_ty), mask=is_v[:, None])


def heads_per_program(tokens: int) -> int:
    """Heads one program of `qk_norm_rope_kv` handles for a launch of `tokens` tokens: one head
    (one warp) per program while the tokens are few, so that every head runs in parallel;
    `HEAD_BLOCK` per program for large launches, where thousands of one-warp programs queue up
    on the SMs (Qwen3-0.6B at 256 rows: 8,192 programs). Depends only on the launch shape, so
    a graph captured at a bucket and the eager step at that bucket run the same programs.

    H200, 2026-12-01, CUDA-graph timed (`scratch` sweep of 1, 2, 4, 8 and 16 heads): Qwen3-0.6B
    at 256 tokens 6.69 us with one head, 3.29 with 16; at 64 tokens 2.78 and 1.68; Qwen3-4B at
    256 tokens 9.13 and 4.23; at 1 to 16 tokens one head is fastest (1.25-1.55 us)."""
    return 1 if tokens < HEAD_BLOCK_MIN_TOKENS else HEAD_BLOCK


HEAD_BLOCK = 16
"""Heads per program of a large `qk_norm_rope_kv` launch."""
HEAD_BLOCK_MIN_TOKENS = 32
"""Launches of at least this many tokens put `HEAD_BLOCK` heads in one program."""


def qk_norm_rope_kv(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    slot_ids: torch.Tensor, page_table: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, nq: int, nkv: int, eps: float,
                    out: torch.Tensor | None = None, heads: int | None = None) -> torch.Tensor:
    """Per-head q/k RMSNorm, RoPE and the KV-cache write of one layer, one Triton launch.

    Args:
        qkv: [T, (nq + 2 nkv) * D] fused projection output (model dtype), last dim contiguous.
        q_weight, k_weight: [D] per-head norm weights.
        cos, sin: float32 [max_position, D] RoPE tables ("rotate half" layout).
        positions: int [T] token positions (< max_position). slot_ids: int32 [T].
        page_table: int32 [slots + 1, pages_per_seq]; k_cache, v_cache: one layer's
            [num_pages + 1, page_size, nkv, D] cache, same strides, last dim contiguous.
        nq, nkv: this rank's query and kv heads. eps: RMSNorm epsilon.
        out: optional [T, nq, D] buffer for q.
        heads: heads per program (a power of two); default `heads_per_program(T)`.
    Returns:
        q [T, nq, D] normalised and rotated; K (normalised, rotated) and V are stored at
        page_table[slot, pos // page_size], row pos % page_size.
    Raises:
        RuntimeError: Triton is not installed.
    """
    _need_triton("qk_norm_rope_kv")
    T = qkv.shape[0]
    D = q_weight.shape[0]
    assert qkv.stride(-1) == 1 and qkv.shape[1] == (nq + 2 * nkv) * D
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    if out is None:
        out = torch.empty(T, nq, D, dtype=qkv.dtype, device=qkv.device)
    hb = heads_per_program(T) if heads is None else heads
    _qk_norm_rope_kv_kernel[(T, triton.cdiv(nq + 2 * nkv, hb))](
        qkv, q_weight, k_weight, cos, sin, positions, slot_ids, page_table, k_cache, v_cache,
        out, qkv.stride(0), cos.stride(0), page_table.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), eps,
        NQ=nq, NKV=nkv, D=D, PAGE=k_cache.shape[1], HB=hb,
        num_warps=max(1 if D <= 128 else 2, hb // 2), **pdl_launch(qkv))
    return out


# -- SwiGLU ---------------------------------------------------------------------------------------


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch version of `silu_mul`: [T, 2I] -> [T, I] = silu(gate) * up (model dtype)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, I, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        if PDL:  # see engine.kernels.pdl: wait for the previous grid before touching memory
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(gu_ptr + t * stride_gu + cols, mask=mask, other=0.0)
        u = tl.load(gu_ptr + t * stride_gu + I + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, (a * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation of the fused gate_up output, one Triton launch.

    Args:
        gate_up: [T, 2I] = [gate | up] (model dtype), last dim contiguous.
        out: optional [T, I] buffer.
    Returns:
        [T, I] = silu(gate) * up, silu rounded to the dtype before the product (as torch).
    Raises:
        RuntimeError: Triton is not installed.
    """
    _need_triton("silu_mul")
    T, two_i = gate_up.shape
    inter = two_i // 2
    assert gate_up.stride(-1) == 1
    if out is None:
        out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
        **pdl_launch(gate_up))
    return out
