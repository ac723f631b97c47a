"""The sampler that rank 0 enqueues behind the forward (`RankExecutor.enqueue_sample`) makes no
device-to-host sync: greedy, top-k (with the host-known bound `BatchParams.max_top_k`), top-p
and min-p rows, under torch's sync debug mode, which raises at any synchronizing call."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_sample_batch_makes_no_host_sync():
    from engine.sampling import BatchParams, SamplingParams, sample_batch

    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20, seed=1),
              SamplingParams(temperature=0.6, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, min_p=0.1, seed=3)]
    bp = BatchParams.from_params(params, [0, 1, 2, 3], [0, 1, 2, 3], device="cuda")
    bp.max_top_k = 20
    logits = torch.randn(4, 151936, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want, _ = sample_batch(logits, bp)  # compiles the kernels outside the debug mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, _ = sample_batch(logits, bp)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(tokens, want)
