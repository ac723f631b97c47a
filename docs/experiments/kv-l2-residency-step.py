"""Whether the decode attention's K/V can stay in L2 from one step to the next (docs/benchmarks.md,
2026-12-07, session of 10:26 UTC).

At one row and context 128, Qwen3-4B's whole KV cache is 18 MB (36 layers x 8 kv heads x 128
tokens x 128 x 2 x 2 bytes), under the 50 MB L2 of an H100 or H200; but between two reads of a
layer's K/V some 8 GB of weights stream through L2, so every attention's loads miss to HBM and
its one dependent chain (K, the scores, V) pays HBM latency. An L2 eviction priority of
`evict_last` on the attention's K/V loads and on the q/k norm kernel's K/V stores asks L2 to
evict those lines after the weights' (`evict_normal`). Triton drops a load's eviction hint when
it software-pipelines the load into `cp.async` (the attention at 3 stages), so the hinted
variant runs the attention at one stage, and the one-stage attention without the hint is timed
beside it. `kv-l2-residency-step.patch` beside this file adds the switches
(`decode_attention.KV_EVICTION`, `fused.KV_STORE_EVICTION`); not on main.

    git apply docs/experiments/kv-l2-residency-step.patch
    PYTHONPATH=. python3 docs/experiments/kv-l2-residency-step.py [out.json]
"""

from __future__ import annotations

import sys

from step_probe import probe_switches

from engine.kernels import decode_attention, fused

LAYERS = 36
BUCKETS = (1, 2, 8)
VARIANTS = {"main": (3, ""), "attention at 1 stage": (1, ""),
            "1 stage, K/V evict_last": (1, "evict_last")}


def switch(stages: int, eviction: str) -> None:
    decode_attention.NUM_STAGES = stages
    decode_attention.KV_EVICTION = eviction
    fused.KV_STORE_EVICTION = eviction


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    probe_switches(BUCKETS, VARIANTS, lambda setting: switch(*setting), VARIANTS["main"],
                   LAYERS, out_path)


if __name__ == "__main__":
    main()
