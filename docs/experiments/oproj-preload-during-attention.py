"""o_proj's weight loaded during the decode attention (docs/benchmarks.md, 2026-12-07, session
of 08:31 UTC).

At context 128 the attention launch is exposed about 4 us a layer at batch 1 (6 at batch 8) and
reads 0.5 MB, so HBM idles while it runs; o_proj, next, then reads its 21 MB weight only after
the attention's last program has finished (its plan tile loops over K, so nothing of it is
loaded before its PDL wait). This times the Qwen3-4B step with o_proj as a one-tile tile (each
program's whole K range one block_k tile, whose weights the kernel loads before its wait:
`skinny_gemm`'s ONE_TILE) and the attention launching its dependents right after its own wait
(`decode_attention.TRIGGER_AT_WAIT`) instead of after its loop, so that o_proj's programs are
resident, and loading, while the attention runs; each of the two alone too, and the attention
asking L2 for its K/V before its own wait.

The switches it sets (`decode_attention.TRIGGER_AT_WAIT` and `PREFETCH_KV_L2`, `skinny_gemm.
ONE_TILE_TRIGGER_AT_EXIT`: a one-tile launch triggers its dependents at exit, not after its
product) are not on main; apply `oproj-preload-during-attention.patch` (beside this file) first.
Results: docs/benchmarks-oproj-preload-h100.json.

For each bucket and variant it prints the graph-replayed step's median (`engine.bench.step_tune.
StepTimer`, 100 replays after 10) in two rounds, and in the second round the device timeline of
20 profiled replays (exposed / busy us per step of the most exposed kernels). On one GPU:

    git apply docs/experiments/oproj-preload-during-attention.patch
    PYTHONPATH=. python3 docs/experiments/oproj-preload-during-attention.py [out.json [1,8]]
"""

from __future__ import annotations

import dataclasses
import functools
import sys

from step_probe import probe_qwen3_4b, rounds

from engine.kernels import decode_attention, skinny_gemm
from engine.kernels.skinny_gemm import TileConfig

LAYERS = 36
BUCKETS = (1, 8)
# one-tile o_proj tiles (K = 4096): programs, and on sm_90 with Triton 3.6 the programs an SM
# holds (registers, shared memory) -> one wave's slots, from ptxas
TILES = {
    "ptr 64x256 s16 (640 progs, 660 slots)": TileConfig(64, 256, 16, 4, 1),
    "tma 64x256 s16 (640 progs, 528 slots)": TileConfig(64, 256, 16, 4, 1, tma=True),
    "tma 32x256 s16 (1280 progs, 660 slots)": TileConfig(32, 256, 16, 4, 1, tma=True),
    "ptr 32x512 s8 (640 progs, 528 slots)": TileConfig(32, 512, 8, 4, 1),
    "tma 128x256 s16 w8 (320 progs, 264 slots)": TileConfig(128, 256, 16, 8, 1, tma=True),
}
# (o_proj tile name or None for the plan's, attention triggers at its wait, a one-tile launch
# triggers at its exit instead of after its product, the attention asks L2 for its first tile's
# earlier K/V before its wait); the last of the session's four calls ran these (the first two: every
# tile with and without the attention's trigger at its wait; the third also with o_proj's at
# exit; docs/benchmarks-oproj-preload-h100.json holds all four)
P64, T64, T32, T128 = (next(n for n in TILES if n.startswith(p))
                       for p in ("ptr 64x256", "tma 64x256", "tma 32x256", "tma 128x256"))
VARIANTS = [(None, False, False, False), (None, False, False, True), (None, True, False, True),
            (P64, True, True, False)] + [(t, True, True, True) for t in (P64, T64, T32, T128)]


def switch(early: bool, at_exit: bool, prefetch: bool) -> None:
    """Set the patch's three switches."""
    decode_attention.TRIGGER_AT_WAIT = early
    skinny_gemm.ONE_TILE_TRIGGER_AT_EXIT = at_exit
    decode_attention.PREFETCH_KV_L2 = prefetch


def per_bucket(timer, bucket: int) -> dict:
    start = timer.start_plan(bucket)
    variants = []
    for tile, early, at_exit, prefetch in VARIANTS:
        label = (f"o_proj {tile}" if tile else "plan") + (
            ", attention triggers at its wait" if early else "") + (
            ", o_proj triggers at exit" if at_exit else "") + (
            ", K/V prefetched to L2" if prefetch else "")
        plan = start if tile is None else dataclasses.replace(start, o_proj=TILES[tile])
        variants.append((label, functools.partial(switch, early, at_exit, prefetch), plan))
    try:
        times, lines = rounds(timer, bucket, variants, LAYERS, 7)
    finally:
        switch(False, False, False)
    return {"plan": str(start), "times_ms": times, "timelines": lines}


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    buckets = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else BUCKETS
    probe_qwen3_4b(buckets, TILES.values(), per_bucket, out_path)


if __name__ == "__main__":
    main()
