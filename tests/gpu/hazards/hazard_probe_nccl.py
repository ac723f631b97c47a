"""NCCL hazards with both ranks in ONE process: two host threads drive two GPUs, one NCCL
communicator each (CuPy's NCCL binding, `NcclCommunicator.initAll`), torch for the tensors
and the graphs (`CUDAGraph(keep_graph=True)`, separate record / instantiate / upload / launch).

This is the topology of the seed's `fused-sweep` deadlock (BACKGROUND.md): the engine runs one
process per rank and never reaches it, so only this probe shows what the hardware does there.

Cases (one per process run; `--case`):
  fused-sweep          per bucket, largest first: record, instantiate, launch (the launch
                       uploads implicitly); rank 1 lags `--skew-s` before each record, so
                       rank 0's launched all-reduce spins on device 0 while rank 1's host
                       thread records and instantiates.
  fused-sweep-free-lagging
                       the same, and the lagging rank 1 frees a cached 256 MiB block
                       (cudaFree through `torch.cuda.empty_cache`, as `torch.cuda.graph()`
                       does per capture) before each record. Its own device is idle; a free
                       waits for its own device to go idle (docs/hazard-probes.md): does it
                       also wait for the OTHER device, where rank 0's all-reduce spins?
                       (H2's scope across devices.)
  fused-sweep-free-both
                       both ranks free before each record: rank 0's free waits on its own
                       spinning device while holding the driver lock (H1 + H2 own device);
                       does rank 1 then get stuck behind it (the seed's deadlock)?
  barrier-sweep        the two-phase startup barrier: record, instantiate and upload every
                       bucket; a barrier; then launch every bucket. Must complete.
  barrier-sweep-free   the barrier sweep with the same frees. Must complete.
  h3-spin              rank 0 launches an all-reduce; rank 1 joins only after `--hold-s`:
                       does rank 0's collective spin all that time (no device-side timeout)?
  h4-lazy-connect      fresh communicators; rank 0 captures a collective that the communicator
                       never ran eagerly while rank 1 captures its own `--hold-s` later: does
                       rank 0's capture wait for its peer (a connection set up inside capture)?
                       For the first collective ever, for a new size after a small warm-up, and
                       (control) for a size already run eagerly.
  h5-destroy-idle      graphs that captured the communicators are kept; the communicators are
                       destroyed; the graphs are replayed again: error, hang, crash or success?
  h5-destroy-no-graph  control: the communicators ran eagerly only, then are destroyed.
  h5-destroy-graph-freed
                       control: the graphs are reset before the communicators are destroyed.
  h5-destroy-in-flight rank 0 replays (its all-reduce spins: rank 1 has not replayed yet) and
                       destroys its communicator at once; rank 1 replays `--hold-s` later: does
                       the destroy wait for the graph in flight?

Every case runs under a watchdog: when its threads have not finished `--hang-s` after they
started, the result is written with outcome `hung` and the process leaves with `os._exit(3)`
(exit does not wait for a spinning kernel on this machine: H8 in docs/hazard-probes.md), and
`faulthandler` ends the process regardless at `--hang-s + 30`. The result file is rewritten
after every step, so a crash keeps what was seen before it.

Usage: python hazard_probe_nccl.py --case CASE --out result.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import sys
import threading
import time

import torch

HIDDEN = 2048
LAYERS = 4
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
FREE_BYTES = 256 << 20
CASES = ("fused-sweep", "fused-sweep-free-lagging", "fused-sweep-free-both", "barrier-sweep", "barrier-sweep-free", "h3-spin",
         "h4-lazy-connect", "h5-destroy-idle", "h5-destroy-in-flight", "h5-destroy-no-graph",
         "h5-destroy-graph-freed")
HUNG_EXIT = 3


class Result:
    """The JSON result, rewritten after every `note` so a crash keeps what came before."""

    def __init__(self, path: str, case: str):
        self.path, self.lock = path, threading.Lock()
        self.data = {"case": case, "outcome": "running", "steps": [], "env": {
            k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_RUNTIME_CONNECT",
                                           "TORCH_SYMM_MEM_DISABLE_MULTICAST")}}

    def note(self, **fields) -> None:
        with self.lock:
            self.data["steps"].append({"t": round(time.monotonic(), 4), **fields})
            self._write()

    def set(self, **fields) -> None:
        with self.lock:
            self.data.update(fields)
            self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


class Rank:
    """One rank: its GPU, its NCCL communicator, a small tensor-parallel-like model whose
    layers each end in an all-reduce, and its graphs per bucket. Construct it in the thread
    that drives it (torch's current device is per thread)."""

    def __init__(self, rank: int, comm, nccl):
        self.rank, self.comm, self.nccl = rank, comm, nccl
        torch.cuda.set_device(rank)
        self.dev = torch.device("cuda", rank)
        g = torch.Generator(device=self.dev).manual_seed(rank)
        self.w = [torch.randn(HIDDEN, HIDDEN, device=self.dev, generator=g) / math.sqrt(HIDDEN)
                  for _ in range(LAYERS)]
        self.inp = {b: torch.randn(b, HIDDEN, device=self.dev, generator=g) for b in BUCKETS}
        self.out = {b: torch.empty(b, HIDDEN, device=self.dev) for b in BUCKETS}
        self.stream = torch.cuda.Stream(self.dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def all_reduce(self, t: torch.Tensor, stream=None) -> None:
        s = stream or torch.cuda.current_stream(self.dev)
        self.comm.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), self.nccl.NCCL_FLOAT32,
                            self.nccl.NCCL_SUM, s.cuda_stream)

    def body(self, b: int) -> None:
        x = self.inp[b]
        for w in self.w:
            y = x @ w
            self.all_reduce(y)
            x = torch.tanh(y)
        self.out[b].copy_(x)

    def eager(self, b: int) -> None:
        with torch.cuda.stream(self.stream):
            self.body(b)
        self.stream.synchronize()

    def record(self, b: int) -> None:
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            self.body(b)
            g.capture_end()
        self.graphs[b] = g

    def instantiate(self, b: int) -> None:
        self.graphs[b].instantiate()

    def upload(self, b: int) -> None:
        from cuda.bindings import runtime as cudart
        err, = cudart.cudaGraphUpload(self.graphs[b].raw_cuda_graph_exec(),
                                      self.stream.cuda_stream)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaGraphUpload failed: {err!r}")

    def launch(self, b: int) -> None:
        with torch.cuda.stream(self.stream):
            self.graphs[b].replay()

    def free_cached(self) -> None:
        t = torch.empty(FREE_BYTES, dtype=torch.uint8, device=self.dev)
        del t
        torch.cuda.empty_cache()  # cudaFree of the block just released

    def wait(self, limit_s: float) -> bool:
        """Poll this rank's stream until idle; False if still busy after `limit_s`."""
        end = time.monotonic() + limit_s
        while not self.stream.query():
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True


def _threads(fn, res: Result, hang_s: float) -> str:
    """Run fn(rank) in two threads; the outcome: completed, error, or hung after hang_s."""
    errors: list[str] = []

    def run(r):
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001 - recorded, the probe goes on
            errors.append(f"rank {r}: {type(exc).__name__}: {exc}")
            res.note(rank=r, error=f"{type(exc).__name__}: {exc}")

    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join(max(0.0, hang_s - (time.monotonic() - t0)))
    if any(t.is_alive() for t in ts):
        with open(res.path + ".stacks", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        res.set(outcome="hung", seconds=round(time.monotonic() - t0, 3),
                alive=[r for r, t in enumerate(ts) if t.is_alive()], errors=errors)
        return "hung"
    outcome = "error" if errors else "completed"
    res.set(outcome=outcome, seconds=round(time.monotonic() - t0, 3), errors=errors)
    return outcome


def _timed(res: Result, rank: int, what: str, fn, *args):
    t = time.monotonic()
    out = fn(*args)
    res.note(rank=rank, op=what, s=round(time.monotonic() - t, 4))
    return out


def sweep(args, nccl, comms, res: Result) -> str:
    fused = args.case.startswith("fused")
    free_ranks = {"fused-sweep-free-lagging": (1,), "fused-sweep-free-both": (0, 1),
                  "barrier-sweep-free": (0, 1)}.get(args.case, ())
    ranks: list[Rank | None] = [None, None]
    ready = threading.Barrier(2)
    phase_barrier = threading.Barrier(2)

    def fn(r):
        rk = ranks[r] = Rank(r, comms[r], nccl)
        for b in BUCKETS:  # warm-up per size (I5 kept): connections exist before capture
            rk.eager(b)
        ready.wait(timeout=args.hang_s)
        res.note(rank=r, op="warm-up done")
        for b in reversed(BUCKETS):
            if r == 1:
                time.sleep(args.skew_s)
            if r in free_ranks:
                _timed(res, r, f"free({b})", rk.free_cached)
            _timed(res, r, f"record({b})", rk.record, b)
            _timed(res, r, f"instantiate({b})", rk.instantiate, b)
            if fused:  # the launch does the implicit upload; no barrier
                _timed(res, r, f"launch({b})", rk.launch, b)
            else:
                _timed(res, r, f"upload({b})", rk.upload, b)
        if not fused:
            rk.stream.synchronize()
            phase_barrier.wait(timeout=args.hang_s)  # the two-phase barrier
            for b in reversed(BUCKETS):
                _timed(res, r, f"launch({b})", rk.launch, b)
        if not rk.wait(args.hang_s):
            raise TimeoutError("graphs still running")

    outcome = _threads(fn, res, args.hang_s)
    if outcome == "completed":  # the all-reduced outputs agree across ranks
        same = all(torch.equal(ranks[0].out[b].cpu(), ranks[1].out[b].cpu()) for b in BUCKETS)
        res.set(outputs_agree=same)
    return outcome


def h3(args, nccl, comms, res: Result) -> str:
    ranks: list[Rank | None] = [None, None]
    ready = threading.Barrier(2)
    t_join = {}

    def fn(r):
        rk = ranks[r] = Rank(r, comms[r], nccl)
        x = torch.ones(1 << 20, device=rk.dev)
        with torch.cuda.stream(rk.stream):
            rk.all_reduce(x, rk.stream)  # warm-up, both ranks
        rk.stream.synchronize()
        ready.wait(timeout=args.hang_s)
        if r == 0:
            rk.all_reduce(x, rk.stream)
            busy = not rk.wait(args.hold_s)
            res.set(still_spinning_after_s=args.hold_s if busy else None)
            t0 = time.monotonic()
            t_join["t0"] = t0
            ready.wait(timeout=args.hang_s)  # releases rank 1
            ok = rk.wait(args.hang_s / 2)
            res.set(completed_after_peer_joined_s=round(time.monotonic() - t0, 4) if ok else None)
        else:
            ready.wait(timeout=args.hang_s)
            rk.all_reduce(x, rk.stream)
            rk.wait(args.hang_s / 2)

    outcome = _threads(fn, res, args.hang_s)
    spun = res.data.get("still_spinning_after_s")
    res.set(verdicts={"H3": {"verdict": "holds" if spun and res.data.get(
        "completed_after_peer_joined_s") is not None else "does not hold" if spun is None
        and outcome == "completed" else "inconclusive"}})
    return outcome


def h4(args, nccl, res: Result) -> str:
    """Fresh communicators per sub-case; rank 0 captures a collective, rank 1 captures its own
    `late` seconds later. A capture that raised is recorded, and the ranks still meet."""
    small, large = 1 << 10, 16 << 20  # floats: 4 KiB and 64 MiB
    cases = [("first collective, peer on time", [], 0.0),
             ("first collective, peer late", [], args.hold_s),
             ("new size after a small warm-up, peer late", [small], args.hold_s),
             ("size already run, peer late (control)", [large], args.hold_s)]
    out = {}
    for name, warm, late in cases:
        comms = nccl.NcclCommunicator.initAll([0, 1])
        seen: dict = {}
        barrier = threading.Barrier(2)

        def fn(r, comms=comms, warm=warm, late=late, seen=seen, barrier=barrier):
            torch.cuda.set_device(r)
            dev = torch.device("cuda", r)
            s = torch.cuda.Stream(dev)
            for n in warm:
                y = torch.ones(n, device=dev)
                comms[r].allReduce(y.data_ptr(), y.data_ptr(), n, nccl.NCCL_FLOAT32,
                                   nccl.NCCL_SUM, s.cuda_stream)
            s.synchronize()
            x = torch.ones(large, device=dev)
            barrier.wait(timeout=args.hang_s)
            if r == 1:
                time.sleep(late)
            g = torch.cuda.CUDAGraph(keep_graph=True)
            t0 = time.monotonic()
            try:
                with torch.cuda.stream(s):
                    g.capture_begin(capture_error_mode="thread_local")
                    try:
                        comms[r].allReduce(x.data_ptr(), x.data_ptr(), large,
                                           nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.cuda_stream)
                    finally:
                        g.capture_end()
            except Exception as exc:  # noqa: BLE001 - the finding
                seen[f"error_{r}"] = f"{type(exc).__name__}: {exc}"
            seen[f"capture_s_{r}"] = round(time.monotonic() - t0, 4)
            barrier.wait(timeout=args.hang_s)
            if any(k.startswith("error") for k in seen):
                return
            g.instantiate()
            with torch.cuda.stream(s):
                g.replay()
            s.synchronize()
            seen[f"sum_ok_{r}"] = bool((x == 2.0).all().item())

        outcome = _threads(fn, res, args.hang_s)
        errors = {k: v for k, v in seen.items() if k.startswith("error")}
        waited = late > 0 and seen.get("capture_s_0", 0) >= 0.9 * late
        kind = ("hung" if outcome == "hung" else "capture error" if errors else
                "waited for peer" if waited else "no wait")
        out[name] = {"kind": kind, "peer_late_s": late, **seen}
        res.set(subcases=out)
        if outcome == "hung":
            return outcome
    first = out["first collective, peer late"]["kind"]
    new_size = out["new size after a small warm-up, peer late"]["kind"]
    control = out["size already run, peer late (control)"]["kind"]
    hazardous = ("capture error", "waited for peer")
    if control != "no wait":
        verdict = "inconclusive"  # even a size already run misbehaved: not a connection effect
    elif first in hazardous and new_size in hazardous:
        verdict = "holds"
    elif first in hazardous:
        verdict = "holds in part"  # the first collective only, not a new size class
    else:
        verdict = "does not hold"
    res.set(verdicts={"H4": {"verdict": verdict, "first_collective": first,
                             "new_size": new_size, "control": control}},
            outcome="completed")
    return "completed"


def h5(args, nccl, comms, res: Result) -> str:
    in_flight = args.case == "h5-destroy-in-flight"
    ranks: list[Rank | None] = [None, None]
    barrier = threading.Barrier(2)
    b = BUCKETS[-1]

    def fn(r):
        rk = ranks[r] = Rank(r, comms[r], nccl)
        rk.eager(b)
        barrier.wait(timeout=args.hang_s)
        if args.case == "h5-destroy-no-graph":  # control: no graph ever captured
            _timed(res, r, "destroy", rk.comm.destroy)
            res.note(rank=r, op="first replay done")  # nothing to replay: the marker only
            return
        rk.record(b)
        rk.instantiate(b)
        rk.upload(b)
        barrier.wait(timeout=args.hang_s)
        rk.launch(b)
        rk.stream.synchronize()
        res.note(rank=r, op="first replay done")
        barrier.wait(timeout=args.hang_s)
        if args.case == "h5-destroy-graph-freed":  # control: the graphs go first
            rk.graphs.pop(b).reset()
            torch.cuda.synchronize(rk.dev)
            barrier.wait(timeout=args.hang_s)
            _timed(res, r, "destroy", rk.comm.destroy)
            return
        if in_flight:
            if r == 1:
                time.sleep(args.hold_s)
                _timed(res, r, "replay", rk.launch, b)
                res.note(rank=r, op="replay finished", ok=rk.wait(args.hang_s / 2))
                _timed(res, r, "destroy", rk.comm.destroy)
            else:
                _timed(res, r, "replay", rk.launch, b)
                res.note(rank=r, op="spinning at destroy", busy=not rk.stream.query())
                _timed(res, r, "destroy", rk.comm.destroy)
                res.note(rank=r, op="replay finished", ok=rk.wait(args.hang_s / 2))
        else:
            _timed(res, r, "destroy", rk.comm.destroy)
            barrier.wait(timeout=args.hang_s)
            _timed(res, r, "replay after destroy", rk.launch, b)
            res.note(rank=r, op="replay after destroy finished", ok=rk.wait(args.hang_s / 2))
            torch.cuda.synchronize(rk.dev)  # raises if the replay faulted
            res.note(rank=r, op="synchronized")

    return _threads(fn, res, args.hang_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, choices=CASES)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--skew-s", type=float, default=0.05, help="rank 1's lag per bucket")
    ap.add_argument("--hold-s", type=float, default=3.0, help="how long a peer stays away")
    ap.add_argument("--hang-s", type=float, default=40.0, help="threads unfinished: hung")
    args = ap.parse_args(argv)
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
    faulthandler.dump_traceback_later(args.hang_s * 3 + 30, exit=True)
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reason for an error, in the log
    from cupy.cuda import nccl

    res = Result(args.out, args.case)
    res.set(nccl_version=nccl.get_version(), skew_s=args.skew_s, hold_s=args.hold_s)
    if args.case == "h4-lazy-connect":
        outcome = h4(args, nccl, res)
    else:
        comms = nccl.NcclCommunicator.initAll([0, 1])
        if args.case.startswith(("fused", "barrier")):
            outcome = sweep(args, nccl, comms, res)
        elif args.case == "h3-spin":
            outcome = h3(args, nccl, comms, res)
        else:
            outcome = h5(args, nccl, comms, res)
    print(json.dumps({k: v for k, v in res.data.items() if k != "steps"}, default=str))
    sys.stdout.flush()
    if outcome == "hung":
        os._exit(HUNG_EXIT)  # a thread may be inside the driver: do not run atexit/teardown
    os._exit(0)  # skip communicator/context teardown ordering across threads


if __name__ == "__main__":
    sys.exit(main())
