"""Qwen3 dense causal LM on one tensor-parallel rank.

Embedding (vocab parallel) -> N x [RMSNorm, attention, residual, RMSNorm, SwiGLU MLP
(column-parallel gate_up, row-parallel down), residual] -> RMSNorm -> LM head (vocab
parallel, all-gathered). Each residual add is fused into the norm after it
(`RMSNorm.add_forward`), so a decode layer is 8 launches on CUDA where the skinny GEMM serves
its bucket (add+norm, QKV GEMM, q/k norm+RoPE+KV write, attention, o_proj, add+norm, gate_up
GEMM with the SwiGLU epilogue, down_proj) and 9 with cuBLAS (SwiGLU its own launch, plus any
split-K reduce cuBLAS adds). Two all-reduces per layer (o_proj, down_proj) plus one in the
embedding when world_size > 1.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import Qwen3Attention, StepContext
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, DecodeGemm, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import TPGroup
from engine.weights import WeightIndex


class Qwen3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up fused and column parallel, the activation
    in the gate_up GEMM's epilogue (skinny GEMM) or one fused kernel after it (cuBLAS)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype, device="cpu"):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, tp, dtype, device)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, dtype,
                                           device)

    def load(self, index: WeightIndex, prefix: str) -> None:
        """Load `prefix` + gate_proj/up_proj (fused, column slices) and down_proj (row slice)."""
        self.gate_up_proj.load(index, [prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        self.down_proj.load(index, prefix + "down_proj.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.gate_up_proj(x, swiglu=True))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary, tp: TPGroup, dtype, device="cpu"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Qwen3Attention(cfg, layer, rotary, tp, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = Qwen3MLP(cfg, tp, dtype, device)

    def load(self, index: WeightIndex, prefix: str) -> None:
        """Load every tensor of layer `prefix` ("model.layers.{i}.") for this rank."""
        self.input_layernorm.load(index, prefix + "input_layernorm.weight")
        self.self_attn.load(index, prefix + "self_attn.")
        self.post_attention_layernorm.load(index, prefix + "post_attention_layernorm.weight")
        self.mlp.load(index, prefix + "mlp.")

    def forward(self, positions, x, residual, ctx: StepContext):
        """x: [T, hidden] this layer's input delta, residual: [T, hidden] the running sum
        before it (None at layer 0, where x is the embedding); positions: int [T].

        Returns (mlp output, residual): the layer's output is their sum, which the next
        layer's fused add + norm forms (the residual is updated in place on CUDA).
        """
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(positions, h, ctx)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class Qwen3ForCausalLM(nn.Module):
    """One rank's shard of a Qwen3 dense model.

    Args:
        cfg: whole-model config (already checked with `check_parallel` for tp.world_size).
        tp: this rank's group. dtype: parameter dtype. device: where parameters live.
        decode_gemm: "auto" or "cublas" (`engine.engine_config.EngineConfig.decode_gemm`).
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device="cpu",
                 decode_gemm: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, device)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype,
                                                   device)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, self.rotary, tp, dtype, device)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype,
                                      self.embed_tokens if cfg.tie_word_embeddings else None,
                                      device)
        gemm = DecodeGemm.for_model(self, device, decode_gemm)
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.gemm = gemm

    @torch.no_grad()
    def load_weights(self, index: WeightIndex, progress=None) -> None:
        """Read this rank's slice of every tensor from the checkpoint.

        Args:
            progress: called as progress(layers_done, num_layers) after each layer.
        """
        self.embed_tokens.load(index, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(index, f"model.layers.{i}.")
            if progress is not None:
                progress(i + 1, len(self.layers))
        self.norm.load(index, "model.norm.weight")
        self.lm_head.load(index, "lm_head.weight")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """input_ids: int64 [T], positions: int [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [B, hidden] -> float32 logits [B, vocab], identical on every rank (written
        into `out`, float32 [B, vocab], when given)."""
        return self.lm_head(hidden, out)
