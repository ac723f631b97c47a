"""CUDA graphs of the decode step: one per eligible (bucket, path) key, with record,
instantiate, upload and launch as separate operations.

The protocol decides which keys exist and when each phase runs (I3, I4, I7); this module only
performs the phases and refuses them out of order. Keeping upload apart from launch is the
point: the controller's two-phase barrier sits between them, so no rank launches a graph whose
captured all-reduce would spin on a peer still inside capture or instantiate (BACKGROUND.md,
`fused-sweep`), and the first launch does no implicit upload.

    record       stream capture on a side stream into the engine's one memory pool
                 (`torch.cuda.CUDAGraph(keep_graph=True)`, `capture_begin/capture_end`; not
                 `torch.cuda.graph()`, whose gc.collect and empty_cache per capture cost
                 seconds over 36 buckets: TARGETS.md).
    instantiate  `graph.instantiate()`: the executable graph.
    upload       `cudaGraphUpload` of `graph.raw_cuda_graph_exec()` through
                 `cuda.bindings.runtime`, on the capture stream.
    launch       `graph.replay()` on the current stream.

All graphs share one pool (`torch.cuda.graph_pool_handle()`) and are captured largest bucket
first (the plan's key order), so smaller graphs reuse the largest one's freed intermediates.
Memory is measured, not estimated: the pool's segments from the caching allocator's snapshot
plus the driver memory each instantiate/upload took (free-memory delta not explained by the
allocator).

`StandInGraphs` has the same state machine with eager replays: the CPU tests drive the whole
protocol path (MeasureGraphs, Capture, Launch, replays) through it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphError(RuntimeError):
    """A graph operation was asked for out of order, for an unknown key, or the driver failed."""


def check_graph_support() -> None:
    """Raise GraphError unless this torch can record/instantiate/upload separately.

    Needs `torch.cuda.CUDAGraph(keep_graph=True)` with `instantiate` and `raw_cuda_graph_exec`,
    and `cuda.bindings.runtime` (package cuda-python / cuda-bindings) for `cudaGraphUpload`.
    """
    missing = [name for name in ("instantiate", "raw_cuda_graph_exec")
               if not hasattr(torch.cuda.CUDAGraph, name)]
    if missing:
        raise GraphError(f"torch {torch.__version__} lacks CUDAGraph.{', '.join(missing)}: "
                         "CUDA graphs need torch >= 2.9; pass cuda_graph=False")
    try:
        from cuda.bindings import runtime  # noqa: F401
    except ImportError as exc:
        raise GraphError("CUDA graphs need cuda.bindings.runtime for cudaGraphUpload "
                         f"({exc}); pip install cuda-bindings, or pass cuda_graph=False") from None


class GraphTable:
    """Per-key phase bookkeeping shared by the CUDA runner and the CPU stand-in.

    A key moves recorded -> instantiated -> uploaded; `launch` needs an instantiated key
    (uploaded in the protocol; MeasureGraphs never launches). Every refusal is a GraphError
    naming the key and its phase.
    """

    PHASES = ("recorded", "instantiated", "uploaded")

    def __init__(self):
        self.phase: dict = {}

    def _need(self, key, want: str, op: str) -> None:
        have = self.phase.get(key)
        if have != want and not (want == "instantiated" and have == "uploaded"
                                 and op == "launch"):
            raise GraphError(f"{op}({key}) refused: the graph is {have or 'not recorded'}, "
                             f"expected {want}")

    def record(self, key) -> None:
        """Capture the decode step of key.bucket rows. Raises GraphError if already held."""
        if key in self.phase:
            raise GraphError(f"record({key}) refused: a graph for this key is already "
                             f"{self.phase[key]} (free_graphs first)")
        self._record(key)
        self.phase[key] = "recorded"

    def instantiate(self, key) -> None:
        """Make the recorded graph executable. Raises GraphError unless recorded."""
        self._need(key, "recorded", "instantiate")
        self._instantiate(key)
        self.phase[key] = "instantiated"

    def upload(self, key) -> None:
        """Upload the executable graph. Raises GraphError unless instantiated."""
        self._need(key, "instantiated", "upload")
        self._upload(key)
        self.phase[key] = "uploaded"

    def launch(self, key) -> None:
        """Replay the graph (enqueued; returns before the device finishes).

        Raises:
            GraphError: no graph was captured for `key` (an uncaptured or ineligible key), or
                it was never instantiated.
        """
        if key not in self.phase:
            held = ", ".join(map(str, sorted(self.phase))) or "none"
            raise GraphError(f"launch({key}) refused: no graph was captured for this key "
                             f"(captured: {held})")
        self._need(key, "instantiated", "launch")
        self._launch(key)

    def free(self) -> None:
        """Drop every graph (safe to call with none)."""
        self._free()
        self.phase.clear()

    @property
    def keys(self) -> tuple:
        """Keys held now, ascending."""
        return tuple(sorted(self.phase))

    # subclass hooks
    def _record(self, key) -> None: ...
    def _instantiate(self, key) -> None: ...
    def _upload(self, key) -> None: ...
    def _launch(self, key) -> None: ...
    def _free(self) -> None: ...

    def memory(self) -> int:
        """Bytes held by the graphs now."""
        return 0


class CudaGraphs(GraphTable):
    """Decode-step CUDA graphs of one rank.

    Args:
        device: the rank's CUDA device.
        forward: forward(key) runs the decode step of `key.path` over the first `key.bucket`
            rows of the executor's static buffers and writes its output into a static buffer;
            it must read no host value that changes between replays (I12).
    """

    def __init__(self, device: torch.device, forward: Callable[[object], None]):
        super().__init__()
        self.device = device
        self.forward = forward
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict = {}
        self.exec_bytes: dict = {}

    def on_stream(self, fn: Callable[[], object]) -> object:
        """Run `fn` eagerly on the capture stream (warm-up: kernel loads, cuBLAS workspace of
        that stream) and make the current stream wait for it."""
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            out = fn()
        cur.wait_stream(self.stream)
        return out

    def _record(self, key) -> None:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            # thread_local: the NCCL watchdog thread's event queries stay legal during capture
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self.forward(key)
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:
                    pass
                raise
            graph.capture_end()
        cur.wait_stream(self.stream)
        self.graphs[key] = graph

    def _driver_bytes(self) -> tuple[int, int]:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free, torch.cuda.memory_reserved(self.device)

    def _instantiate(self, key) -> None:
        free0, res0 = self._driver_bytes()
        self.graphs[key].instantiate()
        free1, res1 = self._driver_bytes()
        self.exec_bytes[key] = max(0, (free0 - free1) - (res1 - res0))

    def _upload(self, key) -> None:
        from cuda.bindings import runtime as cudart

        free0, res0 = self._driver_bytes()
        exec_handle = self.graphs[key].raw_cuda_graph_exec()
        err, = cudart.cudaGraphUpload(exec_handle, self.stream.cuda_stream)
        if err != cudart.cudaError_t.cudaSuccess:
            raise GraphError(f"upload({key}): cudaGraphUpload failed with {err!r}")
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        free1, res1 = self._driver_bytes()
        self.exec_bytes[key] += max(0, (free0 - free1) - (res1 - res0))

    def _launch(self, key) -> None:
        self.graphs[key].replay()

    def _free(self) -> None:
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.exec_bytes.clear()
        torch.cuda.empty_cache()
        self.pool = torch.cuda.graph_pool_handle()  # later captures start a fresh pool

    def pool_bytes(self) -> int:
        """Bytes of the caching allocator's segments that belong to this runner's pool."""
        if not self.graphs:
            return 0
        pool = tuple(self.pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s.get("segment_pool_id", ())) == pool)

    def memory(self) -> int:
        """Bytes held now: the shared pool's segments plus every executable graph's driver
        memory (instantiate + upload)."""
        return self.pool_bytes() + sum(self.exec_bytes.values())


class StandInGraphs(GraphTable):
    """CPU test double with the CUDA runner's state machine: `launch` runs forward(key)
    eagerly. Each held graph counts `bytes_per_row * bucket` bytes, so the protocol's memory
    path (MeasureGraphs, reserve, Finalize check) has figures to work on."""

    bytes_per_row = 4096

    def __init__(self, forward: Callable[[object], None]):
        super().__init__()
        self.forward = forward
        self.launches: list = []  # keys replayed, in order (tests read it)

    def _launch(self, key) -> None:
        self.launches.append(key)
        self.forward(key)

    def memory(self) -> int:
        """Nominal bytes: bytes_per_row per row of every held graph."""
        return sum(self.bytes_per_row * k.bucket for k in self.phase)
