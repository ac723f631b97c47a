"""Example user variants, one per simulator capability: communicators, buffers, per-rank
batches, process death.

Check them all, or one by name:

    lockstep check --variant-file docs/examples/state_variants.py
    lockstep check --variant-file docs/examples/state_variants.py --variant my-side-stream-custom-ar
"""

from dataclasses import dataclass, replace
from typing import ClassVar

from protocol.backend import Op, RunEager
from protocol.commands import Step
from protocol.controller import Controller
from protocol.worker import Worker
from sim.common import DONE, Signature
from sim.comms import Communicator
from sim.devices import EagerDecode
from sim.faults import FaultFamily
from sim.scenario import WorkloadDraw
from sim.variants import Variant

# -- communicators: a second stream on a one-in-flight communicator --------------------------------


@dataclass(frozen=True)
class RunEagerSplit(Op):
    """Eager decode whose all-reduce is split in two halves, one per stream."""

    name: ClassVar[str] = "run_eager"
    step: Step


def _sim_run_eager_split(backend, r, host, op, probe):
    if probe:
        return DONE
    step = op.step
    half = backend.world.config.shape.allreduce_bytes(len(step.rows))
    backend.enqueue(r, Signature("all-reduce", 1, half, "rows 0..n/2", comm="car"))
    backend.enqueue(r, Signature("all-reduce", 1, half, "rows n/2..n", comm="car"), side=True)
    return backend.enqueue_done(r, host, EagerDecode(step.seq, backend.padded(step)))


class SplitEagerWorker(Worker):
    def forward_ops(self, step):
        return [RunEagerSplit(op.step) if isinstance(op, RunEager) else op
                for op in super().forward_ops(step)]


SIDE_STREAM_CUSTOM_AR = Variant(
    name="my-side-stream-custom-ar",
    summary="eager decode splits its all-reduce over two streams on one custom all-reduce "
            "communicator",
    source="sgl-project/sglang #31117", expected={"shared": "deadlock", "per-rank": "deadlock"},
    worker_cls=SplitEagerWorker, sim_ops={RunEagerSplit: _sim_run_eager_split},
    # served without CUDA graphs: with graphs every decode step of the check's workload
    # replays (mixed steps too), and the eager path this bug lives in never runs
    adjust=lambda sc: sc.with_communicators(Communicator("car", one_in_flight=True)).with_(
        config=replace(sc.config, cuda_graphs=False)))

# -- buffers: re-allocating a buffer that graphs captured -----------------------------------------


@dataclass(frozen=True)
class NewLogits(Op):
    """Replace the logits buffer by a fresh allocation."""

    name: ClassVar[str] = "new_logits"


def _sim_new_logits(backend, r, host, op, probe):
    if probe:
        return DONE
    backend.world.devices[r].allocate("logits", {})  # a new generation of the buffer
    return backend.done(host)


class FreshLogitsWorker(Worker):
    def _ops_finalize(self, command):
        ops = super()._ops_finalize(command)  # [GraphMemory(), SYNC]: its reply reads results[0]
        return ops[:-1] + [NewLogits()] + ops[-1:]


FRESH_LOGITS = Variant(
    name="my-fresh-logits", summary="the logits buffer is re-allocated after the graphs captured it",
    source="docs/design.md I15", expected={"shared": "invariant:I15", "per-rank": "invariant:I15"},
    worker_cls=FreshLogitsWorker, sim_ops={NewLogits: _sim_new_logits})

# -- process death: a rank dies in serving, at a rank and call the checker searches ----------------


class IgnoresDeathController(Controller):
    def on_rank_dead(self, rank):
        return None  # waits for the step timeout, which names every uncollected rank


IGNORES_DEATH = Variant(
    name="my-ignores-death", summary="the controller ignores the liveness signal",
    source="ai2cm/ace #348", expected={"shared": "invariant:I13", "per-rank": "invariant:I13"},
    controller_cls=IgnoresDeathController, symmetric=False,
    fault_search=FaultFamily("die", phase="serving"))  # every death in serving, searched

# -- per-rank batches: data-parallel lanes, an idle rank ---------------------------------------------


class IdleSkipsDecodeWorker(Worker):
    """With `Scenario.data_parallel`, the world sets ``rank_batch`` before each step."""

    rank_batch = None

    def forward_ops(self, step):
        if self.rank_batch == ():
            return []  # nothing of its own to decode: skips the step's all-reduces
        return super().forward_ops(step)


IDLE_SKIPS_DECODE = Variant(
    name="my-idle-skips-decode", summary="an idle data-parallel rank skips the decode",
    source="vllm-project/vllm PR #51984", expected={"shared": "divergence", "per-rank": "divergence"},
    worker_cls=IdleSkipsDecodeWorker, adjust=lambda sc: sc.with_(data_parallel=True),
    symmetric=False, draw=WorkloadDraw)  # the workload drawn per run: an idle lane at any size

VARIANTS = [SIDE_STREAM_CUSTOM_AR, FRESH_LOGITS, IDLE_SKIPS_DECODE, IGNORES_DEATH]
