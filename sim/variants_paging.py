"""Variants of KV pages on demand (I14): the scenario that makes pages run out, and two
known-bad designs -- a worker that keeps its own page allocator beside the scheduler's, and an
asynchronous store of a preempted request's pages that the same step's forward overwrites.

`page_pressure` turns any scenario into one whose KV pool holds a single full-length sequence
of its own workload -- the smallest pool the protocol accepts -- with pages small enough that
every request grows across pages, so that running requests outgrow the pool and the controller
must preempt. The correct protocol must serve every request there with unchanged tokens, with
its ``memory_headroom_bytes`` drawn per run (`sim.headroom.HeadroomDraw`) as the ``correct``
row's is: the pool stays one sequence in every run that serves, since ``max_kv_pages`` caps it
and every headroom a serving run draws leaves the room for that sequence (`largest_headroom`),
so a draw changes only how many graphs the fit keeps -- and there a fit that counts the
headroom only when the pool is not capped is caught, which no uncapped row can show. The
``local-pages`` variant, whose workers allocate pages from their own free list and free them
only when a request finishes (vllm-metal PR #128: the model runner's own block allocator beside
the scheduler's KV cache manager never heard of preemption and raised "Not enough free blocks"),
fails the engine in the very step whose preemption hands the freed pages to a growing request.
The ``unfenced-preempt-store`` variant copies a preempted request's pages to a host-side KV store
on the side (copy) stream and orders nothing between that copy and the step's forward, which
writes the same pages for the requests they were handed to (vLLM #52360 and PR #52470, the
Mooncake store connector; DingoCache PR #76): only schedules in which the forward's kernel runs
before the copy store another request's KV -- search finds them, and only with H6.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import ClassVar

from protocol.backend import AssignPages, Op
from protocol.commands import PageAssign, Step
from protocol.errors import PageError
from protocol.pages import pages_for
from protocol.worker import Worker
from sim.common import DONE, Outcome
from sim.devices import Kernel
from sim.headroom import HeadroomDraw
from sim.scenario import Scenario
from sim.variants import Variant, register

PRESSURE_PAGE_SIZE = 1
"""Tokens per page under `page_pressure`: one, so every decode step of every request needs a
new page and the pool runs short as soon as two requests grow together (any page size at which
the workload spans several pages does the same; tests vary it)."""


def page_pressure(sc: Scenario, page_size: int = PRESSURE_PAGE_SIZE) -> Scenario:
    """``sc`` with ``page_size``-token pages and a KV pool of one full-length sequence of its
    own workload (prompt + max_tokens - 1 tokens of its longest request): the smallest pool
    the controller accepts, so running requests outgrow it and are preempted (I14)."""
    longest = max((len(a.request.prompt) + a.request.max_tokens - 1 for a in sc.workload),
                  default=1)
    per_seq = pages_for(longest, page_size)
    config = replace(sc.config, page_size=page_size, max_kv_pages=per_seq)
    return sc.with_(config=config, pages_per_seq=per_seq)


register(Variant(
    name="paged-kv-pressure",
    summary="the correct protocol with a KV pool of one full-length sequence: pages run out "
            "and running requests are preempted and recomputed",
    source="vLLM recompute preemption (Kwon et al., SOSP 2023, section 4.5)",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: exhaustion preempts the most recently admitted request, its pages "
           "are freed in the step's command, and it is recomputed later (I14).",
    adjust=page_pressure,
    reaches=("preemption",), draw=HeadroomDraw))


class LocalPagesWorker(Worker):
    """Allocates KV pages from its own free list (lowest id first, as the controller does)
    and frees a request's pages only when it finishes: a preemption, a scheduler decision,
    never reaches its allocator. It writes its own page choices into the page table."""

    def apply_page_changes(self, step: Step) -> list[Op]:
        if self.pages is None:
            return super().apply_page_changes(step)
        if not hasattr(self, "_free"):
            self._free = list(range(self.pages.num_pages))
        for retire in step.retires:
            for page in self.pages.tables.pop(retire.request_id, ()):
                del self.pages.owner[page]
                heapq.heappush(self._free, page)
        ops: list[Op] = []
        for assign in step.pages:
            if len(assign.pages) > len(self._free):
                raise PageError(f"rank {self.rank}: not enough free KV pages for request "
                                f"{assign.request_id} ({len(self._free)} free)")
            mine = tuple(heapq.heappop(self._free) for _ in assign.pages)
            table = self.pages.tables.get(assign.request_id, [])
            own = PageAssign(assign.request_id, assign.slot, len(table), mine)
            self.pages.assign(own)
            ops.append(AssignPages(own.slot, own.first_index, own.pages))
        return ops


register(Variant(
    name="local-pages",
    summary="each worker allocates KV pages from its own free list and frees them only when a "
            "request finishes; the scheduler's preemptions never reach it",
    source="vllm-project/vllm-metal PR #128 (a model-runner block allocator beside the "
           "scheduler's KV cache manager raised 'Not enough free blocks' instead of preempting)",
    expected={"shared": "invariant:I14", "per-rank": "invariant:I14"},
    remedy="The controller owns the page pool: every page a rank writes through is chosen by "
           "the controller and carried in the step, retirements and preemptions carry the "
           "pages they free, and workers only check them (I14).",
    worker_cls=LocalPagesWorker,
    adjust=page_pressure))


# -- unfenced-preempt-store ---------------------------------------------------------------------


@dataclass(frozen=True)
class StorePages(Op):
    """Copy a preempted request's KV ``pages`` to a host-side store (KV offload for a prefix
    cache), asynchronously on the copy stream."""

    name: ClassVar[str] = "store_pages"
    request_id: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class StoreKernel(Kernel):
    """The store's device copy of ``pages`` in command ``seq``; ``versions`` are the pages' write
    versions when it was enqueued, the KV it means to save."""

    label: ClassVar[str] = "store"
    seq: int
    request_id: int
    pages: tuple[int, ...]
    versions: tuple[int, ...]


class UnfencedStoreWorker(Worker):
    """On preemption, stores the victim's pages on the side stream before releasing them, and
    orders nothing between that copy and the step's forward."""

    def apply_slot_changes(self, step: Step) -> list[Op]:
        stores: list[Op] = [StorePages(p.request_id, p.pages) for p in step.preempts]
        return stores + super().apply_slot_changes(step)


def _sim_store_pages(backend, r, host, op, probe):
    """Enqueue the copy on the side stream, remembering the pages' versions: under the step
    lock the victim's last writes are complete, so these are the KV the store means to save."""
    if probe:
        return DONE
    kv = backend.world.devices[r].live("kv")
    versions = tuple(kv.version(p) for p in op.pages)
    backend.enqueue(r, StoreKernel(host.cmd.seq, op.request_id, op.pages, versions), side=True)
    return backend.done(host)


def _sim_store_kernel(world, r, dev, kernel):
    """The copy reads its pages now: a page written since it was enqueued holds another
    request's KV, which the store saves under the preempted request's tokens."""
    kv = dev.live("kv")
    for page, seen in zip(kernel.pages, kernel.versions):
        if kv.version(page) == seen:
            continue
        slots = world.workers[r].slots.slots
        holder = next((slots.get(s) for s, row in kv.tables.items() if page in row), None)
        world.outcome = Outcome(
            "invariant", f"I14 violated: on rank {r}, step {kernel.seq} preempted request "
            f"{kernel.request_id} and handed its page {page} to request {holder}, whose decode "
            f"wrote it before the step's asynchronous store of request {kernel.request_id}'s KV "
            f"read it: the store saved request {holder}'s KV under request "
            f"{kernel.request_id}'s tokens", "I14", rank=r, step=kernel.seq,
            check="store-after-page-reuse")
        return


register(Variant(
    name="unfenced-preempt-store",
    summary="on preemption each rank copies the victim's KV pages to a host-side store on a "
            "side stream, unordered with the step's forward that reuses those pages",
    source="vllm-project/vllm #52360 and PR #52470 (Mooncake store connector: preemption frees "
           "blocks while async store jobs still read them); dingodb/DingoCache PR #76",
    expected={"shared": "invariant:I14", "per-rank": "invariant:I14"},
    remedy="Preemption recomputes: nothing reads a preempted request's pages after the step "
           "frees them, and the step lock (I1) drains every stream before the next command. An "
           "engine that stores a victim's KV must order the copy before any kernel of the step "
           "that reuses its pages (I14).",
    worker_cls=UnfencedStoreWorker,
    adjust=page_pressure,
    sim_ops={StorePages: _sim_store_pages},
    sim_kernels={StoreKernel: _sim_store_kernel}))
