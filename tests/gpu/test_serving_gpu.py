"""Serving on one GPU (marker `gpu`): the sampler's Triton kernel draws the torch stream at
the real vocabulary, batched sampling matches the reference, a request gets the same tokens
alone and in a batch of 40 (greedy and sampled, graphs on), packed prefill attention (Triton)
matches the torch path with chunks, a packed prefill gives HF's logits, and chunked prefill
through the engine equals unchunked."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_sampler_kernel_matches_torch_stream_and_reference_at_qwen_vocab():
    from engine.sampling import (BatchParams, SamplingParams, _noisy_argmax_torch,
                                 _noisy_argmax_triton, sample_batch, sample_reference)

    g = torch.Generator(device="cuda").manual_seed(0)
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.6, top_p=0.95),
             SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=0.8, min_p=0.05)]
    params = [kinds[i % 4] for i in range(64)]
    logits = torch.randn(64, 151936, device="cuda", generator=g) * 4
    bp = BatchParams.from_params(params, [1000 + i for i in range(64)], list(range(64)), "cuda")
    cut = torch.full((64,), float("-inf"), device="cuda")
    a = _noisy_argmax_triton(logits, bp, cut)
    b = _noisy_argmax_torch(logits, bp, cut)
    assert a.tolist() == b.tolist()
    tokens = sample_batch(logits, bp)[0].tolist()
    ref = [sample_reference(logits[i], p, 1000 + i, i)[0] for i, p in enumerate(params)]
    assert tokens == ref


def test_fused_sampler_matches_reference_token_for_token_on_mixed_rows():
    """300 rows at the real vocabulary, mixed parameters (the serving benchmark's T 0.6 /
    top-p 0.95 among them, flat rows so the redraw path runs, non-finite rows): the race + mass
    + pick kernels give `sample_reference`'s token (-1 where a logit is not finite)."""
    from engine.sampling import BatchParams, SamplingParams, sample_batch, sample_reference

    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.6, top_p=0.95),
             SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=0.7),
             SamplingParams(temperature=1.2, top_k=50, top_p=0.9),
             SamplingParams(temperature=0.8, min_p=0.05, top_p=0.8),
             SamplingParams(temperature=0.6, top_p=1 - 2**-24)]
    n, vocab = 300, 151936
    params = [kinds[i % len(kinds)] for i in range(n)]
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(n, vocab, device="cuda", generator=g)
    logits[::3] *= 4
    logits[1::3] *= 0.05  # flat: winners often leave the nucleus
    logits[7, 11], logits[100, 5], logits[211, 0] = float("nan"), float("inf"), float("-inf")
    seeds, index = [17 * i + 5 for i in range(n)], [i % 9 for i in range(n)]
    bp = BatchParams.from_params(params, seeds, index, "cuda")
    tokens = sample_batch(logits, bp)[0].tolist()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    ref = [sample_reference(logits[i], p, seeds[i], index[i])[0] if finite[i] else -1
           for i, p in enumerate(params)]
    assert tokens == ref
    assert len(set(tokens)) > n // 2


def test_device_top_p_cut_equals_the_sorted_cut_at_qwen_vocab():
    """The top-p cut searched on the device for redrawn rows equals `thresholds`' sorted cut
    at the real vocabulary (flat, peaked and tied rows, top-k and min-p mixed in)."""
    from engine.sampling import (BatchParams, SamplingParams, _cuts, _launch_race,
                                 _redraw_triton, thresholds)

    kinds = [SamplingParams(temperature=0.6, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.3),
             SamplingParams(temperature=1.2, top_k=5000, top_p=0.1),
             SamplingParams(temperature=0.8, min_p=0.05, top_p=0.8),
             SamplingParams(temperature=0.6, top_p=1 - 2**-24)]
    n, vocab = 100, 151936
    params = [kinds[i % len(kinds)] for i in range(n)]
    g = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(n, vocab, device="cuda", generator=g)
    logits[::3] *= 4
    logits[1::3] *= 0.05
    logits[2::3] = logits[2::3].round()  # ties
    bp = BatchParams.from_params(params, list(range(n)), [1] * n, "cuda")
    _, cut_k, cut = _cuts(logits, bp)
    race = _launch_race(logits, bp, cut, cut_k)
    flagged = race.redo.bool()
    got = _redraw_triton(logits, bp, cut, cut_k, race)
    want = thresholds(logits * bp.inv_temp[:, None], bp)
    assert int(flagged.sum()) >= 10
    assert torch.equal(got[flagged], want[flagged])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("tiny-tied", tmp_path_factory.mktemp("s"), seed=5, dtype="float32")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_alone_and_in_a_batch_of_40_with_graphs(model_dir, temperature):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 500, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 40, (40,), generator=g)]
    params = [SamplingParams(max_tokens=8 + i % 7, temperature=temperature, top_p=0.9,
                             seed=100 + i, ignore_eos=True) for i in range(40)]
    with LLM(model_dir, device="cuda", max_batch=64, max_model_len=128) as llm:
        together = llm.generate(prompts, params)
        alone = [llm.generate([prompts[i]], params[i])[0] for i in (0, 13, 39)]
        assert llm.steps["replay"] > 0
    for i, a in zip((0, 13, 39), alone):
        assert together[i].token_ids == a.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_torch_path_with_chunks(dtype):
    from engine.kernels.prefill_attention import (PrefillBatch, prefill_attention_torch,
                                                  prefill_attention_triton)

    g = torch.Generator().manual_seed(1)
    page, d, hq, hkv = 16, 128, 16, 8
    lengths, ctxs = [700, 5, 1024, 64, 300], [0, 11, 400, 64, 0]
    total = [n + c for n, c in zip(lengths, ctxs)]
    pages = sum(-(-t // page) for t in total) + 1
    k = torch.randn(pages + 1, page, hkv, d, generator=g).to(dtype).cuda()
    v = torch.randn(pages + 1, page, hkv, d, generator=g).to(dtype).cuda()
    table = torch.full((len(total) + 1, max(-(-t // page) for t in total)), pages,
                       dtype=torch.int32)
    perm = torch.randperm(pages, generator=g).tolist()
    for s, t in enumerate(total):
        for i in range(-(-t // page)):
            table[s, i] = perm.pop()
    table = table.cuda()
    batch = PrefillBatch.build(list(range(5)), lengths, ctxs, "cuda")
    q = torch.randn(sum(lengths), hq, d, generator=g).to(dtype).cuda()
    a = prefill_attention_triton(q, k, v, table, batch, d ** -0.5).float()
    b = prefill_attention_torch(q, k, v, table, batch, d ** -0.5).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert float((a - b).abs().max()) < tol


def test_packed_prefill_logits_match_hf(model_dir):
    from transformers import AutoModelForCausalLM

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (9, 100, 1, 33, 64)]
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, return_logits=True)
    with LLM(model_dir, device="cuda", max_batch=8, max_model_len=128) as llm:
        outs = llm.generate(prompts, greedy)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        rel = float((o.logits[0] - ref).abs().max() / ref.abs().max())
        assert rel < 1e-3, rel


def test_chunked_prefill_equals_unchunked_with_graphs(model_dir):
    """Prompts longer than the step's prefill budget (chunked through the chunk slot, beside
    replayed decode rows) give the tokens and logits of prefilling them at once."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (100, 7, 61, 3, 90)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    outs = {}
    for budget in (8192, 24):
        with LLM(model_dir, device="cuda", max_batch=8, max_model_len=128,
                 max_prefill_tokens=budget) as llm:
            llm.step_log = []
            outs[budget] = llm.generate(prompts, greedy)
            assert max(s[4] for s in llm.step_log) <= budget
    for a, b in zip(outs[8192], outs[24]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-3, atol=1e-3)
