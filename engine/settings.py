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
        if self.page_size & (self.page_size - 1) or self.page_size < 16:
            raise ParallelConfigError(f"page_size = {self.page_size}, expected a power of two "
                                      ">= 16 (Triton decode attention tile)")
