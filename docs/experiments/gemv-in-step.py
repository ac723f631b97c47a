"""The Qwen3-4B decode step at one row with the shipped plan's tiles against gemv tiles in one
GEMM at a time (docs/benchmarks.md, 2026-12-06, session of 23:06 UTC).

For each plan it prints the graph-replayed step's median (`engine.bench.step_tune.StepTimer`,
100 replays after 10) in two rounds, and in the second also the device timeline of 20 profiled
replays (`engine.bench.profile.replay_timeline`): each kernel's exposed, busy and overlap
time per step, the skinny GEMM's four calls of a layer as `[0]`-`[3]` (qkv, o_proj, gate_up,
down). The gemv tiles are the fastest the 1-row H200 sweep timed alone
(docs/benchmarks-gemm-sweep-gemv-qwen3-4b-h200.json). On one GPU:

    PYTHONPATH=. python3 docs/experiments/gemv-in-step.py
"""

from __future__ import annotations

import dataclasses
import json
import shutil

from step_probe import timeline

from engine.bench.modeldir import write_random_model_fast
from engine.bench.step_tune import StepTimer
from engine.kernels.skinny_gemm import TileConfig

SWEEP = "docs/benchmarks-gemm-sweep-gemv-qwen3-4b-h200.json"
LAYERS = 36


def gemv(block_n: int, block_k: int, split_k: int, num_warps: int) -> TileConfig:
    return TileConfig(block_n, block_k, split_k, num_warps, 1, gemv=True)


def timeline_text(timer: StepTimer) -> str:
    """The exposed / busy / overlap us per step of the nine most exposed kernels."""
    t = timeline(timer, 1, LAYERS, rows=9)
    return f"span {t['span_us']:.1f} us; " + "; ".join(
        f"{r['name'][-24:]} exposed {r['exposed_us']:.0f} busy {r['busy_us']:.0f} "
        f"overlap {r['overlap_us']:.0f}" for r in t["rows"])


def main() -> None:
    results = json.load(open(SWEEP))["results"]
    tiles = [TileConfig(**t["config"]) for r in results for e in r["rows"].values()
             for t in e.get("triton", ()) if "us" in t]
    model_dir = str(write_random_model_fast("qwen3-4b", "bfloat16", 0))
    try:
        timer = StepTimer(model_dir, [1], 128, 100, 10, tiles + [gemv(8, 2048, 2, 4)], 0)
        start = timer.start_plan(1)
        plans = {"start": start,
                 "o_proj gemv 8 x 1024": dataclasses.replace(start, o_proj=gemv(8, 1024, 1, 8)),
                 "o_proj gemv 8 x 2048, 2 splits (one tile)":
                     dataclasses.replace(start, o_proj=gemv(8, 2048, 2, 4)),
                 "down gemv 8 x 1024": dataclasses.replace(start, down=gemv(8, 1024, 1, 8)),
                 "qkv gemv 8 x 512": dataclasses.replace(start, qkv=gemv(8, 512, 1, 4)),
                 "all three": dataclasses.replace(start, qkv=gemv(8, 512, 1, 4),
                                                  o_proj=gemv(8, 1024, 1, 8),
                                                  down=gemv(8, 1024, 1, 8))}
        for round_ in range(2):
            for name, plan in plans.items():
                line = f"round {round_} {name}: step {timer.time(1, plan):.4f} ms"
                print(line + (" " + timeline_text(timer) if round_ else ""), flush=True)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
