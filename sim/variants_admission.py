"""Variants of the batch cap and the graph reserve (I7, I9): two ways to keep a graph set other
than the one a full batch needs, or to reserve memory for a set other than the one kept.

Both come from this project's own bug (issue 13 item 1: ``LLM(max_batch=100)`` on an H200
failed at startup with "rank 0 holds 2310144 graph bytes, above the reserve"), and both have
public counterparts:

- ``row-cap-as-bucket-cap``: the fitted batch cap counts rows, but the plan compares it with
  bucket sizes, so when the cap is not itself a bucket the bucket a full batch pads to is left
  out of the retained set and every full batch runs eager (vllm-project/vllm-ascend #16049: an
  off-stride ``max_num_seqs`` of 12 captures up to 8, and batches 9-12 decode about 7.5x slower;
  vLLM PR #57355: with ``max_num_seqs=100`` batches 97-100 fall out of the full graph).
  The simulator flags it as the sweep ends (`sim.world.World._check_retained_set`, I7).
- ``measure-once``: graphs share one memory pool per rank, so a graph's bytes depend on the
  graphs recorded before it (vLLM PR #7894: "we already use memory pool sharing for cudagraph,
  and the cost should only scale with the max batchsize"). Measured once, largest first, the
  smaller graphs' figures leave out the pool the largest one paid for; when the memory fit then
  keeps fewer graphs, the reserve is the sum of those figures, too small, the KV cache takes the
  rest, and capturing the kept set runs out of memory (I9). The correct controller measures
  again on the kept set (`protocol.controller.Controller.measure_again`).

Neither scenario hard-codes a size: `off_stride_max_batch` derives the max batch from the
configured buckets, `reserve_short_by_the_pool` derives the device capacity from the memory
model, the plan's keys and the protocol's own fit.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from protocol.buckets import select_bucket
from protocol.config import ProtocolConfig
from protocol.controller import Controller
from protocol.eligibility import GraphPlan
from protocol.memory import candidate_caps, kept_buckets
from protocol.worker import Worker
from sim.scenario import Scenario
from sim.variants import FitHasOneCap, Variant, register

# -- row-cap-as-bucket-cap (I7) -------------------------------------------------------------------


class BucketCapPlan(GraphPlan):
    """A graph plan that keeps the buckets no larger than the batch cap, comparing a count of
    rows with bucket sizes: a cap of 255 rows keeps bucket 248 and drops 256, which a full batch
    of 255 rows pads to."""

    @property
    def largest_bucket(self) -> int:
        if self.batch_cap is None or self.batch_cap >= self.buckets[-1]:
            return self.buckets[-1]
        return max((b for b in self.buckets if b <= self.batch_cap), default=self.buckets[0])


def bucket_cap_plan(plan: GraphPlan) -> BucketCapPlan:
    """``plan`` with `BucketCapPlan`'s comparison (same fields)."""
    return BucketCapPlan(**{f.name: getattr(plan, f.name) for f in fields(GraphPlan)})


class BucketCapController(Controller):
    """The correct controller with a `BucketCapPlan`: its retained set, sweep and Finalize."""

    def __init__(self, config: ProtocolConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.plan = bucket_cap_plan(self.plan)


class BucketCapWorker(Worker):
    """The correct worker with a `BucketCapPlan` (it refits it the same way at AllocateKV)."""

    def __init__(self, rank: int, world_size: int, plan: GraphPlan, capacity: int):
        super().__init__(rank, world_size, bucket_cap_plan(plan), capacity)


def off_stride_max_batch(sc: Scenario) -> Scenario:
    """``sc`` with a max batch that is no bucket, so that the batch cap the memory fit gives is
    not one, and never above the scenario's own: that max batch where it is no bucket already
    (``--max-batch 3`` over buckets 1,2,4,8), else one row short of it where the bucket below
    leaves room (4 -> 3; the default 256 -> 255). A max batch one row above the bucket below
    it (2 over buckets 1,2) has no such value and is left unchanged. (Every max batch used to
    become the largest bucket - 1: ``--max-batch 3`` or ``4`` was checked at 7, and
    ``--buckets 5,10,20 --max-batch 5`` at 19, without a word.)"""
    buckets, max_batch = sc.config.buckets, sc.config.max_batch
    if max_batch not in buckets:
        return sc
    i = buckets.index(max_batch)
    if max_batch - 1 <= (buckets[i - 1] if i else 0):
        return sc
    return sc.with_(config=replace(sc.config, max_batch=max_batch - 1))


def _cap_keeps_the_same_buckets(sc: Scenario) -> str | None:
    """Why comparing the batch cap (max batch, after `off_stride_max_batch`) with bucket sizes
    keeps the same graphs as the correct plan here, or None."""
    plan = GraphPlan.from_config(sc.config).fitted(sc.config.max_batch)
    if bucket_cap_plan(plan).keys() != plan.keys():
        return None
    return (f"at max batch {sc.config.max_batch} with buckets "
            f"{','.join(map(str, plan.buckets))} no bucket lies between the cap and the bucket "
            "a full batch pads to, so comparing rows with bucket sizes keeps the same graphs")


register(Variant(
    name="row-cap-as-bucket-cap",
    summary="the fitted batch cap (rows) is compared with bucket sizes, so the bucket a full "
            "batch pads to is left out of the retained set and every full batch runs eager",
    source="lockstep issue 13 item 1 (LLM(max_batch=100) on an H200); vllm-project/vllm-ascend "
           "#16049 (off-stride max_num_seqs leaves the largest batches without a graph, ~7.5x "
           "slower decode); vLLM PR #57355 (throughput cliff when max_num_seqs is not a "
           "multiple of 8)",
    expected={"shared": "invariant:I7", "per-rank": "invariant:I7"},
    remedy="A batch cap counts rows: the plan keeps every bucket up to the one that holds the "
           "cap, and the reserve is measured on that set (I7, I9).",
    controller_cls=BucketCapController, worker_cls=BucketCapWorker,
    adjust=off_stride_max_batch, unreachable=_cap_keeps_the_same_buckets))


# -- measure-once (I9) ----------------------------------------------------------------------------


class MeasureOnceController(Controller):
    """Measures graph memory once, on every graph the unfitted plan may keep; when the fit keeps
    fewer, it reserves the sum of their figures from that one measurement."""

    def measure_again(self, measured) -> bool:
        return False


def reserve_short_by_the_pool(sc: Scenario) -> Scenario:
    """``sc`` with a device capacity at which every graph can be measured but the fit cannot
    keep them all beside one full-length sequence, and at which the smaller set it keeps leaves
    the KV cache exactly the reserve that one measurement gives that set.

    From the memory model (`sim.scenario.MemoryModel`, graphs sharing one pool per rank) and the
    protocol's own fit (`protocol.memory`): measured largest first, graph ``b`` adds
    ``graph_base`` plus what its pool need adds to the pool so far; the first candidate cap
    (every graph) must miss by less than one KV page per sequence page, the second candidate's
    kept set is what the measure-once reserve covers. The kept set's true need is larger by the
    pool its largest graph pays for once the larger graphs are gone, so capturing it runs out of
    memory unless the headroom absorbs that pool. A configuration with a single candidate cap is
    left unchanged.
    """
    cfg, mem = sc.config, sc.memory
    plan = GraphPlan.from_config(cfg)
    measured = plan.keys()
    caps = candidate_caps(plan.buckets, cfg.max_batch)
    if len(caps) < 2 or not measured:
        return sc
    # keyed by graph, as the protocol's reserve is (`protocol.memory.plan_memory`): with the
    # short path on (I22) a bucket holds two graphs, each measured with its own increment
    increments, pool = {}, 0
    for key in measured:  # largest first, into one pool
        growth = max(0, mem.graph_pool_bytes(key.bucket) - pool)
        increments[key] = mem.graph_base + growth
        pool += growth
    total = sum(increments.values())
    kept = set(kept_buckets(plan.buckets, caps[1]))
    reserve = sum(v for key, v in increments.items() if key.bucket in kept)
    page, per_seq = cfg.kv_page_bytes, sc.pages_per_seq
    # budget = reserve + whole pages: at least one sequence and the padding page, fewer than
    # every graph plus those pages would need
    budget = reserve + (per_seq + 1 + math.ceil((total - reserve) / page) - 1) * page
    rows = plan.buckets[-1]  # ProfileMemory's eager forward (its activations stay allocated)
    capacity = (budget + mem.weights + max([mem.overhead(r) for r in range(cfg.world_size)])
                + rows * mem.activation_per_row + cfg.memory_headroom_bytes)
    return sc.with_(memory=replace(mem, capacity=capacity))


register(Variant(
    name="measure-once",
    summary="graphs are measured once, largest first into one pool; when the memory fit keeps "
            "fewer of them, the reserve sums their increments, which leave out the shared pool",
    source="lockstep issue 13 item 1 (an H200 rank held 2310144 graph bytes above a reserve of "
           "2097152); vLLM PR #7894 (CUDA graphs share one memory pool, whose cost scales with "
           "the largest batch)",
    expected={"shared": "oom", "per-rank": "oom"},
    remedy="When the fit keeps fewer graphs than were measured, MeasureGraphs runs again on the "
           "kept set and the fit is redone, capped at the first fit (I9).",
    controller_cls=MeasureOnceController, adjust=reserve_short_by_the_pool,
    unreachable=FitHasOneCap("the set it keeps is the set measured")))


__all__ = ["BucketCapPlan", "BucketCapController", "BucketCapWorker", "MeasureOnceController",
           "off_stride_max_batch", "reserve_short_by_the_pool", "select_bucket"]
