"""What the split-K fix-up costs in Qwen3-4B's decode step, read as an upper bound: the step
with a GEMM split along K, with and without its serial fix-up (docs/benchmarks.md, 2026-12-07,
session of 11:19 UTC).

A split launch's programs publish fp32 partials; the last to arrive at the column block's
counter sums them and runs the epilogue. Its cost is on the launch's critical path. With
`split-k-no-fixup-step.patch` applied, `skinny_gemm.PROBE_NO_FIXUP_K` names the K of launches
whose programs store their partials and stop: the step's result is then wrong, but its time
is that of the same launches without the fix-up. If a split without the fix-up is not faster
than the plan's tile, no way of deferring the sum (into the consumer's prologue, say) can pay.

At 1 and 8 rows (the plans' tiles otherwise), each variant's step median over 100 graph
replays, two rounds, and a device timeline in the second. On one GPU:

    git apply docs/experiments/split-k-no-fixup-step.patch
    PYTHONPATH=. python3 docs/experiments/split-k-no-fixup-step.py OUT.json [BUCKETS, e.g. 1,8]
"""

from __future__ import annotations

import dataclasses
import sys

from step_probe import probe_qwen3_4b, rounds

from engine.kernels import skinny_gemm as sg
from engine.kernels.skinny_gemm import TileConfig

LAYERS = 36
K_QKV, K_OPROJ, K_DOWN = 2560, 4096, 9728


def tma(block_n: int, block_k: int, split: int, stages: int) -> TileConfig:
    return TileConfig(block_n, block_k, split, 4, stages, tma=True)


def probe(ks: frozenset):
    def set_up():
        sg.PROBE_NO_FIXUP_K = ks
    return set_up


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    buckets = tuple(int(b) for b in sys.argv[2].split(",")) if len(sys.argv) > 2 else (1, 8)
    extra = [tma(64, 256, s, 5) for s in (2, 4)] + [tma(64, 128, s, 4) for s in (2, 4)]

    def per_bucket(timer, bucket: int) -> dict:
        start = timer.start_plan(bucket)
        qkv_tile = start.qkv
        variants = [("start", probe(frozenset()), start),
                    ("down: no fix-up", probe(frozenset({K_DOWN})), start)]
        for split in (2, 4):
            o = dataclasses.replace(start, o_proj=tma(64, 256, split, 5))
            variants += [(f"o_proj split {split}", probe(frozenset()), o),
                         (f"o_proj split {split}: no fix-up", probe(frozenset({K_OPROJ})), o)]
        q = dataclasses.replace(start, qkv=dataclasses.replace(qkv_tile, split_k=2))
        variants += [("qkv split 2", probe(frozenset()), q),
                     ("qkv split 2: no fix-up", probe(frozenset({K_QKV})), q)]
        try:
            times, lines = rounds(timer, bucket, variants, LAYERS, 6)
        finally:
            sg.PROBE_NO_FIXUP_K = frozenset()
        return {"plan": str(start), "times_ms": times, "timelines": lines}

    probe_qwen3_4b(buckets, extra, per_bucket, out_path)


if __name__ == "__main__":
    main()
