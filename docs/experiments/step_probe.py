"""What the step experiments here share: the device timeline of a `StepTimer`'s last graph.

Imported by the scripts beside it (run as `python3 docs/experiments/<script>.py`, which puts
this folder on the import path).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.profile import replay_timeline
from engine.bench.step_tune import StepTimer

REPLAYS = 20


def timeline(timer: StepTimer, bucket: int, layers: int, rows: int = 8) -> dict:
    """`replay_timeline` of REPLAYS profiled replays of the graph `timer` last timed at
    `bucket` rows: the step's span and, for its `rows` most exposed kernels, the exposed, busy
    and overlap us per step."""
    ex, key = timer.ex, timer.key(bucket)
    check = timer._check[bucket][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            ex.prepare_replay(check)
            ex.launch(key)
        torch.cuda.synchronize()
    t = replay_timeline(prof.events(), REPLAYS, layers)
    return {"span_us": t["span_us"],
            "rows": [{k: r[k] for k in ("name", "exposed_us", "busy_us", "overlap_us")}
                     for r in t["rows"][:rows]]}


def summary(line: dict, rows: int) -> str:
    """'name exposed/busy; ...' of a `timeline`'s first `rows` kernels."""
    return "; ".join(f"{r['name'][-22:]} {r['exposed_us']:.0f}/{r['busy_us']:.0f}"
                     for r in line["rows"][:rows])
