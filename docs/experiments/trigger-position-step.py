"""Where each of the shipped plan's GEMM launches lets its successor launch: after its main loop
(main), right after its own PDL wait, or at its exit, after its epilogue and split-K fix-up
(docs/benchmarks.md, 2026-12-07, session of 08:31 UTC).

A launch that triggers after its main loop has its successor's programs placed while its own
still hold SMs, so they land on whichever SMs are free; after a one-tile o_proj of 640 programs
that cost gate_up 3.5 us a call on an H100, and triggering at exit removed it
(`oproj-preload-during-attention.py`). Earlier, at the wait, a successor would find the SMs a
small launch leaves idle (o_proj's plan tile at one row is 40 programs on 132 SMs). This asks
both of the shipped Qwen3-4B plans: one GEMM shape at a time, then all four, triggering at
`wait` or `exit` (`skinny_gemm.TRIGGER_AT_WAIT_SHAPES` and `TRIGGER_AT_EXIT_SHAPES`, which
`trigger-position-step.patch` beside this file adds; not on main). Prints the graph-replayed
step's median (`engine.bench.step_tune.StepTimer`, 100 replays after 10) per variant in two
rounds, and in the second the exposed / busy us per step of the most exposed kernels:

    git apply docs/experiments/trigger-position-step.patch
    PYTHONPATH=. python3 docs/experiments/trigger-position-step.py wait|exit [out.json]
"""

from __future__ import annotations

import functools
import sys

from step_probe import probe_switches

from engine.kernels import skinny_gemm

LAYERS = 36
BUCKETS = (1, 8)
SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560),
          "down": (2560, 9728)}  # Qwen3-4B at TP 1, [N, K] of each weight


def main() -> None:
    where = sys.argv[1]
    if where not in ("wait", "exit"):
        raise SystemExit(f"trigger position {where!r}: expected wait or exit")
    out_path = sys.argv[2] if len(sys.argv) > 2 else None
    variants = {"main": set(), **{f"{name} at {where}": {shape} for name, shape in SHAPES.items()},
                f"all four at {where}": set(SHAPES.values())}
    switch = f"TRIGGER_AT_{where.upper()}_SHAPES"
    probe_switches(BUCKETS, variants, functools.partial(setattr, skinny_gemm, switch), set(),
                   LAYERS, out_path)


if __name__ == "__main__":
    main()
