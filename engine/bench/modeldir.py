"""Random-weight model directories for `lockstep bench --preset`, drawn on the GPU.

`engine.model_dir.write_model_dir` draws every tensor on the CPU (reproducible per tensor,
tens of seconds for Qwen3-4B); a benchmark only needs random, non-zero weights of the right
shapes, so this writes the same HF layout from tensors drawn on the device, in seconds.
"""

from __future__ import annotations

import math
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.model_dir import INIT_STD, NORM_NOISE, _shard_plan, build_config, tensor_shapes
from engine.presets import DEFAULT_SHARD_BYTES, PRESETS


def temp_root(need_bytes: int) -> str | None:
    """/dev/shm when it has room for `need_bytes` twice over (fast reads), else the default."""
    try:
        if shutil.disk_usage("/dev/shm").free > 2 * need_bytes:
            return "/dev/shm"
    except OSError:
        pass
    return None


def write_random_model_fast(preset: str, dtype: str = "bfloat16", seed: int = 0,
                            device: str = "cuda", out: str | os.PathLike | None = None) -> Path:
    """Write an HF-layout directory of `preset` with weights drawn on `device`.

    Args:
        preset: a key of `engine.presets.PRESETS`. dtype: storage dtype name.
        seed: generator seed. device: where tensors are drawn ("cuda" or "cpu").
        out: directory; default a new temp directory (caller removes it).
    Returns:
        The directory (config.json, generation_config.json, shards, index).
    Raises:
        ValueError: unknown preset.
    """
    import torch
    from safetensors.torch import save_file

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[dtype]
    cfg = PRESETS[preset]
    shapes = tensor_shapes(cfg)
    total = sum(tdtype.itemsize * math.prod(s) for _, s in shapes)
    if out is None:
        out = tempfile.mkdtemp(prefix=f"lockstep-bench-{preset}-", dir=temp_root(total))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    build_config(preset, dtype).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}) + "\n")
    g = torch.Generator(device=device).manual_seed(seed)
    weight_map = {}
    plan = _shard_plan(shapes, tdtype.itemsize, DEFAULT_SHARD_BYTES)
    for s, indices in enumerate(plan):
        fname = f"model-{s + 1:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for idx in indices:
            name, shape = shapes[idx]
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
            t = 1.0 + NORM_NOISE * t if name.endswith("norm.weight") else INIT_STD * t
            tensors[name] = t.to(tdtype).cpu()
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}) + "\n")
    return out

