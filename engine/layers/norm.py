"""RMSNorm, as Qwen3 computes it: in float32, weight applied after casting back.

Used for the per-layer norms (over hidden) and the per-head q/k norms (over head_dim: the
input is viewed as [..., heads, head_dim] and normalised over the last dimension).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import fused
from engine.weights import WeightIndex


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2, -1) + eps)), statistics in float32.

    Args:
        size: width of the last dimension. eps: added to the mean square.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device="cpu"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device),
                                   requires_grad=False)

    def load(self, index: WeightIndex, name: str) -> None:
        """Copy checkpoint tensor `name` (replicated on every rank)."""
        self.weight.data.copy_(index.read(name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., size] -> same shape and dtype."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused residual add + norm: residual <- x + residual; returns (norm(residual), residual).

        x, residual: [T, size] (residual None: the residual becomes x). On CUDA one Triton
        launch (`engine.kernels.fused.add_rms_norm`, residual updated in place); elsewhere torch.
        """
        if x.is_cuda and fused.triton is not None:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        return fused.add_rms_norm_torch(x, residual, self.weight, self.eps)
