"""Probe H6 (async host): do enqueuing calls return before their device work completes?

Each enqueuing call below puts `--work-s` seconds of device work on a stream (the spin kernel,
which ends by its in-kernel bound; or torch.cuda._sleep). The probe times the call itself,
checks whether the work still runs when the call returns, and times the synchronize.

Usage: python hazard_probe_async.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _timed(enqueue, running, sync) -> dict:
    t0 = time.monotonic()
    enqueue()
    t1 = time.monotonic()
    still = running()
    sync()
    t2 = time.monotonic()
    return {"call_s": t1 - t0, "device_s": t2 - t0, "running_at_return": still}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--work-s", type=float, default=0.3,
                    help="seconds of device work each enqueued call carries")
    ap.add_argument("--watchdog-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    if args.work_s <= 0:
        raise SystemExit(f"--work-s must be positive, got {args.work_s}")

    import torch

    from hazard_driver import open_device
    from hazard_spin import Spinner
    from hazard_verdicts import async_verdict

    dev, drv, ctx = open_device(args.device, args.watchdog_s)
    sp = Spinner(drv, ctx, args.work_s)
    running = lambda: not sp.done  # noqa: E731
    sync = lambda: (drv.set_context(ctx), drv.sync(sp.stream))  # noqa: E731

    def kernel_launch() -> dict:
        sp.enqueue()  # warm: the first launch of a module pays its own costs
        sync()
        return _timed(sp.enqueue, running, sync)

    def graph_launch() -> dict:
        drv.set_context(ctx)
        cap = drv.stream()
        drv.begin_capture(cap)
        drv.launch(sp.fn, cap, *sp.args())
        graph = drv.end_capture(cap)
        exec_ = drv.instantiate(graph)
        drv.upload(exec_, sp.stream)
        drv.sync(sp.stream)

        def launch():
            sp.reset()
            drv.graph_launch(exec_, sp.stream)

        r = _timed(launch, running, sync)
        drv.exec_destroy(exec_)
        drv.graph_destroy(graph)
        return r

    # torch: a sleep kernel of about work_s (cycles at the SM clock the device reports; the
    # H200's boost clock, 1.98 GHz, where torch does not report it)
    clock_khz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 0) or 1_980_000
    cycles = int(args.work_s * clock_khz * 1e3)
    stream = torch.cuda.Stream(dev)

    def torch_op() -> dict:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1000)
        torch.cuda.synchronize(dev)

        def sleep():
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)

        return _timed(sleep, lambda: not stream.query(), stream.synchronize)

    def torch_graph_replay() -> dict:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            g.capture_begin(capture_error_mode="thread_local")
            torch.cuda._sleep(cycles)
            g.capture_end()
        torch.cuda.synchronize(dev)

        def replay():
            with torch.cuda.stream(stream):
                g.replay()

        replay()  # the first replay may upload
        stream.synchronize()
        r = _timed(replay, lambda: not stream.query(), stream.synchronize)
        g.reset()
        return r

    results, errors = {}, {}
    for fn in (kernel_launch, graph_launch, torch_op, torch_graph_replay):
        try:
            results[fn.__name__] = fn()
        except Exception as exc:  # one broken call must not hide the others
            errors[fn.__name__] = f"{type(exc).__name__}: {exc}"

    early = [r["running_at_return"] for r in results.values()]
    out = {"probe": "async", "hazards": ["H6"], "work_s": args.work_s,
           "machine": {"gpu": torch.cuda.get_device_name(dev), "driver_api": drv.driver_version(),
                       "torch": torch.__version__},
           "calls": results, "errors": errors,
           "verdicts": {"H6": {"verdict": async_verdict(early),
                               "returned_early": {k: r["running_at_return"]
                                                  for k, r in results.items()}}}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for k, r in results.items():
        print(f"{k:20s} call {r['call_s'] * 1e3:8.3f} ms  device {r['device_s'] * 1e3:8.1f} ms"
              f"  running at return: {r['running_at_return']}", flush=True)
    print(json.dumps(out["verdicts"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
