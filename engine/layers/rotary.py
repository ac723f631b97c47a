"""Rotary position embedding (RoPE, "rotate half" / NeoX layout) from the config's theta.

cos/sin for every position the engine serves (its max_model_len) are precomputed in float32 once and
indexed on the device by the positions buffer, so a decode step reads positions from device
memory only (I12).
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Apply RoPE to q [T, Hq, D] and k [T, Hk, D] at integer positions [T].

    Args:
        head_dim: D (even). max_position: size of the cos/sin table. theta: RoPE base.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, device="cpu"):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                    .to(device=device, dtype=torch.float) / head_dim))
        t = torch.arange(max_position, device=device, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_position, D] float32
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Returns (q, k) rotated, same shapes and dtypes; positions: int [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
