"""Decode GEMM sweep: cuBLAS against the Triton skinny GEMM, per weight shape and row count.

For each linear layer shape of the named presets (QKV, o_proj, gate_up with the SwiGLU
epilogue, down_proj; per rank at each TP size asked for) and each row count M, it times:
    cublas:  F.linear (and, for gate_up, the separate `fused.silu_mul` launch after it);
    triton:  `skinny_gemm` at every tile configuration of the search space (`sweep_tiles`;
             with `--gemv` also the tiles on the CUDA cores).
Each measurement captures a CUDA graph of one call per weight copy, cycling through enough
distinct copies (>= 128 MB) that the weights come from HBM, not the 60 MB L2, as in a real
step; the time per call is the replay time over the copies (median of `repeats` replays).

    python -m engine.bench.gemm_sweep --presets qwen3-0.6b,qwen3-4b --json out.json
    python -m engine.bench.gemm_sweep --presets qwen3-4b --table engine/kernels/skinny_gemm_table.json

`--table` merges the per-shape choice the engine reads (`engine.kernels.skinny_gemm.load_table`)
into that file: the fastest Triton configuration per (shape, M) and the times of it and
cuBLAS, replacing the entries of the shapes and row counts timed and keeping the rest; the
engine takes cuBLAS where it was faster unless the layer is fused (`engine.model`).
`--from-json` does the same from an earlier `--json` without timing anything. The rope kind
is timed at TP 1 only: the fused layer form, the only user of its launch, runs at world size
1 (`engine.layers.linear.RowParallelLinear`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from engine.cli_args import integer
from engine.bench.options import (BenchArgError, check_output_path, check_range, check_switches,
                                  cuda_missing, parse_int_list, parse_name_list, read_tool_json)
from engine.kernels import fused
from engine.json_fields import Field, FieldError
from engine.kernels.skinny_gemm import (GEMV_MAX_ROWS, MAX_ROWS, TileConfig, Workspace,
                                        parse_table, row_count_key, shape_key, skinny_gemm,
                                        tile_from_json)
from engine.presets import PRESETS
from lockstep.cli import OneLineParser

ROWS = (1, 8, 16, 32, 64)
SPACE = dict(block_n=(16, 32, 64), block_k=(128, 256), split_k=(1, 2, 4, 8),
             num_stages=(3, 4))
"""Tiles whose weights come through pointer loads."""
TMA_SPACE = dict(block_n=(64, 128), block_k=(128, 256), split_k=(1, 2, 4, 8),
                 num_stages=(3, 5))
"""Tiles whose weights come through a tensor descriptor (`TileConfig.tma`); those whose
pipeline stages would not fit `TMA_SMEM_BYTES` are left out."""
XTMA_SPACE = dict(block_n=(32, 64, 128), block_k=(64, 128), split_k=(1, 2, 4),
                  num_stages=(3, 4, 5))
"""Tiles whose weights and activations both come through tensor descriptors
(`TileConfig.x_tma`); those whose stages (weights and a 64-row activation tile) would not fit
`TMA_SMEM_BYTES` are left out. At 32-64 rows of Qwen3-4B's gate_up the first such kernel
read 19456 x 2560 in 29.7 us against 33.4 for cuBLAS (one H200, 2026-12-04)."""
GEMV_SPACE = dict(block_n=(4, 8, 16), block_k=(512, 1024, 2048), split_k=(1, 2, 4),
                  num_warps=(4, 8))
"""Tiles whose products run on the CUDA cores (`TileConfig.gemv`), timed with `--gemv` at up
to `GEMV_MAX_ROWS` rows; those whose per-tile products (rows x block_n x block_k, rows padded
to a power of two, twice that for SwiGLU's two accumulators) exceed `GEMV_MAX_PRODUCT` are left
out (they would not fit the registers). Narrow tiles give
N / block_n programs without a K split: 320-640 for Qwen3-4B's o_proj, whose tensor-core
tile runs one program per SM on 40 SMs (docs/benchmarks.md, 2026-12-06)."""
GEMV_MAX_PRODUCT = 16384
TMA_SMEM_BYTES = 200 * 1024
"""Shared memory a TMA tile's weight stages may take (an H200 SM has 228 KB)."""
COPIES_BYTES = 128 * 1024**2
ROPE_MAX_SPLIT = 20
"""Most K splits `rope_space` names."""


LAYERS = ("qkv", "o_proj", "gate_up", "down")
"""The decode linear layers of one transformer layer, as `layer_shapes` names them."""


def layer_shapes(preset: str, tp: int) -> list[tuple[str, int, int, bool]]:
    """(name, N (weight rows), K, swiglu) of each decode linear layer of one rank."""
    c = PRESETS[preset]
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    return [("qkv", (q + 2 * kv) // tp, h, False), ("o_proj", h, q // tp, False),
            ("gate_up", 2 * inter // tp, h, True), ("down", h, inter // tp, False)]


def sweep_shapes(presets, tps, layers) -> dict[tuple[int, int, bool], list[str]]:
    """The distinct (N, K, swiglu) weight shapes of `layers` (names from LAYERS) over every
    preset and TP size, each with the "preset tpN layer" names that share it, in order."""
    shapes: dict[tuple[int, int, bool], list[str]] = {}
    for preset in presets:
        for tp in tps:
            for name, n, k, sw in layer_shapes(preset, tp):
                if name in layers:
                    shapes.setdefault((n, k, sw), []).append(f"{preset} tp{tp} {name}")
    return shapes


MAX_REPEATS = 1_000
"""Most graph replays per timing: a bound like step_tune's, so a typo cannot run for days."""


def time_graph(fn, repeats: int) -> float:
    """Median ms of one replay of a graph that holds `fn()` once."""
    times = graph_times(fn, repeats)
    return times[len(times) // 2]


def graph_times(fn, repeats: int) -> list[float]:
    """ms of each of `repeats` replays (after 3 warm-up ones) of a graph that holds `fn()` once
    (run once eagerly first, for compiles), sorted; CUDA events."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)


def time_tiles(entry: dict, configs, check, launch, weights: list, repeats: int):
    """Time each tile: `check(cfg)` first (it raises on a wrong result), then a graph of
    `launch(cfg, w)` over every weight copy; us per call. Appends {"config", "us"} or
    {"config", "error"} to entry["triton"], sets and returns entry["best"] (None when no tile
    ran)."""
    for cfg in configs:
        try:
            check(cfg)
            us = time_graph(lambda: [launch(cfg, w) for w in weights], repeats) * 1e3 / len(
                weights)
        except Exception as exc:  # noqa: BLE001 - a config that fails is recorded, not fatal
            entry["triton"].append({"config": cfg.__dict__, "error": str(exc)[:200]})
            continue
        entry["triton"].append({"config": cfg.__dict__, "us": us})
    entry["best"] = min((t for t in entry["triton"] if "us" in t), key=lambda t: t["us"],
                        default=None)
    return entry["best"]


def sweep_shape(n: int, k: int, swiglu: bool, rows, workspace, repeats: int, log,
                gemv: bool = False) -> dict:
    """Times cuBLAS and every Triton configuration (`sweep_tiles`) at each row count;
    per-call microseconds."""
    dev = "cuda"
    wbytes = n * k * 2
    copies = max(2, -(-COPIES_BYTES // wbytes))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k ** 0.5 for _ in range(copies)]
    out = {"N": n, "K": k, "swiglu": swiglu, "weight_bytes": wbytes, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)

        def cublas():
            for w in ws:
                y = torch.nn.functional.linear(x, w)
                if swiglu:
                    fused.silu_mul(y)

        entry = {"cublas_us": time_graph(cublas, repeats) * 1e3 / copies, "triton": []}
        ref = torch.nn.functional.linear(x.float(), ws[0].float())

        def check(cfg):
            y = skinny_gemm(x, ws[0], workspace, cfg, swiglu=swiglu)
            if not swiglu:
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    raise AssertionError(f"relative error {err}")

        best = time_tiles(entry, sweep_tiles(k, m, swiglu, gemv), check,
                          lambda cfg, w: skinny_gemm(x, w, workspace, cfg, swiglu=swiglu),
                          ws, repeats)
        entry["read_GBps_cublas"] = wbytes / entry["cublas_us"] / 1e3
        if best:
            entry["read_GBps_triton"] = wbytes / best["us"] / 1e3
        out["rows"][m] = entry
        log(f"N={n} K={k} swiglu={swiglu} M={m}: cublas {entry['cublas_us']:.2f} us, triton "
            f"{best['us'] if best else float('nan'):.2f} us {best['config'] if best else ''}")
    del ws
    return out


def sweep_tiles(k: int, m: int, swiglu: bool, gemv: bool) -> list[TileConfig]:
    """The tiles `sweep_shape` times at `m` rows over K = k: `gemm_space`, and with `gemv`
    also `gemv_space`. The gemv tiles are left out unless asked for: alone they were the
    fastest of 4B's qkv, o_proj and down at one row (H200), but in the decode step they were
    slower (H100) or no faster (H200's `step_tune`): docs/benchmarks.md, 2026-12-06, session
    of 23:06 UTC. A table made from a sweep with them would pick them where they are not
    faster."""
    return gemm_space(k, swiglu) + (gemv_space(k, m, swiglu) if gemv else [])


def gemm_space(k: int, swiglu: bool) -> list[TileConfig]:
    """The tiles `sweep_shape` times over K = k: `SPACE` with pointer loads, `TMA_SPACE` with
    a tensor descriptor for the weights and `XTMA_SPACE` with one for the activations too, 4
    warps; a split shorter than one block_k is left out."""
    pointer = [TileConfig(bn, bk, sk, 4, st)
               for bn, bk, sk, st in itertools.product(*SPACE.values())]
    tma = [TileConfig(bn, bk, sk, 4, st, tma=True)
           for bn, bk, sk, st in itertools.product(*TMA_SPACE.values())
           if bn * bk * 2 * st * (2 if swiglu else 1) <= TMA_SMEM_BYTES]
    x_tma = [TileConfig(bn, bk, sk, 4, st, tma=True, x_tma=True)
             for bn, bk, sk, st in itertools.product(*XTMA_SPACE.values())
             if (bn * (2 if swiglu else 1) + MAX_ROWS) * bk * 2 * st <= TMA_SMEM_BYTES]
    return [c for c in pointer + tma + x_tma
            if not (c.split_k > 1 and k // c.split_k < c.block_k)]


def gemv_space(k: int, m: int, swiglu: bool) -> list[TileConfig]:
    """The `GEMV_SPACE` tiles `sweep_shape` times at `m` rows over K = k: none past
    `GEMV_MAX_ROWS` rows; per-tile products within `GEMV_MAX_PRODUCT`; a split shorter than one
    block_k left out."""
    if m > GEMV_MAX_ROWS:
        return []
    products = (1 << (m - 1).bit_length()) * (2 if swiglu else 1)
    return [TileConfig(bn, bk, sk, nw, 1, gemv=True)
            for bn, bk, sk, nw in itertools.product(*GEMV_SPACE.values())
            if products * bn * bk <= GEMV_MAX_PRODUCT and k // sk >= bk]


def rope_space(k: int, half: int) -> list[TileConfig]:
    """Tiles of a `skinny_gemm_qkv_rope` launch over K = k: block_n is the half head; each
    (block_k, split) whose splits are one or two block_k tiles long, or one unsplit loop;
    4 and 8 warps, with pointer and tensor-descriptor weight loads (the descriptor's tile at
    least 16 rows, as `TileConfig` requires, and fitting `TMA_SMEM_BYTES` over 4 stages). Splits that round to the same K ranges appear
    once."""
    out = []
    for bk in (128, 256, 512):
        for split in (1, 2, 4, 5, 8, 10, 16, 20):
            k_split = -(-(-(-k // split)) // bk) * bk
            tiles = k_split // bk
            if -(-k // k_split) != split or (split > 1 and tiles > 2):
                continue
            out += [TileConfig(half, bk, split, warps, 4, tma=tma) for warps in (4, 8)
                    for tma in (False, True)
                    if not tma or (half >= 16 and 2 * half * bk * 2 * 4 <= TMA_SMEM_BYTES)]
    return out


def sweep_rope_shape(preset: str, tp: int, rows, workspace, repeats: int, log) -> dict:
    """Times `skinny_gemm_qkv_rope` at every `rope_space` tile against the two launches it
    replaces in a fused layer (the QKV tile the shipped table names, which the fused layer
    takes even where cuBLAS was faster; cuBLAS where it names none; then
    `fused.qk_norm_rope_kv`) at each row count; a tile whose q or caches differ from the two
    launches' by more than 2% (relative norm) is recorded as an error. Per-call microseconds,
    weights from HBM as in `sweep_shape`. The two launches' time is stored as "cublas_us",
    the table's field for what the skinny launch must beat (`TableEntry.skinny_wins`), even
    where their GEMM is a skinny tile ("baseline" names which)."""
    from engine.kernels.skinny_gemm import RopeKV, load_table, skinny_gemm_qkv_rope, table_entry

    c = PRESETS[preset]
    d, nq, nkv = c["head_dim"], c["num_attention_heads"] // tp, c["num_key_value_heads"] // tp
    n, k = (nq + 2 * nkv) * d, c["hidden_size"]
    dev, page = "cuda", 16
    copies = max(2, -(-COPIES_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k ** 0.5 for _ in range(copies)]
    qw, kw = (1 + 0.1 * torch.randn(d, device=dev)).bfloat16(), (1 + 0.1 * torch.randn(
        d, device=dev)).bfloat16()
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, device=dev).float() / d))
    angles = torch.outer(torch.arange(4096, device=dev).float(), inv).repeat(1, 2)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    table = load_table()
    out = {"N": n, "K": k, "swiglu": False, "rope": True, "weight_bytes": n * k * 2,
           "rows": {}}
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        pos = torch.randint(0, 4096, (m,), device=dev)
        slots = torch.arange(m, dtype=torch.int32, device=dev)
        pt = torch.randperm(m * 4096 // page, device=dev).to(torch.int32).view(m, -1)
        caches = [torch.zeros(m * 4096 // page + 1, page, nkv, d, dtype=torch.bfloat16,
                              device=dev) for _ in range(4)]
        rope = RopeKV(qw, kw, cos, sin, pos, slots, pt, caches[2], caches[3], nq, nkv, 1e-6)
        plain = table_entry(table, n, k, False, m)
        qkv_cfg = plain.config if plain is not None else None

        def two_launches(w):
            y = (skinny_gemm(x, w, workspace, qkv_cfg) if qkv_cfg is not None
                 else torch.nn.functional.linear(x, w))
            return fused.qk_norm_rope_kv(y, qw, kw, cos, sin, pos, slots, pt, caches[0],
                                         caches[1], nq, nkv, 1e-6)

        q_ref = two_launches(ws[0])
        entry = {"cublas_us": time_graph(lambda: [two_launches(w) for w in ws], repeats)
                 * 1e3 / copies, "baseline": qkv_cfg.__dict__ if qkv_cfg else "cublas",
                 "triton": []}
        def check(cfg):
            q = skinny_gemm_qkv_rope(x, ws[0], workspace, cfg, rope)
            two_launches(ws[0])
            err = max(((q.float() - q_ref.float()).norm() / q_ref.norm()).item(),
                      *(((a.float() - b.float()).norm() / b.float().norm()).item()
                        for a, b in ((caches[2], caches[0]), (caches[3], caches[1]))))
            if not err < 2e-2:
                raise AssertionError(f"relative error {err} against the two launches")

        best = time_tiles(entry, rope_space(k, d // 2), check,
                          lambda cfg, w: skinny_gemm_qkv_rope(x, w, workspace, cfg, rope),
                          ws, repeats)
        out["rows"][m] = entry
        log(f"rope N={n} K={k} M={m}: two launches {entry['cublas_us']:.2f} us, one "
            f"{best['us'] if best else float('nan'):.2f} us {best['config'] if best else ''}")
    del ws
    return out


def merge_table(path: str, table: dict) -> dict:
    """The table file at `path` (absent: {}) with `table`'s (shape, row count) entries put in
    place of its own; the result must parse (`parse_table`).

    Raises:
        BenchArgError: the file is not a table, or the merged table is not.
    """
    from engine.kernels.skinny_gemm import load_table

    merged: dict = {}
    if os.path.exists(path):
        try:
            load_table(path)
        except ValueError as exc:
            raise BenchArgError(f"--table {exc}"[:300]) from None
        with open(path) as f:
            merged = json.load(f)
    for key, rows in table.items():
        merged.setdefault(key, {}).update(rows)
    try:
        parse_table(merged, f"--table {path}")
    except ValueError as exc:
        raise BenchArgError(f"{exc}; nothing written"[:300]) from None
    return merged


def check_tp(presets: list[str], tps: list[int]) -> None:
    """Each TP size must split every preset's heads and MLP width evenly, as the engine
    requires (`engine.config.check_parallel`).

    Raises:
        BenchArgError: naming the first TP size and preset that do not.
    """
    for tp in tps:
        for preset in presets:
            c = PRESETS[preset]
            for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
                if c[field] % tp:
                    raise BenchArgError(f"--tp {tp}: {preset}'s {field} {c[field]} is not "
                                        "divisible by it")


def sweep_results(doc: Field) -> list[dict]:
    """The "results" of a gemm_sweep --json (`doc`, the whole file), every field `sweep_shape`
    and `sweep_rope_shape` write checked: those the readers use (the shape, each row count's
    cublas_us, triton tiles and best) must be there, the rest (weight_bytes, layers, rope,
    baseline, the bandwidths) be of their kind where they are; fields neither writes (notes
    such as the shipped sweep's "run") are left alone.

    Raises:
        FieldError / RowCountError: naming the first missing or mistyped field by its path.
    """
    def timed(t: Field) -> None:  # a tile and its time, or the error that ruled it out
        t["config"].parse(tile_from_json)
        if t.optional("us") is None and t.optional("error") is None:
            raise FieldError(f"{t.path}: no 'us' or 'error' field")
        t.if_present("us", Field.positive)
        t.if_present("error", Field.string)

    doc.if_present("device", Field.string)
    for r in doc["results"].list():
        r["N"].integer(), r["K"].integer(), r["swiglu"].boolean()
        r.if_present("rope", Field.boolean)
        r.if_present("weight_bytes", Field.integer)
        r.if_present("layers", lambda names: [name.string() for name in names.list()])
        for m, e in r["rows"].items():
            row_count_key(m, r["rows"].path)
            e["cublas_us"].positive()
            for t in e["triton"].list():
                timed(t)
            if e["best"].value is not None:
                e["best"]["us"].positive()
                e["best"]["config"].parse(tile_from_json)
            e.if_present("read_GBps_cublas", Field.positive)
            e.if_present("read_GBps_triton", Field.positive)
            e.if_present("baseline", lambda b: b.value == "cublas" or b.parse(tile_from_json))
    return doc.value["results"]


def to_table(results: list[dict]) -> dict:
    """The table the engine reads: {shape_key: {M: {"skinny": fastest tile, "skinny_us",
    "cublas_us"}}}; `engine.kernels.skinny_gemm.choose` takes the faster of the two. A row
    count where no tile ran has "skinny": null (cuBLAS, and no fused layer, there)."""
    table = {}
    for r in results:
        key = shape_key(int(r["N"]), int(r["K"]), bool(r["swiglu"]), bool(r.get("rope")))
        table[key] = {}
        for m, e in r["rows"].items():
            best = e["best"]
            table[key][str(int(m))] = {"skinny": best["config"] if best else None,
                                       "skinny_us": best["us"] if best else None,
                                       "cublas_us": e["cublas_us"]}
    return table


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m engine.bench.gemm_sweep", error_name="gemm_sweep",
                      description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="qwen3-0.6b,qwen3-4b,qwen3-8b",
                   help="comma-separated model presets whose linear shapes to time (default "
                        "qwen3-0.6b,qwen3-4b,qwen3-8b)")
    p.add_argument("--tp", default="1,2",
                   help="tensor-parallel sizes whose per-rank shapes to time (default 1,2)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help=f"comma-separated row counts M to time (1..{MAX_ROWS}; default "
                        f"{','.join(map(str, ROWS))})")
    p.add_argument("--repeats", type=integer, default=20,
                   help=f"graph replays per timing (1..{MAX_REPEATS}; default 20); the median is "
                        "reported")
    p.add_argument("--kinds", default="gemm,rope",
                   help="what to time, comma-separated (default gemm,rope): gemm (each linear "
                        "shape against cuBLAS), rope (the QKV GEMM with the q/k norm + RoPE + "
                        "KV-write epilogue against the two launches it replaces)")
    p.add_argument("--layers", default=",".join(LAYERS),
                   help=f"which linear layers the gemm kind times, comma-separated (default "
                        f"{','.join(LAYERS)})")
    p.add_argument("--gemv", action="store_true",
                   help=f"also time the tiles on the CUDA cores (TileConfig.gemv) at up to "
                        f"{GEMV_MAX_ROWS} rows; off by default: they win alone but not in the "
                        "decode step (docs/benchmarks.md)")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--table", help="merge the engine's per-shape choice into this file")
    p.add_argument("--from-json", metavar="JSON",
                   help="write --table from this earlier --json instead of timing")
    args = p.parse_args(argv)
    if args.from_json is not None:
        return _table_from_json(args, p)
    try:  # every argument before the GPU is touched, the output paths before the run
        rows = tuple(parse_int_list(args.rows, "--rows"))
        tps = parse_int_list(args.tp, "--tp", example="1,2")
        for flag, values in (("--rows", rows), ("--tp", tps)):
            if any(v < 1 for v in values):
                raise BenchArgError(f"{flag} {','.join(map(str, values))}: each must be >= 1")
        if max(rows) > MAX_ROWS:
            raise BenchArgError(f"--rows {max(rows)}: the skinny GEMM serves at most "
                                f"{MAX_ROWS} rows")
        presets = parse_name_list(args.presets, "--presets")
        unknown = [x for x in presets if x not in PRESETS]
        if unknown:
            raise BenchArgError(f"--presets {args.presets!r}: unknown preset {unknown[0]!r}; "
                                f"choose from {', '.join(sorted(PRESETS))}")
        kinds = parse_name_list(args.kinds, "--kinds")
        if not kinds or any(x not in ("gemm", "rope") for x in kinds):
            raise BenchArgError(f"--kinds {args.kinds!r}: expected gemm, rope or gemm,rope")
        layers = parse_name_list(args.layers, "--layers")
        if not layers or any(x not in LAYERS for x in layers):
            bad = next((x for x in layers if x not in LAYERS), "")
            raise BenchArgError(f"--layers {args.layers!r}: unknown layer {bad!r}; choose from "
                                f"{', '.join(LAYERS)}")
        check_tp(presets, tps)
        if kinds == ["rope"] and 1 not in tps:
            raise BenchArgError(f"--kinds rope --tp {args.tp}: the rope launch is timed at TP 1 "
                                "only (the fused layer runs at world size 1)")
        check_range("--repeats", args.repeats, 1, MAX_REPEATS)
        for flag, path in (("--json", args.json), ("--table", args.table)):
            if path is not None:
                check_output_path(flag, path)
        if (args.json and args.table and os.path.realpath(args.json)
                == os.path.realpath(args.table)):
            raise BenchArgError(f"--json and --table name one file {args.table!r}; the table "
                                "would overwrite the measurements")
        if args.table is not None:
            merge_table(args.table, {})  # an existing --table must be a table
        check_switches()
    except BenchArgError as exc:
        print(f"gemm_sweep: error: {exc}", file=sys.stderr)
        return 2
    if cuda_missing("gemm_sweep"):
        return 2
    shapes = sweep_shapes(presets, tps, layers)
    # every layer's widest shape, so that the rope kind's QKV fits when --layers leaves it out
    max_n = max(n for n, _, _ in sweep_shapes(presets, tps, LAYERS))
    workspace = Workspace("cuda", max_n, max(max(SPACE["split_k"]), ROPE_MAX_SPLIT),
                          -(-max_n // min(SPACE["block_n"] + GEMV_SPACE["block_n"])))
    results = []
    log = lambda s: print(s, flush=True)  # noqa: E731
    for (n, k, sw), names in shapes.items() if "gemm" in kinds else ():
        print(f"-- {', '.join(names)}", flush=True)
        r = sweep_shape(n, k, sw, rows, workspace, args.repeats, log, args.gemv)
        r["layers"] = names
        results.append(r)
    rope_shapes = {}
    for preset in presets if "rope" in kinds else ():
        for tp in (1,) if 1 in tps else ():
            n, k = layer_shapes(preset, tp)[0][1:3]
            rope_shapes.setdefault((n, k), (preset, tp, []))[2].append(f"{preset} tp{tp} qkv")
    for preset, tp, names in rope_shapes.values():
        print(f"-- rope: {', '.join(names)}", flush=True)
        r = sweep_rope_shape(preset, tp, rows, workspace, args.repeats, log)
        r["layers"] = names
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    if args.table:
        try:
            merged = merge_table(args.table, to_table(results))
            _replace_file(os.path.realpath(args.table),
                          json.dumps(merged, indent=1, sort_keys=True))
        except BenchArgError as exc:
            print(f"gemm_sweep: error: {exc}", file=sys.stderr)
            return 2
    return 0


def _replace_file(target: str, text: str, flag: str = "--table") -> None:
    """Write `text` to a temporary file beside `target`, then rename it over `target`, so
    that a failed write leaves no half-written file; the file keeps the mode it had (a new
    one gets the umask's).

    Raises:
        BenchArgError: the write failed (the OS's words).
    """
    import tempfile

    try:
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        os.unlink(tmp)
        raise BenchArgError(f"{flag} {target}: {exc.strerror}") from None


def _table_from_json(args, parser) -> int:
    """`--from-json`: the table from an earlier sweep's measurements, written atomically."""

    source, table_path = args.from_json, args.table
    try:
        timing = [f"--{name.replace('_', '-')}" for name in ("presets", "tp", "rows", "repeats",
                                                            "kinds", "json")
                  if getattr(args, name) != parser.get_default(name)]
        if timing:
            raise BenchArgError(f"--from-json times nothing; {timing[0]} does not apply")
        if table_path is None:
            raise BenchArgError("--from-json needs --table (where to write the table)")
        check_output_path("--table", table_path)
        table = to_table(read_tool_json("--from-json", source, "a gemm_sweep --json",
                                        sweep_results))
        if not table:
            raise BenchArgError(f"--from-json {source}: the sweep measured no shape")
        target = os.path.realpath(table_path)  # through a symlink to the file it names
        if os.path.exists(target) and os.path.samefile(source, target):
            raise BenchArgError(f"--table {table_path}: is the --from-json file itself")
        merged = merge_table(target, table)
        _replace_file(target, json.dumps(merged, indent=1, sort_keys=True))
        kept = len(merged) - len(table)
        print(f"gemm_sweep: wrote {len(table)} shapes to {table_path}"
              + (f" (kept {kept} other shape{'s' if kept != 1 else ''} it held)" if kept else ""))
    except BenchArgError as exc:
        print(f"gemm_sweep: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
