"""Qwen3-4B's batch-1 decode step with the short path's fused attention + o_proj at several
launch settings, against the shipped plan: one process, two alternating rounds.

Needs a GPU and a 4B model directory (`python3 -m lockstep make-model --preset qwen3-4b --out
/tmp/q4b`): `PYTHONPATH=. python3 docs/experiments/attention-oproj-step-probe.py /tmp/q4b
OUT.json`. Each variant is timed by `engine.bench.step_tune.StepTimer` (graph replay of the
step the controller replays at one row and context 128, the median of 100 replays). The
variants: the plan; the plan with the rope epilogue in three QKV tiles and the fused kernel off
(what the epilogue alone costs); and the rope epilogue with the fused kernel at each (block_n,
warps) of `attention-oproj-resources.py`, whose table predicts two or more waves for all.
"""

import dataclasses
import json
import sys

import engine.model as model_mod
from engine.bench.step_tune import StepTimer
from engine.kernels.attention_oproj import AttnOprojWorkspace
from engine.kernels.skinny_gemm import TileConfig
from engine.layers.attention import ShortAttention

SETTINGS = [(32, 4), (32, 8), (64, 4), (64, 8), (64, 16), (128, 4), (128, 8), (128, 16)]
ROPE_TILES = [TileConfig(64, 128, 1, 4, 4, tma=True), TileConfig(64, 128, 1, 4, 4),
              TileConfig(64, 256, 1, 4, 4)]
"""QKV tiles of the rope epilogue (64 features, one head's half): the 2-8-row plan's TMA tile
first, then two pointer tiles the tuner ran. The 1-row plan's own 64 x 256 5-stage TMA tile
needs 360 KB of shared memory with the epilogue (OutOfResources on an H100)."""


def main(model_dir: str, out: str) -> None:
    timer = StepTimer(model_dir, [1], 128, 100, 10, ROPE_TILES)
    ex = timer.ex
    start = timer.start_plan(1)
    fused = model_mod.fuses_attention_oproj
    variants = {"plan": (start, (128, 4), True)}
    for tile in ROPE_TILES:
        variants[f"rope {tile.block_n}x{tile.block_k} tma={tile.tma}, fused off"] = (
            dataclasses.replace(start, qkv=tile, rope=True), (128, 4), False)
    for block_n, warps in SETTINGS:
        variants[f"rope, fused {block_n} x {warps} warps"] = (
            dataclasses.replace(start, qkv=ROPE_TILES[0], rope=True), (block_n, warps), True)
    times = {name: [] for name in variants}
    for _ in range(2):
        for name, (plan, (block_n, warps), on) in variants.items():
            model_mod.fuses_attention_oproj = fused if on else (lambda plan, rows: False)
            ex.short_attention = ShortAttention(ex.short_attention.tokens, AttnOprojWorkspace(
                ex.device, ex.settings.kv_heads_per_rank, ex.cfg.hidden_size, block_n, warps))
            times[name].append(timer.time(1, plan))
            print(f"{name}: {times[name][-1]:.4f} ms", flush=True)
    with open(out, "w") as f:
        json.dump(times, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
