"""Variants of communicators and groups: what needs the simulator's named communicators,
per-communicator sequence numbers and hazard H9 (docs/hazards.md) to be told apart.

``overlap-one-communicator`` and ``overlap-two-communicators`` split each captured decode graph
into two micro-batches whose all-reduces overlap on two streams (dual-batch overlap). Issued on
one communicator, the two in-graph all-reduces are in flight at once and wedge on every rank,
although every rank issues them in the same order; on two communicators, one per stream, they
complete independently and the design is clean.

Registered next to `sim.variants` (which imports this module), so `lockstep check` runs them by
default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.backend import LaunchGraph, Op, Record
from protocol.commands import Launch, Step
from protocol.controller import Controller
from protocol.keys import GraphKey
from protocol.worker import Worker
from sim.common import DONE, Signature
from sim.comms import Communicator
from sim.faults import FaultFamily
from sim.scenario import Scenario, WorkloadDraw
from sim.variants import Variant, register

# -- overlap-one-communicator / overlap-two-communicators -------------------------------------------

SECOND_STREAM_COMM = "tp-ub1"
"""The second device communicator over the TP ranks that the two-communicator design adds."""


@dataclass(frozen=True)
class LaunchOverlapped(Op):
    """Launch the graph of ``key`` whose decode runs as two micro-batches: micro-batch 0's
    all-reduce on the main stream (TP communicator), micro-batch 1's on the second stream, on
    the worker's ``second_comm`` (the op's trace reads as a plain launch of ``key``)."""

    name: ClassVar[str] = "launch"
    key: GraphKey


def micro_batches(bucket: int) -> tuple[int, int]:
    """Rows of the two micro-batches a bucket splits into (the second may be empty)."""
    first = -(-bucket // 2)
    return first, bucket - first


def _sim_launch_overlapped(backend, r, host, op, probe):
    """The replay issues micro-batch 0's in-graph all-reduce on the main stream and micro-batch
    1's on the side stream, each sized by its rows, then the decode compute."""
    shape = backend.world.config.shape
    comm = backend.world.workers[r].second_comm
    first, second = micro_batches(op.key.bucket)
    sigs = [(Signature("all-reduce", shape.allreduces_per_step, shape.allreduce_bytes(first),
                       f"graph {op.key} micro-batch 0", mode="graph"), False)]
    if second:
        sigs.append((Signature("all-reduce", shape.allreduces_per_step,
                               shape.allreduce_bytes(second), f"graph {op.key} micro-batch 1",
                               comm=comm, mode="graph"), True))
    return backend.launch_with(r, host, op.key, probe, tuple(sigs))


class OverlapWorker(Worker):
    """Launches every graph -- in the capture sweep and in serving -- as two overlapped
    micro-batches whose second all-reduce runs on communicator ``second_comm``."""

    second_comm: ClassVar[str] = "tp"

    def _overlapped(self, ops: list[Op]) -> list[Op]:
        return [LaunchOverlapped(op.key) if isinstance(op, LaunchGraph) else op
                for op in ops]

    def _ops_launch(self, command: Launch) -> list[Op]:
        return self._overlapped(super()._ops_launch(command))

    def forward_ops(self, step: Step) -> list[Op]:
        return self._overlapped(super().forward_ops(step))


class TwoCommunicatorOverlapWorker(OverlapWorker):
    """The second stream's all-reduces run on their own communicator."""

    second_comm: ClassVar[str] = SECOND_STREAM_COMM


def with_second_stream_communicator(sc: Scenario) -> Scenario:
    """``sc`` with a second device communicator over every rank, for the second stream."""
    return sc.with_communicators(Communicator(SECOND_STREAM_COMM))


register(Variant(
    name="overlap-one-communicator",
    summary="dual-batch overlap inside the decode graphs: micro-batch 1's all-reduce runs on a "
            "second stream but on the same TP communicator as micro-batch 0's, so two "
            "collectives of one communicator are in flight at once",
    source="sgl-project/sglang #31117 / PR #31135 (custom all-reduce issued on one "
           "communicator from two CUDA streams: permanent hang); ROCm/rccl #2179 (CUDA graph, "
           "one communicator shared by several streams: hang; one group per stream: done); "
           "vllm-project/vllm PR #44677 (DBO all-reduce overlap on a second stream)",
    expected={"shared": "deadlock", "per-rank": "deadlock"},
    remedy="A communicator runs one collective at a time: every stream that issues collectives "
           "concurrently with another has its own communicator (I16).",
    worker_cls=OverlapWorker,
    sim_ops={LaunchOverlapped: _sim_launch_overlapped}))


register(Variant(
    name="overlap-two-communicators",
    summary="the same dual-batch overlap with the second stream's all-reduces on a second "
            "communicator over the same ranks: the two collectives overlap safely",
    source="ROCm/rccl #2179 (one process group per stream completes); sgl-project/sglang "
           "PR #31135",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: this is the remedy of overlap-one-communicator (I16).",
    worker_cls=TwoCommunicatorOverlapWorker,
    adjust=with_second_stream_communicator,
    sim_ops={LaunchOverlapped: _sim_launch_overlapped},
    schedules=2, fault_schedules=0))


# -- death-drops-requests -------------------------------------------------------------------------


class DeathDropsRequestsController(Controller):
    """Fails the in-flight requests only when a rank reported the failure in a reply; a death
    (failure kind ``"dead"``, from the liveness signal) ends the run naming the dead rank but
    leaves every in-flight request waiting."""

    def fail_requests(self, error) -> None:
        if error.kind == "dead":
            return
        super().fail_requests(error)


register(Variant(
    name="death-drops-requests",
    summary="a rank's process dies mid-serving; the controller names the dead rank and stops, "
            "but only a failure a rank reported fails the in-flight requests, so theirs wait "
            "forever",
    source="AtomaAI/atoma-infer #177 (a dead model worker left pending requests waiting "
           "forever instead of failing them); vllm-project/vllm PR #56416 (calls pending when "
           "the engine core died never received the failure)",
    expected={"shared": "invariant:I18", "per-rank": "invariant:I18"},
    remedy="Every path to failure -- a failed reply, a timeout, a dead rank -- fails every "
           "request in flight with the run's error -- `Controller.fail_requests`, I18 -- and the "
           "error names the dead rank (I13).",
    controller_cls=DeathDropsRequestsController, symmetric=False,
    fault_search=FaultFamily("die", phase="serving")))


# -- registration-mismatch -------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordCached(Op):
    """Record ``key``, registering the graph's custom all-reduce buffers only where the rank's
    buffer cache did not already serve them (the trace reads as a plain record)."""

    name: ClassVar[str] = "record"
    key: GraphKey


def _sim_record_cached(backend, r, host, op, probe):
    """A record whose registration depends on the rank's allocator: rank 0 -- the sampling
    rank, whose sampler buffers shift its allocation history -- misses the cache for the
    all-reduce's output buffer and registers it as well; on the other ranks the cache serves
    it and only the input is registered. The collectives themselves are the same everywhere."""
    status = backend.record(r, host, op.key, probe)
    if status == DONE and not probe and r == 0:
        backend.register(r, op.key, "tp", "all-reduce output")
    return status


class CachedRegistrationWorker(Worker):
    """Captures with `RecordCached`: a graph buffer found in the rank's cache is not recorded
    for registration."""

    def _ops_capture(self, command):
        return [RecordCached(op.key) if isinstance(op, Record) else op
                for op in super()._ops_capture(command)]

    def _ops_measuregraphs(self, command):
        return [RecordCached(op.key) if isinstance(op, Record) else op
                for op in super()._ops_measuregraphs(command)]


register(Variant(
    name="registration-mismatch",
    summary="custom all-reduce records a graph buffer for registration only when the rank's "
            "buffer cache misses, so ranks whose allocators differ register different numbers "
            "of graph buffers for the same graphs",
    source="ROCm/aiter PR #2638 (cache hit before the capture check: per-rank graph buffer "
           "counts differ, out-of-bounds IPC handle reads); vllm-project/vllm #39788 / PR "
           "#39791 (ranks log different 'Registering N cuda graph addresses' counts)",
    expected={"shared": "invariant:I17", "per-rank": "invariant:I17"},
    remedy="During capture every buffer a collective uses is recorded for registration "
           "unconditionally, so every rank registers the same graph resources; the end of each "
           "capture compares the per-rank counts and fails fast on a mismatch (I17).",
    worker_cls=CachedRegistrationWorker,
    sim_ops={RecordCached: _sim_record_cached}, symmetric=False))


# -- dp-idle-rank-skips-forward / dp-idle-rank-dummy-batch -----------------------------------------


def data_parallel_lanes(sc: Scenario) -> Scenario:
    """``sc`` with data-parallel lanes: each rank serves its own requests (`Scenario.lane_batch`),
    so near the end of the workload one rank is busy while another is idle.

    Whether some step leaves a lane without rows depends on the workload alone (at max batch 9
    on two ranks the check's workload never does), so both variants draw it per run
    (`sim.scenario.WorkloadDraw`) and the search finds such a step."""
    return sc.with_(data_parallel=True)


class IdleSkipsForwardWorker(Worker):
    """A rank whose own batch is empty returns from the step without a forward: it issues none
    of the step's collectives."""

    rank_batch: tuple[int, ...] | None = None

    def forward_ops(self, step: Step) -> list[Op]:
        if self.rank_batch == ():
            return []
        return super().forward_ops(step)


register(Variant(
    name="dp-idle-rank-skips-forward",
    summary="data-parallel ranks serve their own requests; a rank with no rows of its own in a "
            "step skips the forward, so the busy ranks' collectives of that step wait for it "
            "forever",
    source="vllm-project/vllm PR #51984 / PR #53578 (idle DP ranks returned early without the "
           "dummy forward, missed the per-layer EP collectives, and the busy rank deadlocked "
           "in all2all); RBLN-SW/vllm-rbln PR #902",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy="Every rank runs every step's forward: an idle rank runs a dummy batch padded to the "
           "step's bucket, so it issues the same collectives as the busy ranks (I2).",
    worker_cls=IdleSkipsForwardWorker, adjust=data_parallel_lanes, symmetric=False,
    draw=WorkloadDraw))


register(Variant(
    name="dp-idle-rank-dummy-batch",
    summary="the correct protocol under data-parallel lanes: an idle rank runs the step's "
            "forward on padding (a dummy batch) and joins every collective",
    source="vllm-project/vllm PR #51984 (run the DP dummy forward on every zero-token rank); "
           "vllm-project/vllm-ascend PR #15510",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: this is the remedy of dp-idle-rank-skips-forward.",
    adjust=data_parallel_lanes, symmetric=False, reaches=("idle_rank_step",), schedules=8,
    fault_schedules=0, draw=WorkloadDraw))
