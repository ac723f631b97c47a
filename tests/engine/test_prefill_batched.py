"""Packed (varlen) prefill: attention of chunked prefills equals unchunked and a float64
causal reference (torch path; Triton kernel in interpreter mode), and `LLM` prefills of many
prompts in one step give HF's logits and the tokens each prompt gets alone."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.prefill_attention import PrefillBatch, prefill_attention_torch
from engine.testing import hf_logits, run_in_triton_interpreter


def _cache(lengths, q_heads=4, kv_heads=2, d=16, page=16, seed=0):
    """Slots holding `lengths` tokens on shuffled pages; q for every token of every slot."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in lengths]
    num_pages = sum(pages_per) + 2
    k = torch.randn(num_pages + 1, page, kv_heads, d, generator=g)
    v = torch.randn(num_pages + 1, page, kv_heads, d, generator=g)
    table = torch.full((len(lengths) + 1, max(pages_per)), num_pages, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).tolist()
    for s, n in enumerate(pages_per):
        for i in range(n):
            table[s, i] = perm.pop()
    q = [torch.randn(n, q_heads, d, generator=g) for n in lengths]
    return q, k, v, table


def _reference(q, k, v, table, slot, page):
    """float64 causal attention of all of `q` (one slot, positions 0..n-1)."""
    n, hq, d = q.shape
    pos = torch.arange(n)
    pages = table[slot].long()[pos // page]
    kk = k[pages, pos % page].double().repeat_interleave(hq // k.shape[2], 1)
    vv = v[pages, pos % page].double().repeat_interleave(hq // k.shape[2], 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), kk) * d ** -0.5
    s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("split", [[1.0], [0.5, 0.5], [0.2, 0.3, 0.5]])
def test_chunked_prefill_attention_equals_unchunked_and_reference(split):
    lengths = [37, 16, 70, 1]
    q, k, v, table = _cache(lengths)
    scale = 16 ** -0.5
    outs = [torch.empty_like(x) for x in q]
    done = [0] * len(lengths)
    for r, frac in enumerate(split):  # each round packs one chunk of every sequence
        slots, lens, ctxs = [], [], []
        for s, n in enumerate(lengths):
            m = n - done[s] if r == len(split) - 1 else int(n * frac)
            if m > 0:
                slots.append(s), lens.append(m), ctxs.append(done[s])
        batch = PrefillBatch.build(slots, lens, ctxs, "cpu")
        qq = torch.cat([q[s][c:c + m] for s, m, c in zip(slots, lens, ctxs)])
        o = prefill_attention_torch(qq, k, v, table, batch, scale)
        for s, m, c, st in zip(slots, lens, ctxs, batch.host[1]):
            outs[s][c:c + m] = o[st:st + m]
            done[s] += m
    assert done == lengths
    for s in range(len(lengths)):
        torch.testing.assert_close(outs[s].double(), _reference(q[s], k, v, table, s, 16),
                                   rtol=1e-5, atol=1e-5)


_TRITON_CHECK = r"""
import torch
from engine.kernels.prefill_attention import (PrefillBatch, prefill_attention_torch,
                                              prefill_attention_triton)
g = torch.Generator().manual_seed(0)
for hq, hkv in ((4, 2), (2, 2), (8, 2)):
    lengths, ctxs = [70, 5, 130, 64], [0, 11, 40, 64]
    total = [n + c for n, c in zip(lengths, ctxs)]
    page, d = 16, 16
    pages = sum(-(-t // page) for t in total) + 1
    k = torch.randn(pages + 1, page, hkv, d, generator=g)
    v = torch.randn(pages + 1, page, hkv, d, generator=g)
    width = max(-(-t // page) for t in total)
    table = torch.full((len(total) + 1, width), pages, dtype=torch.int32)
    perm = torch.randperm(pages, generator=g).tolist()
    for s, t in enumerate(total):
        for i in range(-(-t // page)):
            table[s, i] = perm.pop()
    slots = [2, 0, 3, 1]
    lq = [lengths[s] for s in slots]
    cq = [ctxs[s] for s in slots]
    batch = PrefillBatch.build(slots, lq, cq, "cpu")
    q = torch.randn(sum(lq), hq, d, generator=g)
    a = prefill_attention_triton(q, k, v, table, batch, 0.25)
    b = prefill_attention_torch(q, k, v, table, batch, 0.25)
    err = float((a - b).abs().max())
    assert err < 1e-4, (hq, hkv, err)
print("ok")
"""


@pytest.mark.timeout(280)
def test_triton_prefill_kernel_in_interpreter_matches_torch_path():
    pytest.importorskip("triton")
    res = run_in_triton_interpreter(_TRITON_CHECK, timeout_s=270)
    assert res.returncode == 0, res.stdout + res.stderr


def test_many_prompts_prefilled_in_one_step_match_hf_and_their_solo_runs(tiny_dir, hf_model):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (9, 33, 1, 17, 64)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_logits=True)
    llm = LLM(tiny_dir, max_batch=8, max_model_len=96)
    try:
        llm.step_log = []
        together = llm.generate(prompts, greedy)
        assert llm.step_log[0][:3] == ("prefill", 0, len(prompts))  # one packed prefill step
        alone = [llm.generate([p], greedy)[0] for p in prompts]
    finally:
        llm.shutdown()
    hf = hf_model(tiny_dir)
    for p, t, a in zip(prompts, together, alone):
        assert t.token_ids == a.token_ids
        ref = hf_logits(hf, p)[-1]
        rel = float((t.logits[0] - ref).abs().max() / ref.abs().max())
        assert rel < 1e-4, rel
