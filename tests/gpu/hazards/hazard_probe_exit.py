"""Probe H8 (exit teardown): does a process exit wait while one of its threads is blocked in
the driver on a spinning kernel?

The parent starts one child process per case; each child (driver API only, no torch) sets up
a kernel that spins for `--bound-s` seconds (its in-kernel bound; nothing releases it), then
exits. The parent times each exit from the child's last line to the end of the process:

    exit_idle            no kernel: the baseline exit
    exit_spinning        sys.exit with the kernel spinning, no thread in the driver
    exit_lock_held       sys.exit with a daemon thread blocked in `--holder` on the spin
    os_exit_lock_held    os._exit (no Python or atexit teardown), same thread blocked

Usage: python hazard_probe_exit.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

CASES = ("exit_idle", "exit_spinning", "exit_lock_held", "os_exit_lock_held")
HOLDERS = ("mem_free", "ctx_synchronize")


def child(case: str, holder: str, bound_s: float, device: int) -> None:
    """One case, in its own process. Prints 'exiting <spun_s> <holder_in_call>' last."""
    import faulthandler
    faulthandler.dump_traceback_later(bound_s + 30.0, exit=True)
    from hazard_driver import Driver
    from hazard_spin import Spinner

    drv = Driver()
    ctx = drv.primary_context(device)
    sp = Spinner(drv, ctx, bound_s)
    ptr = drv.mem_alloc(64 << 20)
    t0 = time.monotonic()
    in_call = False
    if case != "exit_idle":
        sp.start()
        t0 = time.monotonic()
    if case.endswith("lock_held"):
        def hold():
            drv.set_context(ctx)
            if holder == "mem_free":
                drv.mem_free(ptr)
            else:
                drv.check("cuCtxSynchronize")

        th = threading.Thread(target=hold, daemon=True)
        th.start()
        th.join(0.3)
        in_call = th.is_alive()
    print(f"exiting {time.monotonic() - t0:.4f} {int(in_call)}", flush=True)
    if case.startswith("os_exit"):
        os._exit(0)
    sys.exit(0)


def run_case(case: str, holder: str, bound_s: float, device: int) -> dict:
    """Start the child for `case`; time its exit from its last line."""
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", case,
                          "--holder", holder, "--bound-s", str(bound_s),
                          "--device", str(device), "--out", os.devnull],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    t_line = None
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line or line.startswith("exiting"):
            t_line = time.monotonic()
            break
    rec = {"case": case, "holder": holder if case.endswith("lock_held") else None}
    if not line.startswith("exiting"):
        p.kill()
        rec["error"] = f"the child gave no 'exiting' line: {p.stderr.read()[-2000:]}"
        return rec
    _, spun, in_call = line.split()
    rec |= {"spun_before_exit_s": float(spun), "holder_in_call": bool(int(in_call)),
            "spin_left_s": max(0.0, bound_s - float(spun)) if case != "exit_idle" else 0.0}
    try:
        rc = p.wait(timeout=bound_s + 20.0)
        rec |= {"exit_s": time.monotonic() - t_line, "returncode": rc}
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        rec |= {"exit_s": None, "returncode": None, "killed_after_s": bound_s + 20.0}
    rec["stderr_tail"] = p.stderr.read()[-500:]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--bound-s", type=float, default=2.0, help="the in-kernel spin bound")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--holder", choices=HOLDERS, default="mem_free", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bound_s < 1.0:
        raise SystemExit(f"--bound-s must be >= 1 s (the child needs time to block), got "
                         f"{args.bound_s}")
    if args.child:
        child(args.child, args.holder, args.bound_s, args.device)
        return 0

    import torch

    if not 0 <= args.device < torch.cuda.device_count():
        raise SystemExit(f"device {args.device} out of range: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    from hazard_verdicts import exit_verdict

    runs = [run_case("exit_idle", "mem_free", args.bound_s, args.device),
            run_case("exit_spinning", "mem_free", args.bound_s, args.device)]
    for holder in HOLDERS:
        for case in ("exit_lock_held", "os_exit_lock_held"):
            runs.append(run_case(case, holder, args.bound_s, args.device))
    for r in runs:
        print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)

    verdicts = {}
    for holder in HOLDERS:
        by_case = {r["case"]: r for r in runs if r.get("holder") in (holder, None)}
        held = by_case.get("exit_lock_held", {})
        fast = by_case.get("os_exit_lock_held", {})
        if not held.get("holder_in_call") or "error" in held or "error" in fast:
            verdicts[holder] = "inconclusive"
            continue
        verdicts[holder] = exit_verdict(
            {"exit_lock_held": held.get("exit_s"), "os_exit_lock_held": fast.get("exit_s")},
            held["spin_left_s"])
    counted = [v for v in verdicts.values() if v != "inconclusive"]
    overall = ("inconclusive" if not counted else "holds" if all(v == "holds" for v in counted)
               else "does not hold" if all(v == "does not hold" for v in counted)
               else "holds in part")
    out = {"probe": "exit", "hazards": ["H8"], "bound_s": args.bound_s,
           "machine": {"gpu": torch.cuda.get_device_name(args.device)},
           "runs": runs, "verdicts": {"H8": {"verdict": overall, "by_holder": verdicts}}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["verdicts"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
