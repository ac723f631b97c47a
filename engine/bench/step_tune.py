"""Fused-layer tiles chosen by timing the whole decode step, not one GEMM alone.

The GEMM sweep (`engine.bench.gemm_sweep`) times one shape repeated in a CUDA graph, and in the
decode step tiles rank otherwise: on the H200 a table of the sweep's faster one-tile tiles made
the Qwen3-0.6B step slower (docs/benchmarks.md, 2026-12-02). This tool starts at each row
count from the plan the table gives the fused layer (`engine.layers.linear.FusedLayerPlan`),
then for each GEMM in turn (QKV, o_proj, gate_up, down) swaps in each of the sweep's `--top`
fastest tiles for that shape and row count (for QKV also the fastest tiles of the launch with
the q/k norm + RoPE + KV-write epilogue) and keeps a swap when the captured step replays at
least `MIN_GAIN` faster: one pass of coordinate descent, the step's graph recaptured per trial,
the median of `--steps` replays timed by CUDA events as `lockstep bench` times them. Before a
trial is timed, its eager logits are checked against the starting plan's (`LOGITS_RTOL`) and
its graph replay's against its eager step's (bit for bit). The start and the winner are then
timed again, alternating (`CONFIRM_ROUNDS`), and the winner is kept only if it still wins.

    python -m engine.bench.step_tune --preset qwen3-0.6b --rows 1,8 --json out.json \\
        --plans engine/layers/fused_plans.json

`--plans` merges the winners into the file the engine reads (`load_fused_plans`); `--from-json`
rewrites it from an earlier `--json` without timing anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from engine.bench.options import (BenchArgError, BenchOptions, check_output_path, check_range,
                                  check_switches, cuda_missing, max_positions, model_shape,
                                  parse_int_list, read_tool_json)
from engine.cli_args import integer, shown
from engine.cli_args import seed as seed_arg
from engine.env import switch
from engine.json_fields import Field
from engine.kernels.skinny_gemm import (MAX_ROWS, TileConfig, load_table, row_count_key,
                                        shape_key)
from engine.layers.linear import (FUSED_PLANS_PATH, ROLES, DecodeGemm, FusedLayerPlan,
                                  LayerShapes, check_layer_key, layer_key, load_fused_plans,
                                  parse_fused_plans, plan_from_json, plan_to_json)
from engine.presets import PRESETS
from engine.seeds import derived_seed
from lockstep.cli import OneLineParser
from protocol.keys import SHORT

SWEEP_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "benchmarks-gemm-sweep-h200.json")
"""The shipped sweep, found beside the package (a source checkout), whatever the cwd."""
MAX_STEPS, MAX_WARMUP = 10_000, 1_000
MAX_TOP = 32
"""Most sweep tiles `--top` tries per GEMM. Each is a recaptured step timed over `--steps`
replays, about 1 s at the defaults on the H200 (82 s for 17 trials at each of five row counts,
docs/benchmarks.md): 32 (161 trials per row count) is already about 13 minutes for five, and a
larger value (a typo such as 400) would time nearly every tile the sweep tried (about 70 per
shape) for half an hour."""
MIN_GAIN = 0.002
"""Least relative step-time gain for which a trial's tile replaces the current one: the
spread of one plan's median over repeated runs in one process is about 0.1% (H200)."""
LOGITS_RTOL = 0.1
"""Largest max-abs logit difference, relative to the largest logit, a trial may show against
the starting plan. Another tile adds in another order and rounds otherwise: on the H200 such
trials differed by 0.02-0.045 of the largest logit in random-weight Qwen3-0.6B and 4B (a first
run with 0.02 refused most of them; docs/benchmarks-step-tune-h200.json); a tile that drops or
repeats part of the sum differs by the order of the logits themselves. The kernels' own
correctness is the tests' (float64 oracles)."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One candidate of a GEMM for `descend`: its tile, and for the QKV GEMM whether the plan
    then has the rope epilogue (`FusedLayerPlan.rope`) and attends in its tail (`attend`)."""

    tile: TileConfig
    rope: bool = False
    attend: bool = False


def sweep_options(results: list[dict], shapes, rows: int, top: int
                  ) -> dict[str, list[Option]]:
    """Each GEMM's candidate tiles at `rows` from sweep results (`gemm_sweep --json`'s
    "results"): the `top` fastest the sweep timed at that row count, by shape; for "qkv" also
    the `top` fastest of the rope epilogue's sweep, with rope=True. A shape or row count the
    sweep lacks gives no candidates.

    Args:
        shapes: the layer's `engine.layers.linear.LayerShapes`.
    Returns:
        {role: [Option, ...]} in sweep order (fastest first).
    """
    def fastest(n, k, swiglu, rope):
        for r in results:
            if (int(r["N"]), int(r["K"]), bool(r["swiglu"]), bool(r.get("rope"))) == (
                    n, k, swiglu, rope):
                entry = r["rows"].get(str(rows)) or {}
                timed = sorted((t for t in entry.get("triton", ()) if "us" in t),
                               key=lambda t: t["us"])
                return [TileConfig(**t["config"]) for t in timed[:top]]
        return []

    out = {role: [Option(t) for t in fastest(*getattr(shapes, role), False)] for role in ROLES}
    out["qkv"] += [Option(t, rope=True) for t in fastest(*shapes.qkv, True)]
    return out


def with_tail_attention(options: dict) -> dict:
    """`options` with each rope QKV tile also tried attending in its tail (attend=True, the
    short path's 4-launch form of `FusedLayerPlan.attend`), after the tile without it: for a
    row count whose graph is the short path's."""
    qkv = []
    for option in options.get("qkv", ()):
        qkv += [option] + ([dataclasses.replace(option, attend=True)] if option.rope else [])
    return {**options, "qkv": qkv}


@dataclasses.dataclass(frozen=True)
class Trial:
    """One timed plan: the GEMM it changed ("start" for the starting plan), the plan, its step
    median ms (None when it failed) and the error or logit mismatch that ruled it out."""

    role: str
    plan: FusedLayerPlan
    ms: float | None
    error: str | None = None


def descend(start: FusedLayerPlan, options: dict, time_plan) -> tuple[FusedLayerPlan, list]:
    """One pass of coordinate descent over the GEMMs in `ROLES` order.

    Args:
        start: the first plan. options: `sweep_options`' {role: [Option]} (the QKV
            GEMM's with attend, `with_tail_attention`).
        time_plan: plan -> step median in ms; raises (ValueError, RuntimeError) for a plan
            that cannot run or computes wrong logits.
    Returns:
        (the fastest plan found, every `Trial` in order).
    Raises:
        ValueError / RuntimeError: the starting plan itself failed.
    """
    best, best_ms = start, time_plan(start)
    trials = [Trial("start", start, best_ms)]
    for role in ROLES:
        for option in options.get(role, ()):
            changes = {role: option.tile, **({"rope": option.rope, "attend": option.attend}
                                             if role == "qkv" else {})}
            plan = dataclasses.replace(best, **changes)
            if plan == best or any(t.plan == plan for t in trials):
                continue
            try:
                ms = time_plan(plan)
            except (ValueError, RuntimeError) as exc:
                trials.append(Trial(role, plan, None, str(exc).splitlines()[0][:200]))
                continue
            trials.append(Trial(role, plan, ms))
            if ms < best_ms * (1 - MIN_GAIN):
                best, best_ms = plan, ms
    return best, trials


def tuning_settings(model_dir: str, buckets: list[int], context: int):
    """The engine settings `StepTimer` times with: one GPU, bfloat16, CUDA graphs, slots for
    the largest bucket, room for `context` cached tokens and the step's own, and the short
    path where the engine turns it on (`short_decode_default`), so that each bucket is timed
    on the graph serving replays there.

    Raises:
        ParallelConfigError / ModelDirError: the settings do not hold (`EngineConfig.validate`).
    """
    from engine.bench.decode import PAGE_SIZE
    from engine.engine_config import EngineConfig, short_decode_default
    from protocol.buckets import DEFAULT_DECODE_BUCKETS

    top = max(buckets)
    settings = EngineConfig(
        model_dir=str(model_dir), world_size=1, device="cuda", dtype="bfloat16",
        max_batch=top, max_model_len=context + 1, page_size=PAGE_SIZE,
        buckets=tuple(b for b in DEFAULT_DECODE_BUCKETS if b <= top), cuda_graph=True,
        short_decode=short_decode_default("cuda", True, 1))
    settings.validate()
    return settings


def tuned_graph_key(plan, bucket: int, context: int):
    """The graph key the controller replays for `bucket` rows of `context` tokens under the
    graph plan (`protocol.eligibility.GraphPlan.key_for`): the short path's at one row and a
    context within its tile where the settings turn the path on, else the bucket's DECODE
    graph. Tuning the other graph would tune kernels that serving does not run there."""
    return plan.key_for(bucket, context)[0]


class StepTimer:
    """Times fused-layer plans of one model on one GPU: each plan's decode step captured into
    a CUDA graph at a bucket and replayed through the protocol's reference driver, as
    `engine.bench.decode` does.

    Args:
        model_dir: HF-layout directory. buckets: the decode buckets to time (<= MAX_ROWS).
        context: tokens cached per row. steps / warmup: timed / untimed replays per plan.
        extra_tiles: every tile a plan may name (the split-K workspace is sized for them).
    Raises:
        ValueError: the model runs no fused layer form at 1 row (a shape the table lacks, its
            tiles too slow there: `DecodeGemm.fused_layer_plan`; or LOCKSTEP_FUSED_NORM=0).
    """

    def __init__(self, model_dir: str, buckets: list[int], context: int, steps: int,
                 warmup: int, extra_tiles: list[TileConfig], seed: int = 0):
        import torch

        from engine.bench.decode import HOLD_CYCLES, BenchBackend
        from engine.executor import RankExecutor
        from engine.layers.linear import ColumnParallelLinear, DecodeGemm, RowParallelLinear
        from engine.parallel import TPGroup
        from protocol.eligibility import GraphPlan

        self.settings = tuning_settings(model_dir, buckets, context)
        self.graph_plan = GraphPlan.from_config(self.settings.protocol_config())
        ex = self.ex = RankExecutor(self.settings, TPGroup(0, 1))
        ex.load_model()
        ex.allocate_kv(ex.pages_needed())
        ex.assign_pages_per_slot()
        model = self.model = ex.model
        if model.fused_plan(1) is None:
            raise ValueError(f"{model_dir}: the model runs no fused layer form at 1 row")
        gen = torch.Generator(device=ex.device).manual_seed(derived_seed(seed, 1))
        for layer in range(ex.cfg.num_layers):  # random K/V everywhere, as the bench does
            ex.kv.k[layer].normal_(generator=gen)
            ex.kv.v[layer].normal_(generator=gen)
        widths = [m.weight.shape[0] for m in model.modules()
                  if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        gemm = model.decode_gemm
        gemm.workspace = DecodeGemm.from_table(gemm.table, widths, ex.device, gemm.plans,
                                               extra=tuple(extra_tiles)).workspace
        self.context, self.steps, self.warmup = context, steps, warmup
        self.backend = BenchBackend(ex, lambda: torch.cuda._sleep(HOLD_CYCLES))
        self._rng = torch.Generator().manual_seed(derived_seed(seed, 3))
        self._check: dict[int, tuple] = {}  # per bucket: the logit check's step, its logits

    def shapes(self):
        """The layer's `LayerShapes` on this rank."""
        return self.model.layers[0].shapes()

    def start_plan(self, bucket: int) -> FusedLayerPlan | None:
        """The plan the engine runs at `bucket` rows now (plans file, else the table); None
        where the layer runs unfused."""
        return self.model.decode_gemm.fused_layer_plan(self.shapes(), bucket)

    def key(self, bucket: int):
        """The graph the controller replays for `bucket` rows at this context
        (`tuned_graph_key`)."""
        return tuned_graph_key(self.graph_plan, bucket, self.context)

    def _steps(self, bucket: int, count: int) -> list:
        import torch

        from protocol.commands import DecodeRow, Step

        ids = torch.randint(0, self.ex.cfg.vocab_size, (count, bucket),
                            generator=self._rng).tolist()
        return [Step(seq=i, rows=tuple(DecodeRow(slot=r, request_id=r, token=t,
                                                 position=self.context - 1)
                                       for r, t in enumerate(row)), bucket=bucket,
                     key=self.key(bucket)) for i, row in enumerate(ids)]

    def time(self, bucket: int, plan: FusedLayerPlan) -> float:
        """Median ms of the graph-replayed step at `bucket` rows with `plan`, on the graph the
        controller would replay there (`key`).

        Raises:
            RuntimeError: the plan's eager logits differ from the first plan's timed at this
                bucket by more than `LOGITS_RTOL`, its graph replay's from its eager step at
                all, or a step failed.
        """
        import torch

        from engine.bench.decode import bench_worker, time_steps
        from engine.executor import PhaseTimer

        ex, key = self.ex, self.key(bucket)
        self.model.set_fused_plan(bucket, plan)
        ex.free_graphs()
        if bucket not in self._check:
            self._check[bucket] = (self._steps(bucket, 1)[0], None)
        check, ref = self._check[bucket]
        ex.prepare_replay(check)
        ex._step = None
        logits = ex.graphs.on_stream(lambda: ex.decode_forward(
            bucket, short=key.path == SHORT))[:bucket].float()
        if ref is None:
            ref = logits.clone()
            self._check[bucket] = (check, ref)
        diff = float((logits - ref).abs().max()) / float(ref.abs().max())
        if not diff <= LOGITS_RTOL:
            raise RuntimeError(f"logits differ from the starting plan's by {diff:.3g} of the "
                               "largest")
        ex.record(key)
        ex.instantiate(key)
        ex.upload(key)
        ex.prepare_replay(check)
        ex.launch(key)
        torch.cuda.synchronize()
        ex._decode_logits = None  # nothing is sampled
        if not torch.equal(ex.logits_buf[:bucket].float(), logits):
            raise RuntimeError("the graph replay's logits differ from the eager step's")
        steps = self._steps(bucket, self.warmup + self.steps)
        worker = bench_worker(0, self.settings, bucket, {key})
        ex.phases = PhaseTimer()
        try:
            times = time_steps(worker, self.backend, steps, ex.phases)
        finally:
            ex.phases = None
        times = sorted(times[self.warmup:])
        return 1e3 * times[len(times) // 2]


CONFIRM_ROUNDS = 2
"""Times the start and the winner are each timed again at the end, alternating."""


def tune(timer: StepTimer, results: list[dict], rows: list[int], top: int, log) -> dict:
    """`descend` at each row count, then the starting plan and the winner timed again,
    alternating `CONFIRM_ROUNDS` times (their means are the confirming times). Returns the
    --json record: {"layer": layer_key, "rows": {m: {"start", "best", "start_ms", "best_ms",
    "confirm_start_ms", "confirm_best_ms", "trials"}}}.

    Raises:
        ValueError: a row count where the layer runs unfused (`StepTimer.start_plan` None).
        RuntimeError: the starting plan failed (`descend`).
    """
    shapes = timer.shapes()
    out = {"layer": layer_key(shapes), "rows": {}}
    for m in rows:
        start = timer.start_plan(m)
        if start is None:
            raise ValueError(f"the layer runs unfused at {m} rows; nothing to tune there")
        options = sweep_options(results, shapes, m, top)
        if timer.key(m).path == SHORT:
            options = with_tail_attention(options)
        best, trials = descend(start, options, lambda p, m=m: timer.time(m, p))
        pairs = [(timer.time(m, start), timer.time(m, best)) for _ in range(CONFIRM_ROUNDS)]
        again_start = sum(a for a, _ in pairs) / len(pairs)
        again_best = sum(b for _, b in pairs) / len(pairs)
        out["rows"][str(m)] = {
            "graph": str(timer.key(m)), "start": plan_to_json(start), "best": plan_to_json(best),
            "start_ms": trials[0].ms, "best_ms": next(t.ms for t in trials if t.plan == best),
            "confirm_start_ms": again_start, "confirm_best_ms": again_best,
            "trials": [{"role": t.role, "plan": plan_to_json(t.plan), "ms": t.ms,
                        "error": t.error} for t in trials]}
        log(f"rows {m} ({timer.key(m)}): start {trials[0].ms:.4f} ms -> best {again_best:.4f} "
            f"ms (start again {again_start:.4f}); {len(trials)} trials; best "
            f"{plan_to_json(best)}")
    return out


def plans_from_records(records: list[dict]) -> dict:
    """The plans file's content from --json records (`tune`'s, or a file's checked by
    `records_from_json`): per layer and row count, the winner where its confirming time beat
    the start's by at least `MIN_GAIN`, else the start (a plan at every tuned row count, so
    the file says what was decided there)."""
    plans: dict = {}
    for rec in records:
        for m, r in rec["rows"].items():
            won = r["confirm_best_ms"] < r["confirm_start_ms"] * (1 - MIN_GAIN)
            plans.setdefault(rec["layer"], {})[str(int(m))] = r["best"] if won else r["start"]
    return plans


def write_plans(path: str, plans: dict) -> None:
    """Merge `plans` into the plans file at `path` (its other layers and row counts kept),
    written atomically; the merged file must load (`load_fused_plans`).

    Raises:
        BenchArgError: the existing file is not a plans file, or the write failed.
    """
    from engine.bench.gemm_sweep import _replace_file

    merged: dict = {}
    if os.path.exists(path):
        try:
            load_fused_plans(path)
        except ValueError as exc:
            raise BenchArgError(f"--plans {exc}") from None
        with open(path) as f:
            merged = json.load(f)
    for layer, rows in plans.items():
        merged.setdefault(layer, {}).update(rows)
    try:
        parse_fused_plans(merged, f"--plans {path}")
    except ValueError as exc:
        raise BenchArgError(f"{exc}; nothing written") from None
    _replace_file(os.path.realpath(path), json.dumps(merged, indent=1, sort_keys=True) + "\n",
                  flag="--plans")


def _load_sweep(path: str) -> list[dict]:
    """The sweep's "results", every field checked (`engine.bench.gemm_sweep.sweep_results`).

    Raises:
        BenchArgError: naming --sweep, the file and the first bad field by its path; or that
            the sweep measured nothing.
    """
    from engine.bench.gemm_sweep import sweep_results

    results = read_tool_json("--sweep", path, "a gemm_sweep --json", sweep_results)
    if not results:
        raise BenchArgError(f"--sweep {path}: the sweep measured no shape")
    return results


def records_from_json(doc: Field) -> list[dict]:
    """The "records" of a step_tune --json (`doc`, the whole file), every field `tune` writes
    checked: those `plans_from_records` reads (each record's layer, and per row count the
    start and best plans and their confirming times) must be there, the rest be of their kind
    where they are; fields `tune` does not write (notes such as "model_note") are left alone.

    Raises:
        FieldError / RowCountError: naming the first missing or mistyped field by its path.
    """
    for rec in doc["records"].list():
        rec["layer"].parse(check_layer_key)
        for m, row in rec["rows"].items():
            row_count_key(m, rec["rows"].path)
            for name in ("start", "best"):
                row[name].parse(plan_from_json)
            for name in ("confirm_start_ms", "confirm_best_ms"):
                row[name].positive()
            row.if_present("start_ms", Field.positive)
            row.if_present("best_ms", Field.positive)
            row.if_present("graph", Field.string)
            row.if_present("trials", lambda trials: [_check_trial(t) for t in trials.list()])
        rec.if_present("preset", Field.string, nullable=True)
        rec.if_present("model", Field.string, nullable=True)
        rec.if_present("context", Field.integer)
        rec.if_present("steps", Field.integer)
        rec.if_present("device", Field.string)
        rec.if_present("seconds", Field.positive)
    return doc.value["records"]


def _check_trial(trial: Field) -> None:
    """One of a record's "trials" (`Trial` as `tune` writes it)."""
    trial["role"].string(("start", *ROLES))
    trial["plan"].parse(plan_from_json)
    trial.if_present("ms", Field.positive, nullable=True)
    trial.if_present("error", Field.string, nullable=True)


def layer_shapes(cfg: dict) -> LayerShapes:
    """The TP 1 `LayerShapes` of a model's config dict (a preset or config.json)."""
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    d = int(cfg.get("head_dim") or h // heads)
    q, kv, inter = heads * d, int(cfg["num_key_value_heads"]) * d, int(cfg["intermediate_size"])
    return LayerShapes((q + 2 * kv, h, False), (h, q, False), (2 * inter, h, True),
                       (h, inter, False))


def check_rows(cfg: dict, rows: list[int] | None, flag: str = "--rows") -> list[int]:
    """Each row count must be one the table measured for the layer's QKV shape, where the
    engine runs the layer fused (so a plan there is ever used). `rows` None: every such row
    count.

    Returns:
        the row counts to tune.
    Raises:
        BenchArgError: naming the first row count that is not; for None, where there is none;
            the table's own error where it does not load.
    """
    shapes = layer_shapes(cfg)
    try:
        table = load_table()
    except ValueError as exc:  # the shipped table edited by hand: its own one-line words
        raise BenchArgError(str(exc)) from None
    key = shape_key(*shapes.qkv)
    measured = sorted(table.get(key, {}))
    if not measured:
        raise BenchArgError(f"the skinny GEMM table has no entry for this model's QKV shape "
                            f"{key}: the engine runs its layers unfused (time the shape with "
                            "python -m engine.bench.gemm_sweep first)")
    chooser = DecodeGemm(table, None)
    if rows is None:
        rows = [m for m in measured if chooser.fused_layer_plan(shapes, m) is not None]
        if not rows:
            raise BenchArgError(f"the engine runs this layer unfused at every row count the "
                                f"table measured ({', '.join(map(str, measured))}); nothing "
                                "to tune")
        return rows
    for m in rows:
        if m not in measured:
            raise BenchArgError(f"{flag} {m}: the table measured this layer at row counts "
                                f"{', '.join(map(str, measured))} only")
        if chooser.fused_layer_plan(shapes, m) is None:
            raise BenchArgError(f"{flag} {m}: the engine runs this layer unfused at {m} rows "
                                "(engine.layers.linear.DecodeGemm.fused_layer_plan); "
                                "nothing to tune there")
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: every option with its help and default."""
    p = OneLineParser(prog="python -m engine.bench.step_tune", error_name="step_tune",
                      description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"random weights of a preset ({', '.join(PRESETS)}) "
                                      "(no default: give this or --model to time)")
    src.add_argument("--model", help="HF-layout Qwen3 directory (no default: give this or "
                                     "--preset to time)")
    p.add_argument("--rows", help="row counts to tune, comma-separated: row counts the GEMM "
                                  "table measured where the engine fuses the layer (default: "
                                  "every such row count)")
    p.add_argument("--top", type=integer, default=4,
                   help=f"sweep tiles tried per GEMM (1..{MAX_TOP}; default 4)")
    p.add_argument("--steps", type=integer, default=100,
                   help=f"timed replays per plan (1..{MAX_STEPS}; default 100)")
    p.add_argument("--warmup", type=integer, default=10,
                   help=f"untimed replays per plan before them (0..{MAX_WARMUP}; default 10)")
    p.add_argument("--context", type=integer, default=128,
                   help="tokens cached per row (default 128)")
    p.add_argument("--sweep", default=SWEEP_JSON,
                   help="gemm_sweep --json with the candidates (default: the shipped H200 "
                        "sweep, docs/benchmarks-gemm-sweep-h200.json)")
    p.add_argument("--json", help="write every trial here (default: printed only)")
    p.add_argument("--plans", help=f"merge the winners into this plans file (the engine's: "
                                   f"{os.path.relpath(FUSED_PLANS_PATH)}; default: none)")
    p.add_argument("--from-json", metavar="JSON",
                   help="write --plans from this earlier --json instead of timing (default: "
                        "time)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="seed of the random weights, K/V and tokens (default 0)")
    return p


def main(argv=None) -> int:
    """Check every argument, then tune the fused-layer plans on the GPU (or, with
    `--from-json`, rebuild `--plans` from earlier records); returns the exit status (2 for a
    bad argument or no CUDA GPU, 1 for a failed run)."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.from_json is not None:
            return _plans_from_json(args, p)
        # the values that need no model first, so a bad one is named whatever the model
        for flag, value, least, most in (
                ("--top", args.top, 1, MAX_TOP), ("--steps", args.steps, 1, MAX_STEPS),
                ("--warmup", args.warmup, 0, MAX_WARMUP), ("--context", args.context, 1, None)):
            check_range(flag, value, least, most)
        if (args.preset is None) == (args.model is None):
            raise BenchArgError("give --preset or --model")
        if args.preset is not None and args.preset not in PRESETS:
            raise BenchArgError(f"--preset {args.preset!r}: unknown; choose from "
                                f"{', '.join(sorted(PRESETS))}")
        if args.model is not None and not os.path.isdir(args.model):
            raise BenchArgError(f"--model {args.model!r}: not a directory")
        check_switches()
        if not switch("LOCKSTEP_FUSED_NORM"):
            raise BenchArgError("LOCKSTEP_FUSED_NORM=0 keeps every layer unfused; there is no "
                                "fused-layer plan to tune (unset it)")
        cfg = model_shape(BenchOptions(preset=args.preset, model=args.model))
        rows = None if args.rows is None else parse_int_list(args.rows, "--rows")
        for m in rows or ():
            check_range("--rows", m, 1, MAX_ROWS)
        max_pos = max_positions(cfg)
        if max_pos and args.context + 1 > max_pos:
            raise BenchArgError(f"--context {shown(args.context)}: the model holds at most "
                                f"{max_pos - 1} cached tokens (max_position_embeddings "
                                f"{max_pos})")
        results = _load_sweep(args.sweep)
        for flag, path in (("--json", args.json), ("--plans", args.plans)):
            if path is not None:
                check_output_path(flag, path)
        _check_distinct((("--sweep", args.sweep), ("--json", args.json),
                         ("--plans", args.plans)))
        if args.plans is not None and os.path.exists(args.plans):
            try:
                load_fused_plans(args.plans)
            except ValueError as exc:
                raise BenchArgError(f"--plans {exc}") from None
        # last: whether the table fuses the model's layer at these row counts, so that each
        # value above is named even for a model the table has no entry for
        rows = check_rows(cfg, rows)
    except BenchArgError as exc:
        print(f"step_tune: error: {exc}", file=sys.stderr)
        return 2
    if cuda_missing("step_tune"):
        return 2
    import torch

    if args.json is None and args.plans is None:
        print("step_tune: note: without --json or --plans the results are only printed",
              file=sys.stderr)
    model_dir, tmp = args.model, None
    if args.preset is not None:
        import shutil

        from engine.bench.modeldir import write_random_model_fast

        tmp = model_dir = str(write_random_model_fast(args.preset, "bfloat16", args.seed))
    try:
        t0 = time.perf_counter()
        tiles = [TileConfig(**t["config"]) for r in results for e in r["rows"].values()
                 for t in e.get("triton", ()) if "us" in t]
        timer = StepTimer(model_dir, rows, args.context, args.steps, args.warmup, tiles,
                          args.seed)
        record = tune(timer, results, rows, args.top, lambda s: print(s, flush=True))
        record.update(preset=args.preset, model=args.model, context=args.context,
                      steps=args.steps, device=torch.cuda.get_device_name(),
                      seconds=time.perf_counter() - t0)
    except (ValueError, RuntimeError) as exc:
        print(f"step_tune: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    from engine.bench.gemm_sweep import _replace_file

    try:
        if args.json:
            _replace_file(os.path.realpath(args.json), json.dumps({"records": [record]},
                                                                  indent=1), flag="--json")
        if args.plans:
            write_plans(args.plans, plans_from_records([record]))
    except BenchArgError as exc:
        print(f"step_tune: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _plans_from_json(args, parser) -> int:
    """`--from-json`: the plans file from earlier --json records (merged), nothing timed."""
    timing = [f"--{n}" for n in ("preset", "model", "rows", "top", "steps", "warmup",
                                 "context", "sweep", "json", "seed")
              if getattr(args, n) != parser.get_default(n)]
    if timing:
        raise BenchArgError(f"--from-json times nothing; {timing[0]} does not apply")
    if args.plans is None:
        raise BenchArgError("--from-json needs --plans (where to write the plans)")
    check_output_path("--plans", args.plans)
    plans = plans_from_records(read_tool_json("--from-json", args.from_json,
                                              "a step_tune --json", records_from_json))
    _check_distinct((("--from-json", args.from_json), ("--plans", args.plans)))
    write_plans(args.plans, plans)
    count = sum(len(r) for r in plans.values())
    print(f"step_tune: wrote plans for {count} row count{'s' if count != 1 else ''} to "
          f"{args.plans}")
    return 0


def _check_distinct(paths) -> None:
    """Raises BenchArgError when two of the (flag, path) pairs name one file (the later
    write would replace the earlier file or an input)."""
    seen: dict[str, str] = {}
    for flag, path in paths:
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise BenchArgError(f"{seen[real]} and {flag} name one file {path!r}")
        seen[real] = flag


if __name__ == "__main__":
    raise SystemExit(main())
