"""Skinny decode GEMM on the GPU: every configuration of the shipped table (the fastest tile
of each measured shape and M, also where cuBLAS won, since a fused layer uses it) and of the
step-tuned plans at its real shape against a float64 oracle, bit-identical across launches and inside a CUDA graph,
counters left at zero; the residual and folded-norm epilogues at the real shapes; the QKV GEMM
with the q/k norm + RoPE + KV-write epilogue against the two launches it replaces."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cases():
    from engine.kernels import skinny_gemm as sg

    for key, rows in sorted(sg.load_table().items()):
        if key.endswith(" rope"):  # the QKV GEMM with its rope epilogue: tested below
            continue
        n, k = (int(v) for v in key.split()[0].split("x"))
        for m, entry in sorted(rows.items()):
            if entry.config is not None:
                yield pytest.param(n, k, "swiglu" in key, m, entry.config,
                                   id=f"{key}-M{m}")
    yield from _plan_cases()
    # tiles on the CUDA cores (gemv) at Qwen3-4B's o_proj and gate_up, whether or not the
    # table or a plan names one: narrower than a tensor-core tile, split and unsplit, 1-8 rows
    for n, k, swiglu in ((2560, 4096, False), (19456, 2560, True)):
        for m, cfg in ((1, sg.TileConfig(8, 1024, 1, 8, 1, gemv=True)),
                       (1, sg.TileConfig(4, 512, 4, 4, 1, gemv=True)),
                       (3, sg.TileConfig(16, 256, 2, 4, 1, gemv=True)),
                       (8, sg.TileConfig(4, 512, 1, 8, 1, gemv=True))):
            yield pytest.param(n, k, swiglu, m, cfg, id=f"gemv {n}x{k}-M{m}-{cfg.block_n}x"
                                                        f"{cfg.block_k}s{cfg.split_k}")


def _plan_cases():
    """The step-tuned plans' tiles (`engine/layers/fused_plans.json`), the rope QKV tiles
    aside (tested below with their epilogue)."""
    from engine.layers.linear import ROLES, load_fused_plans

    for layer, plans in sorted(load_fused_plans().items()):
        shapes = dict(part.split() for part in layer.split(", "))
        for m, plan in sorted(plans.items()):
            for role in ROLES:
                if role == "qkv" and plan.rope:
                    continue
                n, k = (int(v) for v in shapes[role].split("x"))
                yield pytest.param(n, k, role == "gate_up", m, getattr(plan, role),
                                   id=f"plan {shapes[role]} {role}-M{m}")


@pytest.mark.parametrize("n, k, swiglu, m, cfg", list(_cases()))
def test_table_config_matches_float64_and_replays_identically(n, k, swiglu, m, cfg):
    from engine.kernels import skinny_gemm as sg

    torch.manual_seed(m)
    ws = sg.Workspace("cuda", n, cfg.split_k, -(-n // cfg.block_n))
    # w first: a one-tile program loads its weights before the PDL wait, so the launch just
    # before the GEMM must not be the one that writes them (engine.kernels.pdl)
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    y = sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu)
    ref = sg.skinny_gemm_torch(x.double(), w.double(), swiglu)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    again = sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu)
    assert torch.equal(y, again)
    out = torch.empty_like(y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sg.skinny_gemm(x, w, ws, cfg, swiglu=swiglu, out=out)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
    assert int(ws.counters.abs().sum()) == 0


def test_programmatic_dependent_launch_changes_no_result(monkeypatch):
    """A chain of PDL launches (skinny GEMM -> SwiGLU GEMM -> split-KV decode attention) inside a
    CUDA graph gives bit-identical results to the same chain launched without PDL."""
    from engine.kernels import decode_attention as da
    from engine.kernels import pdl
    from engine.kernels import skinny_gemm as sg
    from engine.testing import make_case

    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("PDL needs compute capability 9.0")
    torch.manual_seed(0)
    ws = sg.Workspace("cuda", 4096, 8, 256)
    aws = da.SplitWorkspace.for_heads("cuda", 16, 8, 128)
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    w1 = torch.randn(2048, 1024, dtype=torch.bfloat16, device="cuda") / 32
    w2 = torch.randn(4096, 1024, dtype=torch.bfloat16, device="cuda") / 32
    q, k, v, table, lens, slots = make_case([700, 33, 5], 16, 8, 128, dtype=torch.bfloat16,
                                            device="cuda")

    def chain():
        h = sg.skinny_gemm(x, w1, ws, sg.TileConfig(32, 128, 4))
        # one tile per program (K 1024 / split 4 = block_k): weights loaded before the wait
        a = sg.skinny_gemm(h[:, :1024].contiguous(), w2, ws, sg.TileConfig(32, 256, 4),
                           swiglu=True)
        o = da.paged_decode_attention_triton(q + a[: q.shape[0], :1].unsqueeze(-1), k, v,
                                             table, lens, slots, 0.1, workspace=aws)
        return h, a, o

    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LOCKSTEP_PDL", flag)
        assert pdl.use_pdl(x) == (flag == "1")
        eager = chain()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain()
        g.replay()
        torch.cuda.synchronize()
        for e, r in zip(eager, out):
            assert torch.equal(e, r)
        results[flag] = eager
    for off, on in zip(results["0"], results["1"]):
        assert torch.equal(off, on)


def test_programmatic_dependent_launch_only_for_decode_sized_launches():
    from engine.kernels import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    assert pdl.use_pdl(torch.zeros(pdl.MAX_ROWS, 8, device="cuda"))
    assert not pdl.use_pdl(torch.zeros(pdl.MAX_ROWS + 1, 8, device="cuda"))


def _fused_cases():
    from engine.kernels import skinny_gemm as sg

    table = sg.load_table()
    for name, hidden, q_out, inter in (("0.6b", 1024, 4096, 3072), ("4b", 2560, 6144, 9728)):
        o_in = 2048 if name == "0.6b" else 4096
        for m in (1, 8, 64):
            entries = [sg.table_entry(table, n, k, sw, m) for n, k, sw in
                       ((q_out, hidden, False), (hidden, o_in, False),
                        (2 * inter, hidden, True), (hidden, inter, False))]
            tiles = [e.config if e is not None else None for e in entries]
            if all(tiles):
                yield pytest.param(hidden, q_out, o_in, inter, m, tiles, id=f"{name}-M{m}")
    # every GEMM of the chain on the CUDA cores (gemv tiles), split and unsplit
    gemv = [sg.TileConfig(8, 1024, 1, 8, 1, gemv=True), sg.TileConfig(4, 512, 2, 4, 1, gemv=True),
            sg.TileConfig(8, 512, 1, 4, 1, gemv=True), sg.TileConfig(4, 1024, 4, 8, 1, gemv=True)]
    for m in (1, 5):
        yield pytest.param(2560, 6144, 4096, 9728, m, gemv, id=f"4b-M{m}-gemv")


@pytest.mark.parametrize("hidden, q_out, o_in, inter, m, tiles", list(_fused_cases()))
def test_fused_layer_chain_matches_float64_and_replays_identically(hidden, q_out, o_in, inter,
                                                                   m, tiles):
    """o_proj with the residual epilogue -> gate_up over the folded norm -> down with the
    residual epilogue -> QKV over the folded norm, at a real layer's shapes and the table's
    tiles: against float64, and bit-identical in a CUDA graph (PDL on where supported)."""
    from engine.kernels import skinny_gemm as sg

    qkv_t, o_t, gu_t, down_t = tiles
    torch.manual_seed(m)
    eps = 1e-6
    dev = dict(dtype=torch.bfloat16, device="cuda")
    ws = sg.Workspace("cuda", 2 * inter, 8, 2 * inter // min(t.block_n for t in tiles))
    attn = torch.randn(m, o_in, **dev)
    res0 = torch.randn(m, hidden, **dev)
    w_o = torch.randn(hidden, o_in, **dev) / o_in ** 0.5
    w_gu = torch.randn(2 * inter, hidden, **dev) / hidden ** 0.5
    w_down = torch.randn(hidden, inter, **dev) / inter ** 0.5
    w_qkv = torch.randn(q_out, hidden, **dev) / hidden ** 0.5
    n1, n2 = (1 + 0.1 * torch.randn(hidden, **dev) for _ in range(2))
    f_gu, f_qkv = w_gu.clone(), w_qkv.clone()
    sg.fold_norm_weight(f_gu, n1)
    sg.fold_norm_weight(f_qkv, n2)

    def chain(res):
        s = sg.skinny_gemm_add_residual(attn, w_o, res, ws, o_t)
        act = sg.skinny_gemm(res, f_gu, ws, gu_t, swiglu=True, row_stats=s, eps=eps)
        s = sg.skinny_gemm_add_residual(act, w_down, res, ws, down_t)
        return act, sg.skinny_gemm(res, f_qkv, ws, qkv_t, row_stats=s, eps=eps)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    res = res0.clone()
    act, qkv = chain(res)
    # float64 oracle fed with the kernel's own bf16 intermediates, so each step is judged alone
    r1 = attn.double() @ w_o.double().T + res0.double()
    want_act = sg.skinny_gemm_torch(rms(r1, n1), w_gu.double(), True)
    r2 = act.double() @ w_down.double().T + r1
    want_qkv = rms(res.double(), n2) @ w_qkv.double().T
    for got, want, what in ((act, want_act, "gate_up"), (res, r2, "residual"),
                            (qkv, want_qkv, "qkv")):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, (what, err)
    g = torch.cuda.CUDAGraph()
    graph_res = res0.clone()
    with torch.cuda.graph(g):
        out = chain(graph_res)
    for _ in range(2):
        graph_res.copy_(res0)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], act) and torch.equal(out[1], qkv)
        assert torch.equal(graph_res, res)
    assert int(ws.counters.abs().sum()) == 0


def _rope_cases():
    from engine.kernels import skinny_gemm as sg

    from engine.layers.linear import load_fused_plans

    table = sg.load_table()
    plans = load_fused_plans()
    for name, hidden, nq, nkv in (("0.6b", 1024, 16, 8), ("4b", 2560, 32, 8)):
        n = (nq + 2 * nkv) * 128
        # the step-tuned plans' QKV tiles where the plan puts the rope epilogue in them
        planned = {m: plan.qkv for key, by_rows in plans.items()
                   if key.startswith(f"qkv {n}x{hidden},")
                   for m, plan in by_rows.items() if plan.rope}
        for m in sorted({1, 8, 64} | set(planned)):
            entry = sg.table_entry(table, n, hidden, False, m, rope=True)
            tiles = {sg.TileConfig(64, 256, hidden // 256), sg.TileConfig(64, 128, 1)}
            if entry is not None and entry.config is not None:
                tiles.add(entry.config)
            if m in planned:
                tiles.add(planned[m])
            for t in sorted(tiles, key=str):
                yield pytest.param(hidden, nq, nkv, m, t,
                                   id=f"{name}-M{m}-{t.block_k}x{t.split_k}w{t.num_warps}"
                                      + ("-tma" if t.tma else ""))


def _qkv_layer(hidden: int, nq: int, nkv: int, d: int):
    """A random bf16 QKV weight [(nq + 2 nkv) d, hidden], q/k norm weights [d] near 1 and
    float32 RoPE tables [4096, d] (rotate-half layout), on the GPU."""
    dev = dict(dtype=torch.bfloat16, device="cuda")
    w_qkv = torch.randn((nq + 2 * nkv) * d, hidden, **dev) / hidden ** 0.5
    qw, kw = 1 + 0.1 * torch.randn(2, d, **dev)
    angles = torch.outer(torch.arange(4096, device="cuda").float(),
                         1e-6 ** (torch.arange(0, d, 2, device="cuda").float() / d)).repeat(1, 2)
    return w_qkv, qw, kw, angles.cos().contiguous(), angles.sin().contiguous()


@pytest.mark.parametrize("hidden, nq, nkv, m, tile", list(_rope_cases()))
def test_qkv_rope_epilogue_matches_the_two_launches_and_replays_identically(hidden, nq, nkv,
                                                                            m, tile):
    """down's residual epilogue -> the QKV GEMM over the folded norm with the q/k norm, RoPE
    and KV write in its epilogue, at a real layer's shapes (PDL on where supported): q and
    the cache entries against `skinny_gemm` + `fused.qk_norm_rope_kv` and float64, nothing
    else in the caches written, bit-identical in a CUDA graph."""
    from engine.kernels import fused
    from engine.kernels import skinny_gemm as sg

    torch.manual_seed(m)
    d, page, eps, inter = 128, 16, 1e-6, 3 * hidden
    dev = dict(dtype=torch.bfloat16, device="cuda")
    ws = sg.Workspace("cuda", (nq + 2 * nkv) * d, 16, 256)
    w_down = torch.randn(hidden, inter, **dev) / inter ** 0.5
    w_qkv, qw, kw, cos, sin = _qkv_layer(hidden, nq, nkv, d)
    act = torch.randn(m, inter, **dev)
    res0 = torch.randn(m, hidden, **dev)
    pos = torch.randint(0, 4096, (m,), device="cuda")
    slots = torch.randperm(m, device="cuda").to(torch.int32)
    pt = torch.randperm(m * 256, device="cuda").to(torch.int32).view(m, 256)

    def caches():
        return [torch.full((m * 256 + 1, page, nkv, d), float("nan"), **dev) for _ in range(2)]

    def down(res):
        return sg.skinny_gemm_add_residual(act, w_down, res, ws, sg.TileConfig(32, 128, 4))

    k1, v1 = caches()
    res = res0.clone()
    s = down(res)
    y = sg.skinny_gemm(res, w_qkv, ws, sg.TileConfig(32, 256, 1), row_stats=s, eps=eps)
    q1 = fused.qk_norm_rope_kv(y, qw, kw, cos, sin, pos, slots, pt, k1, v1, nq, nkv, eps)
    k2, v2 = caches()
    rope = sg.RopeKV(qw, kw, cos, sin, pos, slots, pt, k2, v2, nq, nkv, eps)

    def chain(r):
        return sg.skinny_gemm_qkv_rope(r, w_qkv, ws, tile, rope, row_stats=down(r), eps=eps)

    res = res0.clone()
    q2 = chain(res)
    r64 = res.double()
    x64 = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps)
    k3, v3 = [c.double() for c in caches()]
    q3 = fused.qk_norm_rope_kv_torch(x64 @ w_qkv.double().T, qw.double(), kw.double(),
                                     cos.double(), sin.double(), pos, slots, pt, k3, v3, nq,
                                     nkv, eps)
    for got, two, want, what in ((q2, q1, q3, "q"), (k2, k1, k3, "k"), (v2, v1, v3, "v")):
        assert torch.equal(got.isnan(), two.isnan()), f"{what}: other cache entries written"
        got, two = got.double().nan_to_num(), two.double().nan_to_num()
        err = ((got - want.nan_to_num()).norm() / want.nan_to_num().norm()).item()
        assert err < 1e-2, (what, err)
        assert ((got - two).norm() / two.norm()).item() < 1e-2, what
    eager_k, eager_v = k2.clone(), v2.clone()
    g = torch.cuda.CUDAGraph()
    graph_res = res0.clone()
    with torch.cuda.graph(g):
        out = chain(graph_res)
    for _ in range(2):
        graph_res.copy_(res0)
        k2.fill_(float("nan"))
        v2.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, q2) and torch.equal(graph_res, res)
        for got, want in ((k2, eager_k), (v2, eager_v)):
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("hidden, nq, nkv, m, tile", [
    (2560, 32, 8, 1, (64, 128, 1, 4, 4, True)),   # Qwen3-4B (group 4), the 8-row rope tile
    (2560, 32, 8, 1, (64, 128, 2, 4, 4, True)),   # split-K: the fix-up program attends
    (2560, 32, 8, 3, (64, 128, 1, 8, 4, True)),
    (1024, 16, 8, 1, (64, 128, 1, 4, 4, False)),  # Qwen3-0.6B (group 2), pointer tiles
])
def test_attention_in_the_qkv_tail_matches_float64_and_replays_identically(hidden, nq, nkv, m,
                                                                           tile):
    """`skinny_gemm_qkv_rope(..., attend=...)` at real layer shapes, 128-token tile, pages of
    16, PDL on where supported: the attention output against float64 over each row's first
    128 tokens of the launch's own q, K and V (one row past the tile), q/K/V bit-identical to
    the launch without the tail, bit-identical across a CUDA graph's replays, counters at zero."""
    from engine.kernels import skinny_gemm as sg
    from engine.kernels.decode_attention import paged_decode_attention_reference

    torch.manual_seed(m + nq)
    d, page, eps, tokens = 128, 16, 1e-6, 128
    cfg = sg.TileConfig(*tile[:5], tma=tile[5])
    dev = dict(dtype=torch.bfloat16, device="cuda")
    ws = sg.Workspace("cuda", (nq + 2 * nkv) * d, 16, 256)
    w_qkv, qw, kw, cos, sin = _qkv_layer(hidden, nq, nkv, d)
    x = torch.randn(m, hidden, **dev)
    pos = torch.tensor([127, 40, 300][:m], device="cuda")  # at 3 rows, one past the tile
    slots = torch.randperm(m, device="cuda").to(torch.int32)
    pt = torch.randperm(m * 32, device="cuda").to(torch.int32).view(m, 32)
    lens = torch.zeros(m, dtype=torch.int32, device="cuda")
    lens[slots.long()] = (pos + 1).to(torch.int32)
    old = [torch.randn(m * 32 + 1, page, nkv, d, **dev) for _ in range(2)]
    k1, v1 = [c.clone() for c in old]
    q1 = sg.skinny_gemm_qkv_rope(x, w_qkv, ws, cfg,
                                 sg.RopeKV(qw, kw, cos, sin, pos, slots, pt, k1, v1, nq, nkv, eps))
    k2, v2 = [c.clone() for c in old]
    o = torch.full((m, nq * d), float("nan"), **dev)
    rope = sg.RopeKV(qw, kw, cos, sin, pos, slots, pt, k2, v2, nq, nkv, eps)
    tail = sg.AttendTail(o, lens, d ** -0.5, tokens)

    def launch():
        return sg.skinny_gemm_qkv_rope(x, w_qkv, ws, cfg, rope, attend=tail)

    q2 = launch()
    torch.cuda.synchronize()
    assert torch.equal(q2, q1) and torch.equal(k2, k1) and torch.equal(v2, v1)
    want = paged_decode_attention_reference(q1, k1, v1, pt, lens.clamp(max=tokens), slots,
                                            d ** -0.5).reshape(m, nq * d)
    err = ((o.double().cpu() - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    eager = o.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    for _ in range(2):
        o.fill_(float("nan"))
        k2.copy_(old[0])
        v2.copy_(old[1])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, eager)
    assert int(ws.counters.abs().sum()) == 0 and int(ws.group_counters.abs().sum()) == 0


@pytest.mark.parametrize("n, k, swiglu, m, cfg", [
    (19456, 2560, True, 64, (32, 64, 1, 4)),
    (6144, 2560, False, 33, (64, 128, 1, 5)),
    (2560, 9728, False, 64, (64, 64, 4, 5)),
    (2560, 4096, False, 1, (64, 128, 2, 3)),
    (2560, 512, False, 16, (64, 256, 2, 3)),  # one block_k per split: the one-tile path
])
def test_activation_descriptor_tiles_equal_pointer_tiles_bit_for_bit(n, k, swiglu, m, cfg):
    """An `x_tma` tile reads the same values as the same tile's per-thread loads, so its
    products, fix-up and epilogue are the same: the result is bit-identical, and an x the bulk
    copy cannot read (a view 2 bytes past an aligned start) falls back to those loads."""
    import dataclasses

    from engine.kernels import skinny_gemm as sg

    if not sg.tma_supported(torch.device("cuda")):
        pytest.skip("tensor descriptors need compute capability 9.0")
    bn, bk, split, stages = cfg
    tile = sg.TileConfig(bn, bk, split, 4, stages, tma=True, x_tma=True)
    ws = sg.Workspace("cuda", n, split, -(-n // bn))
    torch.manual_seed(m)
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    assert sg._bulk_aligned(x)  # so the x_tma launch below reads x through its descriptor
    y = sg.skinny_gemm(x, w, ws, tile, swiglu=swiglu)
    pointer = sg.skinny_gemm(x, w, ws, dataclasses.replace(tile, x_tma=False), swiglu=swiglu)
    assert torch.equal(y, pointer)
    ref = sg.skinny_gemm_torch(x.double(), w.double(), swiglu)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    shifted = torch.empty(m * k + 1, dtype=torch.bfloat16, device="cuda")[1:].view(m, k)
    shifted.copy_(x)
    assert not sg._bulk_aligned(shifted)
    assert torch.equal(sg.skinny_gemm(shifted, w, ws, tile, swiglu=swiglu), y)
    assert int(ws.counters.abs().sum()) == 0
