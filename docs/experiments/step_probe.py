"""What the step experiments here share: the device timeline of a `StepTimer`'s last graph.

Imported by the scripts beside it (run as `python3 docs/experiments/<script>.py`, which puts
this folder on the import path).
"""

from __future__ import annotations

import functools

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


def rounds(timer: StepTimer, bucket: int, variants: list, layers: int, rows: int,
           count: int = 2) -> tuple[dict, dict]:
    """Time each (label, set_up, plan) of `variants` at `bucket` rows, `count` rounds in turn
    (`set_up()` first sets the experiment's switches), printing each median; in the last round
    also each `timeline`. A trial that raises is reported and skipped. Returns
    ({label: [ms per round]}, {label: timeline})."""
    times: dict = {}
    lines: dict = {}
    for round_ in range(count):
        for label, set_up, plan in variants:
            set_up()
            try:
                ms = timer.time(bucket, plan)
            except Exception as e:  # an experiment: report and go on
                print(f"b{bucket} {label}: failed: {str(e)[:300]}", flush=True)
                continue
            times.setdefault(label, []).append(ms)
            text = ""
            if round_ == count - 1:
                lines[label] = timeline(timer, bucket, layers)
                text = " | " + summary(lines[label], rows)
            print(f"b{bucket} round {round_} {label}: {ms:.4f} ms{text}", flush=True)
    return times, lines


def probe_qwen3_4b(buckets, extra_tiles: list, per_bucket, out_path: str | None) -> None:
    """Make a random-weight Qwen3-4B directory and a `StepTimer` over it (context 128, 100
    replays after 10, `extra_tiles` in its workspace), record `per_bucket(timer, bucket)` (a
    dict) for each of `buckets`, write {"gpu", "buckets"} to `out_path` when given, and remove
    the directory."""
    import json
    import shutil

    from engine.bench.modeldir import write_random_model_fast

    model_dir = str(write_random_model_fast("qwen3-4b", "bfloat16", 0))
    record: dict = {"gpu": torch.cuda.get_device_name(), "buckets": {}}
    try:
        timer = StepTimer(model_dir, list(buckets), 128, 100, 10, list(extra_tiles), 0)
        for bucket in buckets:
            record["buckets"][bucket] = per_bucket(timer, bucket)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(record, f, indent=1)


def probe_switches(buckets, variants: dict, apply, default, layers: int, out_path: str | None,
                   extra=None) -> None:
    """`probe_qwen3_4b` at each of `buckets`: the bucket's starting plan timed by `rounds` under
    each setting of `variants` ({label: setting}, put in place by `apply(setting)`), and
    `apply(default)` after, whatever happened. Records {"plan", "times_ms", "timelines"} per
    bucket, and what `extra(timer, bucket)` returns (a dict) when given."""

    def per_bucket(timer: StepTimer, bucket: int) -> dict:
        plan = timer.start_plan(bucket)
        try:
            times, lines = rounds(timer, bucket, [
                (label, functools.partial(apply, setting), plan)
                for label, setting in variants.items()], layers, 6)
        finally:
            apply(default)
        return {"plan": str(plan), "times_ms": times, "timelines": lines,
                **(extra(timer, bucket) if extra else {})}

    probe_qwen3_4b(buckets, [], per_bucket, out_path)
