"""Fused decode kernels on the GPU at the real Qwen3 shapes vs float64 oracles."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (T, hidden, nq, nkv, D, intermediate, page): Qwen3-4B at batch 1 and 64, 0.6B at TP 2.
SHAPES = [(1, 2560, 32, 8, 128, 9728, 16), (64, 2560, 32, 8, 128, 9728, 16),
          (7, 1024, 8, 4, 128, 1536, 16)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_kernels_match_float64(dtype, tol, seed):
    from engine.kernels.fused_reference import check_fused

    worst = check_fused(device="cuda", dtype=dtype, impl="triton", seed=seed, shapes=SHAPES)
    print(dtype, worst)
    assert worst.pop("qk_norm_rope_kv.untouched") == 0.0
    assert max(worst.values()) < tol, worst
