"""The short path's fused layer form on the CPU, in Triton's interpreter: a generation whose
batch-1 decode steps replay `decode-short@1` runs attention fused into o_proj
(`engine.kernels.attention_oproj`) where the plan puts the q/k norm + RoPE + KV write in the
QKV GEMM (`FusedLayerPlan.rope`, 4 launches a layer), and gives the tokens of the same
generation with the short path off; where the plan has no such epilogue the short graph runs
the split-KV attention and o_proj (`engine.model.fuses_attention_oproj`)."""

from __future__ import annotations

import pytest

from engine.testing import run_in_triton_interpreter

_CHECK = r"""
import dataclasses, os, sys
sys.path.insert(0, os.getcwd())
import torch
import engine.executor as executor
from engine.engine_config import EngineConfig, SHORT_DECODE_TOKENS
from engine.kernels import attention_oproj
from engine.kernels import skinny_gemm as sg
from engine.layers import linear
from engine.llm import LLM
from engine.sampling import SamplingParams

model_dir = sys.argv[1]
rope_tiles = []

def for_model(cls, model, device, mode="auto"):
    shapes = {(m.weight.shape[0], m.weight.shape[1]) for m in model.modules()
              if isinstance(m, (linear.ColumnParallelLinear, linear.RowParallelLinear))}
    table = {sg.shape_key(n, k, sw): {64: sg.TableEntry(sg.TileConfig(16, 32, 2), 1.0, 2.0)}
             for n, k in shapes for sw in (False, True)}
    qkv = model.layers[0].self_attn.qkv_proj.weight.shape
    if rope_tiles:  # one program per head's rotate-half halves: block_n is half a head
        cfg = sg.TileConfig(model.layers[0].self_attn.d // 2, 32, 2)
        table[sg.shape_key(*qkv, False, rope=True)] = {64: sg.TableEntry(cfg, 1.0, 2.0)}
    return cls.from_table(table, [n for n, _ in shapes], "cpu")

linear.DecodeGemm.for_model = classmethod(for_model)
init = executor.RankExecutor.__init__

def init_with_short_workspace(self, *args, **kw):  # the CUDA-only workspace, on the CPU
    init(self, *args, **kw)
    if self.short_attention is not None:
        self.short_attention = executor.ShortAttention(
            self.short_attention.tokens, attention_oproj.AttnOprojWorkspace(
                self.device, self.settings.kv_heads_per_rank, self.cfg.hidden_size))

executor.RankExecutor.__init__ = init_with_short_workspace
fused_calls = []
kernel = attention_oproj.attention_oproj
def counted(*args, **kw):
    fused_calls.append(args[0].shape[0])
    return kernel(*args, **kw)
attention_oproj.attention_oproj = counted

g = torch.Generator().manual_seed(3)
prompt = torch.randint(0, 512, (SHORT_DECODE_TOKENS - 3,), generator=g).tolist()
params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, return_logits=True)

def run(short):
    config = EngineConfig.create(model_dir, cuda_graph=True, graph_standin=True, max_batch=2,
                                 max_model_len=256, dtype="bfloat16", record_trace=True)
    with LLM(dataclasses.replace(config, short_decode=short)) as llm:
        out = llm.generate([prompt], params)[0]
        served = [e.detail for e in llm.trace if e.kind == "op" and e.what == "launch"]
        plan = llm.ranks.executor.model.fused_plan(1)
    return out, served, plan

for rope in (False, True):
    rope_tiles[:] = []
    if rope:
        rope_tiles.append(True)
    fused_calls.clear()
    off, served_off, _ = run(False)
    assert not fused_calls and "decode-short@1" not in served_off, served_off
    on, served_on, plan = run(True)
    assert plan.rope == rope, plan
    # contexts SHORT_DECODE_TOKENS - 2 .. + 1: three short steps, then one past the tile
    assert served_on[-4:] == ["decode-short@1"] * 3 + ["decode@1"], served_on
    if rope:
        assert fused_calls and set(fused_calls) == {1}, fused_calls
    else:
        assert not fused_calls, fused_calls
    assert on.token_ids == off.token_ids, (rope, on.token_ids, off.token_ids)
    worst = float((on.logits - off.logits).abs().max()) / float(off.logits.abs().max())
    assert worst < 3e-2, (rope, worst)
    print("rope", rope, "fused calls", len(fused_calls), "worst", worst)
print("ok")
"""


@pytest.mark.timeout(540)
def test_short_path_fuses_attention_into_o_proj_where_the_plan_has_the_rope_epilogue(tiny_dir):
    res = run_in_triton_interpreter(_CHECK.replace("sys.argv[1]", repr(str(tiny_dir))))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok"), res.stdout
