"""The HBM floor of a decode step: bytes it must read over the read bandwidth measured here.

The floor counts each weight byte once per step (tied embeddings once) and each cached K/V
byte the step attends to; activations, logits and the KV write are small beside them and are
left out, so the floor is a lower bound.
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


def weight_bytes(model) -> int:
    """Bytes of this rank's distinct parameters (a tied LM head counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_read(num_layers: int, kv_heads: int, head_dim: int, batch: int, context: int,
                  itemsize: int) -> int:
    """K and V bytes one decode step reads on one rank: every layer, row and cached token."""
    return 2 * num_layers * batch * context * kv_heads * head_dim * itemsize
