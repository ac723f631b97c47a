"""Refuse a benchmark whose weights and KV cache cannot fit its GPUs, before anything is written
or loaded: the decode bench allocates a KV cache for every slot at the longest context (256
slots with the capture sweep), which at long contexts is hundreds of GiB; workload W needs at
least the weights and one sequence of --max-model-len tokens."""

from __future__ import annotations

import math

from engine.bench.options import BenchArgError

GiB = 2**30


def weight_and_kv_bytes(shape: dict, world_size: int, dtype_bytes: int, max_batch: int,
                        max_model_len: int, page_size: int) -> tuple[int, int]:
    """A lower bound of one rank's (weight bytes, KV cache bytes) for a Qwen3 dense ``shape``
    (config.json's keys: hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, vocab_size, tie_word_embeddings): every
    checkpoint tensor (`engine.model_dir.tensor_shapes`) split over ``world_size`` ranks, and
    K and V for ``max_batch`` slots of ``max_model_len`` tokens in pages of ``page_size`` plus
    the padding page, in ``dtype_bytes`` bytes an element."""
    from engine.model_dir import tensor_shapes

    weights = (sum(math.prod(dims) for _, dims in tensor_shapes(shape)) // world_size
               * dtype_bytes)
    layers, kv_heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    pages = max_batch * -(-max_model_len // page_size) + 1
    page_bytes = (2 * layers * page_size * (kv_heads // world_size) * shape["head_dim"]
                  * dtype_bytes)
    return weights, pages * page_bytes


def check_fits(shape: dict, opts, device_bytes: int) -> None:
    """Raise BenchArgError naming the options if one rank's weights and KV cache need more than
    ``device_bytes`` (the smallest GPU's total memory).

    Raises:
        BenchArgError: with the bytes needed and the device's, and what to lower.
    """
    from engine.bench.decode import PAGE_SIZE, slots_for
    from engine.engine_config import DTYPE_BYTES

    max_batch = slots_for(opts)
    weights, kv = weight_and_kv_bytes(shape, opts.tensor_parallel_size, DTYPE_BYTES[opts.dtype],
                                      max_batch, max(opts.context_lens) + 1, PAGE_SIZE)
    if weights + kv > device_bytes:
        sweep = " (the capture sweep's 256; --no-capture-sweep sizes it to the batch sizes)" \
            if opts.capture_sweep else ""
        raise BenchArgError(
            f"--context-lens {max(opts.context_lens)} needs a KV cache of {kv / GiB:.1f} GiB per "
            f"GPU for {max_batch} slots{sweep}, beside {weights / GiB:.1f} GiB of weights: more "
            f"than the GPU's {device_bytes / GiB:.1f} GiB; shorten the context, lower the batch "
            "sizes or raise --tensor-parallel-size")


def check_serving_fits(shape: dict, tensor_parallel_size: int, dtype: str, max_model_len: int,
                       device_bytes: int, model: str) -> None:
    """Raise BenchArgError if one rank's weights and the KV cache of one sequence of
    ``max_model_len`` tokens (a lower bound of what the engine's startup plans,
    `protocol.memory.plan_memory`) need more than ``device_bytes``: a preset's weights
    would be written to disk, and loaded, before the engine refused.

    Raises:
        BenchArgError: naming ``model`` (``--preset NAME`` or ``--model PATH``), the bytes
            needed and the GPU's.
    """
    from engine.engine_config import DTYPE_BYTES, EngineConfig

    weights, kv = weight_and_kv_bytes(shape, tensor_parallel_size, DTYPE_BYTES[dtype], 1,
                                      max_model_len, EngineConfig.page_size)
    if weights + kv > device_bytes:
        raise BenchArgError(
            f"{model}: {weights / GiB:.1f} GiB of {dtype} weights per GPU and one sequence's KV "
            f"cache at --max-model-len {max_model_len} ({kv / GiB:.1f} GiB) need more than the "
            f"GPU's {device_bytes / GiB:.1f} GiB; use a smaller model or raise "
            "--tensor-parallel-size")
