"""`lockstep bench`: time the engine's decode step (graphs and eager) against the HBM floor
and, with `--compare hf`, HF transformers StaticCache + torch.compile, in one run on one GPU
(or `-tp N` GPUs). `--workload throughput` instead serves workload W end to end through
`LLM.generate` (greedy and sampled) and, with `--compare hf`, through HF continuous batching
(`engine.bench.serving`).

Only argparse and the pure-Python option checks run at import time and before any GPU work:
a bad argument prints one line naming it and exits with status 2. torch is imported in `run`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shlex
import shutil
import sys

from engine.bench.flags import apply_workload_flags
from engine.bench.options import (MAX_STEPS, BenchArgError, BenchOptions, max_positions,
                                  parse_int_list, validate)
from engine.cli_args import integer, number, seed as seed_arg, shown
from engine.bench.fits import check_fits, check_serving_fits
from engine.errors import ModelDirError, RankError, cuda_missing
from engine.presets import PRESETS


def add_parser(subparsers, name: str) -> argparse.ArgumentParser:
    """Register the subcommand `name` on `subparsers`; sets `run` as its handler."""
    p = subparsers.add_parser(name, help="benchmark decode steps (graphs, eager, HBM floor, HF)",
                              description=__doc__.splitlines()[0],
                              epilog="A repeated option keeps its last value.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=list(PRESETS),
                     help="random weights of a named Qwen3 shape, written to a temp dir")
    src.add_argument("--model", help="HF-layout Qwen3 directory")
    p.add_argument("--batch-sizes", default=None,
                   help="decode: batch sizes, comma-separated (default 1,8,64,256)")
    p.add_argument("--context-lens", default=None,
                   help="decode: cached tokens per row, comma-separated (default 128)")
    p.add_argument("--tensor-parallel-size", "-tp", type=integer, default=1,
                   help="GPUs (default 1)")
    p.add_argument("--steps", type=integer, default=None,
                   help=f"decode: timed steps per point, 1..{MAX_STEPS} (default 200)")
    p.add_argument("--warmup", type=integer, default=None,
                   help=f"decode: untimed steps first, 0..{MAX_STEPS} (default 20)")
    p.add_argument("--no-graphs", action="store_true", default=None,
                   help="decode: skip the graph-replay path")
    p.add_argument("--no-eager", action="store_true", default=None,
                   help="decode: skip the eager path")
    p.add_argument("--no-capture-sweep", action="store_true", default=None,
                   help="decode: skip timing the capture of all 36 buckets")
    p.add_argument("--decode-gemm", choices=["auto", "cublas"], default=None,
                   help="decode: auto: Triton skinny GEMM where "
                        "engine/kernels/skinny_gemm_table.json measured it faster (default); "
                        "cublas: cuBLAS only (the A/B baseline)")
    p.add_argument("--no-profile", action="store_true", default=None,
                   help="decode: skip the per-point kernel profile (kernels per step, weight-read "
                        "bandwidth of each GEMM)")
    p.add_argument("--compare", choices=["hf"], default=None,
                   help="hf: also time HF StaticCache + torch.compile(mode='reduce-overhead') "
                        "(default: no comparison)")
    p.add_argument("--hf-batch-sizes", default=None,
                   help="--compare hf: its batch sizes (default: --batch-sizes); compiling "
                        "takes ~40-90 s per shape")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights, activations and KV cache dtype (default bfloat16)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="weight and input seed, an integer in [0, 2**64) (default 0)")
    p.add_argument("--workload", choices=["decode", "throughput"], default="decode",
                   help="decode: time decode steps (default); throughput: serve workload W "
                        "(N requests, prompt and output lengths uniform in [100, 1024]) end to "
                        "end")
    p.add_argument("--num-requests", "-n", type=integer, default=None,
                   help=f"throughput: requests in workload W, 1..{MAX_REQUESTS} (default 256)")
    p.add_argument("--max-batch", type=integer, default=None,
                   help="throughput: decode slots (default 256)")
    p.add_argument("--max-model-len", type=integer, default=None,
                   help="throughput: longest prompt + output (default 2048)")
    p.add_argument("--max-prefill-tokens", type=integer, default=None,
                   help="throughput: prompt tokens prefilled per step (default 8192)")
    p.add_argument("--temperature", type=number, default=None,
                   help="throughput: temperature of the sampled run (default 0.6)")
    p.add_argument("--top-p", type=number, default=None,
                   help="throughput: top-p of the sampled run (default 0.95)")
    p.add_argument("--no-decode-overlap", action="store_true", default=None,
                   help="--workload throughput: step-locked scheduling (default: overlapped "
                        "scheduling at -tp 1, each step built while the previous one runs)")
    p.add_argument("--json", dest="json_path", default=None,
                   help="write results as JSON to this file (default: table only)")
    p.add_argument("--plot", dest="plot_path", default=None,
                   help="PNG plot path (default: the --json path with .png; needs matplotlib)")
    p.set_defaults(run=run)
    return p


def implied_plot_path(json_path: str) -> str:
    """The plot written beside ``--json`` when no ``--plot`` is given: its suffix replaced by
    .png (``r.json`` -> ``r.png``), or .png appended where that would be the JSON file itself
    (``r.png``). Old behaviour: the text after the path's last dot was cut, so ``--json
    r.png`` plotted over the JSON and ``--json out.d/r`` plotted to ``out.png``, outside
    out.d."""
    from pathlib import Path

    plot = str(Path(json_path).with_suffix(".png")) if Path(json_path).name else json_path
    return plot if plot != json_path else json_path + ".png"


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Build BenchOptions from parsed arguments once `apply_workload_flags` has filled in the
    defaults. Raises BenchArgError (bad lists)."""
    plot = args.plot_path
    if plot is None and args.json_path:
        plot = implied_plot_path(args.json_path)
    return BenchOptions(
        preset=args.preset, model=args.model,
        batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"),
        context_lens=parse_int_list(args.context_lens, "--context-lens"),
        tensor_parallel_size=args.tensor_parallel_size, steps=args.steps, warmup=args.warmup,
        graphs=not args.no_graphs, eager=not args.no_eager,
        capture_sweep=not args.no_capture_sweep and not args.no_graphs, compare=args.compare,
        hf_batch_sizes=(parse_int_list(args.hf_batch_sizes, "--hf-batch-sizes")
                        if args.hf_batch_sizes is not None else None),  # '' is refused too
        json_path=args.json_path, plot_path=plot, dtype=args.dtype, seed=args.seed,
        decode_gemm=args.decode_gemm, profile=not args.no_profile)


def _error(msg: str) -> int:
    print(f"lockstep bench: error: {msg}", file=sys.stderr)
    return 2


MAX_REQUESTS = 65536
"""The most requests (``-n``) of workload W: each holds up to 2048 tokens of prompt and output,
so this many is already hours of serving and a token list of over 10**8 ids on the host."""


def check_throughput_args(args: argparse.Namespace, cfg: dict | None = None) -> None:
    """The throughput workload's own checks (before torch); ``cfg``, the model's config dict
    (`engine.bench.options.validate`), bounds ``--max-model-len`` by its
    max_position_embeddings. Raises BenchArgError."""
    if not 1 <= args.num_requests <= MAX_REQUESTS:
        raise BenchArgError(f"--num-requests {shown(args.num_requests)}: expected 1..{MAX_REQUESTS}")
    if not 1 <= args.max_batch <= 256:
        raise BenchArgError(f"--max-batch {shown(args.max_batch)}: expected 1..256")
    if args.max_model_len < 2048:
        raise BenchArgError(f"--max-model-len {shown(args.max_model_len)}: workload W needs 2048 "
                            "(prompts and outputs up to 1024 tokens each)")
    max_pos = max_positions(cfg or {})
    if max_pos and args.max_model_len > max_pos:
        raise BenchArgError(f"--max-model-len {shown(args.max_model_len)}: the model holds at most "
                            f"{max_pos} tokens (max_position_embeddings {max_pos})")
    if args.max_prefill_tokens < 1:
        raise BenchArgError(f"--max-prefill-tokens {shown(args.max_prefill_tokens)}: expected >= 1")
    if not (args.temperature > 0 and args.temperature < float("inf")):
        raise BenchArgError(f"--temperature {shown(args.temperature)}: expected a finite number > 0 "
                            "(the sampled pass's; the greedy passes always run)")
    if not 0 < args.top_p <= 1:
        raise BenchArgError(f"--top-p {shown(args.top_p)}: expected a number in (0, 1]")


def _gpu_problem(tensor_parallel_size: int) -> str | None:
    """Why this machine cannot run the bench (no CUDA, too few GPUs), or None."""
    import torch

    problem = cuda_missing()
    if problem is not None:
        return problem
    if torch.cuda.device_count() < tensor_parallel_size:
        return (f"--tensor-parallel-size {shown(tensor_parallel_size)}: only "
                f"{torch.cuda.device_count()} GPU(s) visible")
    return None


def _shape(opts) -> dict:
    """The model's config.json fields: the preset's, or read from ``--model``."""
    if opts.preset is not None:
        return PRESETS[opts.preset]
    from engine.config import load_model_config

    m = load_model_config(opts.model)
    return dict(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_q_heads, num_key_value_heads=m.num_kv_heads,
                head_dim=m.head_dim, intermediate_size=m.intermediate_size,
                vocab_size=m.vocab_size, tie_word_embeddings=m.tie_word_embeddings)


def _smallest_gpu_bytes(tensor_parallel_size: int) -> int:
    """Total memory of the smallest of the GPUs the ranks take (cuda:0 .. cuda:tp-1)."""
    import torch

    return min(torch.cuda.get_device_properties(r).total_memory
               for r in range(tensor_parallel_size))


@contextlib.contextmanager
def _model_dir(opts):
    """The model directory to bench: ``--model``, or a preset's random weights written to a
    temporary directory (removed afterwards)."""
    if opts.preset is None:
        yield opts.model
        return
    import time

    from engine.bench.modeldir import write_random_model_fast

    t0 = time.perf_counter()
    tmp = str(write_random_model_fast(opts.preset, opts.dtype, opts.seed))
    print(f"bench: wrote random {opts.preset} weights to {tmp} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    """Check the arguments, measure, print the table; returns the exit status."""
    try:
        apply_workload_flags(args)
    except BenchArgError as exc:
        return _error(str(exc))
    if args.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        # asked for by name: refused before the run (a plot implied by --json only notes it)
        return _error(f"--plot {args.plot_path}: needs matplotlib, which is not installed "
                      "(pip install matplotlib)")
    if args.workload == "throughput":
        return run_throughput(args)
    try:
        opts = options_from_args(args)
        validate(opts)
    except BenchArgError as exc:
        return _error(str(exc))
    problem = _gpu_problem(opts.tensor_parallel_size)
    if problem:
        return _error(problem)
    try:
        check_fits(_shape(opts), opts, _smallest_gpu_bytes(opts.tensor_parallel_size))
    except (BenchArgError, ModelDirError) as exc:
        return _error(str(exc))
    from engine.bench.decode import measure_engine
    from engine.bench.report import build_document, format_table, write_json, write_plot

    with _model_dir(opts) as model_dir:
        ranks = measure_engine(opts, model_dir)
        hf = []
        if opts.compare == "hf":
            from engine.bench.hf import measure_hf

            for ctx in opts.context_lens:
                hf += measure_hf(model_dir, opts.hf_batch_sizes or opts.batch_sizes, ctx,
                                 opts.dtype, opts.steps, opts.warmup, opts.seed)
    command = "lockstep bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
        if len(sys.argv) > 2 else "lockstep bench"
    doc = build_document(opts, ranks, hf, command)
    print(format_table(doc), flush=True)
    return _write_outputs(opts, lambda path: write_json(doc, path),
                          lambda path: write_plot(doc, path))


def run_throughput(args: argparse.Namespace) -> int:
    """`--workload throughput`: check, serve workload W, print the table; exit status."""
    try:
        opts = options_from_args(args)
        cfg = validate(opts)
        check_throughput_args(args, cfg)
    except BenchArgError as exc:
        return _error(str(exc))
    problem = _gpu_problem(opts.tensor_parallel_size)
    if problem:
        return _error(problem)
    model = f"--preset {opts.preset}" if opts.preset is not None else f"--model {opts.model}"
    try:
        check_serving_fits(_shape(opts), opts.tensor_parallel_size, opts.dtype,
                           args.max_model_len, _smallest_gpu_bytes(opts.tensor_parallel_size),
                           model)
    except (BenchArgError, ModelDirError) as exc:
        return _error(str(exc))
    import json

    from engine.bench.serving import format_table, measure_throughput, write_plot

    try:
        with _model_dir(opts) as model_dir:
            doc = measure_throughput(
                model_dir, opts.preset or opts.model, args.num_requests, opts.seed, opts.dtype,
                args.max_batch, args.max_model_len, args.temperature, args.top_p,
                opts.compare == "hf", args.max_prefill_tokens, opts.tensor_parallel_size,
                False if args.no_decode_overlap else None)
    except ValueError as exc:  # settings the engine refused (a memory fit with no room)
        return _error(str(exc))
    except RankError as exc:
        print(f"lockstep bench: error: {exc}", file=sys.stderr)
        return 1
    doc["command"] = "lockstep bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    print(format_table(doc), flush=True)

    def write_doc(path):
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    return _write_outputs(opts, write_doc, lambda path: write_plot(doc, path))


def _write_outputs(opts, write_doc, write_plot) -> int:
    """Write the --json document and the plot once the table is printed; the exit status: 0,
    or 2 with one line naming the output that could not be written (the table above stands).
    ``write_plot(path)`` returns False without matplotlib."""
    drawn = True
    for flag, path, write in (("--json", opts.json_path, write_doc),
                              ("--plot", opts.plot_path, write_plot)):
        if not path:
            continue
        try:
            result = write(path)
        except OSError as exc:
            return _error(f"{flag} {path!r}: cannot write it: {exc.strerror or exc}")
        if flag == "--plot":
            drawn = result
    if not drawn:
        print("bench: matplotlib not installed; no plot written", file=sys.stderr)
    return 0
