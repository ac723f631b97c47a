"""Known-bad variants whose route to failure was measured on hardware (docs/hazard-probes.md,
docs/fused-sweep-on-hardware.md), not only taken from public reports.

`fused-sweep-graph-context`: the fused sweep as a capture written with `torch.cuda.graph()`
runs it. That context manager frees the caching allocator's cached blocks (`empty_cache`)
before every capture, and on two H200s driven by one process a free waits, holding the
driver lock, until the devices that share its NCCL communicator are idle. With rank 0's
launched all-reduce spinning for its peer, the peer's free never returns: the sweep hung on
the hardware (`hazard_probe_nccl.py --case fused-sweep-free-*`), while the same sweep with no
free completed. So this variant deadlocks under the measured H2 calls as well as under the
assumed ones (`--h2-calls`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.backend import Op
from sim.common import DONE
from sim.variants import CaptureAndLaunch, FusedSweepController, FusedSweepWorker, Variant, register


@dataclass(frozen=True)
class ReleaseCachedMemory(Op):
    """Free the caching allocator's unused blocks (`torch.cuda.empty_cache`): a driver free."""

    name: ClassVar[str] = "release_cached_memory"
    frees: ClassVar[bool] = True


def _sim_release_cached(backend, r, host, op, probe):
    """A free of device memory: takes the driver lock (H1) and waits for quiescence under the
    measured H2 calls; the freed blocks held nothing the model tracks."""
    status = backend.locked(r, host, quiesce=False, probe=probe, frees=True)
    if status != DONE or probe:
        return status
    return backend.done(host)


class GraphContextSweepWorker(FusedSweepWorker):
    """The fused sweep, each capture preceded by the free that `torch.cuda.graph()` makes."""

    def ops_for_other(self, command):
        ops = super().ops_for_other(command)
        if isinstance(command, CaptureAndLaunch):
            return [ReleaseCachedMemory()] + ops
        return ops


register(Variant(
    name="fused-sweep-graph-context",
    summary="the fused sweep (capture, instantiate and launch per bucket, no barrier) written "
            "with torch.cuda.graph(), which frees cached device memory before every capture",
    source="pegainfer TP pre-capture PR (fixes #498); torch.cuda.graph calls empty_cache per "
           "capture (pytorch/pytorch torch/cuda/graphs.py); measured: the sweep hung on two "
           "H200s in one process, docs/fused-sweep-on-hardware.md",
    expected={"shared": "deadlock", "per-rank": "invariant:I4"},
    remedy="Capture every bucket, instantiate and upload it on every rank, barrier, and only "
           "then launch (I4): no free or module load can then wait on a collective that spins "
           "for a peer still capturing.",
    controller_cls=FusedSweepController, worker_cls=GraphContextSweepWorker,
    sim_ops={ReleaseCachedMemory: _sim_release_cached}))
