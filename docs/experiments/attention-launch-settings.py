"""Decode attention's launch settings at Qwen3-4B's heads, timed as the step runs them.

Stand-alone experiment (`PYTHONPATH=. python3 docs/experiments/attention-launch-settings.py
OUT.json`): for each (batch, context) it captures one CUDA graph of 36 attention launches,
one per layer, over caches that rotate so that the KV read comes from HBM and not from L2, and
times its replays (median of 20, us per launch). It varies what `engine.kernels.
decode_attention` fixes as module constants: tokens per iteration (`TILE_TOKENS` for launches
of one program per (row, kv head), `SPLIT_TILE_TOKENS` on the split-KV path), warps, pipeline
stages, and `TARGET_PROGRAMS` (which decides whether a launch splits its sequences). Every
setting computes the same attention up to the order of the online softmax; each result is
compared with the float64 reference.
"""

from __future__ import annotations

import itertools
import json
import math
import sys

import torch

import engine.kernels.decode_attention as da
from engine.bench.gemm_sweep import time_graph

HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 16, 36


def _graph_us(fn, reps: int = 20) -> float:
    """Median us per launch of a graph of LAYERS calls of fn(layer) (`gemm_sweep.time_graph`)."""
    def step():
        for layer in range(LAYERS):
            fn(layer)
    return time_graph(step, reps) * 1e3 / LAYERS


def _case(batch: int, context: int):
    kv_bytes = 2 * batch * context * HKV * D * 2
    copies = min(LAYERS, max(2, math.ceil(400e6 / kv_bytes)))
    pages = batch * context // PAGE
    ks = [torch.randn(pages + 1, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
          for _ in range(copies)]
    vs = [torch.randn_like(k) for k in ks]
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, context // PAGE)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    order = torch.arange(batch, device="cuda", dtype=torch.int64) if da.takes_rows_in_order(
        batch) else None
    ref = da.paged_decode_attention_reference(q, ks[0], vs[0], table, lens, slots,
                                              D ** -0.5).to("cuda")
    return kv_bytes, copies, ks, vs, table, lens, slots, q, order, ref


SETTINGS = {
    "tile": (64, 128),
    "warps": (2, 4, 8),
    "stages": (1, 2, 3, 4),
    "target": (264, 1056),
}


def main() -> int:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    saved = (da.TILE_TOKENS, da.SPLIT_TILE_TOKENS, da.NUM_WARPS, da.NUM_STAGES,
             da.TARGET_PROGRAMS, da.NUM_WARPS_ONE_SPLIT)
    ws = da.SplitWorkspace(torch.device("cuda"), D, 16, programs=2 * 1056)
    rows = []
    cases = [(1, 128), (8, 128), (64, 128), (256, 128), (64, 1024), (256, 1024), (8, 1024),
             (1, 4096)]
    try:
        for batch, context in cases:
            kv_bytes, copies, ks, vs, table, lens, slots, q, order, ref = _case(batch, context)
            outs = torch.empty(LAYERS, batch, HQ, D, device="cuda", dtype=torch.bfloat16)
            seen = set()
            for tile, warps, stages, target in itertools.product(*SETTINGS.values()):
                da.TILE_TOKENS = da.SPLIT_TILE_TOKENS = tile
                da.NUM_WARPS = da.NUM_WARPS_ONE_SPLIT = warps
                da.NUM_STAGES, da.TARGET_PROGRAMS = stages, target
                same = (tile, warps, stages, da.num_splits(batch, HKV))
                if same in seen:  # a target that splits this batch as another one did
                    continue
                seen.add(same)
                row = {"batch": batch, "context": context, "tile": tile, "warps": warps,
                       "stages": stages, "target": target,
                       "splits": da.num_splits(batch, HKV)}
                try:
                    us = _graph_us(lambda layer: da.paged_decode_attention_triton(
                        q, ks[layer % copies], vs[layer % copies], table, lens, slots,
                        D ** -0.5, row_order=order, out=outs[layer], workspace=ws))
                    err = ((outs[0].double() - ref.double()).norm() / ref.double().norm()).item()
                except Exception as exc:  # out of shared memory, registers
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    print("error", row, flush=True)
                    rows.append(row)
                    continue
                row.update(us=us, TBps=kv_bytes / (us * 1e-6) / 1e12, rel_err=err)
                rows.append(row)
            ks = vs = None  # free this case's caches before the next one allocates
            best = sorted((r for r in rows if r["batch"] == batch and r["context"] == context
                           and "us" in r), key=lambda r: r["us"])
            base = next((r for r in best if (r["tile"], r["warps"], r["stages"], r["target"])
                         == ((saved[0], saved[5]) if batch * HKV >= saved[4]
                             else (saved[1], saved[2])) + (saved[3], saved[4])),
                        {"us": float("nan"), "TBps": float("nan")})
            print(f"b{batch} ctx{context}: shipped {base['us']:.2f} us ({base['TBps']:.2f} TB/s)"
                  f"; best " + "; ".join(f"{r['us']:.2f} us t{r['tile']} w{r['warps']} "
                                         f"s{r['stages']} T{r['target']} err {r['rel_err']:.1e}"
                                         for r in best[:4]), flush=True)
            if out_path:  # after every case, so a run cut short keeps what it measured
                with open(out_path, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f,
                              indent=1)
    finally:
        (da.TILE_TOKENS, da.SPLIT_TILE_TOKENS, da.NUM_WARPS, da.NUM_STAGES,
         da.TARGET_PROGRAMS, da.NUM_WARPS_ONE_SPLIT) = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
