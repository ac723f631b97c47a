"""The LM head writes float32 logits, into a caller's buffer when given (the decode graph's
static logits buffer); on CUDA a half-precision GEMM writes them unrounded."""

from __future__ import annotations

import torch

from engine.layers.embed_head import ParallelLMHead
from engine.parallel import SINGLE


def make_head(device, dtype):
    g = torch.Generator().manual_seed(0)
    head = ParallelLMHead(96, 32, SINGLE, dtype, device=device)
    head.weight.data.copy_((torch.randn(96, 32, generator=g) * 0.2).to(dtype))
    x = torch.randn(5, 32, generator=g).to(dtype).to(device)
    return head, x


def test_cpu_logits_are_float32_and_fill_the_given_buffer():
    head, x = make_head("cpu", torch.bfloat16)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, 96)
    out = torch.full((5, 96), float("nan"))
    assert head(x, out) is out
    assert torch.equal(out, logits)


class _TwoRanksStub:
    """Rank 0 of two: holds the first half of the vocabulary; the all-gather appends a second
    rank's slice (here the negated local one)."""

    world_size = 2

    def shard(self, n):
        return 0, n // 2

    def all_gather_last_dim(self, x):
        return torch.cat([x, -x], dim=-1)


def test_tensor_parallel_head_copies_the_gathered_logits_into_the_buffer():
    g = torch.Generator().manual_seed(1)
    head = ParallelLMHead(96, 32, _TwoRanksStub(), torch.float32)
    head.weight.data.copy_(torch.randn(48, 32, generator=g))
    x = torch.randn(3, 32, generator=g)
    local = x @ head.weight.t()
    out = torch.full((3, 96), float("nan"))
    assert head(x, out) is out
    torch.testing.assert_close(out, torch.cat([local, -local], dim=-1))
