"""Column- and row-parallel linear layers (no bias: Qwen3 has none).

Column parallel splits the output features across ranks (each rank holds `out / world_size`
rows of the weight and produces its slice of the output); row parallel splits the input
features and sums the partial products with an all-reduce whose result is complete before it
is returned (I11). Weights are read per rank as slices of the checkpoint tensors.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import fused, skinny_gemm
from engine.parallel import TPGroup
from engine.weights import WeightIndex
from lockstep.args import one_line_repr


class DecodeGemm:
    """Picks the GEMM of each linear call: the Triton skinny GEMM (`engine.kernels.skinny_gemm`)
    for up to 64 rows where the measured table says it beats cuBLAS, else cuBLAS (`F.linear`).
    The choice depends only on the weight shape and the row count, so the eager step and the
    graph captured at the same bucket run the same kernels (replay stays bit-identical).

    Args:
        table: `skinny_gemm.load_table()` ({} : always cuBLAS).
        workspace: the device's `skinny_gemm.Workspace` (None when the table is empty).
        plans: `load_fused_plans()`: fused-layer tiles chosen by timing whole steps, which
            take precedence over the table's per-GEMM choice ({} or None: none).
    """

    def __init__(self, table: dict, workspace: "skinny_gemm.Workspace | None",
                 plans: dict | None = None):
        self.table, self.workspace, self.plans = table, workspace, plans or {}

    @classmethod
    def for_model(cls, model: nn.Module, device, mode: str = "auto") -> "DecodeGemm | None":
        """The model's chooser, or None (cuBLAS everywhere) off CUDA, without Triton, with
        mode "cublas", for a dtype other than bfloat16 (the table's measurements, and its
        tiles' shared-memory budget, are bfloat16) or without a table. Allocates the split-K
        workspace (before capture).

        Raises:
            torch.OutOfMemoryError: the workspace does not fit.
        """
        linears = [m for m in model.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        if (mode == "cublas" or torch.device(device).type != "cuda"
                or skinny_gemm.triton is None or not linears
                or linears[0].weight.dtype != torch.bfloat16):
            return None
        return cls.from_table(skinny_gemm.load_table(), [m.weight.shape[0] for m in linears],
                              device, load_fused_plans())

    @classmethod
    def from_table(cls, table: dict, widths: list[int], device, plans: dict | None = None,
                   extra: tuple = ()) -> "DecodeGemm | None":
        """A chooser over `table` (and `plans`) with a workspace that holds any of their tiles,
        and of the `extra` tiles, for weights of up to max(widths) rows; None for an empty
        table or no widths.

        Raises:
            torch.OutOfMemoryError: the workspace does not fit.
        """
        configs = [e.config for rows in table.values() for e in rows.values()
                   if e.config is not None]
        if not widths or not configs:
            return None
        configs += [c for rows in (plans or {}).values() for p in rows.values()
                    for c in (p.qkv, p.o_proj, p.gate_up, p.down)] + list(extra)
        widest = max(widths)
        workspace = skinny_gemm.Workspace(device, widest, max(c.split_k for c in configs),
                                          -(-widest // min(c.block_n for c in configs)))
        return cls(table, workspace, plans)

    def fused_layer_plan(self, shapes: "LayerShapes", rows: int) -> "FusedLayerPlan | None":
        """The skinny tiles of a fused decoder layer at `rows` rows (`engine.model`), or None
        (run the layer unfused): rows > MAX_ROWS, a shape the table lacks at that row count, or
        a layer whose GEMMs would lose more to cuBLAS than the fusion saves.

        The fused layer needs the skinny GEMM's epilogues, so it takes the fastest skinny tile
        even where cuBLAS was faster; the table's times say by how much (summed over the four
        GEMMs) and the fusion is kept while that is below `FUSED_LAYER_SAVING_US`. The tiles
        are then the step-tuned plan (`load_fused_plans`) of the table's row count that serves
        `rows` (its smallest measured row count >= rows) where there is one; else the table's,
        and where the table's " rope" entry for the QKV shape beat the two launches it
        replaces, the QKV GEMM also does the q/k norm + RoPE + KV write
        (`skinny_gemm.skinny_gemm_qkv_rope`).
        """
        entries = [skinny_gemm.table_entry(self.table, n, k, sw, rows)
                   for n, k, sw in (shapes.qkv, shapes.o_proj, shapes.gate_up, shapes.down)]
        if any(e is None or e.config is None for e in entries):
            return None
        if sum(max(0.0, e.skinny_us - e.cublas_us) for e in entries) >= FUSED_LAYER_SAVING_US:
            return None
        served_by = min(m for m in self.table[skinny_gemm.shape_key(*shapes.qkv)] if m >= rows)
        tuned = self.plans.get(layer_key(shapes), {}).get(served_by)
        if tuned is not None:
            return tuned
        rope = skinny_gemm.table_entry(self.table, *shapes.qkv, rows, rope=True)
        if rope is not None and rope.skinny_wins:
            return FusedLayerPlan(rope.config, *(e.config for e in entries[1:]), rope=True)
        return FusedLayerPlan(*(e.config for e in entries))

    def normed(self, x: torch.Tensor, w: torch.Tensor, config: "skinny_gemm.TileConfig",
               stats: "skinny_gemm.RowStats", eps: float, swiglu: bool = False) -> torch.Tensor:
        """RMSNorm(x) @ w^T for a norm-folded w (`skinny_gemm.skinny_gemm` with row_stats)."""
        return skinny_gemm.skinny_gemm(x, w, self.workspace, config, swiglu=swiglu,
                                       row_stats=stats, eps=eps)

    def add_residual(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                     config: "skinny_gemm.TileConfig") -> "skinny_gemm.RowStats":
        """residual += x @ w^T in place; the new rows' statistics stay in the workspace."""
        return skinny_gemm.skinny_gemm_add_residual(x, w, residual, self.workspace, config)

    def qkv_rope(self, x: torch.Tensor, w: torch.Tensor, config: "skinny_gemm.TileConfig",
                 rope: "skinny_gemm.RopeKV", stats: "skinny_gemm.RowStats | None",
                 eps: float, attend: "skinny_gemm.AttendTail | None" = None) -> torch.Tensor:
        """q [T, nq, D] of the QKV projection with the q/k norm + RoPE + KV write in its
        epilogue (`skinny_gemm.skinny_gemm_qkv_rope`); `stats` None: x is already normalised;
        with `attend`, the attention in the launch's tail too."""
        return skinny_gemm.skinny_gemm_qkv_rope(x, w, self.workspace, config, rope,
                                                row_stats=stats, eps=eps, attend=attend)

    def tile(self, x: torch.Tensor, w: torch.Tensor, config: "skinny_gemm.TileConfig",
             swiglu: bool = False) -> torch.Tensor:
        """x @ w^T with the given skinny tile."""
        return skinny_gemm.skinny_gemm(x, w, self.workspace, config, swiglu=swiglu)

    def linear(self, x: torch.Tensor, w: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """x: [T, K] @ w[N, K]^T -> [T, N]; with swiglu (w = [gate | up]) -> [T, N / 2]."""
        config = skinny_gemm.choose(self.table, w.shape[0], w.shape[1], swiglu, x.shape[0])
        if config is not None and x.stride(-1) == 1:
            return skinny_gemm.skinny_gemm(x, w, self.workspace, config, swiglu=swiglu)
        return _linear(x, w, swiglu)


FUSED_LAYER_SAVING_US = 0.8
"""The least the fused layer form was measured to save per layer and step (us), before the
losses of its skinny GEMMs to cuBLAS: the two add + RMSNorm launches it removes, less its
epilogues. H200, 2026-12-02, decode step in CUDA graphs with every layer fused against none
(same run; docs/benchmarks.md): the step's gain per layer plus the table's loss was 0.8 us
for Qwen3-0.6B at 1 row, 2.1 at 8 and 3.0 at 64; 3.3 for Qwen3-4B at 1 row, 1.0 at 8 and 2.7
at 64, where the 4B layer's skinny GEMMs lose 4.3 us to cuBLAS and the fused step was
slower. A layer fuses only while its loss stays below the smallest of these savings."""


@dataclass(frozen=True)
class LayerShapes:
    """(N, K, swiglu) of a decoder layer's four weights on this rank."""

    qkv: tuple[int, int, bool]
    o_proj: tuple[int, int, bool]
    gate_up: tuple[int, int, bool]
    down: tuple[int, int, bool]


@dataclass(frozen=True)
class FusedLayerPlan:
    """The skinny tile of each GEMM of a fused decoder layer at one row count; with `rope`,
    qkv is a `skinny_gemm.skinny_gemm_qkv_rope` tile (the q/k norm + RoPE + KV write in the
    QKV GEMM's epilogue: 5 launches per layer instead of 6). On the short path
    (`protocol.keys.SHORT`) a rope plan runs attention and o_proj as one launch
    (`engine.kernels.attention_oproj`), or with `attend` (rope only) attends in the QKV
    launch's tail (`skinny_gemm.AttendTail`): 4 launches either way.

    Raises:
        ValueError: `attend` without `rope`.
    """

    qkv: "skinny_gemm.TileConfig"
    o_proj: "skinny_gemm.TileConfig"
    gate_up: "skinny_gemm.TileConfig"
    down: "skinny_gemm.TileConfig"
    rope: bool = False
    attend: bool = False

    def __post_init__(self):
        if self.attend and not self.rope:
            raise ValueError("plan attend true with rope false: the QKV launch attends in "
                             "the tail of its rope epilogue")


ROLES = ("qkv", "o_proj", "gate_up", "down")


def layer_key(shapes: LayerShapes) -> str:
    """Key of a layer's four weight shapes in the fused-plan file, e.g.
    "qkv 4096x1024, o_proj 1024x2048, gate_up 6144x1024, down 1024x3072" (weight rows x K;
    gate_up's rows are gate and up together)."""
    return ", ".join(f"{role} {n}x{k}" for role, (n, k, _) in
                     zip(ROLES, (shapes.qkv, shapes.o_proj, shapes.gate_up, shapes.down)))


FUSED_PLANS_PATH = os.path.join(os.path.dirname(__file__), "fused_plans.json")


def plan_to_json(plan: FusedLayerPlan) -> dict:
    """{"qkv": tile fields, ..., "rope": bool} and "attend": true where set: the form
    `load_fused_plans` reads (plans written before `attend` existed read as attend false)."""
    out = {**{r: dataclasses.asdict(getattr(plan, r)) for r in ROLES}, "rope": plan.rope}
    if plan.attend:
        out["attend"] = True
    return out


def load_fused_plans(path: str = FUSED_PLANS_PATH) -> dict[str, dict[int, FusedLayerPlan]]:
    """Fused-layer plans chosen by timing whole decode steps (`python -m
    engine.bench.step_tune --plans`): {layer_key: {rows: FusedLayerPlan}}; {} when the file is
    absent.

    Raises:
        ValueError: "<path>: not a fused-plan file (...)" for anything else.
    """
    if not os.path.exists(path):
        return {}
    return parse_fused_plans(skinny_gemm.read_tuning_json(path, "a fused-plan file"), path)


def parse_fused_plans(raw, source: str) -> dict[str, dict[int, FusedLayerPlan]]:
    """The plans in `raw` (the JSON object `load_fused_plans` reads), checked entry by entry.

    Raises:
        RowCountError: "<source>: layer '<key>': row count ..." (`skinny_gemm.row_count_key`).
        ValueError: "<source>: not a fused-plan file (...)" for anything else, a `gemv` tile
            at a row count above `skinny_gemm.GEMV_MAX_ROWS` included.
    """
    try:
        plans = {check_layer_key(key): {
                     skinny_gemm.row_count_key(m, f"{source}: layer {key!r}"): plan_from_json(p)
                     for m, p in rows.items()}
                 for key, rows in raw.items()}
        for key, rows in plans.items():
            for m, plan in rows.items():
                for role in ROLES:
                    skinny_gemm.check_tile_rows(getattr(plan, role), m, f"layer {key!r} {role}")
        return plans
    except skinny_gemm.RowCountError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{source}: not a fused-plan file "
                         f"({skinny_gemm.tuning_problem(exc, 'layer keys')})") from None


def plan_from_json(p) -> FusedLayerPlan:
    """The plan in `p`, the JSON object `plan_to_json` writes.

    Raises:
        ValueError: naming what is wrong: not an object, a field unknown or missing, a rope
            or attend that is not true or false, attend without rope, or the role and its
            tile's fault (`skinny_gemm.tile_from_json`).
    """
    fields = (*ROLES, "rope")
    if not isinstance(p, dict):
        raise ValueError(f"plan {one_line_repr(p, 60)} is not an object of {', '.join(fields)}")
    unknown = sorted(map(str, set(p) - set(fields) - {"attend"}))
    missing = [f for f in fields if f not in p]
    if unknown or missing:
        raise ValueError(f"plan field(s) {', '.join(map(repr, unknown or missing))} "
                         f"{'unknown' if unknown else 'missing'}; a plan has "
                         f"{', '.join(fields)} (and optionally attend)")
    for flag in ("rope", "attend"):
        if not isinstance(p.get(flag, False), bool):
            raise ValueError(f"{flag} {p[flag]!r} is not true or false")
    tiles = []
    for role in ROLES:
        try:
            tiles.append(skinny_gemm.tile_from_json(p[role]))
        except ValueError as exc:
            raise ValueError(f"{role}: {exc}") from None
    return FusedLayerPlan(*tiles, rope=p["rope"], attend=p.get("attend", False))


def check_layer_key(key) -> str:
    """`key` where it is a key `layer_key` writes. Raises ValueError naming it otherwise."""
    if not isinstance(key, str) or not _LAYER_KEY.fullmatch(key):
        raise ValueError(f"layer {one_line_repr(key, 100)} is not a layer_key ('qkv NxK, "
                         "o_proj NxK, gate_up NxK, down NxK')")
    return key


_LAYER_KEY = re.compile(", ".join(rf"{role} \d+x\d+" for role in ROLES))


def _linear(x: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
    y = F.linear(x, w)
    if not swiglu:
        return y
    return fused.silu_mul(y) if y.is_cuda and fused.triton is not None else fused.silu_mul_torch(y)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T, W_local = rows of each named checkpoint tensor for this rank.

    Several checkpoint tensors may be fused (e.g. gate_proj and up_proj): each is split
    separately and this rank's slices are concatenated, so the output is
    [T, sum(out_i) / world_size] laid out as [slice of tensor 0 | slice of tensor 1 | ...].

    Args:
        in_features: input width (full, not split).
        out_features: full output width of each fused tensor, e.g. [I, I] for gate_up.
        tp: this rank's group.
        dtype / device: parameter dtype and device.
    """

    def __init__(self, in_features: int, out_features: list[int], tp: TPGroup,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.tp = tp
        self.out_parts = [o // tp.world_size for o in out_features]
        self.weight = nn.Parameter(
            torch.empty(sum(self.out_parts), in_features, dtype=dtype, device=device),
            requires_grad=False)
        self.gemm: DecodeGemm | None = None

    def load(self, index: WeightIndex, names: list[str]) -> None:
        """Copy this rank's rows of each checkpoint tensor in `names` into the weight."""
        row = 0
        for name, part in zip(names, self.out_parts):
            start = self.tp.rank * part
            self.weight.data[row:row + part].copy_(index.read(name, 0, start, start + part))
            row += part

    def forward(self, x: torch.Tensor, swiglu: bool = False,
                tile: "skinny_gemm.TileConfig | None" = None,
                row_stats: "skinny_gemm.RowStats | None" = None, eps: float = 0.0,
                rope: "skinny_gemm.RopeKV | None" = None,
                attend: "skinny_gemm.AttendTail | None" = None) -> torch.Tensor:
        """x: [T, in] -> [T, sum(out_parts)], same dtype; with swiglu (two fused parts
        [gate | up]) -> [T, out_parts[0]] = silu(gate) * up.

        The fused layer form (`engine.model`) names the skinny `tile`, and with `row_stats`
        passes the un-normalised residual as x: the output is RMSNorm(x) @ W^T over the
        norm-folded weight (`DecodeGemm.normed`). With `rope` (a QKV weight, a
        `FusedLayerPlan.rope` tile) it returns q [T, nq, D] and writes K and V into the
        cache (`DecodeGemm.qkv_rope`), and with `attend` also attends in its tail."""
        if rope is not None:
            return self.gemm.qkv_rope(x, self.weight, tile, rope, row_stats, eps, attend)
        if tile is not None:
            if row_stats is not None:
                return self.gemm.normed(x, self.weight, tile, row_stats, eps, swiglu)
            return self.gemm.tile(x, self.weight, tile, swiglu)
        if self.gemm is not None:
            return self.gemm.linear(x, self.weight, swiglu)
        return _linear(x, self.weight, swiglu)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by heads: this rank's [q heads | kv heads | kv heads].

    Args:
        hidden: input width. num_q_heads / num_kv_heads: full head counts (divisible by the
        world size, checked by `engine.config.check_parallel`). head_dim: per-head width.
    """

    def __init__(self, hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 tp: TPGroup, dtype: torch.dtype, device="cpu"):
        super().__init__(hidden, [num_q_heads * head_dim, num_kv_heads * head_dim,
                                  num_kv_heads * head_dim], tp, dtype, device)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T), W_local = this rank's columns of the checkpoint.

    Args:
        in_features: full input width (split across ranks). out_features: output width.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype,
                 device="cpu"):
        super().__init__()
        self.tp = tp
        self.in_part = in_features // tp.world_size
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_part, dtype=dtype, device=device),
            requires_grad=False)
        self.gemm: DecodeGemm | None = None

    def load(self, index: WeightIndex, name: str) -> None:
        """Copy this rank's columns of checkpoint tensor `name` into the weight."""
        start = self.tp.rank * self.in_part
        self.weight.data.copy_(index.read(name, 1, start, start + self.in_part))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                tile: "skinny_gemm.TileConfig | None" = None):
        """x: [T, in / world_size] -> [T, out], summed over ranks (complete on return).

        The fused layer form (`engine.model`, world size 1) passes `residual` [T, out] and the
        skinny `tile`: the product is added into the residual in place and the call returns
        the new rows' `skinny_gemm.RowStats` instead (`DecodeGemm.add_residual`).

        Raises:
            ValueError: `residual` given at world size > 1 (the partial products would be
                added before their all-reduce).
        """
        if residual is not None:
            if self.tp.world_size != 1:
                raise ValueError(f"RowParallelLinear: a residual epilogue at world size "
                                 f"{self.tp.world_size}; it needs the all-reduced output")
            return self.gemm.add_residual(x, self.weight, residual, tile)
        y = self.gemm.linear(x, self.weight) if self.gemm is not None else F.linear(x, self.weight)
        return self.tp.all_reduce(y)
