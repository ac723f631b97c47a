"""Attention options side by side on one GPU (`python -m engine.bench.attention_sweep`).

Decode: the paged Triton kernel at batch 256, 1024 cached tokens per row (Qwen3-0.6B heads:
16 query, 8 KV, head_dim 128, bf16) for several launch settings, with the achieved KV read
bandwidth. Prefill: one packed batch of ~8192 prompt tokens (prompt lengths of workload W)
through the packed Triton kernel, against per-sequence `scaled_dot_product_attention` as the
engine called it before (default backend choice) and with the flash backend forced (K/V
expanded to the query heads). Median of CUDA-event timings after warm-up; the wall column
for SDPA includes the host, which is what a step waits for.
"""

from __future__ import annotations

import random
import statistics
import time


def _time(fn, reps: int = 20, warm: int = 3) -> tuple[float, float]:
    """(median device ms by CUDA events, median wall ms) of fn()."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dev, wall = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        b.synchronize()
        wall.append(1e3 * (time.perf_counter() - t0))
        dev.append(a.elapsed_time(b))
    return statistics.median(dev), statistics.median(wall)


def decode_sweep() -> list[dict]:
    """Decode kernel at B=256, ctx 1024 for (tile tokens, warps, stages) settings."""
    import torch

    import engine.kernels.decode_attention as da

    B, ctx, hq, hkv, d, page = 256, 1024, 16, 8, 128, 16
    pages = B * ctx // page
    dev = "cuda"
    k = torch.randn(pages + 1, page, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(B, ctx // page)
    table = torch.cat([table, torch.full((1, ctx // page), pages, device=dev,
                                         dtype=torch.int32)])
    lens = torch.full((B + 1,), ctx, device=dev, dtype=torch.int32)
    slots = torch.arange(B, device=dev, dtype=torch.int32)
    q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
    kv_bytes = 2 * B * ctx * hkv * d * 2
    out = []
    saved = (da.TILE_TOKENS, da.NUM_WARPS, da.NUM_STAGES)
    try:
        for tile in (64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    da.TILE_TOKENS, da.NUM_WARPS, da.NUM_STAGES = tile, warps, stages
                    try:
                        ms, _ = _time(lambda: da.paged_decode_attention_triton(
                            q, k, v, table, lens, slots, d ** -0.5))
                    except Exception as exc:  # out of shared memory etc.
                        out.append({"tile": tile, "warps": warps, "stages": stages,
                                    "error": type(exc).__name__})
                        continue
                    out.append({"tile": tile, "warps": warps, "stages": stages, "ms": ms,
                                "GBps": kv_bytes / ms / 1e6})
    finally:
        da.TILE_TOKENS, da.NUM_WARPS, da.NUM_STAGES = saved
    return out


def prefill_compare() -> list[dict]:
    """Packed Triton prefill vs per-sequence SDPA (default, forced flash) at ~8192 tokens."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from engine.kernels.prefill_attention import PrefillBatch, prefill_attention_triton

    rng = random.Random(0)
    lens, total = [], 0
    while True:
        n = rng.randint(100, 1024)
        if total + n > 8192:
            break
        lens.append(n)
        total += n
    hq, hkv, d, page, dev = 16, 8, 128, 16, "cuda"
    pages_per = [-(-n // page) for n in lens]
    pages = sum(pages_per)
    k = torch.randn(pages + 1, page, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.full((len(lens) + 1, max(pages_per)), pages, dtype=torch.int32)
    perm = torch.randperm(pages).tolist()
    for s, n in enumerate(pages_per):
        table[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    table = table.to(dev)
    q = torch.randn(total, hq, d, device=dev, dtype=torch.bfloat16)
    batch = PrefillBatch.build(list(range(len(lens))), lens, [0] * len(lens), dev)
    res = []
    ms, wall = _time(lambda: prefill_attention_triton(q, k, v, table, batch, d ** -0.5))
    res.append({"path": "packed Triton (paged KV)", "tokens": total, "seqs": len(lens),
                "device_ms": ms, "wall_ms": wall})
    qs = [torch.randn(1, hq, n, d, device=dev, dtype=torch.bfloat16) for n in lens]
    ks = [torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16) for n in lens]

    def sdpa_default():
        for a, b in zip(qs, ks):
            F.scaled_dot_product_attention(a, b, b, is_causal=True, enable_gqa=True)

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for a, b in zip(qs, ks):
                e = b.repeat_interleave(hq // hkv, dim=1)
                F.scaled_dot_product_attention(a, e, e, is_causal=True)

    for name, fn in (("per-sequence SDPA, flash forced", sdpa_flash),
                     ("per-sequence SDPA, default backend", sdpa_default)):
        ms, wall = _time(fn, reps=5, warm=1)
        res.append({"path": name, "tokens": total, "seqs": len(lens), "device_ms": ms,
                    "wall_ms": wall})
    return res


def main() -> None:
    """Print both tables and write JSON to the path given as argv[1], if any."""
    import json
    import sys

    dec = decode_sweep()
    for r in dec:
        print("decode", r, flush=True)
    pre = prefill_compare()
    for r in pre:
        print("prefill", r, flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"decode": dec, "prefill": pre}, f, indent=1)


if __name__ == "__main__":
    main()
