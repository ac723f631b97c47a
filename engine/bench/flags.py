"""Which `lockstep bench` flags apply to which workload, checked before any GPU work.

argparse leaves each workload's own flags None, so that a flag given (even at its default
value) can be told from one left out; `apply_workload_flags` refuses a flag the run would
ignore and then fills in the defaults.
"""

from __future__ import annotations

import argparse

from engine.bench.options import BenchArgError
from engine.cli_args import shown

DECODE_ONLY = {"batch_sizes": "1,8,64,256", "context_lens": "128", "steps": 200, "warmup": 20,
               "no_graphs": False, "no_eager": False, "no_capture_sweep": False,
               "decode_gemm": "auto", "no_profile": False, "hf_batch_sizes": None}
"""Flags (argparse dest: default) that `--workload decode` uses and `throughput` ignores."""

THROUGHPUT_ONLY = {"num_requests": 256, "max_batch": 256, "max_model_len": 2048,
                   "max_prefill_tokens": 8192, "temperature": 0.6, "top_p": 0.95,
                   "no_decode_overlap": False}
"""Flags (argparse dest: default) that `--workload throughput` uses and `decode` ignores."""


def _shown(dest: str, value) -> str:
    flag = "--" + dest.replace("_", "-")
    if value is True:
        return flag
    return f"{flag} {value!r}" if isinstance(value, str) else f"{flag} {shown(value)}"


def apply_workload_flags(args: argparse.Namespace) -> None:
    """Refuse a flag that the chosen ``--workload`` (or the absence of ``--compare hf``) would
    silently ignore; then set every flag left out to its default.

    Raises:
        BenchArgError: ``FLAG VALUE applies to --workload W only ...``, naming the flag.
    """
    unused, owner = ((THROUGHPUT_ONLY, "throughput") if args.workload == "decode"
                     else (DECODE_ONLY, "decode"))
    for dest in unused:
        value = getattr(args, dest)
        if value is not None:
            raise BenchArgError(f"{_shown(dest, value)} applies to --workload {owner} only "
                                f"(this run is --workload {args.workload}); drop it")
    if args.hf_batch_sizes is not None and args.compare != "hf":
        raise BenchArgError(f"{_shown('hf_batch_sizes', args.hf_batch_sizes)} applies with "
                            "--compare hf only; add --compare hf or drop it")
    for dest, default in {**DECODE_ONLY, **THROUGHPUT_ONLY}.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
