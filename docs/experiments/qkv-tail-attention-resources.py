"""What the QKV launch with the rope epilogue costs on sm_90 with and without the attention in
its tail (`skinny_gemm.AttendTail`), at Qwen3-4B's one-row shapes, without a GPU: registers,
spills and shared memory of each tile, compiled with Triton's own compiler and ptxas as
`docs/experiments/gemv-tile-resources.py` does (whose `resources` it reuses):

    pip install --target /tmp/tr36 triton==3.6.0
    PYTHONPATH=/tmp/tr36:. python3 docs/experiments/qkv-tail-attention-resources.py
"""

from __future__ import annotations

import importlib.util
import os

import triton

from engine.kernels import skinny_gemm as sg

_spec = importlib.util.spec_from_file_location(
    "gemv_tile_resources", os.path.join(os.path.dirname(__file__), "gemv-tile-resources.py"))
gtr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gtr)

TILES = [sg.TileConfig(64, 128, 1, 4, 4, tma=True), sg.TileConfig(64, 128, 1, 4, 5, tma=True),
         sg.TileConfig(64, 128, 1, 4, 3, tma=True), sg.TileConfig(64, 128, 2, 4, 4, tma=True),
         sg.TileConfig(64, 256, 1, 4, 2, tma=True), sg.TileConfig(64, 128, 1, 4, 4),
         sg.TileConfig(64, 128, 1, 8, 4, tma=True)]


def compile_rope_tile(cfg: sg.TileConfig, attend: bool):
    """The cubin of a 4B QKV launch at one row with the rope epilogue (32 query and 8 kv heads
    of 128, pages of 16, the norm folded in), attending over a 128-token tile where asked."""
    return gtr.compile_tile(1, 6144, 2560, False, cfg, NORM_IN=True, STATS_BLOCK=128,
                            PAIRED=True, ROW_STEP=2 * cfg.block_n, HEADS=True, NQ=32, NKV=8,
                            PAGE=16, ATTEND=attend, GROUP=4, BLOCK_G=16, BLOCK_T=128)


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, Qwen3-4B QKV + rope epilogue at 1 row, bf16")
    print("tile                      attend regs stack shared_KB")
    for cfg in TILES:
        for attend in (False, True):
            r = gtr.resources(compile_rope_tile(cfg, attend))
            tile = (f"{cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} "
                    f"st{cfg.num_stages}" + (" tma" if cfg.tma else ""))
            print(f"{tile:25} {str(attend):6} {r['regs']:4} {r['stack']:5} "
                  f"{r['shared'] / 1024:9.1f}")


if __name__ == "__main__":
    main()
