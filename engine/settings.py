"""Engine settings shared by the controller and every rank (plain values, picklable).

Pure Python: the rank processes receive this object through pickling at spawn time.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ParallelConfigError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineSettings:
    """Everything a rank needs to build its executor.

    Attributes:
        model_dir: HF-layout Qwen3 directory.
        world_size: tensor-parallel size (ranks).
        device: "cpu" or "cuda" (rank r uses cuda:r).
        dtype: parameter and KV-cache dtype, one of DTYPES.
        max_batch: decode slots (concurrent requests); also the largest decode bucket.
        max_model_len: longest sequence, prompt + generated tokens (tokens).
        page_size: tokens per KV page (power of two >= 16 for the Triton kernel).
        buckets: decode buckets (ascending, last >= max_batch).
        step_timeout_s: seconds the controller waits for every rank's reply to one command
            before it declares the missing ranks failed.
        dist_init_method: torch.distributed init method (tcp://host:port or env://).
        fault: test hook, None in normal use: (rank, command seq, "raise" | "exit" | "hang")
            makes that rank fail, die or go silent when it receives that command.
        progress: rank 0 prints weight-loading progress to stderr.
        cuda_graph: capture one decode graph per eligible bucket at startup and replay them
            for decode-only steps (CUDA only; the protocol's plan decides eligibility).
        gpu_memory_utilization: fraction (0, 1] of the GPU's total memory this rank may hold
            (weights, activations, graphs, KV cache); the rest is left free. Default 0.9.
        trace: ranks return a `protocol.trace.TraceEvent` per backend op with each reply.
        graph_standin: test hook, False in normal use: with cuda_graph on CPU, the graph ops
            run through `engine.graphs.StandInGraphs` (eager replays), so the CPU tests drive
            the whole graph path of the protocol.
    """

    model_dir: str
    world_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 8
    max_model_len: int = 512
    page_size: int = 16
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    step_timeout_s: float = 300.0
    dist_init_method: str = ""
    fault: tuple[int, int, str] | None = None
    progress: bool = False
    cuda_graph: bool = False
    gpu_memory_utilization: float = 0.9
    trace: bool = False
    graph_standin: bool = False

    @property
    def pages_per_seq(self) -> int:
        """KV pages one full-length sequence needs."""
        return -(-self.max_model_len // self.page_size)

    def validate(self) -> None:
        """Raises ParallelConfigError naming the bad setting."""
        if self.device not in ("cpu", "cuda"):
            raise ParallelConfigError(f"device = {self.device!r}, expected 'cpu' or 'cuda'")
        if self.dtype not in DTYPES:
            raise ParallelConfigError(f"dtype = {self.dtype!r}, expected one of {DTYPES}")
        for name in ("max_batch", "max_model_len", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{name} = {v!r}, expected a positive integer")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ParallelConfigError(f"gpu_memory_utilization = {u!r}, expected a fraction "
                                      "in (0, 1]")
        if self.cuda_graph and self.device != "cuda" and not self.graph_standin:
            raise ParallelConfigError("cuda_graph = True needs device = 'cuda' (the CPU path "
                                      "runs eager only); pass cuda_graph=False")
        if self.page_size & (self.page_size - 1) or self.page_size < 16:
            raise ParallelConfigError(f"page_size = {self.page_size}, expected a power of two "
                                      ">= 16 (Triton decode attention tile)")
