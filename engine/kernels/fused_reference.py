"""float64 oracles of the fused decode kernels (`engine.kernels.fused`), for tests and checks.

Each computes the mathematical function in float64 with no intermediate rounding, so both the
Triton kernels and their torch twins are compared against it with a dtype-sized tolerance.
"""

from __future__ import annotations

import torch


def add_rms_norm_reference(x, residual, weight, eps: float):
    """float64 (out [T, N], residual sum [T, N]) of weight * RMSNorm(x + residual)."""
    s = x.double() if residual is None else x.double() + residual.double()
    out = weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return out, s


def qk_norm_rope_kv_reference(qkv, q_weight, k_weight, positions, theta: float, nq: int,
                              nkv: int, eps: float):
    """float64 (q [T, nq, D], k [T, nkv, D], v [T, nkv, D]): per-head RMSNorm and RoPE
    ("rotate half", base `theta`) of q and k; v passed through. Cos/sin are recomputed in
    float64 from `theta`, independently of the engine's tables."""
    T = qkv.shape[0]
    D = q_weight.shape[0]
    x = qkv.double()
    q, k, v = x.split([nq * D, nkv * D, nkv * D], dim=-1)
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.double().cpu()[:, None] * inv[None, :]
    cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None, :].to(x.device)
    sin = torch.cat((ang.sin(), ang.sin()), -1)[:, None, :].to(x.device)

    def norm_rope(h, w):
        h = w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        h1, h2 = h.chunk(2, dim=-1)
        return h * cos + torch.cat((-h2, h1), -1) * sin

    return (norm_rope(q.reshape(T, nq, D), q_weight), norm_rope(k.reshape(T, nkv, D), k_weight),
            v.reshape(T, nkv, D))


def silu_mul_reference(gate_up):
    """float64 [T, I] = silu(gate) * up of [T, 2I] = [gate | up]."""
    g, u = gate_up.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


def _rel(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out = out.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


def check_fused(device: str = "cpu", dtype: torch.dtype = torch.float32, impl: str = "triton",
                seed: int = 0, shapes=None) -> dict[str, float]:
    """Run each fused kernel on fresh random inputs against the float64 oracles.

    Args:
        device: where the inputs live ("cpu" with TRITON_INTERPRET=1 for the Triton kernels).
        dtype: model dtype of the inputs. impl: "triton" or "torch" (the torch twins).
        shapes: list of (T, hidden, nq, nkv, D, intermediate, page_size); default small ones
            with ragged sizes (hidden not a power of two, several pages).
    Returns:
        {check name: worst relative error}. Cache rows that must not be written are compared
        exactly against their poisoned values ("untouched": 0.0 or inf).
    """
    from engine.kernels import fused

    shapes = shapes or [(3, 80, 4, 2, 16, 96, 16), (5, 64, 8, 2, 32, 160, 16)]
    g = torch.Generator().manual_seed(seed)
    worst: dict[str, float] = {}

    def note(name, value):
        worst[name] = max(worst.get(name, 0.0), value)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

    eps = 1e-6
    theta = 1_000_000.0
    for T, hidden, nq, nkv, D, inter, page in shapes:
        # add + RMSNorm, with and without a residual
        x, r, w = rnd(T, hidden), rnd(T, hidden), rnd(hidden) + 1
        r_before = r.clone()
        for with_res in (True, False):
            res = r.clone() if with_res else None
            if impl == "triton":
                out, new_res = fused.add_rms_norm(x, res, w, eps)
            else:
                out, new_res = fused.add_rms_norm_torch(x, res, w, eps)
            ref, ref_s = add_rms_norm_reference(x, r_before if with_res else None, w, eps)
            note("add_rms_norm", _rel(out, ref))
            note("add_rms_norm.residual", _rel(new_res, ref_s))
        # q/k norm + RoPE + KV write into a poisoned paged cache
        max_pos = 4 * page + 7
        pages_per_seq = -(-max_pos // page)
        slots = T + 1
        num_pages = slots * pages_per_seq
        perm = torch.randperm(num_pages, generator=g).to(torch.int32)
        table = perm.view(slots, pages_per_seq).to(device)
        positions = torch.randint(0, max_pos, (T,), generator=g).to(device)
        slot_ids = torch.randperm(slots, generator=g)[:T].to(torch.int32).to(device)
        qkv = rnd(T, (nq + 2 * nkv) * D)
        qw, kw = rnd(D) + 1, rnd(D) + 1
        inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(device), emb.sin().to(device)
        kc0 = rnd(num_pages + 1, page, nkv, D, scale=100.0)
        vc0 = rnd(num_pages + 1, page, nkv, D, scale=100.0)
        rq, rk, rv = qk_norm_rope_kv_reference(qkv, qw, kw, positions, theta, nq, nkv, eps)
        pos = positions.long().cpu()
        pg = table.cpu()[slot_ids.long().cpu(), pos // page].long()
        row = pos % page
        # the Triton kernel with its default heads per program and with 4, 8 and 16 (a block of
        # heads that straddles q, k and v, and one past the last head)
        for heads in ((None, 4, 8, 16) if impl == "triton" else (None,)):
            kc, vc = kc0.clone(), vc0.clone()
            args = (qkv, qw, kw, cos, sin, positions, slot_ids, table, kc, vc, nq, nkv, eps)
            q = (fused.qk_norm_rope_kv(*args, heads=heads) if impl == "triton"
                 else fused.qk_norm_rope_kv_torch(*args))
            note("qk_norm_rope_kv.q", _rel(q, rq))
            note("qk_norm_rope_kv.k", _rel(kc.cpu()[pg, row], rk))
            note("qk_norm_rope_kv.v", _rel(vc.cpu()[pg, row], rv))
            mask = torch.ones(num_pages + 1, page, dtype=torch.bool)
            mask[pg, row] = False
            same = (torch.equal(kc.cpu()[mask], kc0.cpu()[mask])
                    and torch.equal(vc.cpu()[mask], vc0.cpu()[mask]))
            note("qk_norm_rope_kv.untouched", 0.0 if same else float("inf"))
        # SwiGLU
        gu = rnd(T, 2 * inter, scale=2.0)
        act = fused.silu_mul(gu) if impl == "triton" else fused.silu_mul_torch(gu)
        note("silu_mul", _rel(act, silu_mul_reference(gu)))
    return worst
