"""Vocab-parallel token embedding and LM head.

Each rank holds rows [rank * V/ws, (rank+1) * V/ws) of the embedding (and of the LM head,
which is the same tensor when the model ties them). The embedding looks up the ids it owns,
zeroes the rest and all-reduces; the LM head computes its vocabulary slice of the logits and
all-gathers them, so every rank ends with the full [B, V] logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import TPGroup
from engine.weights import WeightIndex


class VocabParallelEmbedding(nn.Module):
    """Token ids [T] (int64) -> embeddings [T, hidden] in the parameter dtype."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype,
                 device="cpu"):
        super().__init__()
        self.tp = tp
        self.start, self.stop = tp.shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden, dtype=dtype,
                                               device=device), requires_grad=False)

    def load(self, index: WeightIndex, name: str) -> None:
        """Copy this rank's vocabulary rows of checkpoint tensor `name`."""
        self.weight.data.copy_(index.read(name, 0, self.start, self.stop))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [T] -> [T, hidden]; ids outside this rank's range contribute zeros
        before the all-reduce (selected, not multiplied by 0: 0 x NaN is NaN)."""
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight)
        out = torch.where(mine.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Hidden states [B, hidden] -> float32 logits [B, vocab] on every rank.

    Args:
        tied: share the weight of `embedding` (Qwen3 small models) instead of loading
            lm_head.weight.
    """

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype,
                 embedding: VocabParallelEmbedding | None = None, device="cpu"):
        super().__init__()
        self.tp = tp
        self.start, self.stop = tp.shard(vocab_size)
        if embedding is not None:
            self.weight = embedding.weight
            self.tied = True
        else:
            self.weight = nn.Parameter(torch.empty(self.stop - self.start, hidden, dtype=dtype,
                                                   device=device), requires_grad=False)
            self.tied = False

    def load(self, index: WeightIndex, name: str) -> None:
        """Copy this rank's vocabulary rows of `name` (no-op when tied)."""
        if not self.tied:
            self.weight.data.copy_(index.read(name, 0, self.start, self.stop))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, hidden] -> float32 [B, vocab] (this rank's slice, all-gathered), written into
        `out` (float32 [B, vocab]) when given.

        On CUDA a half-precision GEMM writes float32 directly (`torch.mm(out_dtype=)`, the
        float32 accumulator unrounded): no bf16 logits and no conversion pass over them. At
        TP 1 it writes into `out` itself; at TP > 1 the gathered slices are copied into it.
        """
        if x.is_cuda and x.dtype != torch.float32:
            if out is not None and self.tp.world_size == 1:
                return torch.mm(x, self.weight.t(), out_dtype=torch.float32, out=out)
            logits = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(x, self.weight).float()
        logits = self.tp.all_gather_last_dim(logits)
        return logits if out is None else out.copy_(logits)
