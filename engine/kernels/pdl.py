"""Programmatic dependent launch (PDL) for the engine's Triton kernels on Hopper.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
running; it executes `griddepcontrol.wait` (`tl.extra.cuda.gdc_wait`), which returns once the
previous grid has completed and its writes are visible, before it touches anything that grid
writes (the rule below says what may come before). So ordering is unchanged and the launch
latency between dependent kernels overlaps (the decode step is a chain of ~180 small
kernels). Every kernel that takes a `PDL` flag calls `gdc_wait` before
`gdc_launch_dependents`. Stream capture records the
dependency as a programmatic graph edge, so replays keep it. CUDA Programming Guide,
"Programmatic Dependent Launch and Synchronization".

Reading before the wait. A kernel may load, before `gdc_wait`, only what the launch just before
it does not write: weights and the cos/sin tables (written at load, not during steps; a caller
that writes a weight must not make that the launch right before the GEMM) and what was written
two or more launches back (the step's positions and slots, the page table). Every kernel here calls `gdc_wait` before `gdc_launch_dependents`,
and a kernel launched without PDL starts only after its predecessor completes, so by the time
a kernel's programs start, every launch before its immediate predecessor has completed and
flushed its writes. Loads of what changes between steps (positions, slots, page-table entries)
go through L2 (`cache_modifier=".cg"`), which is coherent; only what the immediate predecessor
writes must wait. `sim.launch_chain` searches a real step's kernels for a break of this rule
(`tests/engine/test_pdl_order.py`). `skinny_gemm` loads a one-tile program's
weights this way, and `fused.qk_norm_rope_kv` (and the skinny GEMM's rope epilogue, which
replaces it) its positions, slots, page-table entries, norm weights and cos/sin rows (H200, 2026-12-02, Qwen3-0.6B graph step at batch 1 / 8: 0.878 ->
0.845 ms and 0.900 -> 0.860 ms, docs/benchmarks.md); decode attention its row order, slots
and lengths (2026-12-03: 0.787 -> 0.777 ms at batch 1).

Only for launches of at most MAX_ROWS rows (decode buckets up to 64): measured on the H200,
PDL made Qwen3-0.6B's step faster at 1-64 rows (batch 1: 1.195 -> 1.122 ms in one run) and
slower at 256 (2.662 -> 2.827 ms), where the kernels run several waves of programs and the
early-scheduled dependents take slots from the last wave; prefill launches are thousands of
rows. Off on the CPU, in Triton's interpreter, below compute capability 9.0, and when the
environment sets LOCKSTEP_PDL=0 (the A/B baseline of the benchmarks; "1" or unset: on where
the rest allows, anything else an error, `engine.env`; `EngineConfig.create` and the bench
tools check it before any rank starts or kernel runs).
"""

from __future__ import annotations

import functools
import os

import torch

from engine.env import switch


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


MAX_ROWS = 64


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel whose rows are `t`'s first dimension (tokens or batch rows), launched
    on `t`'s device, uses PDL.

    Raises:
        ParallelConfigError: LOCKSTEP_PDL set to other than 0 or 1 (`engine.env.switch`).
    """
    if not switch("LOCKSTEP_PDL"):
        return False
    if not t.is_cuda or t.shape[0] > MAX_ROWS or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_supports(t.device.index if t.device.index is not None
                            else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """Extra keyword arguments of a Triton launch: {"launch_pdl": True} when `pdl`."""
    return {"launch_pdl": True} if pdl else {}


def pdl_launch(t: torch.Tensor) -> dict:
    """Keyword arguments of a Triton launch whose kernel takes a `PDL` flag: the flag and,
    when on, ``launch_pdl`` (one `use_pdl` decision for both)."""
    pdl = use_pdl(t)
    return {"PDL": pdl, **launch_options(pdl)}
