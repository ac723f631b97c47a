"""Protocol configuration and its validation.

Every value is checked here, before any rank starts or any device memory is allocated; an error
names the bad value and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.buckets import DEFAULT_DECODE_BUCKETS, validate_buckets
from protocol.errors import ConfigError, is_int


@dataclass(frozen=True)
class ModelShape:
    """The model facts the protocol needs: the collective message sizes of a decode step.

    Attributes:
        hidden_size: model width (elements).
        num_layers: decoder layers.
        allreduces_per_layer: row-parallel all-reduces per layer (o_proj and down_proj: 2).
        dtype_bytes: bytes per activation element (bf16: 2).
        name: label for reports.
    """

    hidden_size: int
    num_layers: int
    allreduces_per_layer: int = 2
    dtype_bytes: int = 2
    name: str = "model"

    def __post_init__(self) -> None:
        for attr in ("hidden_size", "num_layers", "allreduces_per_layer", "dtype_bytes"):
            value = getattr(self, attr)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"ModelShape.{attr}={value!r} must be a positive integer")

    @property
    def allreduces_per_step(self) -> int:
        """All-reduces in one forward step: two per layer plus the vocab-parallel embedding's."""
        return self.num_layers * self.allreduces_per_layer + 1

    def allreduce_bytes(self, rows: int) -> int:
        """Message size in bytes of one activation all-reduce over ``rows`` rows."""
        return rows * self.hidden_size * self.dtype_bytes


SHORT_MAX_BUCKET = 8
"""Default largest bucket with a short-context decode graph (rows): the fused attention + o_proj
kernel pays only at small batches, and each short graph is one more graph to reserve and capture."""


QWEN3_4B = ModelShape(hidden_size=2560, num_layers=36, name="Qwen3-4B")
"""Qwen3-4B: hidden 2560, 36 layers, 2 all-reduces per layer, bf16."""


@dataclass(frozen=True)
class ProtocolConfig:
    """Everything the controller and workers agree on before startup.

    Attributes:
        world_size: number of TP ranks (>= 1).
        buckets: ascending decode bucket sizes (rows); default: pegainfer's 36 Qwen3 buckets.
        max_batch: most concurrent decode rows the scheduler admits (<= the largest bucket).
        cuda_graphs: capture decode graphs at startup; False serves every step eagerly.
        graph_batch_cap: numeric policy: decode batches above this run eager (None: no cap).
        decode_overlap: overlapped scheduling: the controller builds and sends step n+1 while
            step n still runs on the device. A rank's reply to step n then means "step n
            enqueued, step n-1 complete", rank 0's reply carries step n-1's tokens, and decode
            rows take their input tokens from the previous step's sampled ids on the device
            (`Step.feed`, `Step.read`; I20). Every rank samples, so every device holds the ids.
        watchdog_timeout_s: seconds the startup sweep may take before the watchdog aborts.
        step_timeout_s: seconds a serving or teardown command may wait for every reply before
            the controller aborts every rank (I13: a wedged rank is a global failure).
        kv_page_bytes: bytes of one KV page on one rank, all layers (default: a Qwen3-4B page
            with all 8 KV heads, the page of TP 1; the engine passes its own figure).
        memory_headroom_bytes: bytes left free on each rank once the graphs and the KV cache
            are in place (default 0; the engine leaves its gpu_memory_utilization share out of
            the free bytes each rank reports instead). Startup is refused when even the
            smallest plan does not fit beside it.
        page_size: tokens per KV page (default 16, the engine's page).
        kv_watermark: fraction of the KV pages that admission leaves free for the running
            requests' growth (default 0.01, as vLLM's block-manager watermark); raise it to
            preempt less often at the price of admitting fewer requests (I14).
        max_kv_pages: most KV pages the memory plan hands out (None: every page memory
            allows). An engine sets it to ``max_batch x pages_per_seq``, past which pages are
            never used, or lower to serve from a smaller KV cache (I14).
        max_prefill_tokens: prompt tokens one step may prefill (the admissions of a step are
            prefilled as one packed batch). A step admits requests in order while their
            prompts fit; a prompt that does not fit what is left is prefilled in chunks over
            several steps (`protocol.commands.Chunk`, I19). Default 8192: enough tokens to
            keep the GPU's GEMMs efficient, few enough that decode rows sharing the step are
            not held back long.
        short_context: tokens of context the short-context decode path holds
            (`protocol.keys.SHORT`: attention fused into the o_proj GEMM, one tile of at most
            this many cached tokens per row). A decode step whose every row's context -- its
            position + 1, the token the step writes included -- is at most this replays the
            short path's graph of its bucket; a longer row anywhere in the step sends the whole
            step to the split-KV `DECODE` graph (I22). Default None: the short path is off and
            nothing is captured for it. Set it to the tile the engine's fused kernel was built
            for, never more.
        short_max_bucket: the largest bucket (rows) with a short-path graph; steps padded to a
            larger bucket take the `DECODE` path whatever their contexts. Default 8, the most
            rows lockstep's fused kernel takes (`engine.kernels.attention_oproj.MAX_ROWS`);
            every short graph is one more graph reserved and captured, and the engine, which
            measured a gain at batch 1 only, sets 1. Checked always, used only when ``short_context`` is set.
        shape: the model's collective shape.
    """

    world_size: int = 2
    buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    max_batch: int = 256
    cuda_graphs: bool = True
    graph_batch_cap: int | None = None
    decode_overlap: bool = False
    watchdog_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    kv_page_bytes: int = 16 * 36 * 2 * 8 * 128 * 2
    memory_headroom_bytes: int = 0
    page_size: int = 16
    kv_watermark: float = 0.01
    max_kv_pages: int | None = None
    max_prefill_tokens: int = 8192
    short_context: int | None = None
    short_max_bucket: int = SHORT_MAX_BUCKET
    shape: ModelShape = field(default_factory=lambda: QWEN3_4B)

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", validate_buckets(self.buckets))
        _positive_int("world_size", self.world_size)
        _positive_int("max_batch", self.max_batch)
        _positive_int("kv_page_bytes", self.kv_page_bytes)
        _positive_int("page_size", self.page_size)
        if self.max_kv_pages is not None:
            _positive_int("max_kv_pages", self.max_kv_pages)
        if (not isinstance(self.kv_watermark, (int, float)) or isinstance(self.kv_watermark, bool)
                or not 0 <= self.kv_watermark < 1):
            raise ConfigError(f"kv_watermark={self.kv_watermark!r} must be a fraction in [0, 1)",
                              fields=("kv_watermark",))
        _positive_int("max_prefill_tokens", self.max_prefill_tokens)
        if self.max_batch > self.buckets[-1]:
            largest = (f"the largest default bucket {self.buckets[-1]}"
                       if self.buckets == DEFAULT_DECODE_BUCKETS
                       else f"the largest of buckets {','.join(map(str, self.buckets))}")
            raise ConfigError(f"max_batch={self.max_batch} exceeds {largest}; add a bucket "
                              "(buckets) or lower max_batch", fields=("max_batch", "buckets"))
        if self.graph_batch_cap is not None:
            _positive_int("graph_batch_cap", self.graph_batch_cap)
        for name in ("watchdog_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            # NaN compared false with every clock, so a missing reply was waited for forever
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not 0 < value < math.inf):
                raise ConfigError(f"{name}={value!r} must be a positive, finite number of "
                                  "seconds", fields=(name,))
        if not isinstance(self.cuda_graphs, bool):  # "no" read as true
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r} must be True or False",
                              fields=("cuda_graphs",))
        if not isinstance(self.shape, ModelShape):  # None failed at the first next_action
            raise ConfigError(f"shape={self.shape!r}: expected a protocol.config.ModelShape",
                              fields=("shape",))
        if not is_int(self.memory_headroom_bytes) or self.memory_headroom_bytes < 0:
            raise ConfigError(
                f"memory_headroom_bytes={self.memory_headroom_bytes!r} must be a non-negative integer",
                fields=("memory_headroom_bytes",))
        if not isinstance(self.decode_overlap, bool):
            raise ConfigError(f"decode_overlap={self.decode_overlap!r} must be True or False",
                              fields=("decode_overlap",))
        _positive_int("short_max_bucket", self.short_max_bucket)
        if self.short_context is not None:
            _positive_int("short_context", self.short_context)
            if self.short_max_bucket < self.buckets[0]:
                raise ConfigError(
                    f"short_max_bucket={self.short_max_bucket} is below the smallest bucket "
                    f"{self.buckets[0]}, so no bucket gets a short-path graph; raise it to a "
                    "bucket or leave short_context unset", fields=("short_max_bucket", "buckets"))


def _positive_int(name: str, value: object) -> None:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer", fields=(name,))
