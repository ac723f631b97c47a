"""Where each of the shipped plan's GEMM launches lets its successor launch: after its main loop
(main) or right after its own PDL wait (docs/benchmarks.md, 2026-12-07, session of 08:31 UTC).

Triggering at exit instead made every GEMM slower, o_proj by 4.1 us a call
(`trigger-at-exit-step.py`), so the successor's launch latency is worth hiding. o_proj's plan
tile at one row is 40 programs on 132 SMs, so a successor launched at o_proj's wait finds 92
SMs free. This triggers one GEMM shape at a time, then all four, right after the wait
(`skinny_gemm.TRIGGER_AT_WAIT_SHAPES`, which `trigger-at-wait-step.patch` beside this file
adds; not on main). Prints the graph-replayed step's median (`engine.bench.step_tune.StepTimer`,
100 replays after 10) per variant in two rounds, and in the second the exposed / busy us per
step of the most exposed kernels:

    git apply docs/experiments/trigger-at-wait-step.patch
    PYTHONPATH=. python3 docs/experiments/trigger-at-wait-step.py [out.json]
"""

from __future__ import annotations

import json
import shutil
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.modeldir import write_random_model_fast
from engine.bench.profile import replay_timeline
from engine.bench.step_tune import StepTimer
from engine.kernels import skinny_gemm

REPLAYS = 20
LAYERS = 36
BUCKETS = (1, 8)
SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560),
          "down": (2560, 9728)}  # Qwen3-4B at TP 1, [N, K] of each weight
VARIANTS = {"main": set(), **{f"{name} at wait": {shape} for name, shape in SHAPES.items()},
            "all four at wait": set(SHAPES.values())}


def gemm_timeline(timer: StepTimer, bucket: int) -> dict:
    ex, key = timer.ex, timer.key(bucket)
    check = timer._check[bucket][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            ex.prepare_replay(check)
            ex.launch(key)
        torch.cuda.synchronize()
    t = replay_timeline(prof.events(), REPLAYS, LAYERS)
    return {"span_us": t["span_us"],
            "rows": [{k: r[k] for k in ("name", "exposed_us", "busy_us", "overlap_us")}
                     for r in t["rows"][:8]]}


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    model_dir = str(write_random_model_fast("qwen3-4b", "bfloat16", 0))
    record: dict = {"gpu": torch.cuda.get_device_name(), "buckets": {}}
    try:
        timer = StepTimer(model_dir, list(BUCKETS), 128, 100, 10, [], 0)
        for bucket in BUCKETS:
            plan = timer.start_plan(bucket)
            times: dict = {}
            lines: dict = {}
            for round_ in range(2):
                for label, shapes in VARIANTS.items():
                    skinny_gemm.TRIGGER_AT_WAIT_SHAPES = shapes
                    ms = timer.time(bucket, plan)
                    times.setdefault(label, []).append(ms)
                    summary = ""
                    if round_:
                        lines[label] = gemm_timeline(timer, bucket)
                        summary = " | " + "; ".join(
                            f"{r['name'][-22:]} {r['exposed_us']:.0f}/{r['busy_us']:.0f}"
                            for r in lines[label]["rows"][:6])
                    print(f"b{bucket} round {round_} {label}: {ms:.4f} ms{summary}", flush=True)
            record["buckets"][bucket] = {"plan": str(plan), "times_ms": times,
                                         "timelines": lines}
            skinny_gemm.TRIGGER_AT_WAIT_SHAPES = set()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
