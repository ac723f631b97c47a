"""The LM head on CUDA (marker `gpu`): a bf16 GEMM writes unrounded float32 logits, into
the caller's buffer when given."""

from __future__ import annotations

import pytest
import torch

from engine.layers.embed_head import ParallelLMHead
from engine.parallel import SINGLE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_half_precision_head_writes_unrounded_float32_into_the_buffer():
    g = torch.Generator(device="cuda").manual_seed(0)
    head = ParallelLMHead(4096, 256, SINGLE, torch.bfloat16, device="cuda")
    head.weight.data.copy_(torch.randn(4096, 256, device="cuda", generator=g) * 0.05)
    x = torch.randn(5, 256, device="cuda", generator=g).to(torch.bfloat16)
    exact = x.double() @ head.weight.double().t()
    out = torch.empty(5, 4096, device="cuda")
    assert head(x, out) is out
    rounded = torch.nn.functional.linear(x, head.weight).float()   # the bf16-output path
    assert float((out.double() - exact).abs().max()) < 1e-5
    assert float((rounded.double() - exact).abs().max()) > 1e-4    # bf16 rounding is visible
    assert torch.equal(head(x), out)                               # with or without a buffer
