"""The fused decoder-layer form (engine.model: residual add and RMSNorm carried by the skinny
GEMM's epilogues, the norm weights folded into QKV and gate_up) against the unfused form on
the same weights: whole generations on the CPU with the skinny GEMM in Triton's interpreter.
A prompt longer than the fused row limit runs its prefill unfused over the folded weights. A
third run puts the q/k norm + RoPE + KV write in the QKV GEMM's epilogue."""

from __future__ import annotations

import pytest

from engine.testing import run_in_triton_interpreter

_CHECK = r"""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from engine.kernels import skinny_gemm as sg
from engine.layers import linear
from engine.llm import LLM
from engine.sampling import SamplingParams

model_dir, dtype = sys.argv[1], sys.argv[2]
# a prefill of 94 rows (unfused, over the folded weights), then one of 14 rows (fused)
prompt_sets = [[list(range(3, 14)), [(7 * i) % 500 + 3 for i in range(80)], [5, 9, 11]],
               [list(range(20, 31)), [4, 8, 15]]]
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)

def run():
    with LLM(model_dir, device="cpu", dtype=dtype, max_batch=4, max_model_len=256) as llm:
        return [out for prompts in prompt_sets for out in llm.generate(prompts, params)]

plain = run()
# split-K on every GEMM (the fix-up carries the epilogues); o_proj (K = 64) and down
# (K = 128) leave 4 and 2 partials, so a norm reading the wrong launch's statistics shows
def tile(k):
    return sg.TileConfig(32, 32, 2) if k == 128 else sg.TileConfig(16, 32, 2)
built = []
rope_tiles = []  # set below: the QKV GEMM also does the q/k norm + RoPE + KV write

def for_model(cls, model, device, mode="auto"):
    shapes = {(m.weight.shape[0], m.weight.shape[1]) for m in model.modules()
              if isinstance(m, (linear.ColumnParallelLinear, linear.RowParallelLinear))}
    table = {sg.shape_key(n, k, sw): {64: sg.TableEntry(tile(k), 1.0, 2.0)}
             for n, k in shapes for sw in (False, True)}
    qkv = model.layers[0].self_attn.qkv_proj.weight.shape
    for cfg in rope_tiles:
        table[sg.shape_key(*qkv, False, rope=True)] = {64: sg.TableEntry(cfg, 1.0, 2.0)}
    gemm = cls.from_table(table, [n for n, _ in shapes], "cpu")
    built.append(model)
    return gemm

linear.DecodeGemm.for_model = classmethod(for_model)
calls = {}
for cls in (linear.ColumnParallelLinear, linear.RowParallelLinear):
    def counted(self, *args, _f=cls.forward, **kw):  # profilers label GEMMs by module call
        if kw.get("tile") is not None:
            calls[id(self)] = calls.get(id(self), 0) + 1
        return _f(self, *args, **kw)
    cls.forward = counted
fused = run()
model = built[0]
gemms = [m for m in model.modules()
         if isinstance(m, (linear.ColumnParallelLinear, linear.RowParallelLinear))]
assert len(gemms) == 4 * len(model.layers) and all(calls.get(id(m), 0) > 0 for m in gemms), calls
assert model.norms_folded and model.fused_plan(4) is not None and model.fused_plan(65) is None
worst = 0.0
for a, b in zip(plain, fused):
    assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
    scale = float(a.logits.abs().max())
    worst = max(worst, float((a.logits - b.logits).abs().max()) / scale)
head_dim = model.layers[0].self_attn.d
rope_tiles.append(sg.TileConfig(head_dim // 2, 32, 2))  # split-K: the fix-up runs the epilogue
with_rope = run()
assert built[-1].fused_plan(4).rope and built[-1].fused_plan(65) is None
for a, b in zip(plain, with_rope):
    assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
    scale = float(a.logits.abs().max())
    worst = max(worst, float((a.logits - b.logits).abs().max()) / scale)
rope_tiles.clear()
os.environ["LOCKSTEP_FUSED_NORM"] = "0"  # the A/B baseline: skinny GEMMs, nothing fused
calls.clear()
baseline = run()
assert not built[-1].norms_folded and not calls, calls
for a, b in zip(plain, baseline):
    assert a.token_ids == b.token_ids
print("worst", worst)
"""


@pytest.mark.timeout(540)
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_fused_layers_generate_what_unfused_layers_generate(tiny_dir, dtype, tol):
    res = run_in_triton_interpreter(_CHECK.replace("sys.argv[1], sys.argv[2]",
                                                   f"{str(tiny_dir)!r}, {dtype!r}"))
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("worst")[-1])
    assert worst < tol, worst
