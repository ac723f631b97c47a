"""What a `gemv` skinny-GEMM tile compiles to on sm_90, next to the tensor-core tiles it competes
with, without a GPU (docs/benchmarks.md, 2026-12-06, session of 20:54 UTC).

It compiles `engine.kernels.skinny_gemm._skinny_gemm_kernel` for sm_90 (H100 / H200) with
Triton's own compiler and ptxas, as the engine launches it for Qwen3-4B at one row (bf16, PDL
on, the integer arguments 16-divisible as Triton's JIT specialises them), and reads each tile's
registers and spills (`cuobjdump -res-usage`), shared memory (Triton's metadata), the programs
its grid launches, and the instructions of its main loop (`cuobjdump -sass`, the body of the
kernel's one backward branch; an unsplit one-tile program has none): weight loads, multiply-adds,
warp shuffles and barriers per K tile. Compile with the Triton the device runs (3.6 in its
image; other versions allocate otherwise):

    pip install --target /tmp/tr36 triton==3.6.0
    PYTHONPATH=/tmp/tr36:. python3 docs/experiments/gemv-tile-resources.py
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import skinny_gemm as sg

# Qwen3-4B's layer GEMMs at TP 1: (name, N, K, swiglu)
SHAPES = [("qkv", 6144, 2560, False), ("o_proj", 2560, 4096, False),
          ("gate_up", 19456, 2560, True), ("down", 2560, 9728, False)]
GEMV_TILES = [sg.TileConfig(8, 1024, 1, 8, 1, gemv=True),
              sg.TileConfig(4, 2048, 1, 8, 1, gemv=True),
              sg.TileConfig(8, 512, 2, 4, 1, gemv=True),
              sg.TileConfig(16, 512, 1, 8, 1, gemv=True)]
"""Beside each GEMM's tile in the shipped 1-row plan (`engine/layers/fused_plans.json`)."""
_POINTERS = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32",
                 count_ptr="*i32", stats_ptr="*fp32", qw_ptr="*bf16", kw_ptr="*bf16",
                 cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i32",
                 pt_ptr="*i32", kc_ptr="*bf16", vc_ptr="*bf16", o_ptr="*bf16",
                 lens_ptr="*i32", group_count_ptr="*i32")
_DIVISIBLE = ("K", "K_SPLIT", "N_OUT", "HALF")
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_tile(m: int, n: int, k: int, swiglu: bool, cfg: sg.TileConfig, **constexprs):
    """The cubin of one launch as `skinny_gemm._launch` would make it (TMA without x_tma);
    `constexprs` replace the plain GEMM's (the rope epilogue's HEADS, NQ, ...)."""
    kernel = sg._skinny_gemm_kernel
    block_m = triton.next_power_of_2(m) if cfg.gemv else max(16, triton.next_power_of_2(m))
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    const = dict(SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 SPLIT_K=triton.cdiv(k, k_split), NORM_IN=False, STATS_BLOCK=1,
                 RESIDUAL=False, STATS_STRIDE=sg.MAX_ROWS, UPCAST=False, IEEE=False, PDL=True,
                 ONE_TILE=k_split <= cfg.block_k, PAIRED=swiglu, ROW_STEP=cfg.block_n,
                 GEMV=cfg.gemv, ROW_ACC=cfg.gemv and block_m == 1 and not cfg.tma,
                 HEADS=False, NQ=1, NKV=1, PAGE=1, TMA=cfg.tma, X_TMA=False, x_desc=None,
                 ATTEND=False, GROUP=1, BLOCK_G=16, BLOCK_T=16)
    const.update(constexprs)
    signature = {}
    for name in kernel.arg_names:
        if name in const:
            signature[name] = "constexpr"
        elif name == "w_desc":
            signature[name] = (f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>" if cfg.tma
                               else "constexpr")
        elif name in _POINTERS:
            signature[name] = _POINTERS[name]
        else:
            signature[name] = "fp32" if name in ("eps", "qk_eps", "scale") else "i32"
    if not cfg.tma:
        const["w_desc"] = None
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in kernel.arg_names
             if signature[name] != "constexpr" and (name in _POINTERS or name in _DIVISIBLE
                                                    or name.startswith("stride"))}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def resources(compiled) -> dict:
    """Registers, stack bytes and main-loop instruction counts of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    fields = dict(item.split(":") for item in next(
        line for line in usage.splitlines() if "REG:" in line).split())
    body = [(int(a, 16), text) for a, text in
            re.findall(r"/\*([0-9a-f]{4})\*/\s+(.*?)\s*;", sass)]
    loop: collections.Counter = collections.Counter()
    for address, text in body:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            for a, t in body:
                if start <= a <= address:
                    op = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", t).group(1)
                    loop[op] += 1
            break
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]),
            "shared": compiled.metadata.shared, "loop": loop}


def main() -> None:
    from engine.layers.linear import load_fused_plans

    plan = next(rows[1] for key, rows in load_fused_plans().items() if "6144x2560" in key)
    print(f"Triton {triton.__version__}, sm_90, Qwen3-4B at 1 row, bf16")
    print("shape    tile                      programs regs stack shared_KB | loop: instrs "
          "weight_loads_B/thread FFMA HMMA SHFL BAR")
    for name, n, k, swiglu in SHAPES:
        for cfg in [getattr(plan, name)] + GEMV_TILES:
            n_out = n // 2 if swiglu else n
            k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
            programs = triton.cdiv(n_out, cfg.block_n) * triton.cdiv(k, k_split)
            r = resources(compile_tile(1, n, k, swiglu, cfg))
            loop = r["loop"]
            loads = (16 * loop["LDG.E.128"] + 16 * loop["LDGSTS.E.BYPASS.128"]
                     + 8 * loop["LDG.E.64"])
            tile = (f"{cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps}"
                    + (" tma" if cfg.tma else "") + (" gemv" if cfg.gemv else ""))
            hmma = sum(v for op, v in loop.items() if op.startswith("HMMA"))
            tma_note = " (bulk copies)" if cfg.tma else ""
            print(f"{name:8} {tile:25} {programs:8} {r['regs']:4} {r['stack']:5} "
                  f"{r['shared'] / 1024:9.1f} | {sum(loop.values()):11} {loads:4}{tma_note:14}"
                  f" {loop['FFMA']:4} {hmma:4} {loop['SHFL.BFLY'] + loop['SHFL.IDX']:4} "
                  f"{sum(v for op, v in loop.items() if op.startswith('BAR'))}")


if __name__ == "__main__":
    main()
