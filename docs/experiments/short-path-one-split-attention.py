"""The decode attention of Qwen3-4B's one-row short-path graph with one program per kv head
instead of the split-KV launch (docs/benchmarks.md, 2026-12-07, session of 10:26 UTC).

At one row the split path launches 16 splits x 8 kv heads = 128 programs; at context 128 one of
each kv head's 16 reads the row's one tile and 15 find nothing, yet the next launch waits for
all 128. A short-path graph (`protocol.keys.SHORT`) replays only steps whose every context fits
one 128-token tile, so there one program per (row, kv head) would do, whatever the context.
Qwen3-4B's one-row plan has no rope epilogue, so its short graph runs the `DECODE` kernels
today. This times, in the graph the controller replays at one row and context 128
(`engine.bench.step_tune.StepTimer`, 100 replays after 10, two rounds), the shipped launch
against one split of 64- or 128-token tiles at 2 or 4 warps, set through the module's own
constants (nothing to patch):

    PYTHONPATH=. python3 docs/experiments/short-path-one-split-attention.py [out.json]
"""

from __future__ import annotations

import sys

from step_probe import probe_switches

from engine.kernels import decode_attention

LAYERS = 36
SHIPPED = (decode_attention.num_splits, decode_attention.TILE_TOKENS,
           decode_attention.NUM_WARPS_ONE_SPLIT)
VARIANTS = {"main (split path)": SHIPPED,
            "1 split, 64-token tiles, 2 warps": (lambda rows, heads: 1, 64, 2),
            "1 split, 128-token tile, 2 warps": (lambda rows, heads: 1, 128, 2),
            "1 split, 128-token tile, 4 warps": (lambda rows, heads: 1, 128, 4)}


def switch(splits, tile_tokens: int, warps: int) -> None:
    decode_attention.num_splits = splits
    decode_attention.TILE_TOKENS = tile_tokens
    decode_attention.NUM_WARPS_ONE_SPLIT = warps


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    probe_switches((1,), VARIANTS, lambda setting: switch(*setting), SHIPPED, LAYERS, out_path,
                   extra=lambda timer, bucket: {"key": str(timer.key(bucket))})


if __name__ == "__main__":
    main()
