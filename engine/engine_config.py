"""`EngineConfig`: the one configuration of an engine, shared by the controller and every rank.

`EngineConfig.create(model_dir, ...)` takes the user's arguments (those of `LLM`), checks
every one before any rank starts or any device memory is allocated, resolves the defaults
(dtype from the checkpoint, max_model_len, graphs on CUDA, decode buckets, startup timeout)
and holds the model's config; the derived values (dtype bytes, per-rank heads, KV page bytes,
pages per sequence) are computed from it in one place, and `protocol_config()` produces the
protocol's `ProtocolConfig` from it. Plain values only: rank processes receive it by pickling.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig, check_parallel, load_model_config
from engine.env import check_switches, switch
from engine.errors import ModelDirError, ParallelConfigError, cuda_missing

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


DECODE_GEMMS = ("auto", "cublas")

FAULTS = ("raise", "exit", "kill", "stop", "hang")
"""The kinds of `EngineConfig.fault` (`engine.ranks` injects each)."""

SHORT_DECODE_TOKENS = 128
"""Context (tokens, the step's own included) up to which a decode step of at most
SHORT_DECODE_MAX_BUCKET rows replays the short path (`protocol.keys.SHORT`): attention fused
into o_proj, one tile of this many tokens (`engine.kernels.attention_oproj`)."""

SHORT_DECODE_MAX_BUCKET = 1
"""The largest bucket with a short-path graph: on an H200 the fused form made Qwen3-0.6B's
batch-1 step 0.780 -> 0.736 ms at context 128, and batch 2 and 4 slower (0.793 -> 0.808,
0.802 -> 0.853 ms; `engine.kernels.attention_oproj`)."""

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""Share of each GPU's memory the engine may hold where `LLM(..., gpu_memory_utilization=None)`
(the default) leaves it unset."""


MAX_MODEL_LEN = 2**24
"""The longest max_model_len: the RoPE table's positions are float32, whose integers are exact up
to 2**24 (a position past it rotates by a neighbour's angle)."""


def check_init_method(method) -> None:
    """Refuse a `EngineConfig.dist_init_method` the spawned ranks could not meet at: it is ""
    (the spawning process's store), ``env://``, ``file://PATH`` or ``tcp://HOST:PORT`` with a
    port in 1..65535. The host is not resolved here.

    Raises:
        ParallelConfigError: naming the value and what is wrong with it.
    """
    from urllib.parse import urlsplit

    if not isinstance(method, str):
        raise ParallelConfigError(f"dist_init_method = {method!r}, expected a str")
    if method in ("", "env://"):
        return
    url = urlsplit(method)
    if url.scheme == "file" and url.path:
        return
    if url.scheme != "tcp":
        raise ParallelConfigError(f"dist_init_method = {method!r}, expected '', 'env://', "
                                  "'file://PATH' or 'tcp://HOST:PORT'")
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None or not 0 < port < 65536:
        raise ParallelConfigError(f"dist_init_method = {method!r}, expected tcp://HOST:PORT "
                                  "with a host and a port in 1..65535")


def short_decode_default(device: str, cuda_graph: bool, world_size: int) -> bool:
    """`EngineConfig.short_decode` as `create` sets it: on with CUDA graphs at world size 1,
    unless the environment sets LOCKSTEP_SHORT_DECODE=0 (the benchmarks' A/B baseline) or
    LOCKSTEP_FUSED_NORM=0 (no fused layer form, which the short path shortens).

    Raises:
        ParallelConfigError: either switch set to a value other than 0 or 1 (`engine.env`).
    """
    return (device == "cuda" and cuda_graph and world_size == 1
            and switch("LOCKSTEP_SHORT_DECODE") and switch("LOCKSTEP_FUSED_NORM"))


def check_timeout(name: str, value) -> None:
    """Raises ParallelConfigError unless ``value`` is a positive, finite number of seconds
    below 1e9 (a NaN startup timeout expired at once and aborted the process; an infinite one
    overflowed the watchdog's timer thread)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value < 1e9 or math.isnan(value)):
        raise ParallelConfigError(f"{name} = {value!r}, expected a positive, finite number of "
                                  "seconds below 1e9")


def check_model_dir_arg(model_dir) -> None:
    """Raises ModelDirError unless ``model_dir`` is a non-empty path (str or os.PathLike)."""
    if not isinstance(model_dir, (str, os.PathLike)):
        raise ModelDirError(f"model_dir = {model_dir!r}, expected a path to a model directory")
    if isinstance(model_dir, str) and not model_dir.strip():  # else read as '.'
        raise ModelDirError(f"model_dir = {model_dir!r} is empty; name the model directory")


def check_model_fits(model: ModelConfig, world_size: int, device: str) -> None:
    """Check that ``world_size`` ranks split ``model`` exactly (`check_parallel`), that its
    weights hold every tensor with the right shape (`engine.weights.WeightIndex`) and, on
    CUDA, that CUDA works and ``world_size`` GPUs are visible (unless under torchrun).

    Raises:
        ParallelConfigError, ModelDirError: naming the setting or file.
    """
    from engine.weights import WeightIndex

    check_parallel(model, world_size)
    WeightIndex(model)
    if device == "cuda":
        import torch

        from engine.ranks import torchrun_env

        problem = cuda_missing()
        if problem is not None:
            raise ParallelConfigError(f"device = 'cuda' {problem}")
        if torch.cuda.device_count() < world_size and torchrun_env() is None:
            raise ParallelConfigError(
                f"tensor_parallel_size = {world_size} needs that many GPUs; "
                f"{torch.cuda.device_count()} visible")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the controller and a rank need. Build it with `create` (checks, defaults);
    direct construction takes the values as given (tests and benchmarks), and `LLM` checks
    them with `validate` before any rank starts.

    Attributes:
        model_dir: HF-layout Qwen3 directory.
        world_size: tensor-parallel size (ranks); `LLM`'s tensor_parallel_size.
        device: "cpu" (gloo between ranks) or "cuda" (rank r on cuda:r, NCCL).
        dtype: parameter and KV-cache dtype, one of DTYPES; `create` defaults to the
            checkpoint's dtype (bfloat16 when it names another).
        max_batch: decode slots (most requests decoded together), 1..256.
        max_model_len: longest sequence, prompt + generated tokens, at most
            max_position_embeddings and MAX_MODEL_LEN (2**24); `create` defaults to
            min(max_position_embeddings, 2048).
        page_size: tokens per KV page (power of two >= 16 for the Triton kernels), at most
            max_model_len rounded up to a power of two (one page then holds a sequence).
        kv_cache_pages: most KV pages per rank (None: as many as memory allows, up to
            max_batch x pages_per_seq). Pages are handed out as sequences grow and a short
            cache preempts requests for recompute (I14), so any value that holds one
            full-length sequence serves every request.
        max_prefill_tokens: prompt tokens one step prefills as one packed batch; admission
            stops at this budget, and a prompt that does not fit what is left is prefilled in
            chunks over several steps (chunked prefill, decode rows going on beside it).
            Default 8192.
        buckets: decode buckets (ascending, last >= max_batch); `create` takes the default
            buckets up to the one that holds max_batch.
        step_timeout_s: seconds to wait for every rank's reply to one serving or teardown
            command; past it the missing ranks are declared failed and every rank is
            stopped (I13). The one value used by the controller and the transport. 300 s.
        startup_timeout_s: seconds the ranks may take to start (load the model) and the
            startup sweep may take, under the watchdog that aborts (I6); `create` defaults
            to step_timeout_s.
        cuda_graph: capture one decode graph per eligible bucket at startup and replay them
            for every step's decode rows, mixed steps' too (their prefill runs eagerly
            first; I21) (CUDA only); `create` defaults to on with CUDA.
        gpu_memory_utilization: fraction (0, 1] of each GPU's memory the engine may hold
            (weights, activations, graphs, KV cache). Default 0.9
            (`DEFAULT_GPU_MEMORY_UTILIZATION`); `create` refuses it given with a device other
            than CUDA, where nothing is measured against it.
        progress: print loading progress, capture progress and the memory report to stderr.
        trace: ranks return a `protocol.trace.TraceEvent` per backend op with each reply.
        dist_init_method: torch.distributed init method (tcp://host:port or env://) of spawned
            ranks; empty (the default): they meet at a store the spawning process holds
            (`engine.rendezvous`).
        fault: test hook, None in normal use: (rank, command seq, "raise" | "exit" | "kill" |
            "stop" | "hang") makes that rank fail, exit, get SIGKILL, get SIGSTOP or go silent
            when it receives that command (rank in 0..world_size - 1, seq >= 0, a kind of
            FAULTS; `validate` refuses anything else).
        graph_standin: test hook, False in normal use: with cuda_graph on CPU, the graph ops
            run through `engine.graphs.StandInGraphs` (eager replays).
        model: the model's config (read from model_dir when None).
        decode_overlap: overlapped scheduling (`protocol.config.ProtocolConfig.decode_overlap`):
            each step is built and launched while the previous one runs, its rows reading
            their input tokens from the previous step's sampled ids on the device; every rank
            samples (identical logits, counter-based random stream). `create` defaults to on
            at tensor_parallel_size 1 and off under TP, where it runs when asked for but was
            tested on CPU ranks (gloo) only.
        decode_gemm: "auto" (default): decode GEMMs of up to 64 rows use the Triton skinny GEMM
            where `engine/kernels/skinny_gemm_table.json` measured it faster than cuBLAS;
            "cublas": every GEMM through cuBLAS (the A/B baseline of `lockstep bench`).
        short_decode: capture and replay the short-context decode path (`short_context`);
            `create` turns it on with CUDA graphs at tensor_parallel_size 1 (the fused layer
            form it shortens runs there only) unless the environment sets
            LOCKSTEP_SHORT_DECODE=0 (the A/B baseline of the benchmarks; `engine.env`).
    """

    model_dir: str
    world_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 8
    max_model_len: int = 512
    page_size: int = 16
    kv_cache_pages: int | None = None
    max_prefill_tokens: int = 8192
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    step_timeout_s: float = 300.0
    startup_timeout_s: float = 300.0
    cuda_graph: bool = False
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    progress: bool = False
    trace: bool = False
    dist_init_method: str = ""
    fault: tuple[int, int, str] | None = None
    graph_standin: bool = False
    model: ModelConfig | None = None
    decode_gemm: str = "auto"
    decode_overlap: bool = False
    short_decode: bool = False

    @classmethod
    def create(cls, model_dir, tensor_parallel_size: int = 1, device: str = "cpu",
               dtype: str | None = None, max_batch: int = 8, max_model_len: int | None = None,
               page_size: int = 16, kv_cache_pages: int | None = None,
               max_prefill_tokens: int = 8192,
               step_timeout_s: float = 300.0, startup_timeout_s: float | None = None,
               cuda_graph: bool | None = None, gpu_memory_utilization: float | None = None,
               progress: bool = False, record_trace: bool = False, fault=None,
               graph_standin: bool = False,
               decode_overlap: bool | None = None) -> "EngineConfig":
        """Check the arguments (those of `LLM`) and the model directory; resolve defaults.

        Raises:
            ModelDirError, ParallelConfigError (ValueError): a bad directory or setting, named
                with its value, before any rank starts or device memory is allocated; also
                cuda_graph=True on CPU, a gpu_memory_utilization given on CPU (None: the
                default), or on a torch without separate instantiate/upload, or
                an environment switch (`engine.env.SWITCHES`) set to other than 0 or 1.
        """
        from protocol.buckets import DEFAULT_DECODE_BUCKETS, select_bucket

        check_switches()  # read again in the ranks and at each kernel launch (LOCKSTEP_PDL)

        if cuda_graph is None:
            cuda_graph = device == "cuda"
        if not isinstance(cuda_graph, bool):
            raise ParallelConfigError(f"cuda_graph = {cuda_graph!r}, expected True, False or None")
        if decode_overlap is None:
            decode_overlap = tensor_parallel_size == 1
        if not isinstance(decode_overlap, bool):
            raise ParallelConfigError(f"decode_overlap = {decode_overlap!r}, expected True, "
                                      "False or None")
        for name, value in (("progress", progress), ("record_trace", record_trace),
                            ("graph_standin", graph_standin)):
            if not isinstance(value, bool):
                raise ParallelConfigError(f"{name} = {value!r}, expected True or False")
        check_timeout("step_timeout_s", step_timeout_s)
        if startup_timeout_s is None:
            startup_timeout_s = step_timeout_s
        check_timeout("startup_timeout_s", startup_timeout_s)
        utilization_given = gpu_memory_utilization is not None
        if not utilization_given:
            gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
        check_model_dir_arg(model_dir)
        model = load_model_config(model_dir)
        check_model_fits(model, tensor_parallel_size, device)
        if dtype is None:  # only None means the checkpoint's: "" or 0 is named by validate
            dtype = model.torch_dtype if model.torch_dtype in DTYPES else "bfloat16"
        if max_model_len is None:
            max_model_len = min(model.max_position, 2048)
        if (not isinstance(max_batch, int) or isinstance(max_batch, bool)
                or not 1 <= max_batch <= DEFAULT_DECODE_BUCKETS[-1]):
            raise ParallelConfigError(f"max_batch = {max_batch!r}, expected 1.."
                                      f"{DEFAULT_DECODE_BUCKETS[-1]}")
        buckets = tuple(b for b in DEFAULT_DECODE_BUCKETS
                        if b <= select_bucket(max_batch, DEFAULT_DECODE_BUCKETS))
        config = cls(
            model_dir=str(model_dir), world_size=tensor_parallel_size, device=device,
            dtype=dtype, max_batch=max_batch, max_model_len=max_model_len, page_size=page_size,
            kv_cache_pages=kv_cache_pages, max_prefill_tokens=max_prefill_tokens, buckets=buckets,
            step_timeout_s=step_timeout_s, startup_timeout_s=startup_timeout_s,
            cuda_graph=cuda_graph, gpu_memory_utilization=gpu_memory_utilization,
            progress=progress, trace=record_trace, fault=fault, graph_standin=graph_standin,
            model=model, decode_overlap=decode_overlap,
            short_decode=short_decode_default(device, cuda_graph, tensor_parallel_size))
        config.validate()
        if utilization_given and device != "cuda":  # as `lockstep generate` refuses it
            raise ParallelConfigError(
                f"gpu_memory_utilization = {gpu_memory_utilization!r} applies to device = "
                f"'cuda' only (device = {device!r} sizes its KV cache without it); leave it out")
        if cuda_graph and device == "cuda":
            from engine.graphs import GraphError, check_graph_support

            try:
                check_graph_support()
            except GraphError as exc:
                raise ParallelConfigError(str(exc)) from None
        return config

    # -- derived values ------------------------------------------------------------------------

    @property
    def model_config(self) -> ModelConfig:
        """The model's config (`model`, or read from model_dir)."""
        return self.model if self.model is not None else load_model_config(self.model_dir)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per parameter and KV element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def q_heads_per_rank(self) -> int:
        """Query heads on one rank."""
        return self.model_config.num_q_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads on one rank."""
        return self.model_config.num_kv_heads // self.world_size

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one KV page on one rank: K and V, every layer, page_size tokens."""
        m = self.model_config
        return (2 * m.num_layers * self.page_size * self.kv_heads_per_rank * m.head_dim
                * self.dtype_bytes)

    @property
    def pages_per_seq(self) -> int:
        """KV pages one full-length sequence needs."""
        return -(-self.max_model_len // self.page_size)

    @property
    def short_context(self) -> int | None:
        """`protocol.config.ProtocolConfig.short_context`: SHORT_DECODE_TOKENS with
        `short_decode` where the buckets start at or below SHORT_DECODE_MAX_BUCKET, the model is
        bfloat16, the decode GEMMs are the skinny ones and pages are no longer than the tile,
        else None: elsewhere the layer runs
        unfused and a short-path graph would be the same computation as the `DECODE` one.
        Where the model's plan at one row has no rope epilogue (Qwen3-4B's), or its layer
        runs unfused there, the short graph is still captured and runs the `DECODE` kernels
        (`engine.model.fuses_attention_oproj`, `Qwen3ForCausalLM.fuses_short_path`): which
        plan a model gets is known only once its weights are loaded, after the protocol's
        configuration is fixed."""
        if (not self.short_decode or not self.cuda_graph or self.decode_gemm != "auto"
                or self.dtype != "bfloat16" or self.buckets[0] > SHORT_DECODE_MAX_BUCKET
                or self.page_size > SHORT_DECODE_TOKENS):
            return None
        return SHORT_DECODE_TOKENS

    def protocol_config(self):
        """The protocol's `ProtocolConfig` for this engine (same on every rank)."""
        from protocol.config import ModelShape, ProtocolConfig

        m = self.model_config
        full = self.max_batch * self.pages_per_seq  # pages past this are never used
        return ProtocolConfig(
            world_size=self.world_size, buckets=self.buckets, max_batch=self.max_batch,
            cuda_graphs=self.cuda_graph, watchdog_timeout_s=self.startup_timeout_s,
            step_timeout_s=self.step_timeout_s, kv_page_bytes=self.kv_page_bytes,
            page_size=self.page_size,
            max_kv_pages=min(full, self.kv_cache_pages or full),
            max_prefill_tokens=self.max_prefill_tokens, decode_overlap=self.decode_overlap,
            short_context=self.short_context, short_max_bucket=SHORT_DECODE_MAX_BUCKET,
            shape=ModelShape(m.hidden_size, m.num_layers, dtype_bytes=self.dtype_bytes,
                             name=Path(self.model_dir).name))

    def validate(self) -> None:
        """Check every setting against the others and the model's config.json, as `create`
        does for its arguments. The weights and the devices are checked by `check_model_fits`
        (which `create` runs, and `LLM` for a config built directly), not here: the benchmarks
        build CUDA settings on machines that only plan a run.

        Raises:
            ModelDirError: a model_dir that is no path, or whose config.json is refused.
            ParallelConfigError: naming the bad setting and its value: a timeout that is not a
                positive finite number of seconds below 1e9, a world size that does not
                divide the model, a max_model_len past 2**24 or the model's
                max_position_embeddings, and the rest below.
        """
        check_model_dir_arg(self.model_dir)
        check_timeout("step_timeout_s", self.step_timeout_s)
        check_timeout("startup_timeout_s", self.startup_timeout_s)
        if self.device not in ("cpu", "cuda"):
            raise ParallelConfigError(f"device = {self.device!r}, expected 'cpu' or 'cuda'")
        if self.dtype not in DTYPES:
            raise ParallelConfigError(f"dtype = {self.dtype!r}, expected one of {DTYPES}")
        for name in ("world_size", "max_batch", "max_model_len", "page_size",
                     "max_prefill_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParallelConfigError(f"{name} = {v!r}, expected a positive integer")
        model = self.model_config
        check_parallel(model, self.world_size)
        if self.max_model_len > MAX_MODEL_LEN:
            raise ParallelConfigError(f"max_model_len = {self.max_model_len} exceeds "
                                      f"{MAX_MODEL_LEN} (2**24): RoPE positions are float32, "
                                      "exact only up to there")
        if self.max_model_len > model.max_position:
            raise ParallelConfigError(f"max_model_len = {self.max_model_len} exceeds the "
                                      f"model's max_position_embeddings {model.max_position}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ParallelConfigError(f"gpu_memory_utilization = {u!r}, expected a fraction "
                                      "in (0, 1]")
        if self.cuda_graph and self.device != "cuda" and not self.graph_standin:
            raise ParallelConfigError("cuda_graph = True needs device = 'cuda' (the CPU path "
                                      "runs eager only); pass cuda_graph=False")
        if self.decode_gemm not in DECODE_GEMMS:
            raise ParallelConfigError(f"decode_gemm = {self.decode_gemm!r}, expected one of "
                                      f"{DECODE_GEMMS}")
        for name in ("cuda_graph", "short_decode", "decode_overlap", "progress", "trace",
                     "graph_standin"):
            if not isinstance(getattr(self, name), bool):
                raise ParallelConfigError(f"{name} = {getattr(self, name)!r}, expected True "
                                          "or False")
        check_init_method(self.dist_init_method)
        f = self.fault
        if f is not None:
            if not isinstance(f, tuple) or len(f) != 3:
                raise ParallelConfigError(f"fault = {f!r}, expected None or a tuple (rank, "
                                          "command seq, kind)")
            rank, seq, kind = f
            if (isinstance(rank, bool) or not isinstance(rank, int)
                    or not 0 <= rank < self.world_size):
                raise ParallelConfigError(
                    f"fault = {f!r}: rank {rank!r}, expected an integer in "
                    f"0..{self.world_size - 1} (tensor_parallel_size {self.world_size})")
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise ParallelConfigError(f"fault = {f!r}: command seq {seq!r}, expected an "
                                          "integer >= 0")
            if kind not in FAULTS:
                raise ParallelConfigError(f"fault = {f!r}: kind {kind!r}, expected one of "
                                          f"{FAULTS}")
        k = self.kv_cache_pages
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                              or k < self.pages_per_seq):
            raise ParallelConfigError(
                f"kv_cache_pages = {k!r}, expected an integer >= {self.pages_per_seq} (one "
                f"sequence of max_model_len {self.max_model_len} tokens in pages of "
                f"{self.page_size})")
        if self.page_size & (self.page_size - 1) or self.page_size < 16:
            raise ParallelConfigError(f"page_size = {self.page_size}, expected a power of two "
                                      ">= 16 (Triton decode attention tile)")
        most = max(16, 1 << (self.max_model_len - 1).bit_length())
        if self.page_size > most:  # 2**28 reached the rank and failed its KV allocation there
            raise ParallelConfigError(f"page_size = {self.page_size}, expected at most {most}: "
                                      f"one page holds a whole sequence of max_model_len "
                                      f"{self.max_model_len} tokens")
