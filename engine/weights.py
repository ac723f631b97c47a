"""Read a Qwen3 checkpoint's tensors from safetensors shards, one rank's slice at a time.

`WeightIndex` maps each HF tensor name to its shard (from model.safetensors.index.json, or the
single model.safetensors) and checks names, dtypes and shapes from the shard headers alone,
before any rank starts. `read` returns one slice of one tensor through `safe_open(...).get_slice`, so a
rank never loads a full tensor it does not own.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath

from engine.config import ModelConfig
from engine.config_json import STORAGE_DTYPES, load_json
from engine.errors import ModelDirError, refuse_not_regular, special_kind, unreadable
from lockstep.args import one_line_repr

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
"""The safetensors header's spelling of each dtype in `engine.config_json.STORAGE_DTYPES`: the
tensor dtypes the loader takes. A tensor of any other (I32, F64, F8_E4M3, BOOL) would be
converted silently by the copy into the model's parameters (an int32 shard loaded and
generated tokens: a fresh user's finding), so it is refused from the header before any rank
starts."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> full (unsharded) shape the engine expects for `cfg`."""
    h, d, i, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_q_heads, cfg.num_kv_heads
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * d, h),
            p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h),
            p + "self_attn.o_proj.weight": (h, nq * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


HEAD_COMPARE_ROWS = 8192
"""Vocabulary rows compared at a time by `stored_head_differs` (bounds its memory)."""


def _tensor_files(d: Path) -> dict[str, Path] | None:
    """Tensor name -> shard file of the checkpoint in `d`, None where it has neither an index
    nor a single model.safetensors (`WeightIndex` raises for that). The one in use that is
    there but no regular file is refused (`engine.errors.refuse_not_regular`): it read as absent."""
    index_path = d / INDEX_FILE
    for path in (index_path, d / SINGLE_FILE):  # the index first, as it is used first
        refuse_not_regular(path)
        if path.is_file():
            break
    if index_path.is_file():
        index = load_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) and isinstance(fname, str)
                for name, fname in weight_map.items()):
            # a list or a map of numbers was a TypeError traceback (a fresh user's finding)
            raise ModelDirError(f"{index_path}: no \"weight_map\" object mapping tensor names "
                                "to shard file names")
        for name, fname in weight_map.items():
            # the index names files of this directory (as the Hub writes it); a path out of it
            # (absolute, or up through "..") was followed without a word (a fresh user's finding)
            if not _names_a_file_inside(fname):
                raise ModelDirError(f"{index_path}: shard {one_line_repr(fname, 120)} (of "
                                    f"{one_line_repr(name)}) is not a file name inside {d}")
        return {name: d / fname for name, fname in weight_map.items()}
    if (d / SINGLE_FILE).is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(d / SINGLE_FILE), framework="pt") as f:
                return {name: d / SINGLE_FILE for name in f.keys()}
        except Exception as exc:  # safetensors raises its own error types
            raise _open_error(d / SINGLE_FILE) or ModelDirError(
                f"{d / SINGLE_FILE}: unreadable safetensors file ({exc})") from exc
    return None


def _names_a_file_inside(fname: str) -> bool:
    """Whether an index's shard name ``fname`` is a relative path that stays inside its
    directory: not empty or ".", no drive or root (``PurePath.anchor``), not up through ".."
    once normalised ("sub/../x" stays inside)."""
    normal = os.path.normpath(fname)  # "" is "." too
    return not PurePath(fname).anchor and normal != "." and PurePath(normal).parts[0] != ".."


def _open_error(path: Path) -> ModelDirError | None:
    """`engine.errors.unreadable` for ``path`` where the OS will not open it for reading, else
    None: asked after `safe_open` refused a file, since safetensors says "No such file or
    directory" of one that exists but may not be read."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        return unreadable(path, exc)
    return None


def stored_head_differs(model_dir: str | Path) -> bool:
    """Whether the checkpoint stores an `lm_head.weight` of its own that differs from
    `model.embed_tokens.weight` (shape or any value).

    transformers ties the two when a config says `tie_word_embeddings: true`, but not when
    both tensors are in the checkpoint with different values: it loads both and warns
    (transformers 5, `PreTrainedModel.tie_weights`). The engine follows it, so that its logits
    match the reference's; `engine.config.load_model_config` unties such a config. Compared
    HEAD_COMPARE_ROWS rows at a time, stopping at the first difference.

    The answer is cached per directory and checkpoint stamp (`_checkpoint_stamp`): a head equal
    to the embedding is read in full, and `load_model_config` asks on every call. A shard or
    index that is rewritten changes its stamp and is compared again.

    Raises:
        ModelDirError: the index or a shard holding either tensor cannot be read (the OS's
            reason) or is not valid, or the index names a shard outside the directory.
    """
    d = Path(model_dir)
    try:
        key = (d.resolve(), _checkpoint_stamp(d))
    except OSError:  # a file vanished while it was listed: compare, and cache nothing
        return _compare_stored_head(d)
    if key not in _HEAD_DIFFERS:  # an error is raised, not cached
        while len(_HEAD_DIFFERS) >= _HEAD_DIFFERS_KEPT:
            del _HEAD_DIFFERS[next(iter(_HEAD_DIFFERS))]  # the oldest answer
        _HEAD_DIFFERS[key] = _compare_stored_head(d)
    return _HEAD_DIFFERS[key]


_HEAD_DIFFERS: dict[tuple, bool] = {}
"""`stored_head_differs`'s answers by (resolved directory, `_checkpoint_stamp`)."""

# A process loads a few model directories; a rewritten checkpoint adds a key, and the oldest
# answers are dropped so that rewrites do not grow the cache without bound.
_HEAD_DIFFERS_KEPT = 16


def _checkpoint_stamp(d: Path) -> tuple:
    """(name, inode, size, mtime_ns, ctime_ns) of every safetensors file in `d`, sorted, and of
    the index file: what changes when the checkpoint's tensors or their map are rewritten. The
    inode and ctime are there because copies that keep times (`cp -p`, `rsync -a`, `tar x`)
    put the old mtime back on a file of the same size; no tool sets a ctime back."""
    stamp = []
    for f in sorted(d.glob("*.safetensors")) + [d / INDEX_FILE]:
        if f.is_file():
            st = f.stat()
            stamp.append((f.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(stamp)


def _compare_stored_head(model_dir: Path) -> bool:
    """`stored_head_differs` without the cache: reads both tables."""
    import torch
    from safetensors import safe_open

    files = _tensor_files(Path(model_dir))
    if not files or "lm_head.weight" not in files or "model.embed_tokens.weight" not in files:
        return False
    try:
        with safe_open(str(files["lm_head.weight"]), framework="pt") as fh, \
                safe_open(str(files["model.embed_tokens.weight"]), framework="pt") as fe:
            head, embed = fh.get_slice("lm_head.weight"), fe.get_slice("model.embed_tokens.weight")
            shape = tuple(head.get_shape())
            if shape != tuple(embed.get_shape()) or len(shape) != 2:
                return True
            for start in range(0, shape[0], HEAD_COMPARE_ROWS):
                stop = min(shape[0], start + HEAD_COMPARE_ROWS)
                if not torch.equal(head[start:stop], embed[start:stop]):
                    return True
    except Exception as exc:  # safetensors raises its own error types
        raise (_open_error(files["lm_head.weight"])
               or _open_error(files["model.embed_tokens.weight"])
               or ModelDirError(f"{model_dir}: cannot compare lm_head.weight with "
                                f"model.embed_tokens.weight ({exc})")) from exc
    return False


class WeightIndex:
    """Where each tensor of a checkpoint lives, checked against a `ModelConfig`.

    Raises (from the constructor):
        ModelDirError: no index and no single model.safetensors; the index names a shard
            outside the directory; the index or a shard file it names is missing, is a
            directory or another file that is no regular file (a FIFO, a link to /dev/zero),
            cannot be read (the OS's reason) or is not valid; an expected
            tensor is absent; a tensor's dtype is not one of `SAFETENSORS_DTYPES`, or its shape
            differs from the config's.
    """

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        d = Path(cfg.model_dir)
        files = _tensor_files(d)
        if files is None:
            raise ModelDirError(f"{d}: no {INDEX_FILE} and no {SINGLE_FILE}")
        self.files = files
        self.source = d / INDEX_FILE if (d / INDEX_FILE).is_file() else d / SINGLE_FILE
        self._check()

    def _check(self) -> None:
        from safetensors import safe_open

        expected = expected_shapes(self.cfg)
        by_file: dict[Path, list[str]] = {}
        for name in expected:
            if name not in self.files:
                raise ModelDirError(f"{self.source}: tensor {name!r} is missing from the "
                                    "checkpoint")
            by_file.setdefault(self.files[name], []).append(name)
        for path, names in by_file.items():
            kind = special_kind(path)  # a link to /dev/zero read as missing
            if kind is not None or not path.is_file():
                what = ("is a directory, not a file" if kind == "a directory" else
                        f"is not a regular file ({kind})" if kind else "is missing")
                # the name is the index's, which may hold a line break
                raise ModelDirError(f"{one_line_repr(str(path), 160)}: shard file {what} (named "
                                    f"by the index for {one_line_repr(names[0])})")
            try:
                with safe_open(str(path), framework="pt") as f:
                    present = set(f.keys())
                    for name in names:
                        if name not in present:
                            raise ModelDirError(f"{path}: tensor {name!r} is not in this shard, "
                                                f"though the index says it is")
                        tensor = f.get_slice(name)
                        dtype = tensor.get_dtype()
                        if dtype not in SAFETENSORS_DTYPES:
                            raise ModelDirError(
                                f"{path}: tensor {name!r} has dtype {dtype}; this engine loads "
                                f"weights stored as {', '.join(STORAGE_DTYPES)} only")
                        shape = tuple(tensor.get_shape())
                        if shape != expected[name]:
                            raise ModelDirError(
                                f"{path}: tensor {name!r} has shape {list(shape)}, expected "
                                f"{list(expected[name])} from {self.cfg.config_path}")
            except ModelDirError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise _open_error(path) or ModelDirError(
                    f"{path}: unreadable safetensors shard ({exc})") from exc

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None):
        """Read tensor `name`, or only `[start:stop]` along dimension `dim` (0 or 1).

        Returns a CPU torch tensor in the checkpoint's dtype. Only the slice is read from disk.
        """
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            sl = f.get_slice(name)
            if dim is None:
                return sl[:]
            if dim == 0:
                return sl[start:stop]
            if dim == 1:
                return sl[:, start:stop]
            raise ValueError(f"dim must be None, 0 or 1, got {dim!r}")
