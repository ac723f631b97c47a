"""Probe H1 (driver lock) and H2 (quiescence): which host calls wait for a kernel that spins?

A kernel spins on the spin device; a second host thread makes one call on the call device
(the same device by default: H2 with own-device scope; `--spin-device 1 --call-device 0` asks
the cross-device question and needs two GPUs). The call either returns while the kernel still
spins, or only once the host releases it after `--hold-s` seconds. Every call is also timed
with the device idle (the baseline).

H1: while a first thread waits in a call that blocked on the spin (the lock holder, if the
model is right), does a second thread's call that did not block on its own (a kernel launch,
a graph launch, end of capture, an allocation) block too?

Usage: python hazard_probe_block.py --out result.json [--spin-device N --call-device M]
Writes one JSON object; exit status 0 once every call was measured (whatever it showed).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import sys
import time

MiB = 1 << 20

# The calls each rule of sim/hazards.py names (docs/hazards.md).
H2_MODELLED = ("instantiate", "upload", "first_launch", "instantiate_512", "upload_512",
               "first_launch_512", "torch_new_segment",
               "torch_instantiate", "torch_upload", "torch_first_replay",
               "torch_instantiate_big", "torch_upload_big", "torch_first_replay_big")
H1_OTHERS = ("kernel_launch", "launch_uploaded", "stream_query", "record", "instantiate",
             "upload", "first_launch", "mem_alloc", "torch_first_replay")
# driver-level (ctypes) calls only: they release the GIL. At most three of these that block,
# plus cuCtxSynchronize (a wait that holds no lock, if H1 is right) as the control.
H1_HOLDERS = ("instantiate", "upload", "first_launch", "instantiate_512", "upload_512",
              "first_launch_512", "mem_alloc", "mem_free", "module_load", "exec_destroy",
              "module_unload", "host_free")
H1_CONTROL = "ctx_synchronize"


def build_calls(drv, torch, ctx, call_dev: int):
    """The calls under test, in order, as hazard_spin.Call records."""
    from hazard_driver import PTX, cubin_from_ptx
    from hazard_spin import Call

    drv.set_context(ctx)
    cubin = cubin_from_ptx(PTX)
    image = cubin if cubin is not None else PTX.encode()
    mod = drv.module_load(image)
    noop = drv.function(mod, "noop")
    # s2 for the calls that can hold the lock (upload, first launch), s3 for the other
    # thread's launches and captures in H1 pairs: two threads never share a stream
    s2, s3 = drv.stream(), drv.stream()
    dev = torch.device("cuda", call_dev)
    side = torch.cuda.Stream(dev)
    x = torch.ones(1024, device=dev)
    y = torch.empty_like(x)

    def graph_state(upload: bool = False, instantiate: bool = True, nodes: int = 8) -> dict:
        drv.set_context(ctx)
        st = {"graph": drv.capture_graph(s2, noop, nodes)}
        if instantiate:
            st["exec"] = drv.instantiate(st["graph"])
        if upload:
            drv.upload(st["exec"], s2)
            drv.sync(s2)
        return st

    def graph_cleanup(st: dict) -> None:
        drv.set_context(ctx)
        drv.sync(s2)
        drv.sync(s3)
        if "exec" in st:
            drv.exec_destroy(st["exec"])
        drv.graph_destroy(st["graph"])

    # a larger graph like a decode step's: 64 layers of bf16 matmul (cuBLAS) and SiLU on
    # 256 x 2560 rows, about 130 nodes, warmed up eagerly first as the engine does
    w_big = torch.randn(2560, 2560, device=dev, dtype=torch.bfloat16) * 0.02
    h_big = torch.randn(256, 2560, device=dev, dtype=torch.bfloat16)

    def big_forward() -> None:
        h = h_big
        for _ in range(64):
            h = torch.nn.functional.silu(h @ w_big)
        h_big.copy_(h)

    with torch.cuda.stream(side):
        big_forward()
    torch.cuda.synchronize(dev)

    def torch_graph(instantiate: bool, big: bool = False) -> dict:
        torch.cuda.set_device(dev)
        g = torch.cuda.CUDAGraph(keep_graph=True)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            g.capture_begin(capture_error_mode="thread_local")
            if big:
                big_forward()
            else:
                y.copy_(x * 2)
            g.capture_end()
        if instantiate:
            g.instantiate()
        torch.cuda.synchronize(dev)
        return {"g": g}

    def torch_cleanup(st: dict) -> None:
        torch.cuda.synchronize(dev)
        st["g"].reset()

    def raw_exec(g):
        import ctypes
        return ctypes.c_void_p(int(g.raw_cuda_graph_exec()))

    def in_torch(fn):
        def run(st):
            torch.cuda.set_device(dev)
            with torch.cuda.stream(side):
                fn(st)
        return run

    salt = iter(range(1, 1000))

    def triton_prepare() -> dict:
        # a new SALT is a new module: compiled here with the device idle, loaded by the
        # first launch (module_loaded_before says whether warmup already loaded it)
        from hazard_triton import add_salt
        torch.cuda.set_device(dev)
        st = {"t": torch.zeros(1, device=dev), "salt": next(salt)}
        with torch.cuda.stream(side):
            k = add_salt.warmup(st["t"], SALT=st["salt"], grid=(1,))
        torch.cuda.synchronize(dev)
        st["notes"] = {"module_loaded_before_call": getattr(k, "module", None) is not None}
        return st

    def triton_run(st: dict) -> None:
        from hazard_triton import add_salt
        torch.cuda.set_device(dev)
        with torch.cuda.stream(side):
            add_salt[(1,)](st["t"], SALT=st["salt"])

    def torch_cache_fill() -> dict:
        torch.cuda.set_device(dev)
        t = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
        del t
        return {}

    def torch_uncached() -> dict:
        torch.cuda.set_device(dev)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        return {}

    def torch_free(st: dict) -> None:
        st.clear()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()

    calls = [
        Call("kernel_launch", dict, lambda st: drv.launch(noop, s3),
             lambda st: drv.sync(s3), ctx),
        Call("stream_query", dict, lambda st: drv.query(s3), None, ctx),
        Call("record", dict, lambda st: st.update(graph=drv.capture_graph(s3, noop, 8)),
             graph_cleanup, ctx),
        Call("instantiate", lambda: graph_state(instantiate=False),
             lambda st: st.update(exec=drv.instantiate(st["graph"])), graph_cleanup, ctx),
        Call("upload", graph_state, lambda st: drv.upload(st["exec"], s2), graph_cleanup, ctx),
        Call("first_launch", graph_state, lambda st: drv.graph_launch(st["exec"], s2),
             graph_cleanup, ctx),
        Call("instantiate_512", lambda: graph_state(instantiate=False, nodes=512),
             lambda st: st.update(exec=drv.instantiate(st["graph"])), graph_cleanup, ctx),
        Call("upload_512", lambda: graph_state(nodes=512), lambda st: drv.upload(st["exec"], s2),
             graph_cleanup, ctx),
        Call("first_launch_512", lambda: graph_state(nodes=512),
             lambda st: drv.graph_launch(st["exec"], s2), graph_cleanup, ctx),
        Call("exec_destroy", lambda: graph_state(upload=True),
             lambda st: drv.exec_destroy(st.pop("exec")), graph_cleanup, ctx),
        Call("launch_uploaded", lambda: graph_state(upload=True),
             lambda st: drv.graph_launch(st["exec"], s3), graph_cleanup, ctx),
        Call("mem_alloc", dict, lambda st: st.update(ptr=drv.mem_alloc(64 * MiB)),
             lambda st: drv.mem_free(st["ptr"]), ctx),
        Call("mem_free", lambda: {"ptr": drv.mem_alloc(64 * MiB)},
             lambda st: drv.mem_free(st["ptr"]), None, ctx),
        Call("module_load", dict, lambda st: st.update(mod=drv.module_load(image)),
             lambda st: drv.module_unload(st["mod"]), ctx),
        Call("module_unload", lambda: {"mod": drv.module_load(image)},
             lambda st: drv.module_unload(st["mod"]), None, ctx),
        Call("host_alloc", dict, lambda st: st.update(h=drv.host_alloc(64 * MiB)),
             lambda st: drv.host_free(st["h"][0]), ctx),
        Call("host_free", lambda: {"h": drv.host_alloc(64 * MiB)},
             lambda st: drv.host_free(st["h"][0]), None, ctx),
        Call("stream_destroy", lambda: {"s": drv.stream()},
             lambda st: drv.stream_destroy(st["s"]), None, ctx),
        Call("ctx_synchronize", dict, lambda st: drv.check("cuCtxSynchronize"), None, ctx),
        Call("torch_empty_cache", torch_cache_fill, lambda st: torch.cuda.empty_cache()),
        Call("torch_new_segment", torch_uncached,
             lambda st: st.update(t=torch.empty(256 * MiB, dtype=torch.uint8, device=dev)),
             torch_free),
        Call("torch_instantiate", lambda: torch_graph(instantiate=False),
             lambda st: st["g"].instantiate(), torch_cleanup),
        Call("torch_upload", lambda: torch_graph(instantiate=True),
             lambda st: drv.upload(raw_exec(st["g"]), s2), torch_cleanup, ctx),
        Call("torch_first_replay", lambda: torch_graph(instantiate=True),
             in_torch(lambda st: st["g"].replay()), torch_cleanup),
        Call("torch_instantiate_big", lambda: torch_graph(instantiate=False, big=True),
             lambda st: st["g"].instantiate(), torch_cleanup),
        Call("torch_upload_big", lambda: torch_graph(instantiate=True, big=True),
             lambda st: drv.upload(raw_exec(st["g"]), s2), torch_cleanup, ctx),
        Call("torch_first_replay_big", lambda: torch_graph(instantiate=True, big=True),
             in_torch(lambda st: st["g"].replay()), torch_cleanup),
        Call("torch_graph_reset", lambda: torch_graph(instantiate=True),
             lambda st: st["g"].reset(), lambda st: torch.cuda.synchronize(dev)),
        Call("triton_first_launch", triton_prepare, triton_run),
    ]
    info = {"module_image": "cubin (ptxas)" if cubin is not None else "ptx (driver JIT)"}
    return calls, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--spin-device", type=int, default=0)
    ap.add_argument("--call-device", type=int, default=0)
    ap.add_argument("--peer-access", action="store_true",
                    help="enable peer access between the two devices first (as NCCL does for "
                         "two ranks in one process): H2's 'peers' scope")
    ap.add_argument("--hold-s", type=float, default=0.5,
                    help="seconds the host lets the kernel spin before releasing it")
    ap.add_argument("--bound-s", type=float, default=3.0, help="the in-kernel spin bound")
    ap.add_argument("--watchdog-s", type=float, default=240.0,
                    help="the whole probe is ended (exit status 1) after this many seconds")
    ap.add_argument("--only", default="", help="comma-separated call names (default: all)")
    args = ap.parse_args(argv)
    if args.hold_s <= 0 or args.bound_s < 2 * args.hold_s:
        raise SystemExit(f"need 0 < --hold-s and --bound-s >= 2 x --hold-s, got hold "
                         f"{args.hold_s} s, bound {args.bound_s} s")

    import torch

    from hazard_driver import Driver
    from hazard_spin import Spinner, baseline, pair_under_spin, under_spin
    from hazard_verdicts import BLOCKS, RETURNS, aggregate, lock_verdict

    n = torch.cuda.device_count()
    for d in (args.spin_device, args.call_device):
        if not 0 <= d < n:
            raise SystemExit(f"device {d} out of range: this machine has {n} CUDA device(s)")
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    for d in sorted({args.spin_device, args.call_device}):
        torch.zeros(1, device=torch.device("cuda", d))  # the runtime's primary contexts
    torch.cuda.set_device(args.call_device)
    drv = Driver()
    ctx_call = drv.primary_context(args.call_device)
    ctx_spin = drv.primary_context(args.spin_device)
    if args.peer_access and args.spin_device != args.call_device:
        for a, b in ((ctx_call, ctx_spin), (ctx_spin, ctx_call)):
            drv.set_context(a)
            drv.check("cuCtxEnablePeerAccess", b, ctypes.c_uint(0))
        drv.set_context(ctx_call)
    spinner = Spinner(drv, ctx_spin, args.bound_s)
    calls, info = build_calls(drv, torch, ctx_call, args.call_device)
    if args.only:
        calls = [c for c in calls if c.name in args.only.split(",")]

    t_start = time.monotonic()
    result = {
        "probe": "block", "hazards": ["H1", "H2"],
        "scope": ("own device" if args.spin_device == args.call_device else
                  "peer device" if args.peer_access else "other device"),
        "spin_device": args.spin_device, "call_device": args.call_device,
        "hold_s": args.hold_s, "bound_s": args.bound_s,
        "machine": {"gpu": torch.cuda.get_device_name(args.call_device),
                    "driver_api": drv.driver_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda} | info,
        "calls": {}, "pairs": [],
    }
    alone = {}
    for call in calls:
        rec = {}
        try:
            rec["baseline_s"] = baseline(drv, call)
            timing = under_spin(drv, spinner, call, args.hold_s)
            rec |= timing.record()
        except Exception as exc:  # one broken call must not hide the others
            rec |= {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}
        alone[call.name] = rec["outcome"]
        result["calls"][call.name] = rec
        print(f"{call.name:22s} {rec['outcome']:15s} call {rec.get('call_s', float('nan')):.4f} s"
              f"  idle {rec.get('baseline_s', float('nan')):.4f} s", flush=True)

    by_name = {c.name: c for c in calls}
    holders = [h for h in H1_HOLDERS if alone.get(h) == BLOCKS][:3]
    if alone.get(H1_CONTROL) == BLOCKS:
        holders.append(H1_CONTROL)
    others = [o for o in H1_OTHERS if alone.get(o) == RETURNS]
    pairs = []
    for h in holders:
        for o in others:
            if o == h:
                continue
            try:
                th, to = pair_under_spin(drv, spinner, by_name[h], by_name[o], args.hold_s)
            except Exception as exc:
                result["pairs"].append({"holder": h, "other": o,
                                        "error": f"{type(exc).__name__}: {exc}"})
                continue
            pairs.append((th, to, alone[o]))
            result["pairs"].append({"holder": h, "other": o, "holder_timing": th.record(),
                                    "other_timing": to.record()})
            print(f"H1 {h:16s} holds, {o:18s} {to.outcome:15s} call {to.call_s:.4f} s",
                  flush=True)

    modelled = [p for p in pairs if p[0].call != H1_CONTROL and p[1].call != "stream_query"]
    h2_calls = {c: alone[c] for c in H2_MODELLED if c in alone}
    result["verdicts"] = {
        "H2": {"verdict": aggregate(list(h2_calls.values())), "modelled_calls": h2_calls,
               "other_calls_that_block": sorted(c for c, o in alone.items()
                                                if o == BLOCKS and c not in H2_MODELLED)},
        # H1 over the calls the model has take the lock (sim.world.LOCKING_OPS: record,
        # instantiate, upload, launch, allocate_kv), behind holders other than the control
        "H1": {"verdict": lock_verdict(modelled), "holders": holders, "others": others,
               "pairs_counted": sum(1 for h, o, a in modelled if h.outcome == BLOCKS
                                    and o.holder_in_call and a == RETURNS),
               "behind_control_holder": lock_verdict(
                   [p for p in pairs if p[0].call == H1_CONTROL]),
               "stream_query_behind_holders": lock_verdict(
                   [p for p in pairs if p[1].call == "stream_query" and p[0].call != H1_CONTROL])},
    }
    result["seconds"] = time.monotonic() - t_start
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["verdicts"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
