"""Chunked prefill through the engine (issue 12 item 2, I19): prompts longer than a step's
prefill budget are written into the paged KV cache over several steps through the chunk slot,
decode rows going on beside them; the tokens and logits equal prefilling each prompt at once
and HF's."""

from __future__ import annotations

import pytest
import torch

from engine.testing import hf_logits

pytestmark = pytest.mark.timeout(300)


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (70, 9, 41, 3, 23)]


def _serve(tiny_dir, budget, prompts, **kw):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, return_logits=True)
    llm = LLM(tiny_dir, max_batch=4, max_model_len=96, max_prefill_tokens=budget, **kw)
    try:
        llm.step_log = []
        outs = llm.generate(prompts, greedy)
        steps = llm.step_log
        trace = list(llm.trace)
    finally:
        llm.shutdown()
    return outs, steps, trace


def test_chunked_prefill_gives_the_tokens_and_logits_of_unchunked_prefill_and_hf(tiny_dir,
                                                                                 hf_model):
    prompts = _prompts()
    whole, whole_steps, _ = _serve(tiny_dir, 8192, prompts)
    chunked, steps, trace = _serve(tiny_dir, 16, prompts, record_trace=True)
    assert max(s[4] for s in whole_steps) > 16  # unchunked: a step prefills more than 16
    assert max(s[4] for s in steps) <= 16       # chunked: no step prefills more than 16
    sends = [e for e in trace if e.kind == "op" and e.what == "prefill" and "chunk" in e.detail]
    assert sends, "no step carried a chunk"
    # a chunk shares steps with decode rows (mixed steps)
    assert any(kind == "mixed" for kind, *_ in steps)
    hf = hf_model(tiny_dir)
    for p, a, b in zip(prompts, whole, chunked):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
        ref = hf_logits(hf, p + b.token_ids[:-1])[len(p) - 1:]  # HF over the same history
        rel = float((b.logits - ref).abs().max() / ref.abs().max())
        assert rel < 1e-4, rel
        assert b.token_ids == ref.argmax(dim=-1).tolist()


def test_a_prompt_longer_than_the_budget_is_served_beside_decoding_requests(tiny_dir,
                                                                              hf_model):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(7)
    short = torch.randint(0, 500, (5,), generator=g).tolist()
    long = torch.randint(0, 500, (90,), generator=g).tolist()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(tiny_dir, max_batch=4, max_model_len=128, max_prefill_tokens=8,
              kv_cache_pages=16)
    try:
        llm.step_log = []
        outs = llm.generate([short, long], greedy)
        steps = llm.step_log
    finally:
        llm.shutdown()
    hf = hf_model(tiny_dir)
    for prompt, out in zip((short, long), outs):  # HF's greedy choice at every position
        ref = hf_logits(hf, prompt + out.token_ids[:-1])[len(prompt) - 1:]
        assert out.token_ids == ref.argmax(dim=-1).tolist()
    # the 90-token prompt took 12 steps of at most 8 prompt tokens, beside the short one's rows
    assert sum(s[4] for s in steps) == 5 + 90 and max(s[4] for s in steps) <= 8
    assert sum(1 for kind, rows, *_ in steps if kind == "mixed" and rows == 1) >= 10
