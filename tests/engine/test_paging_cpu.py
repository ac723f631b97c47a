"""KV pages on demand in the engine (I14), on CPU: a KV cache smaller than max_batch x
max_model_len serves every request; page exhaustion preempts instead of failing, and the
preempted requests, recomputed from prompt + generated tokens, get the same tokens."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ParallelConfigError
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.testing import hf_greedy

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.8, top_k=50, ignore_eos=True, seed=11)


def _prompts(n=6):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in (20, 9, 33, 14, 26, 5)[:n]]


def _generate(model_dir, params, **kw):
    llm = LLM(model_dir, max_batch=4, max_model_len=80, **kw)
    try:
        outs = llm.generate(_prompts(), params)
        return [o.token_ids for o in outs], llm.controller.preemptions, llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def roomy(tiny_dir):
    """Every slot can hold a full-length sequence: no preemption."""
    greedy, preempted, _ = _generate(tiny_dir, GREEDY)
    sampled, _, _ = _generate(tiny_dir, SAMPLED)
    assert preempted == 0
    return greedy, sampled


def test_kv_pool_below_max_batch_times_max_model_len_serves_every_request(tiny_dir, roomy):
    # max_batch 4 x 80 tokens = 20 pages of 16; 5 pages hold one full-length sequence
    greedy, preempted, llm = _generate(tiny_dir, GREEDY, kv_cache_pages=5)
    assert llm.controller.memory.kv_pages == 5
    assert llm.ranks.executor.kv.k.shape[1] == 6  # + the padding page
    assert preempted > 0, "a 5-page pool must preempt on this workload"
    assert greedy == roomy[0]


def test_preemption_and_recompute_keep_greedy_tokens_equal_to_hf(tiny_dir, hf_model):
    greedy, preempted, _ = _generate(tiny_dir, GREEDY, kv_cache_pages=5)
    assert preempted > 0
    hf = hf_model(tiny_dir)
    for prompt, tokens in list(zip(_prompts(), greedy))[:3]:
        assert tokens == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_preempted_seeded_sampling_continues_the_same_stream(tiny_dir, roomy):
    sampled, preempted, _ = _generate(tiny_dir, SAMPLED, kv_cache_pages=5)
    assert preempted > 0
    assert sampled == roomy[1]


def test_graph_path_replays_over_on_demand_pages(tiny_dir, roomy):
    llm = LLM(tiny_dir, max_batch=4, max_model_len=80, kv_cache_pages=6, cuda_graph=True,
              _graph_standin=True)
    try:
        outs = llm.generate(_prompts(), GREEDY)
        assert llm.steps["replay"] > 0 and llm.controller.preemptions > 0
        assert [o.token_ids for o in outs] == roomy[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("pages", [4, 0, True, "5"])
def test_kv_cache_pages_below_one_sequence_is_refused_before_start(tiny_dir, pages):
    with pytest.raises(ParallelConfigError, match=f"kv_cache_pages = {pages!r}, expected an "
                                                  "integer >= 5"):
        LLM(tiny_dir, max_batch=4, max_model_len=80, kv_cache_pages=pages)


def test_tensor_parallel_ranks_apply_the_same_pages_and_preemptions(tiny_dir, roomy):
    greedy, preempted, _ = _generate(tiny_dir, GREEDY, kv_cache_pages=5, tensor_parallel_size=2)
    assert preempted > 0
    assert greedy == roomy[0]
