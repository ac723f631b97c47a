"""Fused decode kernels (add+RMSNorm, q/k norm+RoPE+KV write, SwiGLU) against float64 oracles:
the torch twins directly, the Triton kernels in the interpreter (TRITON_INTERPRET=1, in a
subprocess because the variable must be set before triton is imported)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import fused
from engine.kernels.fused_reference import check_fused
from engine.testing import run_in_triton_interpreter

# ||out - ref|| / ||ref|| bounds: float32 arithmetic lands far under 1e-5; bf16 outputs
# carry one rounding of 2^-9 relative per element (~3e-3 rms), the interpreter's bf16
# emulation up to ~1e-2.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_twins_match_float64(dtype, seed):
    worst = check_fused(impl="torch", dtype=dtype, seed=seed)
    assert worst.pop("qk_norm_rope_kv.untouched") == 0.0
    assert max(worst.values()) < TOL[dtype], worst


def test_check_catches_a_wrong_kernel(monkeypatch):
    """The oracle check is not vacuous: a SwiGLU that forgets the silu, a norm with the wrong
    epsilon scale and a RoPE at the wrong position are all reported."""
    monkeypatch.setattr(fused, "silu_mul_torch", lambda gu: gu.chunk(2, -1)[0] * gu.chunk(2, -1)[1])
    assert check_fused(impl="torch")["silu_mul"] > 0.1
    real = fused.qk_norm_rope_kv_torch
    monkeypatch.setattr(fused, "qk_norm_rope_kv_torch",
                        lambda *a: real(*a[:5], (a[5] + 1) % 71, *a[6:]))  # 71 = max_pos
    worst = check_fused(impl="torch")
    assert worst["qk_norm_rope_kv.q"] > 0.01 and worst["qk_norm_rope_kv.k"] > 0.01
    assert worst["qk_norm_rope_kv.untouched"] == float("inf")  # wrote the wrong cache rows


def test_add_rms_norm_torch_without_residual_returns_input_as_residual():
    x = torch.randn(2, 8)
    out, res = fused.add_rms_norm_torch(x, None, torch.ones(8), 1e-6)
    assert res is x
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


_TRITON_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, os.getcwd())
from engine.kernels.fused_reference import check_fused
tol = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
for dtype in (torch.float32, torch.bfloat16):
    for seed in (0, 1):
        worst = check_fused(impl="triton", dtype=dtype, seed=seed)
        print(dtype, seed, worst)
        assert worst.pop("qk_norm_rope_kv.untouched") == 0.0, "cache rows outside the step written"
        assert max(worst.values()) < tol[dtype], (dtype, worst)
print("ok")
"""


@pytest.mark.timeout(600)
def test_triton_kernels_in_interpreter_match_float64():
    pytest.importorskip("triton")
    res = run_in_triton_interpreter(_TRITON_CHECK)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
