"""Passes over the logits that the sampler's CUDA path makes, counted on the CPU.

Runs `engine.sampling.sample_batch`'s CUDA path (`_sample_batch_triton`) on CPU tensors, its
Triton kernels in the interpreter (TRITON_INTERPRET=1, set here before triton is imported),
and records every torch op (through a `TorchDispatchMode`) and every Triton kernel launch. A
*pass* is an op or a kernel that reads or writes a tensor of ``rows x vocab`` elements or more
(the batch's logits or a tensor as large): on an H200 each costs about the time to stream
those bytes (155 MB at 256 x 151,936 float32: ~40-80 us). Ops on the rows drawn again under
their top-p cut (those whose first winner left the top-p nucleus: the kernels of
`engine.sampling.ROW_SUBSET_KERNELS`, which load only those rows) are counted apart, with their
row count. Kernel launches and torch ops of any size are counted too (each is one launch on
the GPU). These are op counts, not times: the GPU times are measured by
`lockstep bench --workload throughput`.

    python -m engine.bench.sampler_passes --rows 256 --temperature 0.6 --top-p 0.95

Logits are ``randn * --scale`` (seed 0); one output index and seed per row.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections import Counter

from engine.cli_args import integer, number, shown
from engine.bench.options import MAX_BATCH, BenchArgError, check_range
from lockstep.cli import OneLineParser


VIEWS = frozenset({"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze",
                   "squeeze", "t", "transpose", "permute", "as_strided", "alias", "detach",
                   "lift_fresh", "empty", "empty_strided", "empty_like"})
"""Torch ops that return a view or allocate uninitialised memory: no memory traffic, no
kernel."""
INDEXED = frozenset({"gather", "index", "index_select", "take"})
"""Torch ops that read only the elements they return."""

MAX_VOCAB = 1 << 20
"""Largest --vocab: 1,048,576 logits per row, 6.9x Qwen3's 151,936. At --rows 256 (the most,
`engine.bench.options.MAX_BATCH`: the engine samples at most its largest decode bucket of rows
per step) the logits are 1.07 GB of float32, and the run peaks at about four times that with
top-k and logprobs (0.4 GB of Python and torch besides): larger products ended in an
out-of-memory traceback after the logits were made."""


def count_passes(rows: int, vocab: int, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0, logprobs: bool = False, scale: float = 1.0) -> dict:
    """Run the CUDA sampling path once on CPU tensors and count its passes.

    Needs TRITON_INTERPRET=1 in the environment before triton was first imported (`main`
    sets it).
    Returns:
        dict: ``full`` (list of (op or kernel name, MB read, MB written) over all rows),
        ``partial`` (the same for ops over fewer rows, each with its row count), ``launches``
        (torch ops + kernels, any size), ``kernels`` (Triton launches by name) and ``redrawn``
        (rows drawn again).
    Raises:
        ValueError: rows or vocab < 1.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import engine.sampling as S
    from engine.sampling import BatchParams, SamplingParams

    if rows < 1 or vocab < 1:
        raise ValueError(f"rows = {rows}, vocab = {vocab}: expected both >= 1")
    full_numel = rows * vocab
    log = {"full": [], "partial": [], "launches": 0, "kernels": Counter()}
    paused = [False]

    def big(t):
        return isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] >= vocab

    def record(name, reads, writes):
        if name in VIEWS:  # no memory traffic, no launch
            return
        if name in INDEXED:  # reads only the elements it returns
            reads = [o for o in writes if big(o)]
        log["launches"] += 1
        touched = [t for t in reads + writes if big(t)]
        if not touched:
            return
        mb = lambda ts: sum(t.numel() * t.element_size() for t in ts if big(t)) / 1e6  # noqa
        n = max(t.shape[0] for t in touched)
        entry = (name, round(mb(reads), 1), round(mb(writes), 1))
        if max(t.numel() for t in touched) >= full_numel:
            log["full"].append(entry)
        else:
            log["partial"].append(entry + (n,))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not paused[0]:
                flat = lambda xs: [y for x in xs for y in (x if isinstance(x, (list, tuple))  # noqa
                                                           else [x])]
                outs = flat(out if isinstance(out, (list, tuple)) else [out])
                ins = flat(list(args) + list((kwargs or {}).values()))
                # an in-place op writes its first argument: counted as read and written
                inplace = func._schema.name.endswith("_") or "out" in (kwargs or {})
                record(str(func.overloadpacket.__name__), ins,
                       [o for o in outs if not (inplace and any(o is i for i in ins))]
                       + ([ins[0]] if inplace and ins else []))
            return out

    kernels = [(name, getattr(S, name)) for name in dir(S)
               if name.endswith("_kernel") and hasattr(getattr(S, name), "run")]
    saved = [kernel.run for _, kernel in kernels]
    redo_launches = []  # kernels that load only the redrawn rows: sized once they are known
    for name, kernel in kernels:
            def run(*args, _run=kernel.run, _name=name, **kw):
                paused[0] = True
                try:
                    return _run(*args, **kw)
                finally:
                    paused[0] = False
                    log["kernels"][_name] += 1
                    if _name in S.ROW_SUBSET_KERNELS:
                        log["launches"] += 1
                        redo_launches.append((_name, any(big(a) for a in args)))
                    else:
                        record(_name, [a for a in args if big(a)], [])
            kernel.run = run

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * scale
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    bp = BatchParams.from_params([p] * rows, list(range(rows)), [3] * rows)
    stats = {"redrawn": 0}
    try:
        with Ops():
            with warnings.catch_warnings():
                # The interpreter's numpy warns where the Gumbel noise takes log(0): a
                # uniform whose Philox word has its top 24 bits set rounds to 1.0 in float32
                # (`engine.sampling.philox_uniform`), about once per 2**24 entries (twice at
                # 256 x 151,936). The GPU's logf gives the same -inf without a word, and no
                # pass count depends on the value; any other warning still shows.
                warnings.filterwarnings("ignore", "divide by zero encountered in log",
                                        RuntimeWarning, r"triton\.runtime\.interpreter")
                tokens = S._sample_batch_triton(logits, bp, stats)
            if logprobs:
                chosen = logits.gather(1, tokens.long().clamp(min=0)[:, None])[:, 0]
                chosen - torch.logsumexp(logits, dim=-1)
    finally:
        for (_, kernel), original in zip(kernels, saved):
            kernel.run = original
    n = stats["redrawn"]
    for name, reads_logits in redo_launches:
        mb = n * vocab * logits.element_size() / 1e6 if reads_logits else 0.0
        log["partial"].append((name, round(mb, 1), 0.0, n))
    log["redrawn"] = n
    return log


MAX_SCALE = 1e30
"""Largest --scale: randn (|x| < 10 in practice) times it stays well inside float32 (3.4e38),
so max - logit and exp of it are finite; 1e308 made every logit inf and the passes NaN."""


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: every option with its help and default."""
    ap = OneLineParser(prog="python -m engine.bench.sampler_passes", error_name="sampler_passes",
                       description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=integer, default=256,
                    help=f"rows of the batch, each sampled once (1..{MAX_BATCH}; default 256)")
    ap.add_argument("--vocab", type=integer, default=151936,
                    help=f"logits per row (1..{MAX_VOCAB}; default 151936, Qwen3's vocabulary)")
    ap.add_argument("--temperature", type=number, default=0.6,
                    help="every row's temperature (default 0.6)")
    ap.add_argument("--top-p", type=number, default=0.95,
                    help="every row's top-p; 1 = off (default 0.95)")
    ap.add_argument("--top-k", type=integer, default=0,
                    help="every row's top-k; 0 = off (default 0)")
    ap.add_argument("--min-p", type=number, default=0.0,
                    help="every row's min-p; 0 = off (default 0)")
    ap.add_argument("--scale", type=number, default=1.0,
                    help="the logits are randn times this (default 1)")
    ap.add_argument("--logprobs", action="store_true",
                    help="also return each sampled token's logprob")
    return ap


def main(argv=None) -> int:
    """CLI: print the passes of one sampling call (see the module docstring). Returns 0, or 2
    after one error line naming the bad value (rows outside 1..MAX_BATCH or vocab outside
    1..MAX_VOCAB, a scale that is not finite, sampling settings
    `engine.sampling.SamplingParams.validate` refuses) before any logits are made."""
    a = build_parser().parse_args(argv)
    problem = None
    try:
        check_range("--rows", a.rows, 1, MAX_BATCH)
        check_range("--vocab", a.vocab, 1, MAX_VOCAB)
    except BenchArgError as exc:
        problem = str(exc)
    if problem is None and not abs(a.scale) <= MAX_SCALE:
        problem = (f"--scale {shown(a.scale)}: expected a finite number of at most {MAX_SCALE:g} in "
                   "size (float32 logits of randn times it, with room for their spread)")
    too_late = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    if problem is None:
        if not too_late:
            os.environ["TRITON_INTERPRET"] = "1"
        from engine.errors import RequestError
        from engine.sampling import SamplingParams

        try:  # the engine's own checks and words, as `lockstep generate` gives them
            SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                           min_p=a.min_p).validate(a.vocab)
        except RequestError as exc:
            problem = str(exc)
    if problem is None and too_late:
        problem = "triton was imported before TRITON_INTERPRET=1 could be set"
    if problem is not None:
        print(f"sampler_passes: error: {problem}", file=sys.stderr)
        return 2
    log = count_passes(a.rows, a.vocab, a.temperature, a.top_p, a.top_k, a.min_p, a.logprobs,
                       a.scale)
    print(f"sampler CUDA path on [{a.rows}, {a.vocab}] float32 (T {a.temperature}, top-p "
          f"{a.top_p}, top-k {a.top_k}, min-p {a.min_p}{', logprobs' if a.logprobs else ''})")
    for name, r, w in log["full"]:
        print(f"  pass  {name:<24} read {r:>7.1f} MB  write {w:>7.1f} MB")
    for name, r, w, n in log["partial"]:
        print(f"  redo  {name:<24} read {r:>7.1f} MB  write {w:>7.1f} MB  ({n} rows)")
    mb = sum(r + w for _, r, w in log["full"])
    print(f"full passes: {len(log['full'])} ({mb:.0f} MB); ops on the {log['redrawn']} redrawn "
          f"rows: {len(log['partial'])}; launches: {log['launches']} "
          f"(Triton: {dict(log['kernels'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
