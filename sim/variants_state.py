"""Known-bad variants of the data and memory class: what goes wrong in device state, not in
control flow. Each needs the simulator's per-slot KV contents or its buffer generations to be
caught (docs/hazards.md, "device state"); each cites the public bug it comes from.

Registered next to `sim.variants` (which imports this module), so `lockstep check` runs them by
default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from protocol.backend import SYNC, EnqueueSample, Op, PrepareReplay, ReadTokens, RunEager
from protocol.commands import AllocateKV, Capture, DecodeRow, DecodeRows, Step
from protocol.controller import Controller
from protocol.worker import Worker
from sim.common import DONE
from sim.devices import EagerDecode, WriteReplayMeta
from sim.kv import PAD_REQUEST
from sim.scenario import in_rounds
from sim.faults import FaultFamily
from sim.variants import Variant, register

# -- padding-into-live-slot ---------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareReplayPadSlot0(Op):
    """prepare_replay whose padding rows reuse slot 0's metadata instead of the scratch slot."""

    name: ClassVar[str] = "prepare_replay"
    step: Step


@dataclass(frozen=True)
class RunEagerPadSlot0(Op):
    """run_eager whose padding rows reuse slot 0's metadata instead of the scratch slot."""

    name: ClassVar[str] = "run_eager"
    step: Step


def _rows_padded_into_slot_0(step: Step) -> tuple[DecodeRow, ...]:
    pad = DecodeRow(slot=0, request_id=PAD_REQUEST, token=0, position=0)
    return tuple(step.rows) + (pad,) * max(0, step.bucket - len(step.rows))


def _sim_prepare_pad_slot_0(backend, r, host, op, probe):
    """Writes the replay inputs with padding rows on slot 0: the replay's padding rows then
    write KV position 0 of the request living in slot 0."""
    if probe:
        return DONE
    return backend.enqueue_done(r, host, WriteReplayMeta(op.step.seq, _rows_padded_into_slot_0(op.step)))


def _sim_eager_pad_slot_0(backend, r, host, op, probe):
    """Eager decode with the same padding rows on slot 0."""
    if probe:
        return DONE
    step = op.step
    backend.enqueue_eager(r, len(step.rows), "eager decode")
    return backend.enqueue_done(r, host, EagerDecode(step.seq, _rows_padded_into_slot_0(step)))


class PadIntoLiveSlotWorker(Worker):
    """Forward ops whose padding rows point at slot 0, a live slot, not the scratch slot."""

    def forward_ops(self, step: Step) -> list[Op]:
        swap = {PrepareReplay: PrepareReplayPadSlot0, RunEager: RunEagerPadSlot0}
        return [swap[type(op)](op.step) if type(op) in swap else op
                for op in super().forward_ops(step)]


register(Variant(
    name="padding-into-live-slot",
    summary="padding rows of a bucket reuse a live slot's metadata (slot 0) instead of a "
            "reserved scratch slot, so a padded step writes KV a live request reads",
    source="m0at/rvllm PR #32 (padded graph metadata reused live KV slot 0); "
           "vllm-project/vllm #43810 / PR #43869 (padding slot id -1 wrapped onto the last "
           "real KV slot)",
    expected={"shared": "invariant:I8", "per-rank": "invariant:I8"},
    remedy="Padding rows read and write a reserved scratch slot (one past the last real slot) "
           "that no request ever holds; replay metadata names only the step's live slots or "
           "the scratch slot (I8).",
    worker_cls=PadIntoLiveSlotWorker,
    sim_ops={PrepareReplayPadSlot0: _sim_prepare_pad_slot_0,
             RunEagerPadSlot0: _sim_eager_pad_slot_0}))


# -- kv-realloc-under-graphs --------------------------------------------------------------------


@dataclass(frozen=True)
class ResetKV(Op):
    """Clear the KV cache by freeing it and allocating a fresh one."""

    name: ClassVar[str] = "reset_kv"
    frees: ClassVar[bool] = True  # a driver free: waits for quiescence under the measured H2


def _sim_reset_kv(backend, r, host, op, probe):
    """Free and re-allocate the KV cache: same size, new buffer generation (new address). A
    lock-holding, quiescing driver call like any allocation and any free (H1, H2)."""
    status = backend.locked(r, host, quiesce=True, probe=probe, frees=True)
    if status != DONE or probe:
        return status
    dev = backend.world.devices[r]
    dev.allocate("kv", dev.live("kv").empty_like(), by=host.cmd,
                 nbytes=dev.buffers["kv"].nbytes)
    return backend.done(host)


class ClearKVAfterCaptureWorker(Worker):
    """Clears the KV cache, which the capture sweep's replays wrote padding garbage into, by
    freeing and re-allocating it at the end of startup -- after the graphs captured it."""

    def _ops_finalize(self, command) -> list[Op]:
        ops = super()._ops_finalize(command)
        return ops[:-1] + [ResetKV()] + ops[-1:]


register(Variant(
    name="kv-realloc-under-graphs",
    summary="the KV cache is cleared at the end of startup by freeing and re-allocating it, "
            "while the captured decode graphs keep the old cache's addresses",
    source="infinigence/ApxInf PR #89 (a captured decode graph reads freed K/V allocations "
           "after the cache's clear replaced them)",
    expected={"shared": "invariant:I15", "per-rank": "invariant:I15"},
    remedy="The KV cache is allocated once, before capture, and cleared in place; a graph is "
           "replayed only while every buffer it captured is the live one (I15).",
    worker_cls=ClearKVAfterCaptureWorker,
    sim_ops={ResetKV: _sim_reset_kv}))


# -- capture-before-kv ----------------------------------------------------------------------------


class CaptureBeforeKVController(Controller):
    """Runs the capture sweep straight after measuring the graphs, before the KV cache is
    allocated: the serving graphs are captured against the placeholder cache that the
    measurement graphs read, and `AllocateKV` then replaces it."""

    def startup_stages(self) -> list[str]:
        stages = [s for s in super().startup_stages() if s != "sweep"]
        stages.insert(stages.index("allocate"), "sweep")
        return stages


class CaptureBeforeKVWorker(Worker):
    """Takes a Capture before `AllocateKV`, as the worker did before the lifecycle rule
    (`Worker.check_lifecycle`) refused it."""

    def check_lifecycle(self, command) -> None:
        if not (isinstance(command, Capture) and self.pages is None):
            super().check_lifecycle(command)


register(Variant(
    name="capture-before-kv",
    summary="the serving graphs are captured before the KV cache is allocated, against the "
            "placeholder cache the graph measurement used; the allocation then replaces it "
            "and every replay reads and writes the placeholder",
    source="lightseekorg/tokenspeed PR #1509 (graphs measured against a probe-sized KV arena "
           "before the budget is spent: the probe's graphs are released and the ladder "
           "captured again once the real pool is bound, since a graph keeps the addresses "
           "it captured)",
    expected={"shared": "invariant:I15", "per-rank": "invariant:I15"},
    remedy="The startup order is measure, allocate, capture: a rank refuses a Capture before "
           "its AllocateKV (Worker.check_lifecycle, I15), so every serving graph captures the "
           "cache that serves.",
    controller_cls=CaptureBeforeKVController, worker_cls=CaptureBeforeKVWorker))


# -- kv-realloc-on-wake ---------------------------------------------------------------------------


class SleepWakeController(Controller):
    """Drives the engine as an RL rollout loop does: it serves the first round straight after
    startup; once a round's last request has left (nothing live, retiring, chunking or
    unread) the engine has slept, its KV cache released, and the next round's first step is
    preceded by a wake that allocates the cache again (`AllocateKV`, the same size)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.woke = False  # the wake of the current idle spell was sent

    def fingerprint(self) -> tuple:
        return super().fingerprint() + (self.woke,)

    def _next_step(self):
        idle = self._steps > 0 and not (self.slots.requests() or self._to_retire
                                        or self._chunking is not None
                                        or self._unread is not None)
        if not idle:
            self.woke = False
        elif self.pending and not self.woke:
            self.woke = True
            self.seq += 1
            return self.allocate_command(self.seq)
        return super()._next_step()


@dataclass(frozen=True)
class ReleaseKV(Op):
    """The sleep's release of the KV cache (its memory goes back to the driver)."""

    name: ClassVar[str] = "release_kv"
    frees: ClassVar[bool] = True


def _sim_release_kv(backend, r, host, op, probe):
    """Free the KV cache's bytes: a lock-holding driver free (H1, H2). The buffer stays
    what the graphs captured; the wake's allocation makes a new generation of it."""
    status = backend.locked(r, host, quiesce=False, probe=probe, frees=True)
    if status != DONE or probe:
        return status
    world = backend.world
    world.used[r] -= world.devices[r].buffers["kv"].nbytes
    return backend.done(host)


class WakeReallocWorker(Worker):
    """Takes the wake's `AllocateKV` while serving, as the worker did before the lifecycle
    rule (`Worker.check_lifecycle`): the sleep releases the cache, the wake allocates a new
    one at a new address, and the graphs captured at startup keep the old one's."""

    def check_lifecycle(self, command) -> None:
        if not (self.serving and isinstance(command, AllocateKV)):
            super().check_lifecycle(command)

    def _ops_allocatekv(self, command) -> list[Op]:
        ops = super()._ops_allocatekv(command)
        return [ReleaseKV()] + ops if self.serving else ops


register(Variant(
    name="kv-realloc-on-wake",
    summary="the workload comes in rounds; between rounds the idle engine sleeps, releasing "
            "its KV cache, and the wake before the next round allocates a new one, while the "
            "decode graphs captured at startup keep the old cache's addresses",
    source="vllm-project/vllm PR #53197 (a KV-cache wake-up rebuilt tensors that a captured "
           "decode graph reads, at new addresses: an illegal address on the first request "
           "after the wake; there block-table metadata, here the cache itself); ROCm/ATOM PR "
           "#2267 (the KV pool allocated anew, and re-sized, at a wake)",
    expected={"shared": "invariant:I15", "per-rank": "invariant:I15"},
    remedy="A rank allocates its KV cache once, before capture, and refuses a second "
           "AllocateKV, and every other startup command once serving (Worker.check_lifecycle: "
           "I15, I3). An engine that must give memory back while idle keeps the cache's "
           "addresses (its pages unmapped and mapped again in place), so the graphs stay valid.",
    controller_cls=SleepWakeController, worker_cls=WakeReallocWorker,
    adjust=in_rounds, sim_ops={ReleaseKV: _sim_release_kv}))


# -- no-liveness ----------------------------------------------------------------------------------


class NoLivenessController(Controller):
    """Ignores the liveness signal; a dead rank shows only as a step timeout."""

    def on_rank_dead(self, rank: int) -> None:
        return None


register(Variant(
    name="no-liveness",
    summary="a rank's process dies mid-serving and the controller learns of it only from the "
            "step timeout, whose error names every rank not collected -- the survivors stuck "
            "in the dead rank's collective as much as the dead rank",
    source="ai2cm/ace #348 (every surviving rank reports a collective timeout; nothing names the "
           "rank that died); pytorch/pytorch #97191",
    expected={"shared": "invariant:I13", "per-rank": "invariant:I13"},
    remedy="The transport reports a broken connection as a liveness signal "
           "(`Controller.on_rank_dead`), and the failure names the dead rank (I13).",
    controller_cls=NoLivenessController, symmetric=False,
    fault_search=FaultFamily("die", phase="serving")))


# -- prefill-dispatched-into-graph --------------------------------------------------------------


def _admissions_as_rows(step: Step) -> Step:
    """``step`` with its admissions turned into decode rows at their prompts' last positions
    (the prompt's last token as input) and no admissions: a batch taken for uniform decode."""
    admits = step.admits
    rows = DecodeRows(step.rows.request_ids + tuple(a.request_id for a in admits),
                      step.rows.tokens + tuple(a.prompt[-1] for a in admits),
                      step.rows.positions + tuple(len(a.prompt) - 1 for a in admits))
    return replace(step, rows=rows, admits=())


class UniformDecodeDispatchController(Controller):
    """Counts a step's admissions as decode rows when it picks the step's graph: the batch
    (a prefill-only step too) is dispatched to the graph of the bucket that holds rows +
    admissions."""

    def _next_step(self):
        step = super()._next_step()
        if (step is None or not step.admits or step.chunk is not None
                or any(a.start for a in step.admits)):
            return step
        # the admissions as rows at their prompts' last positions: context len(prompt)
        longest = max([self.longest_context(step.rows)] + [len(a.prompt) for a in step.admits])
        key, bucket = self.plan.key_for(len(step.rows) + len(step.admits), longest)
        return step if key is None else replace(step, key=key, bucket=bucket)


class UniformDecodeWorker(Worker):
    """Replays a step with admissions that names a graph as one decode batch: the admitted
    requests are rows of the replay (their slots and pages registered as usual) and are not
    prefilled, so only their prompt's last token is written to the KV."""

    def _ops_step(self, step: Step) -> list[Op]:
        if step.key is None or not step.admits or step.overlap:
            return super()._ops_step(step)
        ops = self.apply_slot_changes(step) + self.apply_page_changes(step)
        whole = _admissions_as_rows(step)
        ops += self.forward_ops(whole)
        if self.rank != 0:
            return ops + [SYNC]
        return ops + [EnqueueSample(whole), SYNC, ReadTokens(whole)]


register(Variant(
    name="prefill-dispatched-into-graph",
    summary="a step's admitted prompts are dispatched into the decode CUDA graph as rows of "
            "its replay and are never prefilled",
    source="vllm-project/vllm #53051 (a prefill shaped like a speculative-decode batch was "
           "dispatched into the FULL decode graph, whose replay dropped the prefill's "
           "recurrent-state writes: garbage output; dispatch-side fix PR #53059, replay-side "
           "guard PR #55123), generalised: here the dispatch counts every admission as one "
           "row, and the lost writes are the prompt's KV",
    expected={"shared": "invariant:I21", "per-rank": "invariant:I21"},
    remedy="A mixed step runs its prefill as an eager forward of its own, then replays the "
           "graph of the bucket that holds its decode rows only; a graph never covers prompt "
           "tokens (GraphPlan.key_for counts decode rows; I21).",
    controller_cls=UniformDecodeDispatchController,
    worker_cls=UniformDecodeWorker))
