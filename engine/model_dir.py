"""Write a random-weight Qwen3 model directory in the Hugging Face layout.

The directory holds config.json (built with `transformers.Qwen3Config`), generation_config.json,
sharded `*.safetensors` and `model.safetensors.index.json`, so that both this engine and
`transformers.AutoModelForCausalLM.from_pretrained` load it. Weights are drawn tensor by tensor
from a generator seeded with (seed, tensor index) and written shard by shard: peak host memory
is one shard plus one tensor, never the whole model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator

from engine.config_json import load_json
from engine.errors import ModelDirError
from engine.presets import DEFAULT_SHARD_BYTES, PRESETS, SHARD_BYTES
from engine.seeds import derived_seed
from engine.weights import INDEX_FILE, SINGLE_FILE

# Standard deviation of the random matrices: the `initializer_range` of Qwen3 configs.
INIT_STD = 0.02
# Norm weights are 1 plus noise of this size, so a norm that is skipped or applied to the
# wrong tensor changes the logits measurably in tests.
NORM_NOISE = 0.1


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes of a Qwen3 dense model, in checkpoint order.

    Args:
        cfg: a preset dict (see `engine.presets`).
    Returns:
        [(name, shape)], e.g. ("model.layers.0.self_attn.q_proj.weight", (q_heads*head_dim, hidden)).
    """
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (nq * d, h)),
            (p + "self_attn.k_proj.weight", (nkv * d, h)),
            (p + "self_attn.v_proj.weight", (nkv * d, h)),
            (p + "self_attn.o_proj.weight", (h, nq * d)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


def build_config(preset: str, dtype: str):
    """Return the `transformers.Qwen3Config` of a preset.

    Raises:
        ValueError: unknown preset name.
    """
    from transformers import Qwen3Config

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = dict(PRESETS[preset])
    theta = cfg.pop("rope_theta")
    config = Qwen3Config(
        **cfg,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        hidden_act="silu",
        attention_bias=False,
        torch_dtype=dtype,
        architectures=["Qwen3ForCausalLM"],
    )
    # transformers 4.x keeps rope_theta as an attribute; 5.x moved it into rope_parameters.
    # Writing both keeps the directory loadable by either.
    config.rope_theta = theta
    return config


def _shard_plan(shapes, itemsize: int, shard_bytes: int) -> list[list[int]]:
    """Group tensor indices into shards of at most `shard_bytes` (a lone big tensor is a shard)."""
    shards, cur, cur_bytes = [], [], 0
    for idx, (_, shape) in enumerate(shapes):
        n = itemsize
        for s in shape:
            n *= s
        if cur and cur_bytes + n > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(idx)
        cur_bytes += n
    if cur:
        shards.append(cur)
    return shards


def write_model_dir(preset: str, out: str | os.PathLike, seed: int = 0,
                    dtype: str = "bfloat16", shard_bytes: int | None = None,
                    progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a random-weight HF-layout Qwen3 directory.

    The files are written into a temporary directory beside ``out`` (`_staging_dir`) and moved
    into ``out`` only once all are written (`_swap_in`): a failure, Ctrl-C or SIGTERM part-way
    leaves a model already in ``out`` as it was, and no temporary directory. One left by a run
    that was SIGKILLed is removed first (`remove_stale_staging`).

    Args:
        preset: a key of `engine.presets.PRESETS`.
        out: directory to write, created with its parents if missing. A model already there --
            its index, shards, config and tokenizer (`model_files`) -- is replaced, so no stale
            shard stays beside new ones; other files stay.
        seed: an integer in [0, 2**64); tensor `k` is drawn from
            `torch.Generator().manual_seed(derived_seed(seed * 1_000_003, k))`, so a tensor's
            value does not depend on the shard layout (`engine.seeds.derived_seed` wraps the
            sum into the seed range and changes nothing for seeds below 2**64 // 1_000_003).
        dtype: "float32", "bfloat16" or "float16": storage dtype of every tensor.
        shard_bytes: shard size limit in bytes; default per preset (`engine.presets`).
        progress: called as progress(done_shards, total_shards) after each shard.
    Returns:
        The directory path.
    Raises:
        ValueError: unknown preset or dtype; ``out`` not UTF-8 (`utf8_refused`), raised
            before anything is created.
        OSError: the directory cannot be written.
    """
    import shutil

    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(dtypes)}")
    config = build_config(preset, dtype)
    if shard_bytes is None:
        shard_bytes = SHARD_BYTES.get(preset, DEFAULT_SHARD_BYTES)
    refused = utf8_refused(out)
    if refused is not None:
        raise ValueError(f"{os.fspath(out)!r} {refused}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging, lock = _locked_staging_dir(out)
    try:
        _write_files(staging, config, PRESETS[preset], seed, dtypes[dtype], shard_bytes,
                     progress)
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(lock)  # after the removal: no other run sees it unlocked before
    return out


def utf8_refused(out: str | os.PathLike) -> str | None:
    """Why no model can be written to ``out`` for the bytes of its path, or None. The
    tokenizers library writes tokenizer.json only to a path that is UTF-8 text; non-UTF-8 bytes
    in a path reach Python as lone surrogates (``\\udcff``), and it raised a UnicodeEncodeError
    after every shard was written. ``out`` is checked as given and as the real path it
    resolves to, beside which the files are first written (`_staging_dir`). The reason follows
    the path: "is not valid UTF-8 text: '\\udcff' at character 8; ..."."""
    from engine.errors import not_utf8_text

    given = os.fspath(out)
    for path in (given, os.path.realpath(given)):
        problem = not_utf8_text(path)
        if problem is not None:
            where = "is" if path == given else f"resolves to {path!r},"
            return (f"{where} {problem}; the tokenizers library writes tokenizer.json only to "
                    "a UTF-8 path")
    return None


def _write_files(out: Path, config, cfg: dict, seed: int, tdtype, shard_bytes: int,
                 progress: Callable[[int, int], None] | None) -> None:
    """Write the model of preset dict ``cfg`` (its `transformers.Qwen3Config` ``config``) into
    the empty directory ``out``: config, generation config, tokenizer, shards, index."""
    from safetensors.torch import save_file

    config.save_pretrained(out)
    write_tokenizer(out, cfg)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    shapes = tensor_shapes(cfg)
    plan = _shard_plan(shapes, tdtype.itemsize, shard_bytes)
    weight_map, total = {}, 0
    for s, indices in enumerate(plan):
        fname = f"model-{s + 1:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for idx in indices:
            name, shape = shapes[idx]
            tensors[name] = _random_tensor(name, shape, seed, idx, tdtype)
            weight_map[name] = fname
            total += tensors[name].numel() * tdtype.itemsize
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        _readable(out / fname)
        del tensors
        if progress is not None:
            progress(s + 1, len(plan))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


MODEL_FILES = ("config.json", "generation_config.json", INDEX_FILE, SINGLE_FILE,
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""Files of a model directory that `write_model_dir` writes or that a previous model left."""

WEIGHT_ENTRIES = (INDEX_FILE, SINGLE_FILE)
"""The files through which a loader finds a model's weights: `_swap_in` removes the old ones
first and moves the new index in last."""


def model_files(out: Path) -> list[str]:
    """Names of the files of a model already in ``out``: MODEL_FILES, the shards its index
    names and any ``model-NNNNN-of-NNNNN.safetensors``, sorted; other files are not named."""
    import re

    names = set()
    index = out / INDEX_FILE
    if index.is_file():
        try:  # a hand-broken index names no shards: a number there was a TypeError
            weight_map = load_json(index).get("weight_map", {})
            names |= {v for v in weight_map.values() if isinstance(v, str)}
        except (ModelDirError, AttributeError):
            pass
    names |= {p.name for p in out.iterdir()
              if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", p.name)}
    names |= {n for n in MODEL_FILES if (out / n).exists()}
    return sorted(n for n in names if (out / n).is_file() and (out / n).parent == out)


def _staging_dir(out: Path) -> Path:
    """A new empty directory to write a model for ``out`` into: ``.NAME.make-model-XXXXXXXX``
    beside ``out``, so that even a SIGKILL part-way leaves ``out`` as it was (and that
    directory behind, until a later run for ``out`` removes it: `remove_stale_staging`).
    Inside ``out`` where a file cannot be renamed from beside it into it (its parent
    read-only, or ``out`` a mount point, even a bind mount of the same file system):
    `_swap_in` moves the files by rename, and must not fail after it began."""
    import shutil
    import tempfile

    real = out.resolve()
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{real.name}.make-model-", dir=real.parent))
    except OSError:
        return Path(tempfile.mkdtemp(prefix=".make-model-", dir=real))
    probe = real / staging.name  # a name no other file has
    try:
        (staging / "probe").touch()
        os.rename(staging / "probe", probe)
        probe.unlink()
        return staging
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=".make-model-", dir=real))


STAGING_LOCK = ".make-model.lock"
"""The file in a staging directory on which its writer holds an exclusive flock until the
directory is gone: the kernel drops the lock when the writer exits, even by SIGKILL, so a staging
directory whose lock another process can take has no writer (`remove_stale_staging`). A lock,
not a PID in the name: a PID is reused, and is not visible across PID namespaces (containers)
sharing the directory."""

STAGING_ATTEMPTS = 8
"""Staging directories `_locked_staging_dir` tries: one is lost only to another run removing
it as stale between its creation and its lock (microseconds), so a second try succeeds."""


def _staging_candidates(out: Path) -> list[Path]:
    """The directories that `_staging_dir` names for ``out``, of any run: ``.NAME.make-model-``
    and tempfile's 8 characters beside ``out``, ``.make-model-`` and 8 inside it; real
    directories only (no link), in folders that can be listed."""
    import re

    real = out.resolve()
    found = []
    for folder, prefix in ((real.parent, f".{real.name}.make-model-"), (real, ".make-model-")):
        pattern = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}")
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        found += [p for p in entries
                  if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found)


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the staging directories of ``out`` (`_staging_candidates`) left by runs that no
    longer write them (SIGKILLed, or a machine that went down): those whose STAGING_LOCK this
    process can lock. A directory whose lock is held (another make-model of ``out`` writing
    now), or that cannot be opened or locked, is kept. Returns the ones removed."""
    import fcntl
    import shutil

    removed = []
    for staging in _staging_candidates(out):
        try:
            fd = os.open(staging / STAGING_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(staging, ignore_errors=True)
            if not staging.exists():
                removed.append(staging)
        except OSError:  # held: its writer is alive
            pass
        finally:
            os.close(fd)
    return removed


def _locked_staging_dir(out: Path) -> tuple[Path, int]:
    """A new staging directory (`_staging_dir`) and the descriptor of its STAGING_LOCK, locked
    exclusively: held until the directory is removed, so that no other run takes it as stale.

    A run cleaning up may lock and remove the directory between its creation and the lock;
    then the lock taken is of a removed file (its inode no longer the directory's lock file)
    and another directory is made. Where the file system has no flock, the directory is used
    unlocked (and no other run can lock it either, so none removes it).

    Raises:
        OSError: the directory cannot be made, or STAGING_ATTEMPTS were all removed.
    """
    import fcntl
    import shutil

    for _ in range(STAGING_ATTEMPTS):
        staging = _staging_dir(out)
        try:
            fd = os.open(staging / STAGING_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:  # removed as stale already
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run is removing it
            os.close(fd)
            continue
        except OSError:  # no flock here
            return staging, fd
        try:
            mine = os.stat(staging / STAGING_LOCK)
        except FileNotFoundError:
            mine = None
        held = os.fstat(fd)
        if mine is not None and (mine.st_dev, mine.st_ino) == (held.st_dev, held.st_ino):
            return staging, fd
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
    raise OSError(f"no staging directory for {out} stayed in place in {STAGING_ATTEMPTS} tries")


def _swap_in(staging: Path, out: Path) -> None:
    """Move the complete model in ``staging`` into ``out`` and remove the one it replaces.

    Only renames within one file system and deletions: the old model's WEIGHT_ENTRIES go
    first and the new index comes last, so that no moment has an index naming a mix of old and
    new shards of the same names; a kill within these few steps leaves a directory without an
    index, which the engine refuses and `lockstep make-model --overwrite` replaces.
    """
    old = model_files(out)
    for name in WEIGHT_ENTRIES:
        if name in old:
            (out / name).unlink()
    new = sorted(p.name for p in staging.iterdir() if p.name != STAGING_LOCK)
    for name in sorted(new, key=lambda n: n == INDEX_FILE):  # the index last
        os.replace(staging / name, out / name)
    for name in set(old) - set(new) - set(WEIGHT_ENTRIES):
        (out / name).unlink()


TOKENIZER_SPECIALS = {"bos_token_id": "<|bos|>", "eos_token_id": "<|endoftext|>"}


def write_tokenizer(out: Path, cfg: dict) -> None:
    """Write a byte-level tokenizer (tokenizer.json, tokenizer_config.json) built offline.

    Each of the 256 bytes is one token (ids 0.. upward, skipping the special ids), with no
    merges, so any text encodes; the preset's bos and eos ids are its special tokens. Ids
    above the 258 used ones decode to nothing. It lets text prompts be tried on a random model;
    it is not Qwen3's tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {cfg[k]: t for k, t in TOKENIZER_SPECIALS.items() if k in cfg}
    free = (i for i in range(cfg["vocab_size"]) if i not in specials)
    vocab = {ch: next(free) for ch in sorted(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({t: i for i, t in specials.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok,
                                   bos_token=specials.get(cfg.get("bos_token_id")),
                                   eos_token=specials.get(cfg.get("eos_token_id")))
    fast.save_pretrained(str(out))


def _random_tensor(name: str, shape, seed: int, idx: int, dtype):
    import torch

    g = torch.Generator().manual_seed(derived_seed(seed * 1_000_003, idx))
    if name.endswith("norm.weight"):
        t = 1.0 + NORM_NOISE * torch.randn(shape, generator=g)
    else:
        t = INIT_STD * torch.randn(shape, generator=g)
    return t.to(dtype)


def iter_presets() -> Iterator[str]:
    """Names of the presets, in declaration order."""
    return iter(PRESETS)


def _readable(path: Path) -> None:
    """Give a written shard the permissions of any other new file (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
