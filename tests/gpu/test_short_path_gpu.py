"""The short-context decode path on one GPU (marker `gpu`; skipped only where CUDA is
unavailable): Qwen3-0.6B's real shapes, where the fused layer form runs, so a batch-1 step
whose context fits `SHORT_DECODE_TOKENS` replays attention fused into o_proj
(`engine.kernels.attention_oproj`). A sequence that grows past the tile switches to the
split-KV graph, and its logits stay within the HF eager-vs-sdpa noise floor on both sides;
the short graph's replay is bit-identical to the same step run eagerly on the short path."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


SPLIT_KV = "_paged_decode_kernel"
"""The split-KV decode attention's kernel (`engine.kernels.decode_attention`)."""
FUSED_OPROJ = "_attn_oproj_kernel"
"""Attention fused into o_proj (`engine.kernels.attention_oproj`)."""


@pytest.fixture(scope="module")
def qwen06_dir(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("qwen3-0.6b", tmp_path_factory.mktemp("short"), seed=1,
                           dtype="bfloat16")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tail", [False, True], ids=["attention+o_proj", "qkv-tail"])
def test_short_path_across_the_tile_boundary_matches_hf_and_replays_bit_identically(
        qwen06_dir, tail, monkeypatch):
    """`tail`: the 1-row plan attends in the QKV launch's tail (`FusedLayerPlan.attend`)
    instead of fusing attention into o_proj."""
    import dataclasses

    from engine.bench.kernel_profile import kernel_events
    from engine.engine_config import SHORT_DECODE_TOKENS
    from engine.layers.linear import DecodeGemm
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.testing import hf_cuda_logits
    from protocol.keys import DECODE, SHORT, GraphKey

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 151936, (SHORT_DECODE_TOKENS - 20,), generator=g).tolist()
    n = 40  # decode contexts SHORT_DECODE_TOKENS - 19 .. + 19
    if tail:
        shipped = DecodeGemm.fused_layer_plan

        def attending(self, shapes, rows):
            plan = shipped(self, shapes, rows)
            return dataclasses.replace(plan, attend=True) if rows == 1 and plan.rope else plan

        monkeypatch.setattr(DecodeGemm, "fused_layer_plan", attending)
    with LLM(qwen06_dir, device="cuda", max_batch=4, max_model_len=512,
             record_trace=True) as llm:
        assert llm.config.short_context == SHORT_DECODE_TOKENS
        ex = llm.ranks.executor
        assert GraphKey(1, SHORT) in ex.graphs.keys and GraphKey(2, SHORT) not in ex.graphs.keys
        assert ex.model.fuses_short_path(1) != tail
        assert ex.model.fused_plan(1).attend == tail
        before = sum(1 for e in llm.trace if e.kind == "op" and e.what == "launch")
        out, = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0,
                                                      ignore_eos=True, return_logits=True))
        served = [e.detail for e in llm.trace if e.kind == "op" and e.what == "launch"][before:]
        assert served == [str(GraphKey(1, SHORT))] * 20 + [str(GraphKey(1, DECODE))] * 19
        # the static buffers hold a short step: its graph's replay against the same step
        # eager on the short path (its K/V rewrite is idempotent), and on the split-KV path
        llm.generate([prompt[:50]], SamplingParams(max_tokens=3, temperature=0,
                                                    ignore_eos=True))
        torch.cuda.synchronize()
        short_kernels = [e.name for e in kernel_events(lambda: ex.decode_forward(1, short=True))]
        split_kernels = [e.name for e in kernel_events(lambda: ex.decode_forward(1))]
        eager_short = ex.decode_forward(1, short=True).clone()
        eager_split = ex.decode_forward(1).clone()
        ex.graphs.launch(GraphKey(1, SHORT))
        torch.cuda.synchronize()
        replay = ex.logits_buf[:1].clone()
    assert torch.equal(replay, eager_short)
    # which attention ran, by kernel: the tail's attention can match the split-KV kernel's
    # bit for bit (the same one-tile softmax before the same o_proj), so logits cannot tell
    assert any(SPLIT_KV in k for k in split_kernels)
    assert not any(SPLIT_KV in k for k in short_kernels), "the short path ran split-KV"
    assert any(FUSED_OPROJ in k for k in short_kernels) != tail
    assert len(short_kernels) < len(split_kernels)
    assert float((eager_short - eager_split).abs().max()) < 0.05 * float(eager_split.abs().max())
    tokens = prompt + out.token_ids[:-1]
    eager = hf_cuda_logits(qwen06_dir, "bfloat16", "eager", tokens)[len(prompt) - 1:]
    sdpa = hf_cuda_logits(qwen06_dir, "bfloat16", "sdpa", tokens)[len(prompt) - 1:]
    floor = float((sdpa - eager).abs().max())
    for name, part in (("short", slice(1, 21)), ("split-KV", slice(21, None))):
        delta = float((out.logits[part] - eager[part]).abs().max())
        print(f"\n{name} steps: worst |engine - HF eager| {delta:.4g}, noise floor {floor:.4g}")
        assert delta <= 4 * floor + 0.05, name
