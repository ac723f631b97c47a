"""The short path's decode attention in the QKV launch's tail (`skinny_gemm.AttendTail`), timed
in the whole batch-1 step against the shipped plan: one process per model, two alternating
rounds.

Needs a GPU and a model directory (`python3 -m lockstep make-model --preset qwen3-4b --out
/tmp/q4b`): `PYTHONPATH=. python3 docs/experiments/qkv-tail-attention-step-probe.py /tmp/q4b
OUT.json`. Each variant is timed by `engine.bench.step_tune.StepTimer` (graph replay of the
step the controller replays at one row and context 128: the short path; median of 100
replays), which also checks each variant's eager logits against the first variant's and its
graph replay against its eager step. A plan with `attend` (`FusedLayerPlan.attend`) runs,
on the short path, the QKV launch with the rope epilogue attending in its tail and o_proj
reading its output: 4 launches a layer. Variants: the shipped plan; the rope epilogue alone in
each QKV tile (attention and o_proj as the plan runs them, the fused attention + o_proj off);
the same tiles attending in the tail.
"""

import dataclasses
import json
import os
import sys

import engine.model as model_mod
from engine.bench.step_tune import StepTimer
from engine.kernels.skinny_gemm import TileConfig

TILES = [TileConfig(64, 128, 1, 4, 4, tma=True), TileConfig(64, 128, 1, 4, 5, tma=True),
         TileConfig(64, 128, 2, 4, 4, tma=True), TileConfig(64, 128, 1, 8, 4, tma=True),
         TileConfig(64, 128, 1, 4, 4)]
"""QKV tiles of half a head (D = 128): the 2-8-row plan's 4-stage TMA tile first. PROBE_TILES=n
in the environment times the first n only."""


def main(model_dir: str, out: str) -> None:
    fused = model_mod.fuses_attention_oproj
    tiles = TILES[:int(os.environ.get("PROBE_TILES", len(TILES)))]
    timer = StepTimer(model_dir, [1], 128, 100, 10, tiles)
    start = timer.start_plan(1)
    variants = {"plan": (start, True)}
    for tile in tiles:
        name = (f"{tile.block_n}x{tile.block_k} s{tile.split_k} w{tile.num_warps} "
                f"st{tile.num_stages}" + (" tma" if tile.tma else ""))
        rope_plan = dataclasses.replace(start, qkv=tile, rope=True)
        variants[f"rope {name}"] = (rope_plan, False)
        variants[f"rope + attend {name}"] = (dataclasses.replace(rope_plan, attend=True), False)
    times = {name: [] for name in variants}
    errors = {}
    for _ in range(2):
        for name, (plan, oproj) in variants.items():
            if name in errors:
                continue
            model_mod.fuses_attention_oproj = fused if oproj else (lambda plan, rows: False)
            try:
                times[name].append(timer.time(1, plan))
            except Exception as exc:  # an experiment: record and go on
                errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{name}: {errors[name]}", flush=True)
                continue
            print(f"{name}: {times[name][-1]:.4f} ms", flush=True)
    with open(out, "w") as f:
        json.dump({"times": times, "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
