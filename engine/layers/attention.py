"""Qwen3 self-attention on one rank: fused QKV, per-head q/k RMSNorm, RoPE, KV-cache write,
attention (SDPA for prefill, paged decode attention for decode), row-parallel output.

A decode step runs q/k norm, RoPE and the KV write as one fused kernel
(`engine.kernels.fused.qk_norm_rope_kv`; its torch twin on CPU); a prefill runs them as
separate torch ops, since SDPA needs the step's k and v anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kernels import fused
from engine.kv_cache import KVCache
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import TPGroup
from engine.weights import WeightIndex


@dataclass
class StepContext:
    """What attention needs to know about the current step, all device tensors.

    Attributes:
        prefill: True for a prefill of one sequence (tokens are that sequence's positions
            0..T-1), False for a decode step (one token per batch row).
        slot_ids: int32 [T]: the slot each token belongs to.
        kv: the rank's KV cache.
        decode_attention: one of the `engine.kernels.decode_attention` implementations.
    """

    prefill: bool
    slot_ids: torch.Tensor
    kv: KVCache
    decode_attention: Callable


class Qwen3Attention(nn.Module):
    """Attention block of one layer; holds num_q_heads / world_size query heads."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 dtype: torch.dtype, device="cpu"):
        super().__init__()
        self.layer = layer
        self.nq = cfg.num_q_heads // tp.world_size
        self.nkv = cfg.num_kv_heads // tp.world_size
        self.d = cfg.head_dim
        self.scale = self.d ** -0.5
        self.rotary = rotary
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads,
                                          self.d, tp, dtype, device)
        self.o_proj = RowParallelLinear(cfg.num_q_heads * self.d, cfg.hidden_size, tp, dtype,
                                        device)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype, device)

    def load(self, index: WeightIndex, prefix: str) -> None:
        """Load `prefix` + q_proj/k_proj/v_proj/o_proj/q_norm/k_norm, this rank's slices."""
        self.qkv_proj.load(index, [prefix + n + ".weight" for n in ("q_proj", "k_proj", "v_proj")])
        self.o_proj.load(index, prefix + "o_proj.weight")
        self.q_norm.load(index, prefix + "q_norm.weight")
        self.k_norm.load(index, prefix + "k_norm.weight")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x: [T, hidden], positions: int [T] -> [T, hidden] (all-reduced over ranks)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if not ctx.prefill:  # fused q/k norm + RoPE + KV write, then paged attention
            args = (qkv, self.q_norm.weight, self.k_norm.weight, self.rotary.cos,
                    self.rotary.sin, positions, ctx.slot_ids, ctx.kv.page_table,
                    ctx.kv.k[self.layer], ctx.kv.v[self.layer], self.nq, self.nkv,
                    self.q_norm.eps)
            q = (fused.qk_norm_rope_kv(*args) if x.is_cuda and fused.triton is not None
                 else fused.qk_norm_rope_kv_torch(*args))
            o = ctx.decode_attention(q, ctx.kv.k[self.layer], ctx.kv.v[self.layer],
                                     ctx.kv.page_table, ctx.kv.seq_lens, ctx.slot_ids,
                                     self.scale)
            return self.o_proj(o.reshape(T, self.nq * self.d))
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d,
                                          self.nkv * self.d], dim=-1)
        q = self.q_norm(q.reshape(T, self.nq, self.d))
        k = self.k_norm(k.reshape(T, self.nkv, self.d))
        v = v.reshape(T, self.nkv, self.d)
        q, k = self.rotary(positions, q, k)
        ctx.kv.write(self.layer, ctx.slot_ids, positions, k, v)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale,
            enable_gqa=True)
        o = o.squeeze(0).transpose(0, 1)
        return self.o_proj(o.reshape(T, self.nq * self.d))
