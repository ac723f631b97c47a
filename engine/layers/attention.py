"""Qwen3 self-attention on one rank: fused QKV, per-head q/k RMSNorm, RoPE, KV-cache write,
attention (varlen paged prefill attention for prefill, paged decode attention for decode),
row-parallel output.

Both kinds of step run q/k norm, RoPE and the KV write as one fused kernel per layer
(`engine.kernels.fused.qk_norm_rope_kv`; its torch twin on CPU), then attend over the paged
cache: a prefill packs many sequences (`engine.kernels.prefill_attention.PrefillBatch`) and
attends causally with one launch per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels import attention_oproj, fused, skinny_gemm
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
        prefill: True for a packed prefill of several sequences (layout in `prefill_batch`),
            False for a decode step (one token per batch row).
        slot_ids: int32 [T]: the slot each token belongs to.
        kv: the rank's KV cache.
        decode_attention: one of the `engine.kernels.decode_attention` implementations.
        prefill_batch: the packed prefill's layout (prefill steps only).
        prefill_attention: one of the `engine.kernels.prefill_attention` implementations.
        row_order: int64 [T] or None: the order in which decode attention takes the rows
            (`engine.kernels.decode_attention.longest_first`); no value depends on it.
        short: set on the short path (decode steps whose every row fits its tile).
    """

    prefill: bool
    slot_ids: torch.Tensor
    kv: KVCache
    decode_attention: Callable
    prefill_batch: object = None
    prefill_attention: Callable | None = None
    row_order: torch.Tensor | None = None
    short: "ShortAttention | None" = None


@dataclass(frozen=True)
class ShortAttention:
    """The short path of a decode step (`protocol.keys.SHORT`): every row's context holds at
    most `tokens` tokens, so the fused layer form attends and projects in one launch
    (`engine.kernels.attention_oproj`).

    Attributes:
        tokens: the tile every row's context fits (`EngineConfig.short_context`).
        workspace: the fused launch's partials on this device; None on the CPU, where the
            path runs the ordinary attention and o_proj.
    """

    tokens: int
    workspace: "attention_oproj.AttnOprojWorkspace | None"


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
        return self.o_proj(self.attend(positions, self.qkv_proj(x), ctx))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: StepContext
               ) -> torch.Tensor:
        """qkv: [T, (nq + 2 nkv) * head_dim] this rank's projection -> [T, nq * head_dim], the
        attention output before o_proj; K and V are written into the layer's cache."""
        return self.attend_rotated(self.rotate(positions, qkv, ctx), ctx)

    def rotate(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: StepContext
               ) -> torch.Tensor:
        """qkv: [T, (nq + 2 nkv) * head_dim] -> q [T, nq, head_dim], normalised and rotated;
        K (normalised, rotated) and V written into the layer's cache: the fused q/k norm +
        RoPE + KV write (`fused.qk_norm_rope_kv`; its torch twin on CPU)."""
        args = (qkv, self.q_norm.weight, self.k_norm.weight, self.rotary.cos,
                self.rotary.sin, positions, ctx.slot_ids, ctx.kv.page_table,
                ctx.kv.k[self.layer], ctx.kv.v[self.layer], self.nq, self.nkv,
                self.q_norm.eps)
        return (fused.qk_norm_rope_kv(*args) if qkv.is_cuda and fused.triton is not None
                else fused.qk_norm_rope_kv_torch(*args))

    def rope_kv(self, positions: torch.Tensor, ctx: StepContext) -> "skinny_gemm.RopeKV":
        """What the q/k norm + RoPE + KV write of this layer reads besides the projection."""
        return skinny_gemm.RopeKV(self.q_norm.weight, self.k_norm.weight, self.rotary.cos,
                                  self.rotary.sin, positions, ctx.slot_ids, ctx.kv.page_table,
                                  ctx.kv.k[self.layer], ctx.kv.v[self.layer], self.nq,
                                  self.nkv, self.q_norm.eps)

    def attend_project(self, q: torch.Tensor, residual: torch.Tensor,
                       gemm_workspace: "skinny_gemm.Workspace", ctx: StepContext
                       ) -> "skinny_gemm.RowStats":
        """The short path's attention and o_proj in one launch (world size 1, fused layer
        form): residual [T, hidden] += o_proj(attention(q)) in place; returns the new rows'
        statistics, as `RowParallelLinear` with a residual does. q: [T, nq, head_dim]
        normalised and rotated, every row's context within `ctx.short.tokens`."""
        kv = ctx.kv
        return attention_oproj.attention_oproj(
            q, kv.k[self.layer], kv.v[self.layer], kv.page_table, kv.seq_lens, ctx.slot_ids,
            self.scale, self.o_proj.weight, residual, ctx.short.workspace, gemm_workspace,
            ctx.short.tokens)

    def tail_attention(self, rows: int, ctx: StepContext) -> "skinny_gemm.AttendTail":
        """The short path's attention in the QKV launch's tail (`skinny_gemm.AttendTail`):
        a new [rows, nq * head_dim] output, every row's context within `ctx.short.tokens`."""
        out = torch.empty(rows, self.nq * self.d, dtype=self.q_norm.weight.dtype,
                          device=self.q_norm.weight.device)
        return skinny_gemm.AttendTail(out, ctx.kv.seq_lens, self.scale, ctx.short.tokens)

    def attend_rotated(self, q: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """q: [T, nq, head_dim] normalised and rotated, this step's K and V already in the
        cache -> [T, nq * head_dim], the attention output before o_proj."""
        if ctx.prefill:
            o = ctx.prefill_attention(q, ctx.kv.k[self.layer], ctx.kv.v[self.layer],
                                      ctx.kv.page_table, ctx.prefill_batch, self.scale)
        else:
            o = ctx.decode_attention(q, ctx.kv.k[self.layer], ctx.kv.v[self.layer],
                                     ctx.kv.page_table, ctx.kv.seq_lens, ctx.slot_ids,
                                     self.scale, ctx.row_order)
        return o.reshape(q.shape[0], self.nq * self.d)
