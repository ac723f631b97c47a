"""Known-bad variants whose failure needs a rare interleaving: random search almost never finds
them, PCT does (docs/search-stats.md has each one's failing share per strategy). One per bug
class: a deadlock (`warmup-scratch-free`), device data (`kv-zero-unordered`) and a divergence
between ranks (`autotune-cache-shared`).

Each is written from a public bug whose report says it happens "from time to time", and each
declares the strategy `lockstep check` searches it with (`Variant.strategy`), so the default
check still catches it; `lockstep check --strategy random --variant NAME` shows random search
missing it. Registered next to `sim.variants` (which imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.backend import Op, WarmupCollective
from protocol.worker import SYNC, Worker
from sim.common import BLOCKED, DONE, Outcome, Signature
from sim.devices import Kernel
from sim.paged_kv import NEVER_WRITTEN
from sim.scenario import Scenario
from sim.variants import Variant, register

# -- warmup-scratch-free (deadlock) ---------------------------------------------------------------


@dataclass(frozen=True)
class AllocScratch(Op):
    """Allocate the warm-up's scratch buffer (``cudaMalloc``): takes the process's driver lock
    (H1; on the H200 an allocation waited behind a thread that held it), waits for no device."""

    name: ClassVar[str] = "alloc_scratch"
    takes_driver_lock: ClassVar[bool] = True


@dataclass(frozen=True)
class FreeScratch(Op):
    """Free the warm-up's scratch buffer (``cudaFree``): takes the driver lock and waits, holding
    it, until its devices are idle -- what frees did on H200s (docs/hazard-probes.md; H1, H2)."""

    name: ClassVar[str] = "free_scratch"
    takes_driver_lock: ClassVar[bool] = True


def _sim_alloc_scratch(backend, r, host, op, probe):
    return backend.locked(r, host, quiesce=False, probe=probe)


def _sim_free_scratch(backend, r, host, op, probe):
    # a free: in H2's measured call set, not the literature's (`HazardModel.h2_waits`)
    return backend.locked(r, host, quiesce=False, frees=True, probe=probe)


class ScratchFreeWorker(Worker):
    """Allocates a scratch buffer for the warm-up all-reduces, issues them, and frees the
    buffer before it synchronizes."""

    def _ops_warmup(self, command) -> list[Op]:
        ops = super()._ops_warmup(command)
        body = [op for op in ops if isinstance(op, WarmupCollective)]
        return [AllocScratch()] + body + [FreeScratch()] + ops[len(body):]


def _one_process_per_rank(sc: Scenario) -> str | None:
    if all(len(ranks) == 1 for ranks in sc.processes()):
        return ("every rank has its own process and driver lock, so no rank's allocation can "
                "wait behind a peer's free; the bug needs two ranks in one process")
    return None


register(Variant(
    name="warmup-scratch-free",
    summary="each rank allocates a scratch buffer for its warm-up all-reduces and frees it "
            "before synchronizing; a rank that races through its warm-up frees while its peer "
            "in the same process has not yet allocated",
    source="NVIDIA/nccl #48 (allreduce threads hang 'from time to time' while one thread is in "
           "cudaFreeHost); pytorch/pytorch #50925 and PR #880 (cudaFree between the launches of "
           "one collective on two devices deadlocks; the free mutex)",
    expected={"shared": "deadlock", "per-rank": "clean"},
    remedy="Nothing frees device memory while a collective may be waiting for a peer: the warm-up "
           "synchronizes before it frees, and the startup barrier (every rank replies before the "
           "next command) orders every rank's allocation before any rank's free (I1, I5).",
    worker_cls=ScratchFreeWorker,
    sim_ops={AllocScratch: _sim_alloc_scratch, FreeScratch: _sim_free_scratch},
    unreachable=_one_process_per_rank,
    strategy="pct"))


# -- kv-zero-unordered (data) ----------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroKV(Op):
    """Zero the KV cache's pages with an asynchronous memset on another stream (the legacy
    default stream), unordered with the engine's own stream."""

    name: ClassVar[str] = "zero_kv"


@dataclass(frozen=True)
class SyncStream(Op):
    """Synchronize the engine's own (main) stream only: work on other streams may still run."""

    name: ClassVar[str] = "synchronize"


@dataclass(frozen=True)
class ZeroKVKernel(Kernel):
    """The memset of command ``seq``: every KV page it covers reads as never written afterwards.
    ``versions`` are the pages' write versions when it was issued: what it means to erase."""

    label: ClassVar[str] = "memset"
    seq: int
    versions: tuple[tuple[int, int], ...]


def _sim_zero_kv(backend, r, host, op, probe):
    if probe:
        return DONE
    kv = backend.world.devices[r].live("kv")
    backend.enqueue(r, ZeroKVKernel(host.cmd.seq, tuple(sorted(kv.versions.items()))), side=True)
    return backend.done(host)


def _sim_sync_stream(backend, r, host, op, probe):
    if backend.world.devices[r].main:
        return BLOCKED
    return DONE if probe else backend.done(host)


def _sim_zero_kv_kernel(world, r, dev, kernel):
    """Zero every page; a page written since the memset was issued held a live request's KV."""
    kv = dev.live("kv")
    seen = dict(kernel.versions)
    for page, version in sorted(kv.versions.items()):
        if page != kv.padding_page and version != seen.get(page, 0):
            slots = world.workers[r].slots.slots
            holder = next((slots.get(s) for s, row in kv.tables.items() if page in row), None)
            world.outcome = Outcome(
                "invariant", f"I11 violated: on rank {r}, the KV memset issued in command "
                f"{kernel.seq} ran in command {world.current_seq()}, after that command wrote "
                f"request {holder}'s KV into page {page}: device work of one command outlived "
                "its reply and erased live KV", "I11", rank=r, step=world.current_seq(),
                check="memset-outlived-reply")
            return
    kv.cells.clear()


class ZeroUnorderedWorker(Worker):
    """Zeroes the KV cache at the end of startup on another stream and synchronizes only its
    own stream before replying."""

    def _ops_finalize(self, command) -> list[Op]:
        ops = super()._ops_finalize(command)
        return [op for op in ops if op is not SYNC] + [ZeroKV(), SyncStream()]


register(Variant(
    name="kv-zero-unordered",
    summary="the KV cache is zeroed at the end of startup by a memset on another stream, and "
            "the rank synchronizes only its own stream before serving starts, so the memset can "
            "land after the first prefill's KV writes",
    source="kekzl/imp #1652 (a growable KV pool zeroed new blocks with cudaMemset on the legacy "
           "default stream and handed them to a non-blocking decode stream with no event: the "
           "zeroing could land after the first KV write)",
    expected={"shared": "invariant:I11", "per-rank": "invariant:I11"},
    remedy="A rank replies only after a device-wide synchronize (every stream, I11): nothing "
           "issued in one command can still run in the next.",
    worker_cls=ZeroUnorderedWorker,
    sim_ops={ZeroKV: _sim_zero_kv, SyncStream: _sim_sync_stream},
    sim_kernels={ZeroKVKernel: _sim_zero_kv_kernel},
    strategy="pct"))


# -- autotune-cache-shared (divergence) ------------------------------------------------------------

CANDIDATE_TACTICS = 2
"""Tactics the modelled autotuner times per message size, one all-reduce each. Any number above
one makes a rank that tunes issue more collectives than a rank that reuses a cached choice
(flashinfer-ai/flashinfer #3186 saw rank 0 run 12 collectives more than its peers)."""


@dataclass(frozen=True)
class LookupTactics(Op):
    """Ask the process's autotuner whether its tactic cache is already filled (a host-side read
    of a process-wide singleton; no device work)."""

    name: ClassVar[str] = "lookup_tactics"


@dataclass(frozen=True)
class TuneAllReduce(Op):
    """Warm up the all-reduce of ``nbytes`` bytes: run every candidate tactic (one all-reduce
    each) when this rank tunes, or the cached tactic once when its lookup found the cache
    filled."""

    name: ClassVar[str] = "warmup_collective"  # the trace's warm-up of this size (I5)
    enqueues: ClassVar[bool] = True  # device work that may outlive the call (H6)
    nbytes: int


@dataclass(frozen=True)
class StoreTactics(Op):
    """Fill the process's tactic cache with this rank's choices (host-side write)."""

    name: ClassVar[str] = "store_tactics"


class SharedTunerWorker(Worker):
    """Warms up through a process-wide autotuner: looks the cache up first, tunes (or reuses)
    each warm-up size, then stores its choices for the process.

    Attributes:
        reuses_cache: None before the lookup, then whether it found the cache filled.
        stored: whether this rank has filled its process's cache.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reuses_cache: bool | None = None
        self.stored = False

    def fingerprint(self) -> tuple:
        return super().fingerprint() + (self.reuses_cache, self.stored)

    def _ops_warmup(self, command) -> list[Op]:
        ops = super()._ops_warmup(command)
        body = [TuneAllReduce(op.nbytes) for op in ops if isinstance(op, WarmupCollective)]
        return [LookupTactics()] + body + [StoreTactics()] + ops[len(body):]


def _sim_lookup_tactics(backend, r, host, op, probe):
    if probe:
        return DONE
    w = backend.world
    w.workers[r].reuses_cache = any(w.workers[q].stored for q in w.procs[w.proc_of[r]])
    return backend.done(host)


def _sim_tune_all_reduce(backend, r, host, op, probe):
    if probe:
        return DONE
    w = backend.world
    w.connected[r].add(op.nbytes)
    reuse = w.workers[r].reuses_cache
    for _ in range(1 if reuse else CANDIDATE_TACTICS):
        backend.enqueue(r, Signature("all-reduce", 1, op.nbytes,
                                     "warm-up (cached tactic)" if reuse else "autotune candidate"))
    return backend.done(host)


def _sim_store_tactics(backend, r, host, op, probe):
    if probe:
        return DONE
    backend.world.workers[r].stored = True
    return backend.done(host)


def _no_shared_tuner(sc: Scenario) -> str | None:
    if all(len(ranks) == 1 for ranks in sc.processes()):
        return ("every rank has its own process and so its own autotuner cache: no rank can "
                "read a peer's tactics; the bug needs two ranks in one process")
    # With one warm-up size the bug still shows: the tuning rank's extra candidate run spins
    # for a peer that already replied (a fresh helper's finding: "not reachable here" was
    # claimed at --buckets 4, where a search finds that divergence in 12 actions).
    return None


register(Variant(
    name="autotune-cache-shared",
    summary="each rank warms up through its process's autotuner: a rank whose lookup finds the "
            "cache already filled by a faster peer in the same process runs each cached tactic "
            "once instead of timing every candidate, so its warm-up collectives no longer pair "
            "with the peer's",
    source="NVIDIA/TensorRT-LLM PR #14240 (a rank whose autotuner cache is already populated "
           "returns from the autotuner warm-up at once and its collectives mismatch a peer still "
           "tuning; fixed with barriers around the warm-up and a collective vote on cache hits); "
           "flashinfer-ai/flashinfer #3186 and PR #3187 (the process-wide AutoTuner's choices "
           "differ per rank under TP: 'Detected mismatch between collectives on ranks', rank 0 "
           "ran 12 extra collectives)",
    expected={"shared": "divergence", "per-rank": "clean"},
    remedy="Every rank issues exactly the collectives the command names, whatever its process "
           "has cached: the Warmup command carries the message sizes and each rank runs one "
           "all-reduce per size (I2); a tuning choice is made once and travels in a command, as "
           "the bucket does, never read from per-process state.",
    worker_cls=SharedTunerWorker,
    sim_ops={LookupTactics: _sim_lookup_tactics, TuneAllReduce: _sim_tune_all_reduce,
             StoreTactics: _sim_store_tactics},
    unreachable=_no_shared_tuner,
    strategy="pct"))
