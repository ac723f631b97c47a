"""Attention options side by side on one GPU (`python -m engine.bench.attention_sweep`).

Context: decode attention per layer at contexts 128 / 1k / 4k / 16k and batch 1 / 8 / 64 /
256, one program per (row, kv head) against the split-KV path (`--context` runs only this).
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
    saved = (da.TILE_TOKENS, da.NUM_WARPS_ONE_SPLIT, da.NUM_STAGES)
    try:
        for tile in (64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    da.TILE_TOKENS, da.NUM_WARPS_ONE_SPLIT, da.NUM_STAGES = tile, warps, stages
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
        da.TILE_TOKENS, da.NUM_WARPS_ONE_SPLIT, da.NUM_STAGES = saved
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


def context_sweep(contexts=(128, 1024, 4096, 16384), batches=(1, 8, 64, 256),
                  heads=((16, 8), (32, 8))) -> list[dict]:
    """Decode attention per layer against context length: one program per (row, kv head)
    against the split-KV path (`SplitWorkspace`), Qwen3-0.6B (16 q / 8 kv heads) and 4B
    (32 / 8) heads, head_dim 128, bf16; device us and KV read GB/s."""
    import torch

    import engine.kernels.decode_attention as da

    d, page, dev = 128, 16, "cuda"
    out = []
    for hq, hkv in heads:
        ws = da.SplitWorkspace.for_heads(dev, hq, hkv, d)
        for ctx in contexts:
            for B in batches:
                pages = B * ctx // page
                k = torch.randn(pages + 1, page, hkv, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                table = torch.randperm(pages, device=dev, dtype=torch.int32).view(B, ctx // page)
                lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
                slots = torch.arange(B, device=dev, dtype=torch.int32)
                q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
                kv_bytes = 2 * B * ctx * hkv * d * 2
                row = {"q_heads": hq, "kv_heads": hkv, "context": ctx, "batch": B,
                       "splits": da.num_splits(B, hkv)}
                for name, w in (("single", None), ("split", ws)):
                    ms, _ = _time(lambda: da.paged_decode_attention_triton(
                        q, k, v, table, lens, slots, d ** -0.5, workspace=w))
                    row[f"{name}_us"] = 1e3 * ms
                    row[f"{name}_GBps"] = kv_bytes / (ms * 1e-3) / 1e9
                out.append(row)
                print("context", row, flush=True)
                del k, v
    return out


def build_parser():
    """The command line of `main`: every option with its help and default."""
    from lockstep.cli import OneLineParser

    p = OneLineParser(prog="python -m engine.bench.attention_sweep", error_name="attention_sweep",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", metavar="OUT.json",
                   help="write every measurement here (default: printed only)")
    p.add_argument("--context", action="store_true",
                   help="run only the context sweep (default: context, decode and prefill)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the tables and write JSON to the path given as the one positional argument, if
    any; `--context` runs only the context sweep. Returns the exit status: 2 for a bad
    argument (one line, `lockstep.cli.OneLineParser`'s for what argparse refuses) or no CUDA
    GPU, before any GPU work; `--help` prints the usage and exits 0."""
    import json
    import sys

    from engine.bench.options import BenchArgError, check_output_path, cuda_missing

    args = build_parser().parse_args(argv)
    if args.out is not None:  # the output path before the sweep, not after it
        try:
            check_output_path("OUT.json", args.out)
        except BenchArgError as exc:
            print(f"attention_sweep: error: {exc}", file=sys.stderr)
            return 2
    if cuda_missing("attention_sweep"):
        return 2
    result = {"context": context_sweep()}
    if not args.context:
        result["decode"] = decode_sweep()
        for r in result["decode"]:
            print("decode", r, flush=True)
        result["prefill"] = prefill_compare()
        for r in result["prefill"]:
            print("prefill", r, flush=True)
    if args.out is not None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
