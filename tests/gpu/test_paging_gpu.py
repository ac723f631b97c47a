"""KV pages on demand on the GPU (I14; marker `gpu`, skipped only where CUDA is unavailable).

A tiny float32 model with a KV cache of one full-length sequence (5 pages) against the same
engine with room for every slot: preemption and recompute give the same greedy and seeded
sampled tokens, through the Triton paged decode kernel and CUDA graph replays whose page table
is refreshed in place (I12), and the greedy tokens equal HF transformers'.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny_cuda_dir(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("tiny", tmp_path_factory.mktemp("tiny_gpu"), seed=0, dtype="float32")


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in (20, 9, 33, 14, 26, 5)]


def _run(model_dir, params, **kw):
    from engine.llm import LLM

    llm = LLM(model_dir, device="cuda", dtype="float32", max_batch=4, max_model_len=80, **kw)
    try:
        outs = llm.generate(_prompts(), params)
        return [o.token_ids for o in outs], llm.controller.preemptions, dict(llm.steps)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("sampled", [False, True])
def test_small_kv_pool_preempts_and_keeps_tokens_with_graph_replays(tiny_cuda_dir, sampled):
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.8 if sampled else 0, top_k=50,
                            ignore_eos=True, seed=11)
    roomy, none, _ = _run(tiny_cuda_dir, params, cuda_graph=True)
    tight, preempted, steps = _run(tiny_cuda_dir, params, cuda_graph=True, kv_cache_pages=5)
    eager, _, _ = _run(tiny_cuda_dir, params, cuda_graph=False, kv_cache_pages=5)
    print(f"\npaging on GPU (sampled={sampled}): {preempted} preemptions, steps {steps}")
    assert none == 0 and preempted > 0 and steps["replay"] > 0
    assert tight == roomy == eager
    if not sampled:
        from transformers import AutoModelForCausalLM

        from engine.testing import hf_greedy

        hf = AutoModelForCausalLM.from_pretrained(str(tiny_cuda_dir), attn_implementation="eager",
                                                  dtype=torch.float32).eval()
        for prompt, tokens in list(zip(_prompts(), tight))[:3]:
            assert tokens == hf_greedy(hf, prompt, 40)
