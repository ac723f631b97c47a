"""Where a decode step's device time goes, measured inside `lockstep bench`: kernel launches
per step (torch profiler over graph replays) and the weight-read bandwidth each GEMM reaches
(torch profiler over eager forwards, every GEMM module under its own `record_function` label,
so a kernel is attributed by the module that launched it, not by its name: the kernels that
run inside the label's range on the device timeline, `kernel_time_in_ranges`).

The GEMMs of a Qwen3 decode step read each weight once: qkv_proj, o_proj, gate_up_proj and
down_proj of every layer, and lm_head. A GEMM's bandwidth is its weight bytes (this rank's
shard) over its median device time per call; next to the read bandwidth the bench measured,
it says how far each GEMM is from the floor.
"""

from __future__ import annotations

import contextlib
import statistics

GEMM_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
"""Attribute names of the model's GEMM modules, in the order a decode layer runs them."""


def gemm_modules(model) -> dict[str, list]:
    """The model's GEMM modules by name (`GEMM_MODULES`): {name: [module, ...]}, one module
    per layer (one lm_head). Modules without a 2-D `weight` are skipped."""
    found: dict[str, list] = {name: [] for name in GEMM_MODULES}
    for qualified, module in model.named_modules():
        name = qualified.rsplit(".", 1)[-1]
        w = getattr(module, "weight", None)
        if name in found and w is not None and getattr(w, "dim", lambda: 0)() == 2:
            found[name].append(module)
    return {k: v for k, v in found.items() if v}


@contextlib.contextmanager
def labelled_gemms(model):
    """Run every GEMM module's forward under `torch.profiler.record_function("gemm:NAME")`
    while the context is open (instance attributes shadow the class's forward; removed on
    exit)."""
    import torch

    wrapped = []
    for name, modules in gemm_modules(model).items():
        for module in modules:
            def forward(*args, _f=module.forward, _label=f"gemm:{name}", **kw):
                with torch.profiler.record_function(_label):
                    return _f(*args, **kw)
            module.forward = forward
            wrapped.append(module)
    try:
        yield
    finally:
        for module in wrapped:
            del module.forward


def is_kernel_event(e) -> bool:
    """Whether a profiler event is a kernel on the device (not a memcpy or memset)."""
    return e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))


def kernel_events(run, calls: int = 1) -> list:
    """The device kernels (`is_kernel_event`) of `calls` calls of `run()`, in launch order:
    torch profiler with CUDA activity, the device synchronized before and after. Each event
    has ``name`` and ``device_time`` (us)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    return [e for e in prof.events() if is_kernel_event(e)]


def launches_per_step(replay, steps: int = 10) -> dict:
    """Kernels a step launches: torch profiler (CUDA activity) over `steps` calls of
    `replay()` (one decode step each, e.g. a graph replay).

    Returns:
        dict: ``launches`` (kernels per step, float), ``device_ms`` (summed kernel device
        time per step) and ``top`` ([(kernel name, us per step, calls per step)], the 8
        costliest).
    Raises:
        ValueError: steps < 1.
    """
    if steps < 1:
        raise ValueError(f"steps = {steps}, expected >= 1")
    kernels: dict[str, list] = {}
    for e in kernel_events(replay, steps):
        k = kernels.setdefault(e.name, [0, 0.0])
        k[0] += 1
        k[1] += e.device_time
    total_us = sum(k[1] for k in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:8]
    return {"launches": sum(k[0] for k in kernels.values()) / steps,
            "device_ms": total_us / steps / 1e3,
            "top": [(name[:80], us / steps, n / steps) for name, (n, us) in top]}


def gemm_bandwidth(model, forward, read_bandwidth_Bps: float, steps: int = 5,
                   rows: int | None = None) -> list[dict]:
    """Per GEMM module kind: median device time per call over `steps` eager `forward()` calls
    (each one decode step) and the weight-read bandwidth that implies.

    Args:
        model: the engine's model (its GEMM modules are labelled while profiling).
        forward: runs one eager decode forward.
        read_bandwidth_Bps: the measured HBM read bandwidth, bytes/s (for the ratio).
        rows: rows each call multiplies (the step's bucket); with it, each entry also gives
            the matmul rate achieved, "TFLOPps" (2 x rows x out x in FLOPs per call).
    Returns:
        [{"gemm", "shape" (out x in, this rank), "weight_bytes", "calls", "us", "GBps",
        "of_read_bandwidth"[, "TFLOPps"]}] in `GEMM_MODULES` order; a kind whose calls launched
        no kernel the profiler saw is left out.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    mods = gemm_modules(model)
    torch.cuda.synchronize()
    with labelled_gemms(model), profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            forward()
        torch.cuda.synchronize()
    per_call = kernel_time_in_ranges(prof.events(), "gemm:")
    out = []
    for name in GEMM_MODULES:
        times = [t for t in per_call.get(name, []) if t > 0]
        if name not in mods or not times:
            continue
        w = mods[name][0].weight
        nbytes = w.numel() * w.element_size()
        us = statistics.median(times)
        out.append({"gemm": name, "shape": f"{w.shape[0]} x {w.shape[1]}",
                    "weight_bytes": nbytes, "calls": len(times), "us": us,
                    "GBps": nbytes / us / 1e3,
                    "of_read_bandwidth": nbytes / (us * 1e-6) / read_bandwidth_Bps})
        if rows is not None:
            out[-1]["TFLOPps"] = 2 * rows * w.numel() / (us * 1e-6) / 1e12
    return out


def kernel_time_in_ranges(events, prefix: str) -> dict[str, list[float]]:
    """Device time of the kernels inside each profiler range whose name starts with `prefix`.

    A `record_function` range appears twice in the profiler's events: on the CPU, and on the
    device timeline (from the first to the last kernel launched inside it, idle gaps
    included: an eager step waits for the host between launches). The device-timeline
    ranges are used, summing only the kernels that run within each, so gaps do not count
    and kernels that no CPU op records (Triton launches) do. Without device-timeline
    ranges, the CPU ranges' device_time_total (aten kernels only) stands in.

    Args:
        events: `torch.profiler.profile().events()` (FunctionEvents: name, device_type,
            time_range with start/end in us, device_time).
    Returns:
        {range name without the prefix: [us of kernels per occurrence]}.
    """
    import bisect

    def on_device(e):
        return getattr(e.device_type, "name", str(e.device_type)) != "CPU"

    ranges = [e for e in events if e.name.startswith(prefix) and on_device(e)]
    out: dict[str, list[float]] = {}
    if not ranges:
        for e in events:
            if e.name.startswith(prefix):
                out.setdefault(e.name[len(prefix):], []).append(e.device_time_total)
        return out
    kernels = sorted((e.time_range.start, e.time_range.end, e.device_time) for e in events
                     if on_device(e) and not e.name.startswith(prefix)
                     and not e.name.startswith(("Memcpy", "Memset")))
    starts = [k[0] for k in kernels]
    for r in ranges:
        lo, hi = r.time_range.start, r.time_range.end
        i = bisect.bisect_left(starts, lo)
        us = 0.0
        while i < len(kernels) and kernels[i][0] <= hi:
            if kernels[i][1] <= hi:
                us += kernels[i][2]
            i += 1
        out.setdefault(r.name[len(prefix):], []).append(us)
    return out


def format_profile(point: dict, num_layers: int) -> list[str]:
    """Table lines for one bench point's "profile" entry (`launches_per_step` and
    `gemm_bandwidth` results)."""
    prof = point["profile"]
    lines = [f"batch {point['batch']} ctx {point['context']}: {prof['launches']:.0f} kernels per "
             f"step ({prof['launches'] / num_layers:.1f} per layer over {num_layers} layers), "
             f"{prof['device_ms']:.3f} ms of kernel time per step"]
    for g in prof.get("gemms", []):
        lines.append(f"  {g['gemm']:<13} {g['shape']:>13}  {g['weight_bytes'] / 1e6:8.2f} MB  "
                     f"{g['us']:8.1f} us  {g['GBps']:7.0f} GB/s  "
                     f"{100 * g['of_read_bandwidth']:5.1f}% of read bandwidth"
                     + (f"  {g['TFLOPps']:5.0f} TFLOP/s" if "TFLOPps" in g else ""))
    return lines


def step_timeline(kernels, steps: int) -> dict:
    """Where a captured step's time goes, kernel by kernel, from the device timeline of
    `steps` back-to-back replays.

    A kernel's *exposed* time is how far it moves the end of the step: how far its end lies
    past the latest end of the kernels before it in the step (its start, for the step's first
    kernel), never less than 0. The exposed times of one step add up to the step's span, so
    they say which kernels the step waits on; a kernel launched with PDL starts before its
    predecessor ends, and its *overlap* is the part of it that runs before that latest end.
    The rows give medians over steps, so their sum is the span only when the steps agree.

    Args:
        kernels: (name, start_us, end_us) tuples of the replays' kernels, any order; every
            step launches the same kernels in the same order.
        steps: how many steps the kernels span.
    Returns:
        dict: ``span_us`` (median first start to last end of a step), ``launches`` (kernels
        per step) and ``rows``: [{"name", "calls" (per step), "exposed_us", "busy_us"
        (summed durations), "overlap_us"}], each per step and the median over steps, largest
        exposed time first.
    Raises:
        ValueError: steps < 1, or the kernels do not split into `steps` equal steps.
    """
    if steps < 1:
        raise ValueError(f"steps = {steps}, expected >= 1")
    ordered = sorted(kernels, key=lambda k: k[1])
    if not ordered or len(ordered) % steps:
        raise ValueError(f"{len(ordered)} kernels do not split into {steps} equal steps")
    per_step = len(ordered) // steps
    spans: list[float] = []
    per_name: dict[str, list[dict]] = {}
    first_names = None
    for s in range(steps):
        step = ordered[s * per_step:(s + 1) * per_step]
        names = [name for name, _, _ in step]
        if first_names is None:
            first_names = names
        elif names != first_names:
            raise ValueError(f"step {s} launches other kernels than step 0")
        spans.append(max(end for _, _, end in step) - step[0][1])
        sums: dict[str, dict] = {}
        latest_end = step[0][1]
        for name, start, end in step:
            t = sums.setdefault(name, {"exposed": 0.0, "busy": 0.0, "overlap": 0.0, "calls": 0})
            t["exposed"] += max(0.0, end - latest_end)
            t["busy"] += end - start
            t["overlap"] += max(0.0, min(latest_end, end) - start)
            t["calls"] += 1
            latest_end = max(latest_end, end)
        for name, t in sums.items():
            per_name.setdefault(name, []).append(t)
    rows = [{"name": name, "calls": ts[0]["calls"],
             "exposed_us": statistics.median(t["exposed"] for t in ts),
             "busy_us": statistics.median(t["busy"] for t in ts),
             "overlap_us": statistics.median(t["overlap"] for t in ts)}
            for name, ts in per_name.items()]
    rows.sort(key=lambda r: -r["exposed_us"])
    return {"span_us": statistics.median(spans), "launches": per_step, "rows": rows}
