"""Kernel-level profile of one decode step (torch profiler over graph replays).

    PYTHONPATH=. python3 -m engine.bench.profile --preset qwen3-4b --batch 1

prints the kernels of the captured decode step with their share of device time, and the
number of launches per step, so the gap to the HBM floor can be attributed. With
`--timeline` it prints instead how far each kernel moves the end of the step
(`kernel_profile.step_timeline`): with PDL the kernels overlap, and summed device time
overstates the step.
"""

from __future__ import annotations

import argparse
import shutil
import sys


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: every option with its help and default."""
    from engine.bench.options import MAX_BATCH
    from engine.cli_args import integer
    from engine.presets import PRESETS

    from lockstep.cli import OneLineParser

    p = OneLineParser(prog="python -m engine.bench.profile", error_name="profile",
                      description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True,
                   help=f"random weights of a preset ({', '.join(PRESETS)})")
    p.add_argument("--batch", type=integer, default=1,
                   help=f"decode rows of the captured step, its graph's bucket (1..{MAX_BATCH}; "
                        "default 1)")
    p.add_argument("--context", type=integer, default=128,
                   help="tokens cached per row (default 128)")
    p.add_argument("--steps", type=integer, default=20,
                   help="graph replays profiled, after 5 unprofiled ones (default 20)")
    p.add_argument("--rows", type=integer, default=25,
                   help="kernels to list, by device time or with --timeline by exposed time "
                        "(default 25)")
    p.add_argument("--timeline", action="store_true",
                   help="print each kernel's exposed time (its end minus the previous "
                        "kernel's end) instead of its device time: with PDL the kernels "
                        "overlap")
    return p


def main(argv=None) -> int:
    """Profile `--steps` graph replays of one bucket; print the top kernels by device time."""
    args = build_parser().parse_args(argv)
    from engine.presets import PRESETS

    if args.preset not in PRESETS:
        print(f"profile: error: --preset {args.preset!r}: choose from "
              f"{', '.join(sorted(PRESETS))}", file=sys.stderr)
        return 2
    from engine.bench.options import (MAX_BATCH, BenchArgError, check_range, check_switches,
                                      cuda_missing)

    try:
        check_range("--batch", args.batch, 1, MAX_BATCH)
        for flag, value in (("--context", args.context), ("--steps", args.steps),
                            ("--rows", args.rows)):
            check_range(flag, value, 1)
        check_switches()
    except BenchArgError as exc:
        print(f"profile: error: {exc}", file=sys.stderr)
        return 2

    if cuda_missing("profile"):
        return 2

    import torch

    from torch.profiler import ProfilerActivity, profile

    from engine.bench.decode import engine_settings
    from engine.bench.modeldir import write_random_model_fast
    from engine.bench.options import BenchOptions
    from engine.executor import RankExecutor
    from engine.parallel import SINGLE
    from protocol.commands import DecodeRow, Step
    from protocol.keys import GraphKey

    torch.cuda.set_device(0)
    d = write_random_model_fast(args.preset)
    try:
        opts = BenchOptions(preset=args.preset, batch_sizes=[args.batch],
                            context_lens=[args.context], capture_sweep=False)
        ex = RankExecutor(engine_settings(d, opts, 1), SINGLE)
        ex.load_model()
        ex.allocate_kv(ex.pages_needed())
        ex.assign_pages_per_slot()
        for layer in range(ex.cfg.num_layers):
            ex.kv.k[layer].normal_()
            ex.kv.v[layer].normal_()
        key = GraphKey(args.batch)
        ex.graphs.on_stream(lambda: ex.decode_forward(args.batch))
        ex.record(key)
        ex.instantiate(key)
        ex.upload(key)
        step = Step(seq=0, rows=tuple(DecodeRow(r, r, 7 + r, args.context - 1)
                                      for r in range(args.batch)), bucket=args.batch)
        for _ in range(5):
            ex.prepare_replay(step)
            ex.launch(key)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                ex.prepare_replay(step)
                ex.launch(key)
            torch.cuda.synchronize()
        if args.timeline:
            print_timeline(prof.events(), args, ex.cfg.num_layers)
            return 0
        rows = {}
        for e in prof.events():
            if e.device_type.name != "CUDA":
                continue
            t = rows.setdefault(e.name, [0, 0.0])
            t[0] += 1
            t[1] += e.device_time
        total = sum(t[1] for t in rows.values())
        launches = sum(t[0] for t in rows.values()) / args.steps
        print(f"{args.preset} batch {args.batch} ctx {args.context}: {launches:.0f} kernels per "
              f"step, {total / args.steps / 1e3:.3f} ms device time per step (sum of kernels)")
        for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:args.rows]:
            print(f"{us / args.steps:9.1f} us/step {n / args.steps:6.1f}x  "
                  f"{100 * us / total:5.1f}%  {name[:110]}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


def layer_labels(names: list[str], num_layers: int) -> list[str]:
    """Each kernel name of one step with its call index within the layer appended when the
    kernel runs a multiple of `num_layers` times per step (the skinny GEMM's four calls per
    layer become "name[0]".."name[3]": QKV, o_proj, gate_up, down). A kernel whose count is
    not such a multiple (it also runs outside the layers) keeps its bare name on every call.

    Args:
        names: kernel names of one step in launch order. num_layers: the model's layers.
    Raises:
        ValueError: num_layers < 1.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers = {num_layers}, expected >= 1")
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for n in names:
        per_layer = counts[n] // num_layers if counts[n] % num_layers == 0 else 0
        i = seen.get(n, 0)
        seen[n] = i + 1
        out.append(f"{n}[{i % per_layer}]" if per_layer > 1 else n)
    return out


def replay_timeline(events, steps: int, num_layers: int) -> dict:
    """`kernel_profile.step_timeline` of `steps` profiled replays, each kernel labelled by
    `layer_labels` (the skinny GEMM's calls of a layer apart).

    Args:
        events: the profiler's events (kernels are picked out by `is_kernel_event`).
    Raises:
        ValueError: the kernels do not split into `steps` equal steps (the profiler lost
            some), or those steps launch different kernels.
    """
    from engine.bench.kernel_profile import is_kernel_event, step_timeline

    kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in events
                      if is_kernel_event(e)), key=lambda k: k[1])
    if len(kernels) % steps:
        raise ValueError(f"{len(kernels)} kernels over {steps} replays: the profiler lost "
                         "some; run again")
    per_step = len(kernels) // steps
    labelled = []
    for s in range(steps):
        step = kernels[s * per_step:(s + 1) * per_step]
        names = layer_labels([k[0] for k in step], num_layers)
        labelled += [(n, k[1], k[2]) for n, k in zip(names, step)]
    return step_timeline(labelled, steps)


def print_timeline(events, args, num_layers: int) -> None:
    """Print `replay_timeline` of the profiled replays."""
    try:
        t = replay_timeline(events, args.steps, num_layers)
    except ValueError as exc:
        raise SystemExit(f"profile: {exc}") from None
    print(f"{args.preset} batch {args.batch} ctx {args.context}: {t['launches']} kernels per "
          f"step, span {t['span_us']:.1f} us (median of {args.steps} replays)")
    print(f"{'exposed us':>10} {'busy us':>9} {'overlap us':>10} {'calls':>5}  kernel")
    for r in t["rows"][:args.rows]:
        print(f"{r['exposed_us']:10.1f} {r['busy_us']:9.1f} {r['overlap_us']:10.1f} "
              f"{r['calls']:5d}  {r['name'][:90]}")


if __name__ == "__main__":
    raise SystemExit(main())
