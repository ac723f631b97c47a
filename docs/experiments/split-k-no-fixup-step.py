"""What the split-K fix-up costs in Qwen3-4B's decode step, read as an upper bound: the step
with a GEMM split along K, with and without its serial fix-up (docs/benchmarks.md, 2026-12-07,
session of 11:19 UTC).

A split launch's programs publish fp32 partials; the last to arrive at the column block's
counter sums them and runs the epilogue. Its cost is on the launch's critical path. With
`split-k-no-fixup-step.patch` applied, `skinny_gemm.PROBE_NO_FIXUP_K` names the K of launches
whose programs store their partials and stop: the step's result is then wrong, but its time
is that of the same launches without the fix-up. If a split without the fix-up is not faster
than the plan's tile, no way of deferring the sum can pay.

The patch also carries one such way, correct at one row: `engine.model.DEFER_DOWN` makes each
layer's down_proj (4 splits in the plan) store its partials and stop, and the next layer's QKV
GEMM add them, with the residual, as it loads x, form the norm's sum of squares in its own K
loop, and store the new residual into a second buffer (`skinny_gemm.DeferredSum`); the last
layer's down sums its own split. It is timed at one row beside the probe, after a check on the
GPU that a tiny model generates the same tokens and logits with it as without.

At 1 and 8 rows (the plans' tiles otherwise), each variant's step median over 100 graph
replays, two rounds, and a device timeline in the second. On one GPU:

    git apply docs/experiments/split-k-no-fixup-step.patch
    PYTHONPATH=. python3 docs/experiments/split-k-no-fixup-step.py OUT.json [BUCKETS [quick]]

BUCKETS, e.g. 1,8 (the default); a third argument leaves the o_proj splits out (the session's
second call, at 1 row, timed the plan, down without its fix-up and the deferred sum only).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from step_probe import probe_qwen3_4b, rounds

from engine import model as model_mod
from engine.bench import step_tune
from engine.kernels import skinny_gemm as sg
from engine.kernels.skinny_gemm import TileConfig

LAYERS = 36
CHECKED_RTOL = step_tune.LOGITS_RTOL
# a short device call: o_proj at 2 splits only, qkv unsplit (the session of 11:19 UTC had
# minutes of device time left; set (2, 4) and True for the whole probe)
SPLITS = (2,)
QKV_SPLIT = False
K_QKV, K_OPROJ, K_DOWN = 2560, 4096, 9728


def tma(block_n: int, block_k: int, split: int, stages: int) -> TileConfig:
    return TileConfig(block_n, block_k, split, 4, stages, tma=True)


def probe(ks: frozenset, defer: bool = False):
    def set_up():
        sg.PROBE_NO_FIXUP_K = ks
        model_mod.DEFER_DOWN = defer
        # a probed launch's logits are wrong by design: StepTimer's check against the
        # starting plan would refuse to time it
        step_tune.LOGITS_RTOL = float("inf") if ks else CHECKED_RTOL
    return set_up


def check_deferred_on_gpu() -> str:
    """The tiny model's greedy generations with and without the deferred down on the GPU:
    tokens equal and the largest logit difference (the CPU check gave 0.0)."""
    import shutil
    import subprocess
    import tempfile

    path = tempfile.mkdtemp()
    try:
        subprocess.run([sys.executable, "-m", "lockstep", "make-model", "--preset", "tiny",
                        "--out", path, "--overwrite"], check=True, capture_output=True)
        check = Path(__file__).with_name("split-k-deferred-check.py")
        res = subprocess.run([sys.executable, str(check), path, "bfloat16", "cuda"],
                             capture_output=True, text=True, timeout=300)
        return (res.stdout + res.stderr[-2000:]).strip()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    buckets = tuple(int(b) for b in sys.argv[2].split(",")) if len(sys.argv) > 2 else (1, 8)
    extra = [tma(64, 256, s, 5) for s in (2, 4)] + [tma(64, 128, s, 4) for s in (2, 4)]

    def per_bucket(timer, bucket: int) -> dict:
        start = timer.start_plan(bucket)
        qkv_tile = start.qkv
        variants = [("start", probe(frozenset()), start),
                    ("down: no fix-up", probe(frozenset({K_DOWN})), start)]
        if model_mod.defers_down(start, bucket):
            variants.append(("down deferred to the next qkv", probe(frozenset(), True), start))
        for split in (SPLITS if len(sys.argv) <= 3 else ()):
            o = dataclasses.replace(start, o_proj=tma(64, 256, split, 5))
            variants += [(f"o_proj split {split}", probe(frozenset()), o),
                         (f"o_proj split {split}: no fix-up", probe(frozenset({K_OPROJ})), o)]
        if QKV_SPLIT:
            q = dataclasses.replace(start, qkv=dataclasses.replace(qkv_tile, split_k=2))
            variants += [("qkv split 2", probe(frozenset()), q),
                         ("qkv split 2: no fix-up", probe(frozenset({K_QKV})), q)]
        try:
            times, lines = rounds(timer, bucket, variants, LAYERS, 6)
        finally:
            probe(frozenset())()
        return {"plan": str(start), "times_ms": times, "timelines": lines}

    probe_qwen3_4b(buckets, extra, per_bucket, out_path)
    print("deferred down on the GPU, tiny model:", check_deferred_on_gpu(), flush=True)


if __name__ == "__main__":
    main()
