"""The floors of a decode step: bytes it must read over the read bandwidth measured here, and
the roofline, which also counts the arithmetic it must do at the matmul rate measured here.

The HBM floor counts each weight byte once per step (tied embeddings once; an untied
embedding table only the rows the step looks up) and each cached K/V byte the step attends
to; activations, logits and the KV write are small beside them and are left out, so the floor
is a lower bound.

The roofline floor is the HBM floor where the bytes bound the step and the arithmetic where
that does: for the GEMMs, max(weight bytes / read bandwidth, GEMM FLOPs / matmul rate); for
the attention, max(K/V bytes / read bandwidth, attention FLOPs / matmul rate); the two parts
add, as a decode layer runs its attention and its GEMMs one after another. A step of few rows
is bound by bytes (the two floors agree); a step of many rows, 256 at Qwen3-4B on an H200,
does 2 x rows FLOPs per weight element, more than the GPU's FLOPs per byte read, and the
roofline is the higher floor there. FLOPs are counted for the real rows, not the bucket's
padding.
"""

from __future__ import annotations

# Size of the bandwidth probe: 2 GiB of bf16, far past the 60 MB L2 so that repeated sums
# read HBM, and long enough (~0.5 ms) that launch overhead is noise.
PROBE_BYTES = 2 * 1024**3


def measure_read_bandwidth(device, repeats: int = 30) -> float:
    """Median read bandwidth of `torch.sum` over a 2 GiB random bf16 tensor, bytes/s."""
    import torch

    x = torch.randn(PROBE_BYTES // 2, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        out = torch.sum(x, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = torch.sum(x, dtype=torch.float32)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    assert torch.isfinite(out), "bandwidth probe produced a non-finite sum"
    del x
    times.sort()
    return PROBE_BYTES / times[len(times) // 2]


# Size of the matmul-rate probe: a bf16 GEMM of 8192 x 8192 x 8192 (1.1 TFLOP, about 1.4 ms on
# an H200), large enough that cuBLAS runs at its sustained rate.
PROBE_MATMUL = 8192


def measure_matmul_rate(device, repeats: int = 20, n: int = PROBE_MATMUL) -> float:
    """Median bf16 matmul rate of `torch.matmul` on [n, n] x [n, n] (2 n^3 FLOPs), FLOP/s."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        c = a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        c = a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    assert torch.isfinite(c).all(), "matmul probe produced a non-finite product"
    del a, b, c
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def _untied_embedding(model):
    """The model's input embedding weight when the LM head does not share it, else None."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is None:
        return None
    if head is not None and head.weight.data_ptr() == embed.weight.data_ptr():
        return None
    return embed.weight


def weight_bytes(model, batch: int | None = None) -> int:
    """Bytes of this rank's distinct parameters (a tied LM head counted once).

    With `batch`, the bytes one decode step of `batch` rows reads: an untied embedding table
    counts only the `batch` rows it looks up (at most its own size)."""
    untied = _untied_embedding(model)
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if batch is not None and untied is not None and p.data_ptr() == untied.data_ptr():
            total += min(batch, p.shape[0]) * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def gemm_flops(model, batch: int) -> int:
    """FLOPs of one decode step's GEMMs on this rank: 2 x `batch` x the elements of every
    distinct 2-D weight that multiplies activations (the LM head included, an untied
    embedding table, a lookup, not)."""
    untied = _untied_embedding(model)
    skip = {untied.data_ptr()} if untied is not None else set()
    elements = 0
    for p in model.parameters():
        if p.dim() != 2 or p.data_ptr() in skip:
            continue
        skip.add(p.data_ptr())
        elements += p.numel()
    return 2 * batch * elements


def attention_flops(num_layers: int, q_heads: int, head_dim: int, batch: int,
                    context: int) -> int:
    """FLOPs of one decode step's attention on this rank: q.K and p.V, 2 FLOPs per
    multiply-add each, for every layer, row, query head and cached token."""
    return 4 * num_layers * batch * context * q_heads * head_dim


def roofline_seconds(weight_bytes: float, kv_bytes: float, gemm_flops: float,
                     attention_flops: float, read_bandwidth_Bps: float,
                     matmul_Fps: float) -> float:
    """The roofline floor of a step, seconds: max(bytes / bandwidth, FLOPs / rate) for its
    GEMMs plus the same for its attention (see the module docstring).

    Raises:
        ValueError: a bandwidth or rate that is not positive.
    """
    if read_bandwidth_Bps <= 0 or matmul_Fps <= 0:
        raise ValueError(f"read bandwidth {read_bandwidth_Bps} B/s and matmul rate "
                         f"{matmul_Fps} FLOP/s must be positive")
    return (max(weight_bytes / read_bandwidth_Bps, gemm_flops / matmul_Fps)
            + max(kv_bytes / read_bandwidth_Bps, attention_flops / matmul_Fps))


def kv_bytes_read(num_layers: int, kv_heads: int, head_dim: int, batch: int, context: int,
                  itemsize: int) -> int:
    """K and V bytes one decode step reads on one rank: every layer, row and cached token."""
    return 2 * num_layers * batch * context * kv_heads * head_dim * itemsize
