"""The deferred down_proj sum of `split-k-no-fixup-step.patch`
against the shipped fix-up: a tiny model's greedy generations at one row, with a table whose
down splits K in two and whose QKV tile loops through a tensor descriptor, with
`engine.model.DEFER_DOWN` off and on. Tokens must be equal; prints the largest logit
difference relative to the largest logit (0.0 in Triton's interpreter, both dtypes).

    TRITON_INTERPRET=1 PYTHONPATH=. python3 docs/experiments/split-k-deferred-check.py DIR bfloat16
    PYTHONPATH=. python3 docs/experiments/split-k-deferred-check.py DIR bfloat16 cuda
"""
import sys

from engine import model as model_mod
from engine.kernels import skinny_gemm as sg
from engine.layers import linear
from engine.llm import LLM
from engine.sampling import SamplingParams

model_dir, dtype = sys.argv[1], sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)

def tile(n, k):
    if k == 128:  # down: two K splits, so its sum can be deferred
        return sg.TileConfig(32, 32, 2)
    if n == 128:  # qkv: a looping TMA tile (the one-row plan's kind)
        return sg.TileConfig(16, 32, 1, tma=True)
    return sg.TileConfig(16, 32, 1)

def for_model(cls, model, device, mode="auto"):
    shapes = {(m.weight.shape[0], m.weight.shape[1]) for m in model.modules()
              if isinstance(m, (linear.ColumnParallelLinear, linear.RowParallelLinear))}
    table = {sg.shape_key(n, k, sw): {64: sg.TableEntry(tile(n, k), 1.0, 2.0)}
             for n, k in shapes for sw in (False, True)}
    return cls.from_table(table, [n for n, _ in shapes], device)

linear.DecodeGemm.for_model = classmethod(for_model)
deferred = []
original = sg.skinny_gemm_add_residual
def counted(*a, defer_into=None, **kw):
    out = original(*a, defer_into=defer_into, **kw)
    deferred.append(isinstance(out, sg.DeferredSum))
    return out
sg.skinny_gemm_add_residual = counted

def run():
    with LLM(model_dir, device=device, dtype=dtype, max_batch=1, max_model_len=256) as llm:
        return [llm.generate([p], params)[0] for p in ([3, 5, 7, 11], [20, 21, 22])]

plain = run()
assert not any(deferred)
model_mod.DEFER_DOWN = True
deferred.clear()
with_defer = run()
assert any(deferred) and not all(deferred), deferred  # one-row steps defer all but the last layer
worst = 0.0
for a, b in zip(plain, with_defer):
    assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
    worst = max(worst, float((a.logits - b.logits).abs().max() / a.logits.abs().max()))
print("deferred launches", sum(deferred), "of", len(deferred), "worst", worst)
