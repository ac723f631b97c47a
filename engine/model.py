"""Qwen3 dense causal LM on one tensor-parallel rank.

Embedding (vocab parallel) -> N x [RMSNorm, attention, residual, RMSNorm, SwiGLU MLP
(column-parallel gate_up, row-parallel down), residual] -> RMSNorm -> LM head (vocab
parallel, all-gathered). Two all-reduces per layer (o_proj, down_proj) plus one in the
embedding when world_size > 1.

A layer runs in one of two forms, chosen by the step's row count alone, and for a decode step
by its graph key's path: the eager step and the graph of the same key run the same kernels,
but an eager decode step always runs the `DECODE` path, so at a bucket with a short-path
graph a run with graphs on and one with graphs off differ in rounding:

* fused (world size 1, CUDA, bfloat16, rows <= 64, the skinny GEMM table measured every
  weight shape at that row count and its skinny tiles lose less than
  `engine.layers.linear.FUSED_LAYER_SAVING_US` to cuBLAS there; decode steps and short
  prefills alike): 6 launches, QKV GEMM, q/k norm+RoPE+KV write, attention,
  o_proj, gate_up with SwiGLU, down_proj; 5 where the plan (`FusedLayerPlan.rope`) puts the
  q/k norm + RoPE + KV write in the QKV GEMM's epilogue (`skinny_gemm.skinny_gemm_qkv_rope`);
  4 on the short path (`protocol.keys.SHORT`: a decode step whose every row's context fits
  one tile, `StepContext.short`) where the plan has that epilogue, attention and o_proj
  being one launch (`engine.kernels.attention_oproj`; `fuses_attention_oproj`), or, where
  the plan says `attend`, the QKV launch attending in its tail (`skinny_gemm.AttendTail`).
  The tiles are the step-tuned plan's where `engine/layers/fused_plans.json` has one.
  o_proj and down_proj add their output into the residual in their epilogue and leave each row's sum of squares in the GEMM workspace; QKV
  and gate_up read the residual itself and scale each output row by 1 / rms, their weights
  having the norm weights folded in at load (`skinny_gemm.fold_norm_weight`). Layer 0 has no
  statistics yet and normalises its input in a launch of its own.
* unfused (everything else: longer prefills, larger buckets, TP > 1): each residual add is fused into the norm after
  it (`RMSNorm.add_forward`): 8 launches where the skinny GEMM serves the bucket (add+norm,
  QKV, q/k norm+RoPE+KV, attention, o_proj, add+norm, gate_up with SwiGLU, down_proj), 9
  with cuBLAS (SwiGLU its own launch, plus any split-K reduce cuBLAS adds). When the model's
  norm weights are folded, these norms have weight 1 and the GEMMs use the folded weights.

`LOCKSTEP_FUSED_NORM=0` in the environment keeps every step unfused and the weights as
loaded (the A/B baseline of the benchmarks; "1" or unset: as above, anything else an error,
`engine.env`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.env import switch
from engine.layers.attention import Qwen3Attention, StepContext
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.kernels import attention_oproj, skinny_gemm
from engine.layers.linear import (
    ColumnParallelLinear,
    DecodeGemm,
    FusedLayerPlan,
    LayerShapes,
    RowParallelLinear,
)
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

    def shapes(self) -> LayerShapes:
        """This rank's (N, K, swiglu) of the layer's four weights."""
        def of(linear, swiglu=False):
            return (*linear.weight.shape, swiglu)

        return LayerShapes(of(self.self_attn.qkv_proj), of(self.self_attn.o_proj),
                           of(self.mlp.gate_up_proj, True), of(self.mlp.down_proj))

    def fold_norms(self) -> None:
        """Fold both norms' weights into the GEMMs after them and set the norms' weights to 1
        (world size 1 only: the row-parallel outputs are then complete per rank)."""
        for norm, linear in ((self.input_layernorm, self.self_attn.qkv_proj),
                             (self.post_attention_layernorm, self.mlp.gate_up_proj)):
            w = linear.weight.data
            for start in range(0, w.shape[0], 1024):  # bounded float32 temporaries
                skinny_gemm.fold_norm_weight(w[start:start + 1024], norm.weight.data)
            norm.weight.data.fill_(1)

    def forward_fused(self, positions, residual, stats, ctx: StepContext,
                      plan: FusedLayerPlan):
        """The fused form (module docstring): residual [T, hidden] is the running sum, updated
        in place; stats the `skinny_gemm.RowStats` of its rows (None at layer 0). Returns the
        statistics of the updated residual."""
        # every GEMM goes through its module, so profilers see one call per module
        attn, mlp = self.self_attn, self.mlp
        x = residual
        if stats is None:
            x, _ = self.input_layernorm.add_forward(residual, None)
        rope = attn.rope_kv(positions, ctx) if plan.rope else None
        short = ctx.short is not None and ctx.short.workspace is not None and not ctx.prefill
        tail = attn.tail_attention(x.shape[0], ctx) if short and plan.attend else None
        qkv = attn.qkv_proj(x, tile=plan.qkv, row_stats=stats, eps=self.input_layernorm.eps,
                            rope=rope, attend=tail)
        if tail is not None:
            stats = attn.o_proj(tail.out, residual=residual, tile=plan.o_proj)
        elif short and fuses_attention_oproj(plan, x.shape[0]):
            stats = attn.attend_project(qkv, residual, attn.o_proj.gemm.workspace, ctx)
        else:
            o = (attn.attend_rotated(qkv, ctx) if plan.rope
                 else attn.attend(positions, qkv, ctx))
            stats = attn.o_proj(o, residual=residual, tile=plan.o_proj)
        act = mlp.gate_up_proj(residual, swiglu=True, tile=plan.gate_up, row_stats=stats,
                               eps=self.post_attention_layernorm.eps)
        return mlp.down_proj(act, residual=residual, tile=plan.down)


def fuses_attention_oproj(plan: FusedLayerPlan, rows: int) -> bool:
    """Whether the short path's fused layer form (`plan`) at `rows` rows runs attention and
    o_proj as one launch: where the plan puts the q/k norm + RoPE + KV write in the QKV GEMM
    (`FusedLayerPlan.rope`; the fused kernel takes q already rotated), does not attend in
    that launch's tail instead (`FusedLayerPlan.attend`), and the rows fit
    `attention_oproj.MAX_ROWS`. Elsewhere a short-path graph runs the same kernels as the
    `DECODE` graph of its bucket, or with `attend` the QKV launch attends. Behind a separate
    q/k norm launch the fused kernel was slower: Qwen3-4B at one row, context 128, 2.839 ms
    against 2.546 with the short path off (H200, 2026-12-03, docs/benchmarks.md)."""
    return plan.rope and not plan.attend and rows <= attention_oproj.MAX_ROWS


class Qwen3ForCausalLM(nn.Module):
    """One rank's shard of a Qwen3 dense model.

    Args:
        cfg: whole-model config (already checked with `check_parallel` for tp.world_size).
        tp: this rank's group. dtype: parameter dtype. device: where parameters live.
        decode_gemm: "auto" or "cublas" (`engine.engine_config.EngineConfig.decode_gemm`).
        max_positions: rows of the RoPE cos/sin tables: the engine's max_model_len (every
            position a step reads is below it; `engine.llm` refuses prompt + max_tokens past
            it); None: the config's max_position_embeddings. A config may name 10**12
            positions, whose table (1 KB a position at D = 128) no machine holds.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device="cpu",
                 decode_gemm: str = "auto", max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position,
                                      cfg.rope_theta, device)
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
        self.decode_gemm = gemm
        # intent at construction; the fused form runs only once load_weights has folded
        self.fuse_norms = (gemm is not None and tp.world_size == 1
                           and switch("LOCKSTEP_FUSED_NORM"))
        self.norms_folded = False
        self._plans: dict[int, FusedLayerPlan | None] = {}

    def fused_plan(self, rows: int) -> FusedLayerPlan | None:
        """The tiles of the fused layer form at `rows` rows, or None where the step runs
        unfused (module docstring). Every layer has the same shapes, so one plan serves all."""
        if not self.norms_folded:
            return None
        if rows not in self._plans:
            self._plans[rows] = self.decode_gemm.fused_layer_plan(self.layers[0].shapes(), rows)
        return self._plans[rows]

    def fuses_short_path(self, rows: int) -> bool:
        """Whether a short-path step of `rows` rows runs attention fused into o_proj
        (`fuses_attention_oproj` of the fused plan at that row count; False where the step
        runs unfused)."""
        plan = self.fused_plan(rows)
        return plan is not None and fuses_attention_oproj(plan, rows)

    def attends_in_qkv_tail(self, rows: int) -> bool:
        """Whether a short-path step of `rows` rows attends in the QKV launch's tail
        (`FusedLayerPlan.attend` of the fused plan at that row count)."""
        plan = self.fused_plan(rows)
        return plan is not None and plan.attend

    def set_fused_plan(self, rows: int, plan: FusedLayerPlan) -> None:
        """Run the fused layer form at `rows` rows with `plan`'s tiles from the next forward
        on (a graph captured before keeps its own): how `engine.bench.step_tune` times a
        candidate plan. The workspace must hold the plan's tiles (`DecodeGemm.from_table`'s
        `extra`).

        Raises:
            ValueError: the norms are not folded (the model does not run the fused form).
        """
        if not self.norms_folded:
            raise ValueError("set_fused_plan: this model runs unfused (cuBLAS, TP > 1, or "
                             "LOCKSTEP_FUSED_NORM=0)")
        self._plans[rows] = plan

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
        if self.fuse_norms:
            for layer in self.layers:
                layer.fold_norms()
            self.norms_folded = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """input_ids: int64 [T], positions: int [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        plan = self.fused_plan(x.shape[0])
        if plan is not None:
            stats = None
            for layer in self.layers:
                stats = layer.forward_fused(positions, x, stats, ctx, plan)
            return self.norm.add_forward(x, None)[0]
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [B, hidden] -> float32 logits [B, vocab], identical on every rank (written
        into `out`, float32 [B, vocab], when given)."""
        return self.lm_head(hidden, out)
