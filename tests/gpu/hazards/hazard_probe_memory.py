"""Probe H7 (memory): how much device memory does a CUDA graph hold, and is a graph past the
device's capacity an out-of-memory error?

1. Driver graphs of N empty kernel nodes: the free-memory delta (cuMemGetInfo) of
   instantiating, uploading and launching `--copies` of them, per graph.
2. The engine's own graph runner (`engine.graphs.CudaGraphs`: one shared pool, largest bucket
   first, instantiate and upload timed apart) over a Qwen3-4B-shaped decode stack in bf16
   (36 layers of the real projection shapes, RMSNorm, SiLU-and-mul, residual adds and the tied
   LM head; attention is left out because it needs the KV cache): pool bytes and executable
   bytes per bucket against the model's 6 MiB + 64 KiB per bucket row (sim/scenario.py).
3. With the device filled by plain allocations, instantiate and upload one more graph: the
   error the driver gives.

Usage: PYTHONPATH=<repo root> python hazard_probe_memory.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MiB = 1 << 20
GiB = 1 << 30
# Qwen3-4B (engine/presets.py): hidden, layers, q heads x head_dim, kv heads x head_dim,
# intermediate, vocab
QWEN3_4B = dict(hidden=2560, layers=36, q=32 * 128, kv=8 * 128, inter=9728, vocab=151936)


def driver_graphs(drv, ctx, fn, nodes_list, copies: int) -> list[dict]:
    """Part 1: per-graph free-memory deltas of instantiate, upload and launch."""
    rows = []
    drv.set_context(ctx)
    s = drv.stream()
    for nodes in nodes_list:
        graphs = [drv.capture_graph(s, fn, nodes) for _ in range(copies)]
        f0, _ = drv.mem_get_info()
        execs = [drv.instantiate(g) for g in graphs]
        f1, _ = drv.mem_get_info()
        for e in execs:
            drv.upload(e, s)
        drv.sync(s)
        f2, _ = drv.mem_get_info()
        for e in execs:
            drv.graph_launch(e, s)
        drv.sync(s)
        f3, _ = drv.mem_get_info()
        for e in execs:
            drv.exec_destroy(e)
        for g in graphs:
            drv.graph_destroy(g)
        f4, _ = drv.mem_get_info()
        rows.append({"nodes": nodes, "copies": copies,
                     "instantiate_bytes_per_graph": (f0 - f1) / copies,
                     "upload_bytes_per_graph": (f1 - f2) / copies,
                     "launch_bytes_per_graph": (f2 - f3) / copies,
                     "returned_on_destroy_per_graph": (f4 - f3) / copies})
    drv.stream_destroy(s)
    return rows


def engine_graphs(torch, dev, buckets) -> dict:
    """Part 2: the engine's CudaGraphs over a Qwen3-4B-shaped decode stack."""
    from engine.graphs import CudaGraphs
    from protocol.keys import GraphKey
    from sim.scenario import MemoryModel

    c = QWEN3_4B
    bf16 = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=dev, dtype=bf16, generator=gen) * 0.02)

    layers = [dict(n1=torch.ones(c["hidden"], device=dev, dtype=bf16),
                   qkv=w(c["hidden"], c["q"] + 2 * c["kv"]), o=w(c["q"], c["hidden"]),
                   n2=torch.ones(c["hidden"], device=dev, dtype=bf16),
                   gu=w(c["hidden"], 2 * c["inter"]), down=w(c["inter"], c["hidden"]))
              for _ in range(c["layers"])]
    emb = w(c["vocab"], c["hidden"])
    top = max(buckets)
    x_in = torch.randn(top, c["hidden"], device=dev, dtype=bf16, generator=gen)
    logits = torch.empty(top, c["vocab"], device=dev, dtype=bf16)

    def rms(x, g):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * g

    def forward(b: int) -> None:
        h = x_in[:b]
        for L in layers:
            qkv = rms(h, L["n1"]) @ L["qkv"]
            h = h + qkv[:, :c["q"]] @ L["o"]
            gate, up = (rms(h, L["n2"]) @ L["gu"]).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ L["down"]
        logits[:b].copy_(rms(h, layers[-1]["n2"]) @ emb.t())

    graphs = CudaGraphs(dev, lambda key: forward(key.bucket))
    for b in buckets:  # eager warm-up on the capture stream: kernel loads, cuBLAS workspace
        graphs.on_stream(lambda b=b: forward(b))
    torch.cuda.synchronize(dev)
    model = MemoryModel()
    rows = []
    for b in sorted(buckets, reverse=True):  # largest first, as the engine captures
        key = GraphKey(b)
        pool0 = graphs.pool_bytes()
        t0 = time.monotonic()
        graphs.record(key)
        t1 = time.monotonic()
        pool1 = graphs.pool_bytes()
        graphs.instantiate(key)
        t2 = time.monotonic()
        inst = graphs.exec_bytes[key]
        graphs.upload(key)
        torch.cuda.synchronize(dev)
        t3 = time.monotonic()
        rows.append({"bucket": b, "pool_growth_bytes": pool1 - pool0,
                     "instantiate_bytes": inst, "upload_bytes": graphs.exec_bytes[key] - inst,
                     "record_s": t1 - t0, "instantiate_s": t2 - t1, "upload_s": t3 - t2,
                     "model_bytes": model.graph_bytes(b)})
    for b in buckets:  # every graph replays
        graphs.launch(GraphKey(b))
    torch.cuda.synchronize(dev)
    total = graphs.memory()
    out = {"shape": "qwen3-4b decode stack without attention, bf16, TP 1",
           "buckets": rows, "pool_bytes": graphs.pool_bytes(),
           "exec_bytes": sum(graphs.exec_bytes.values()), "measured_total_bytes": total,
           "model_total_bytes": model.graph_set_bytes(buckets)}
    graphs.free()
    layers.clear()  # the weights go back before part 3 fills the device (emb goes on return)
    return out


def graph_when_full(drv, ctx, fn) -> dict:
    """Part 3: fill the device with allocations, then instantiate and upload one graph."""
    drv.set_context(ctx)
    s = drv.stream()
    g = drv.capture_graph(s, fn, 512)
    held = []
    for chunk in (GiB, 64 * MiB, 2 * MiB):
        while True:
            free, _ = drv.mem_get_info()
            if free < chunk:
                break
            try:
                held.append(drv.mem_alloc(chunk))
            except Exception:
                break
    free, _ = drv.mem_get_info()
    res = {"free_bytes_when_full": free, "instantiate": "ok", "upload": "ok"}
    e = None
    try:
        e = drv.instantiate(g)
    except Exception as exc:
        res["instantiate"] = str(exc)
    if e is not None:
        try:
            drv.upload(e, s)
            drv.sync(s)
        except Exception as exc:
            res["upload"] = str(exc)
    for p in held:
        drv.mem_free(p)
    if e is not None:
        drv.exec_destroy(e)
    drv.graph_destroy(g)
    drv.stream_destroy(s)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--copies", type=int, default=16,
                    help="driver graphs per size (cuMemGetInfo moves in 2 MiB steps)")
    ap.add_argument("--buckets", default="1,8,64,256",
                    help="comma-separated bucket rows for the engine-runner part")
    ap.add_argument("--watchdog-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    try:
        buckets = sorted({int(b) for b in args.buckets.split(",")})
    except ValueError:
        raise SystemExit(f"--buckets must be comma-separated integers, got {args.buckets!r}")
    if args.copies < 1 or not buckets or buckets[0] < 1:
        raise SystemExit(f"--copies and every bucket must be >= 1, got copies {args.copies}, "
                         f"buckets {args.buckets!r}")

    import torch

    from hazard_driver import PTX, open_device
    from hazard_verdicts import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE

    dev, drv, ctx = open_device(args.device, args.watchdog_s)
    drv.set_context(ctx)
    noop = drv.function(drv.module_load(PTX.encode()), "noop")
    out = {"probe": "memory", "hazards": ["H7"],
           "machine": {"gpu": torch.cuda.get_device_name(dev), "driver_api": drv.driver_version(),
                       "torch": torch.__version__}, "errors": {}}
    def engine_part() -> dict:
        res = engine_graphs(torch, dev, buckets)
        torch.cuda.empty_cache()  # its weights are unreferenced now: give them back
        return res

    parts = (("driver_graphs", lambda: driver_graphs(drv, ctx, noop, (1, 64, 512), args.copies)),
             ("engine_graphs", engine_part),
             ("graph_when_full", lambda: graph_when_full(drv, ctx, noop)))
    for name, part in parts:
        try:
            out[name] = part()
        except Exception as exc:  # one broken part must not hide the others
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
        print(name, json.dumps(out.get(name, out["errors"].get(name)), indent=1), flush=True)

    eng = out.get("engine_graphs")
    if eng is None:
        verdict = INCONCLUSIVE
    else:  # H7: graphs draw on the device's memory budget
        verdict = HOLDS if eng["measured_total_bytes"] > 0 else DOES_NOT_HOLD
    out["verdicts"] = {"H7": {
        "verdict": verdict,
        "measured_over_model": None if eng is None
        else eng["measured_total_bytes"] / eng["model_total_bytes"],
        "full_device": out.get("graph_when_full")}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["verdicts"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
