"""Stand-alone experiment behind docs/benchmarks.md, 2026-12-06 (session of 18:18 UTC): how
close to the HBM floor can a decode step of one launch per GEMM come at all?

Qwen3-4B's batch-1 step is a chain of about 6 launches a layer (36 layers) plus the LM head;
its gap to the floor is the same in microseconds on an H100 and an H200 (about 611 us), so it
is latency, not bandwidth. This script times a step with the same chain and the same bytes
but no arithmetic: each GEMM is replaced by a kernel that only streams its weight (sums it in
float32), each of the two small launches (q/k norm + RoPE + KV write, attention) by a kernel
that reads nothing, and each launch reads one value its predecessor wrote, so the chain keeps
its data dependencies. Its time over the floor is what launches and dependencies cost a chain
of ideal kernels; the engine's step can come no closer to the floor than that without a
persistent kernel (fewer launches), whatever its tiles.

Timed as one CUDA graph of the whole chain (median of the replays, CUDA events), for:
  one launch    every byte of the step in one streaming kernel (the bytes alone);
  chain         217 launches (36 x [qkv, rope, attention, o_proj, gate_up, down] + LM head),
                with programmatic dependent launch (PDL), each streaming kernel loading its
                weight after `gdc_wait` (as the engine's multi-tile GEMMs do);
  chain, pre    the same, each weight streamed before `gdc_wait` (the best PDL allows: only
                the one value from its predecessor waits);
  chain, no PDL the same 217 launches without PDL;
  GEMMs only    the 145 streaming launches alone (PDL, after the wait);
  empty chain   217 launches that read nothing (PDL), the launch and dependency cost alone.
  persistent    the same 217 phases in one cooperative launch, a grid-wide barrier after each
                phase in place of a launch boundary (an arrival counter, polled with L2 reads),
                each program reading another's value written before the barrier (added
                2026-12-07, session of 15:44 UTC: what the "persistent kernel per layer" that
                docs/benchmarks.md names as the remaining lever could gain at most);
  persistent, pre  the same, each program loading its first block of the next phase before
                the barrier;
  persistent/layer one cooperative launch per layer (6 phases; 37 launches with PDL).
The floor is the step's bytes over the read bandwidth of `torch.sum` measured in the same run
(`engine.bench.floor.measure_read_bandwidth`), as `lockstep bench` computes it.

    python docs/experiments/launch-chain-floor.py --out $OUT/launch-chain.json   # GPU
    TRITON_INTERPRET=1 python docs/experiments/launch-chain-floor.py --check      # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Qwen3-4B (hidden 2560, intermediate 9728, 32 query and 8 kv heads of 128, 36 layers, tied
# 151,936 x 2560 embedding as the LM head), weights [N, K] in bfloat16.
LAYER_WEIGHTS = {"qkv": 6144 * 2560, "o_proj": 2560 * 4096, "gate_up": 19456 * 2560,
                 "down": 2560 * 9728}
LM_HEAD = 151936 * 2560
NUM_LAYERS = 36
LAYER = ("qkv", "rope", "attention", "o_proj", "gate_up", "down")
"""One layer's launches in the engine's unfused-rope batch-1 plan; rope and attention read no
weight."""


@triton.jit
def stream_kernel(w_ptr, per_program, dep_ptr, out_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                  BEFORE_WAIT: tl.constexpr):
    """Sum this program's `per_program` weights (a multiple of BLOCK) and the value its
    predecessor left at dep_ptr[0]; write it to out_ptr[program]."""
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * per_program
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    if PDL and not BEFORE_WAIT:
        tl.extra.cuda.gdc_wait()
    for i in tl.range(0, per_program, BLOCK):
        acc += tl.load(base + i + offs).to(tl.float32)
    if PDL and BEFORE_WAIT:
        tl.extra.cuda.gdc_wait()
    dep = tl.load(dep_ptr)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + pid, tl.sum(acc) + dep)


@triton.jit
def empty_kernel(dep_ptr, out_ptr, PDL: tl.constexpr):
    """Read the value the predecessor left at dep_ptr[0] and write it on (no weight)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    dep = tl.load(dep_ptr)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), dep + 1.0)


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Wait until `target` arrivals at bar_ptr[0] (every program of the grid, this phase).
    The arrival releases this program's stores; the final acquire makes the others' visible."""
    tl.debug_barrier()
    seen = tl.atomic_add(bar_ptr, 1, sem="acq_rel") + 1
    while seen < target:
        seen = tl.load(bar_ptr, volatile=True)
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def persistent_kernel(w_ptr, off_ptr, per_ptr, first, last, scratch_ptr, bar_ptr, dep_ptr,
                      out_ptr, NPROG: tl.constexpr, BLOCK: tl.constexpr, BARRIERS: tl.constexpr,
                      PDL: tl.constexpr, PRE: tl.constexpr, FROM_SCRATCH: tl.constexpr):
    """Phases first..last-1 of a chain: in each, sum this program's `per_ptr[ph]` weights at
    `off_ptr[ph]` plus the carried value, store it to scratch[ph % 2][program], pass a grid
    barrier (`BARRIERS`; in the interpreter each phase is its own launch instead), and carry on
    the value the next program stored (a data dependency between programs, as a layer's GEMM
    needs its predecessor's whole output). out_ptr[program] gets the last value carried."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if FROM_SCRATCH:  # the interpreter's phase-per-launch form
        carry = tl.load(scratch_ptr + ((first + 1) % 2) * NPROG + (pid + 1) % NPROG)
    else:
        carry = tl.load(dep_ptr)
    per = tl.load(per_ptr + first)
    base = w_ptr + tl.load(off_ptr + first) + pid.to(tl.int64) * per
    head = tl.zeros([BLOCK], tl.float32)
    if PRE and per > 0:
        head = tl.load(base + offs).to(tl.float32)
    for ph in range(first, last):
        acc = head
        start = BLOCK if PRE else 0
        if per == 0:
            start = 0
        for i in tl.range(start, per, BLOCK):
            acc += tl.load(base + i + offs).to(tl.float32)
        tl.store(scratch_ptr + (ph % 2) * NPROG + pid, tl.sum(acc) + carry)
        head = tl.zeros([BLOCK], tl.float32)
        if ph + 1 < last:
            per = tl.load(per_ptr + ph + 1)
            base = w_ptr + tl.load(off_ptr + ph + 1) + pid.to(tl.int64) * per
            if PRE and per > 0:  # weights of the next phase do not wait for the barrier
                head = tl.load(base + offs).to(tl.float32)
        if BARRIERS:
            _grid_barrier(bar_ptr, (ph - first + 1) * NPROG)
            carry = tl.load(scratch_ptr + (ph % 2) * NPROG + (pid + 1) % NPROG)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if BARRIERS:
        tl.store(out_ptr + pid, carry)


def run_persistent(chain, w, dep, scratch, bars, out, programs: int, block: int, warps: int,
                   per_layer: bool, pre: bool, tables=None) -> None:
    """The chain's phases in one cooperative launch, or one per layer (PDL between them);
    `bars` holds one zeroed arrival counter per launch (the caller zeroes them per replay)."""
    off, per = tables
    phases = len(chain)
    bounds = ([(i, min(i + len(LAYER), phases)) for i in range(0, phases, len(LAYER))]
              if per_layer else [(0, phases)])
    bars.zero_()
    prev = dep
    for j, (a, b) in enumerate(bounds):
        persistent_kernel[(programs,)](w, off, per, a, b, scratch, bars[j:], prev, out,
                                       NPROG=programs, BLOCK=block, BARRIERS=True,
                                       PDL=per_layer, PRE=pre, FROM_SCRATCH=False,
                                       num_warps=warps, launch_cooperative_grid=True,
                                       **({"launch_pdl": True} if per_layer else {}))
        prev = out


def phase_tables(chain, device):
    """int64 offsets and per-program weights of each phase, on `device`."""
    off = torch.tensor([c[1] for c in chain], dtype=torch.int64, device=device)
    per = torch.tensor([c[2] for c in chain], dtype=torch.int64, device=device)
    return off, per


def plan_chain(layers: int, block: int, programs: int, lm_head: int = LM_HEAD,
               layer_weights: dict[str, int] = LAYER_WEIGHTS) -> list[tuple[str, int, int]]:
    """The chain's launches as (name, offset into the weight buffer, weights a program reads);
    0 weights for a launch that reads none. Each streaming launch reads its weight rounded up to
    programs x block (the buffer holds that slack), so every program reads whole blocks."""
    chain, offset = [], 0

    def stream(name: str, n: int) -> None:
        nonlocal offset
        per = -(-n // (programs * block)) * block
        chain.append((name, offset, per))
        offset += per * programs

    for _ in range(layers):
        for name in LAYER:
            if name in layer_weights:
                stream(name, layer_weights[name])
            else:
                chain.append((name, 0, 0))
    stream("lm_head", lm_head)
    return chain


def buffer_elements(chain, programs: int) -> int:
    return max(off + per * programs for _, off, per in chain)


def run_chain(chain, w, dep, outs, programs: int, block: int, warps: int, pdl: bool,
              before_wait: bool, small_programs: int, keep=lambda name: True) -> None:
    """Launch `chain` once; outs is a ring of per-launch output buffers, each launch reading
    element 0 of the one before."""
    launch = {"launch_pdl": True} if pdl else {}
    prev = dep
    for i, (name, off, per) in enumerate(c for c in chain if keep(c[0])):
        out = outs[i % len(outs)]
        if per:
            stream_kernel[(programs,)](w[off:], per, prev, out, BLOCK=block, PDL=pdl,
                                      BEFORE_WAIT=before_wait, num_warps=warps, **launch)
        else:
            empty_kernel[(small_programs,)](prev, out, PDL=pdl, num_warps=4, **launch)
        prev = out


def check() -> None:
    """Interpreter check: every streaming launch sums exactly its slice (float64 oracle), and
    each launch adds its predecessor's value."""
    block, programs = 64, 3
    sizes = {"qkv": 500, "o_proj": 100, "gate_up": 1000, "down": 300}
    chain = plan_chain(2, block, programs, lm_head=700, layer_weights=sizes)
    w = torch.randn(buffer_elements(chain, programs), dtype=torch.bfloat16)
    dep = torch.tensor([0.5], dtype=torch.float32)
    outs = [torch.zeros(max(programs, 4), dtype=torch.float32) for _ in range(len(chain))]
    for before in (False, True):
        run_chain(chain, w, dep, outs, programs, block, 4, False, before, 4)
        prev = 0.5
        for (name, off, per), out in zip(chain, outs):
            if per:
                want = w[off:off + per * programs].double().view(programs, per).sum(1) + prev
                assert torch.allclose(out[:programs].double(), want, rtol=1e-5, atol=1e-3), name
            else:
                assert out[0].item() == (torch.tensor(prev, dtype=torch.float32) + 1.0).item(), name
            prev = out[0].item()
    off, per = phase_tables(chain, "cpu")
    scratch = torch.zeros(2 * programs, dtype=torch.float32)
    out = torch.zeros(programs, dtype=torch.float32)
    for pre in (False, True):
        carry = [0.5] * programs
        for ph, (name, o, n) in enumerate(chain):
            persistent_kernel[(programs,)](w, off, per, ph, ph + 1, scratch, dep[:1], dep, out,
                                           NPROG=programs, BLOCK=block, BARRIERS=False,
                                           PDL=False, PRE=pre, FROM_SCRATCH=ph > 0)
            sums = (w[o:o + n * programs].double().view(programs, n).sum(1) if n
                    else torch.zeros(programs, dtype=torch.float64))
            want = [float(sums[p]) + carry[p] for p in range(programs)]
            got = scratch[(ph % 2) * programs:(ph % 2 + 1) * programs].double()
            assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5,
                                  atol=1e-3), (pre, name)
            carry = [float(got[(p + 1) % programs]) for p in range(programs)]
    print("launch-chain-floor: interpreter check passed "
          f"({len(chain)} launches, {sum(1 for c in chain if c[2])} streaming)")


def time_graph(fn, repeats: int) -> tuple[float, float]:
    """(median, p90) ms of one replay of a graph that holds `fn()` once."""
    from engine.bench.gemm_sweep import graph_times

    times = graph_times(fn, repeats)
    return times[len(times) // 2], times[int(len(times) * 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="interpreter check only")
    parser.add_argument("--out", default=None, help="JSON of every timing")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.check:
        check()
        return
    from engine.bench.floor import measure_read_bandwidth

    device = torch.device("cuda")
    bandwidth = measure_read_bandwidth(device)
    step_bytes = 2 * (NUM_LAYERS * sum(LAYER_WEIGHTS.values()) + LM_HEAD)
    floor_ms = step_bytes / bandwidth * 1e3
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    result = {"device": torch.cuda.get_device_name(device), "read_TBps": bandwidth / 1e12,
              "step_GB": step_bytes / 1e9, "floor_ms": floor_ms, "settings": []}
    print(f"{result['device']}: read {bandwidth / 1e12:.3f} TB/s, {step_bytes / 1e9:.3f} GB a "
          f"step, floor {floor_ms:.3f} ms")
    dep = torch.zeros(1, dtype=torch.float32, device=device)
    w = None
    for programs_per_sm, block, warps in ((1, 8192, 8), (2, 8192, 8), (4, 4096, 8),
                                          (4, 8192, 8), (8, 4096, 4)):
        programs = programs_per_sm * sms
        chain = plan_chain(NUM_LAYERS, block, programs)
        n = buffer_elements(chain, programs)
        if w is None or w.numel() < n:
            w = None
            torch.cuda.empty_cache()
            w = torch.empty(int(n * 1.02), dtype=torch.bfloat16, device=device).normal_()
        outs = [torch.zeros(programs, dtype=torch.float32, device=device) for _ in range(8)]
        # each launch reads its weight rounded up to whole blocks: the floor of a setting is
        # its own bytes (a few percent above the step's), so every row compares like with like
        read = 2 * sum(per * programs for _, _, per in chain)
        whole = [("all", 0, -(-read // 2 // (programs * block)) * block)]
        assert whole[0][2] * programs <= w.numel()
        row = {"programs": programs, "block": block, "warps": warps, "read_GB": read / 1e9}

        def timed(label, fn):
            med, p90 = time_graph(fn, args.repeats)
            own_floor = read / bandwidth * 1e3
            row[label] = {"ms": med, "p90_ms": p90, "x_floor": med / own_floor}
            print(f"  {programs:4d} programs, block {block:5d}, {warps} warps, {label:14s}"
                  f" {med:7.3f} ms (p90 {p90:.3f}) {med / own_floor:5.2f}x its floor "
                  f"({read / 1e9:.2f} GB)", flush=True)

        common = dict(programs=programs, block=block, warps=warps, small_programs=32)
        timed("one launch", lambda: run_chain(whole, w, dep, outs, pdl=False, before_wait=False,
                                              **common))
        timed("chain", lambda: run_chain(chain, w, dep, outs, pdl=True, before_wait=False,
                                         **common))
        timed("chain, pre", lambda: run_chain(chain, w, dep, outs, pdl=True, before_wait=True,
                                              **common))
        timed("chain, no PDL", lambda: run_chain(chain, w, dep, outs, pdl=False,
                                                 before_wait=False, **common))
        timed("GEMMs only", lambda: run_chain(chain, w, dep, outs, pdl=True, before_wait=False,
                                              keep=lambda name: name not in ("rope", "attention"),
                                              **common))
        med, p90 = time_graph(lambda: run_chain([(c[0], 0, 0) for c in chain], w, dep, outs,
                                                pdl=True, before_wait=False, **common),
                              args.repeats)
        row["empty chain"] = {"ms": med, "p90_ms": p90, "us_per_launch": med * 1e3 / len(chain)}
        print(f"  {programs:4d} programs, block {block:5d}, {warps} warps, empty chain     "
              f"{med:7.3f} ms (p90 {p90:.3f}) {med * 1e3 / len(chain):.2f} us a launch",
              flush=True)
        tables = phase_tables(chain, device)
        scratch = torch.zeros(2 * programs, dtype=torch.float32, device=device)
        bars = torch.zeros(len(chain), dtype=torch.int32, device=device)
        for label, per_layer, pre in (("persistent", False, False),
                                      ("persistent, pre", False, True),
                                      ("persistent/layer", True, False)):
            try:
                timed(label, lambda: run_persistent(chain, w, dep, scratch, bars, outs[0],
                                                    programs, block, warps, per_layer, pre,
                                                    tables))
            except Exception as exc:  # a grid that cannot be co-resident is refused
                row[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"  {programs:4d} programs, {label}: {row[label]['error']}", flush=True)
        result["settings"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
