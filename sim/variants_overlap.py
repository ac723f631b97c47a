"""Variants of overlapped scheduling (``ProtocolConfig.decode_overlap``, I20): the controller
builds and sends step n+1 while step n runs on the device.

Under overlap a rank's reply to step n means "step n enqueued, step n-1 complete"
(`protocol.worker.Worker.overlapped_tail`): every rank samples and keeps the ids on its device,
marks the end of the step's device work, waits only for the previous step's mark, and rank 0
replies with the previous step's tokens. Decode rows carry no tokens: row i reads the id the
previous step sampled at ``Step.feed[i]``, on the device. A request that stops on a stop token
already has a row in the step in flight; that row's token is dropped and the request retires a
step late. The modelled device checks the fed ids directly (I20), the host staging buffer of the
replay inputs (I12) and the host buffer of the sampled ids (I11), each in the step it breaks.

`overlapped` turns any scenario into one with overlapped scheduling, and `stopping` gives its
requests stop tokens that a quarter of the modelled tokens hit, so requests end on a stop token
with a leftover row in flight as well as by length. The two clean rows draw
``memory_headroom_bytes`` per run (`sim.headroom.HeadroomDraw`), as the ``correct`` row does.

Known-bad designs:
- ``overlap-one-staging-buffer``: one pinned staging buffer for the replay inputs; the host
  rewrites it for step n+1 while step n's copy from it still waits on the stream
  (lightseekorg/tokenspeed PR #376; vllm-project/vllm PR #25279);
- ``overlap-one-token-buffer``: one pinned host buffer for the sampled ids; step n's copy
  lands in it while the host still has to read step n-1's (vllm-project/vllm PR #36013, and
  the review of vllm-project/vllm PR #39568: a shared buffer overwritten by the next step);
- ``overlap-feed-ignores-moves``: the controller feeds row i from index i of the previous
  step, ignoring the slot moves of compaction, so a moved request reads another request's
  token (sgl-project/sglang-jax #1487: rows read another request's future token);
- ``overlap-keeps-leftover-token``: the controller appends the token of a leftover row, after
  the request's stop token (tenstorrent/vllm-tt-plugin PR #76);
- ``overlap-rank0-samples-only``: only rank 0 samples, so the other ranks feed their rows from
  stale ids (HabanaAI/vllm-fork PR #135 review: delayed sampling with TP > 1 updated only the
  driver's input ids).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from protocol.backend import EnqueueSample, Op, PrepareReplay, ReadTokens
from protocol.commands import Step
from protocol.controller import Controller, Sampled
from protocol.worker import Worker
from sim.common import DONE
from sim.headroom import HeadroomDraw
from sim.scenario import Scenario
from sim.variants import Variant, eager_decode, register

STOP_EVERY = 4
"""`stopping` makes every STOP_EVERY-th token id of the vocabulary a stop token."""


def overlapped(sc: Scenario) -> Scenario:
    """``sc`` with overlapped scheduling."""
    return sc.with_(config=replace(sc.config, decode_overlap=True))


def stopping(sc: Scenario) -> Scenario:
    """``sc`` whose requests stop on every STOP_EVERY-th token id: some end on a stop token
    before their length, while a row of theirs is in flight under overlap."""
    stops = frozenset(range(0, sc.vocab, STOP_EVERY))
    return sc.with_(workload=tuple(replace(a, request=replace(a.request, stop_token_ids=stops))
                                   for a in sc.workload))


register(Variant(
    name="overlapped-scheduling",
    summary="the correct protocol with overlapped scheduling: each step is built and sent while "
            "the previous one runs; rows read their input tokens from the previous step's ids "
            "on the device; a request that stops has one leftover row, whose token is dropped",
    source="SGLang's overlap scheduler (sgl-project/sglang PR #1738) and vLLM's async "
           "scheduling (vllm-project/vllm PR #23569)",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: replies mean 'enqueued, previous step complete', every rank samples "
           "and feeds its rows by request from the previous step's ids, host buffers alternate "
           "by step parity, and leftover rows' tokens are dropped (I11, I12, I20).",
    adjust=lambda sc: stopping(overlapped(sc)),
    reaches=("fed_row", "leftover_row"), draw=HeadroomDraw))


register(Variant(
    name="overlapped-eager",
    summary="overlapped scheduling served without CUDA graphs: every decode step runs eagerly "
            "and feeds its rows from the previous step's ids on the device",
    source="the overlapped-scheduling row on the eager path (with graphs, mixed steps replay "
           "too and no decode step of the check's workload is eager)",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: the eager decode gathers its fed rows exactly as the replay's "
           "metadata copy does (I20).",
    adjust=lambda sc: stopping(overlapped(eager_decode(sc))),
    reaches=("fed_row", "leftover_row"), schedules=20, fault_schedules=10, draw=HeadroomDraw))


# -- overlap-one-staging-buffer -------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareReplayOneStaging(Op):
    """prepare_replay whose rows always go through host staging buffer 0."""

    name: ClassVar[str] = "prepare_replay"
    step: Step


def _sim_prepare_one_staging(backend, r, host, op, probe):
    return DONE if probe else backend.prepare_replay(r, host, op.step, 0)


class OneStagingWorker(Worker):
    """Writes every step's replay inputs through one pinned host staging buffer."""

    def forward_ops(self, step: Step) -> list[Op]:
        return [PrepareReplayOneStaging(op.step) if type(op) is PrepareReplay else op
                for op in super().forward_ops(step)]


register(Variant(
    name="overlap-one-staging-buffer",
    summary="under overlapped scheduling the replay inputs of every step go through one pinned "
            "host staging buffer: the host rewrites it for step n+1 while step n's "
            "non-blocking copy from it still waits on the stream",
    source="lightseekorg/tokenspeed PR #376 (overlap scheduler: the host fills the buffer "
           "before the previous step's host-to-device copy ran); vllm-project/vllm PR #25279 "
           "(async scheduling: reused CPU tensors modified while their copy was pending)",
    expected={"shared": "invariant:I12", "per-rank": "invariant:I12"},
    remedy="Two staging buffers by step parity: step n+2 rewrites step n's only after the reply "
           "to step n+1, which waited for step n's device work (I12).",
    worker_cls=OneStagingWorker,
    sim_ops={PrepareReplayOneStaging: _sim_prepare_one_staging},
    adjust=overlapped))


# -- overlap-one-token-buffer ---------------------------------------------------------------------


@dataclass(frozen=True)
class SampleIntoOneBuffer(Op):
    """enqueue_sample whose ids are always copied into host buffer 0."""

    name: ClassVar[str] = "enqueue_sample"
    step: Step


@dataclass(frozen=True)
class ReadOneBuffer(Op):
    """read_tokens from host buffer 0."""

    name: ClassVar[str] = "read_tokens"
    step: Step


def _sim_sample_one_buffer(backend, r, host, op, probe):
    return DONE if probe else backend.sample_into(r, host, op.step, 0)


def _sim_read_one_buffer(backend, r, host, op, probe):
    return DONE if probe else backend.read_token_buffer(r, host, op.step, 0)


class OneTokenBufferWorker(Worker):
    """Copies and reads every step's sampled ids through one pinned host buffer."""

    def overlapped_tail(self, step: Step) -> list[Op]:
        swap = {EnqueueSample: SampleIntoOneBuffer, ReadTokens: ReadOneBuffer}
        return [swap[type(op)](op.step) if type(op) in swap else op
                for op in super().overlapped_tail(step)]


register(Variant(
    name="overlap-one-token-buffer",
    summary="under overlapped scheduling the sampled ids of every step are copied into one "
            "pinned host buffer: step n's copy may land before the host read step n-1's ids",
    source="vllm-project/vllm PR #36013 (async scheduling: pinned memory read in the next step "
           "while its copy had not landed); vllm-project/vllm PR #39568 review (one shared "
           "buffer overwritten by the next step's copy)",
    expected={"shared": "invariant:I11", "per-rank": "invariant:I11"},
    remedy="Two host buffers by step parity: step n's ids land in one while the host reads "
           "step n-1's from the other, after waiting for step n-1's mark (I11).",
    worker_cls=OneTokenBufferWorker,
    sim_ops={SampleIntoOneBuffer: _sim_sample_one_buffer, ReadOneBuffer: _sim_read_one_buffer},
    adjust=overlapped))


# -- overlap-feed-ignores-moves -------------------------------------------------------------------


class FeedBySlotController(Controller):
    """Feeds decode row i from index i of the previous step's ids, as if no slot had moved."""

    def _next_step(self) -> Step | None:
        step = super()._next_step()
        if step is not None and step.feed is not None:
            step = replace(step, feed=tuple(range(len(step.rows))))
        return step


register(Variant(
    name="overlap-feed-ignores-moves",
    summary="under overlapped scheduling the controller feeds row i from index i of the "
            "previous step's sampled ids, ignoring compaction: a request moved into a freed "
            "slot reads the token another request sampled",
    source="sgl-project/sglang-jax #1487 (overlap scheduler: rows read another request's "
           "future token after the relay was reused; sgl-project/sglang PR #25862 keyed it by "
           "the request's own slot)",
    expected={"shared": "invariant:I20", "per-rank": "invariant:I20"},
    remedy="Each row is fed by its request: feed[i] is the index of row i's request in the "
           "previous step's slot order, which compaction changes (I20).",
    controller_cls=FeedBySlotController,
    adjust=overlapped))


# -- overlap-keeps-leftover-token -----------------------------------------------------------------


class KeepLeftoverController(Controller):
    """Keeps the token of a leftover row (sampled after the request's stop token)."""

    def drop_leftover_token(self, in_flight: Sampled, request_id: int) -> None:
        return None


register(Variant(
    name="overlap-keeps-leftover-token",
    summary="under overlapped scheduling a request that stopped on a stop token still had a "
            "row in the step in flight, and the controller appends that row's token to its "
            "output",
    source="tenstorrent/vllm-tt-plugin PR #76 (a captured row whose request the engine already "
           "dropped); sgl-project/sglang PR #18301 (overlap mode decodes finished requests "
           "once more)",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy="A request found ended in step n-1 gets a scratch list in step n's record, so the "
           "token its leftover row samples is dropped; it retires in step n+1.",
    controller_cls=KeepLeftoverController,
    adjust=lambda sc: stopping(overlapped(sc))))


# -- overlap-rank0-samples-only -------------------------------------------------------------------


class Rank0SamplesWorker(Worker):
    """Under overlap, only rank 0 runs the sampler, as without overlap."""

    def overlapped_tail(self, step: Step) -> list[Op]:
        ops = super().overlapped_tail(step)
        return ops if self.rank == 0 else [op for op in ops if type(op) is not EnqueueSample]


register(Variant(
    name="overlap-rank0-samples-only",
    summary="under overlapped scheduling only rank 0 samples: the other ranks' rows read their "
            "input tokens from ids their devices never computed",
    source="HabanaAI/vllm-fork PR #135 review (delayed sampling with TP > 1: the sampled ids "
           "became rank 0's input ids, not the other ranks')",
    expected={"shared": "invariant:I20", "per-rank": "invariant:I20"},
    remedy="Every rank samples (identical logits and a counter-based random stream give every "
           "rank the same ids), or rank 0's ids are broadcast on the device, before the next "
           "step's rows read them (I20).",
    worker_cls=Rank0SamplesWorker,
    symmetric=False,
    adjust=overlapped))
