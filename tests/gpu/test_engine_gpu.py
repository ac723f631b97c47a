"""GPU checks of the engine (marker `gpu`; skipped only where CUDA is unavailable).

* The Triton paged decode-attention kernel against the float64 reference at long, ragged
  contexts with the Qwen3 head shapes.
* Qwen3-0.6B (random weights, real shapes) in bfloat16 against HF transformers at the same
  weights, teacher-forced on the engine's own tokens. The tolerance is stated relative to the
  noise floor of HF itself (eager vs SDPA attention in bf16): the engine's worst logit delta to
  HF eager must be within 4x that floor plus 0.05. The float32 run must agree to 1e-3 relative.
Numbers are printed (run with -s to see them).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_heads, kv_heads, page_size", [(16, 8, 16), (32, 8, 16), (32, 8, 64)])
@pytest.mark.parametrize("split", [False, True])
def test_triton_decode_attention_long_ragged_contexts(dtype, q_heads, kv_heads, page_size,
                                                      split):
    """One launch over ragged lengths, and with a workspace (the split-KV path: a sequence
    of one tile stores directly, a longer one merges one split per tile up to the launch's
    count); with split, each length alone too (batch 1: 16 splits)."""
    from engine.kernels.decode_attention import (
        SplitWorkspace,
        paged_decode_attention_reference,
        paged_decode_attention_triton,
    )
    from engine.testing import make_case

    lengths = [1, 2, 15, 16, 17, 127, 128, 129, 1000, 4097, 8192, 16383]
    ws = SplitWorkspace.for_heads("cuda", q_heads, kv_heads, 128) if split else None
    tol = 2e-5 if dtype == "float32" else 2e-2
    for rows in [lengths] + ([[n] for n in lengths] if split else []):
        case = make_case(rows, q_heads, kv_heads, head_dim=128, page_size=page_size,
                         dtype=getattr(torch, dtype), device="cuda", seed=3)
        out = paged_decode_attention_triton(*case, 128 ** -0.5, workspace=ws)
        torch.cuda.synchronize()
        ref = paged_decode_attention_reference(*[t.cpu() for t in case], 128 ** -0.5)
        err = float((out.double().cpu() - ref).abs().max())
        print(f"\ntriton decode attention {dtype} Hq={q_heads} Hkv={kv_heads} page={page_size}"
              f" split={split} rows {len(rows)}: max abs err {err:.3g} (tol {tol})")
        assert err < tol, rows
    if ws is not None:
        assert int(ws.counters.abs().sum()) == 0, "a split counter was left non-zero"


def test_longest_first_row_order_gives_the_same_attention_bit_for_bit():
    """A decode launch of many rows (the ordered path) and a split launch, each with its rows
    taken longest first: the outputs of the unordered launches, bit for bit."""
    from engine.kernels.decode_attention import (
        ORDER_MIN_ROWS,
        SplitWorkspace,
        longest_first,
        paged_decode_attention_triton,
    )
    from engine.testing import make_case

    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 2048, (ORDER_MIN_ROWS + 15,), generator=g).tolist()
    q, k, v, table, lens, slots = make_case(lengths, 16, 8, head_dim=128, page_size=16,
                                            dtype=torch.bfloat16, device="cuda", seed=4)
    order = longest_first((lens[slots.long()].long() - 1).cpu())  # sorted on the host
    assert order is not None and int(lens[slots[int(order[0])]]) == max(lengths)
    order = order.cuda()
    ws = SplitWorkspace.for_heads("cuda", 16, 8, 128)
    for rows in (len(slots), 8):  # 8 rows: the split-KV path
        args = (q[:rows], k, v, table, lens, slots[:rows], 128 ** -0.5)
        sub = order if rows == len(slots) else torch.randperm(rows, generator=g).cuda()
        plain = paged_decode_attention_triton(*args, workspace=ws)
        ordered = paged_decode_attention_triton(*args, sub, workspace=ws)
        assert torch.equal(plain, ordered), rows


@pytest.fixture(scope="module")
def qwen06_dir(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("qwen3-0.6b", tmp_path_factory.mktemp("q06"), seed=0,
                           dtype="bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_qwen3_06b_logits_vs_hf(qwen06_dir, dtype):
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.testing import hf_cuda_logits

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 151936, (700,), generator=g).tolist()
    n = 24
    with LLM(qwen06_dir, device="cuda", dtype=dtype, max_batch=4, max_model_len=1024) as llm:
        out, = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0,
                                                      ignore_eos=True, return_logits=True))
        # continuous batching on the GPU path: same tokens in a batch of 3 as alone
        batch = llm.generate([prompt[:50], prompt, prompt[:300]],
                             SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        alone = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                       ignore_eos=True))
    tokens = prompt + out.token_ids[:-1]
    eager = hf_cuda_logits(qwen06_dir, dtype, "eager", tokens)[len(prompt) - 1:]
    sdpa = hf_cuda_logits(qwen06_dir, dtype, "sdpa", tokens)[len(prompt) - 1:]
    scale = float(eager.abs().max())
    engine_delta = float((out.logits - eager).abs().max())
    floor = float((sdpa - eager).abs().max())
    agree = float((out.logits.argmax(-1) == eager.argmax(-1)).float().mean())
    print(f"\nqwen3-0.6b {dtype}: worst |engine - HF eager| logit delta {engine_delta:.4g}, "
          f"HF sdpa-vs-eager noise floor {floor:.4g}, max |logit| {scale:.3g}, "
          f"argmax agreement {agree:.3f} over {n} positions")
    if dtype == "float32":
        assert engine_delta / scale < 1e-3
    else:
        assert engine_delta <= 4 * floor + 0.05
    assert batch[1].token_ids == alone[0].token_ids


@pytest.mark.timeout(600)
def test_qwen3_4b_decode_of_40_rows_vs_hf(tmp_path):
    """40 sequences decoded together run the 40-row bucket, served by the table's 64-row
    entry: Qwen3-4B's fused layer with activation-descriptor (x_tma) tiles. Their logits stay
    within the HF eager-vs-sdpa noise floor, as the 0.6B test's do."""
    from engine.llm import LLM
    from engine.model_dir import write_model_dir
    from engine.sampling import SamplingParams
    from engine.kernels import skinny_gemm as sg
    from engine.testing import hf_cuda_logits

    served = sg.table_entry(sg.load_table(), 19456, 2560, True, 40)
    assert served.skinny_wins and served.config.x_tma  # the tile this test exists for
    model = write_model_dir("qwen3-4b", tmp_path / "q4b", seed=0, dtype="bfloat16")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 151936, (40, 24), generator=g).tolist()
    n = 4
    with LLM(model, device="cuda", max_batch=40, max_model_len=64) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0,
                                                    ignore_eos=True, return_logits=True))
        assert llm.steps["replay"] >= n - 1
    tokens = [p + o.token_ids[:-1] for p, o in zip(prompts, outs)]
    eager = hf_cuda_logits(model, "bfloat16", "eager", tokens)[:, 23:]
    sdpa = hf_cuda_logits(model, "bfloat16", "sdpa", tokens)[:, 23:]
    engine = torch.stack([o.logits for o in outs])
    delta = float((engine - eager).abs().max())
    floor = float((sdpa - eager).abs().max())
    print(f"\nqwen3-4b, 40 rows: worst |engine - HF eager| logit delta {delta:.4g}, HF "
          f"sdpa-vs-eager noise floor {floor:.4g}, max |logit| {float(eager.abs().max()):.3g}")
    assert delta <= 4 * floor + 0.05
