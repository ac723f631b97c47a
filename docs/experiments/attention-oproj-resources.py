"""What one program of the short path's fused attention + o_proj holds, and how many fit an SM.

Stand-alone, no GPU needed: it compiles `engine.kernels.attention_oproj._attn_oproj_kernel`
for sm_90 (H100 / H200) with Triton's own compiler and ptxas, then reads each launch setting's
shared memory (Triton's metadata), registers and stack (spills, `cuobjdump -res-usage`), and
from them the programs an SM holds and the waves a decode step's grid takes. Compile with the
Triton the device runs (3.6 in its image; other versions allocate otherwise):

    pip install --target /tmp/tr36 triton==3.6.0
    PYTHONPATH=/tmp/tr36:. python3 docs/experiments/attention-oproj-resources.py

Shapes: Qwen3-0.6B (16 query heads on 8 kv heads, group 2, hidden 1024) and Qwen3-4B (32 on
8, group 4, hidden 2560); head_dim 128, one row, a 128-token tile, bf16, PDL on.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import engine.kernels.attention_oproj as ao

SMS = 132
"""SMs of an H100 SXM and of an H200."""
SHARED_PER_SM = 228 * 1024
"""Shared memory an sm_90 SM can give its resident programs (bytes)."""
REGS_PER_SM = 65536
"""32-bit registers of an sm_90 SM."""
KV_HEADS, HEAD_DIM = 8, 128
MODELS = {"qwen3-0.6b": (2, 1024), "qwen3-4b": (4, 2560)}  # (group, hidden)
SETTINGS = [(128, 4), (128, 8), (64, 4), (64, 8), (32, 4), (32, 8)]  # (block_n, warps)

_ARGS = [("q_ptr", "*bf16"), ("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("pt_ptr", "*i32"),
         ("lens_ptr", "*i32"), ("slots_ptr", "*i32"), ("w_ptr", "*bf16"), ("out_ptr", "*bf16"),
         ("part_ptr", "*fp32"), ("count_ptr", "*i32"), ("stats_ptr", "*fp32")] + [
    (name, "i32") for name in ("stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh",
                               "stride_pt", "stride_wn", "stride_om")] + [
    ("scale", "fp32"), ("N_OUT", "i32")]


def resources(group: int, block_n: int, warps: int) -> dict:
    """Shared bytes, registers per thread and stack bytes of one program."""
    kernel = ao._attn_oproj_kernel
    const = dict(ROWS=1, BLOCK_M=1, NUM_KV=KV_HEADS, GROUP=group, BLOCK_G=16, GROUP_P2=group,
                 HEAD_DIM=HEAD_DIM, PAGE=16, BLOCK_T=128, BLOCK_N=block_n, STATS_STRIDE=64,
                 IEEE=False, UPCAST=False, PDL=True)
    signature = dict(_ARGS) | {name: "constexpr" for name in const}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=1))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                           text=True, check=True).stdout
    os.unlink(f.name)
    fields = dict(item.split(":") for item in next(
        line for line in usage.splitlines() if "REG:" in line).split())
    return {"shared": compiled.metadata.shared, "regs": int(fields["REG"]),
            "stack": int(fields["STACK"])}


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, {SMS} SMs")
    print("model       block_n warps  shared KB  regs  stack B  per SM  programs  waves")
    for model, (group, hidden) in MODELS.items():
        for block_n, warps in SETTINGS:
            r = resources(group, block_n, warps)
            per_sm = min(SHARED_PER_SM // max(r["shared"], 1),
                         REGS_PER_SM // (max(r["regs"], 1) * 32 * warps))
            programs = -(-hidden // block_n) * KV_HEADS
            waves = -(-programs // (per_sm * SMS)) if per_sm else float("inf")
            print(f"{model:11} {block_n:7} {warps:5} {r['shared'] / 1024:10.0f} {r['regs']:5} "
                  f"{r['stack']:8} {per_sm:7} {programs:9} {waves:6}")


if __name__ == "__main__":
    main()
