"""`lockstep make-model`: write a random-weight HF-layout Qwen3 directory from a named preset.

Only argparse runs at import time; torch and transformers are imported inside `run`.
"""

from __future__ import annotations

import math
import argparse
import sys

from engine.cli_args import seed as seed_arg
from engine.presets import PRESETS


def add_parser(subparsers, name: str) -> argparse.ArgumentParser:
    """Register the subcommand `name` on `subparsers`; sets `run` as its handler."""
    p = subparsers.add_parser(name, help="write a random-weight Qwen3 model directory",
                              description=__doc__.splitlines()[0],
                              epilog="A repeated option keeps its last value.")
    p.add_argument("--preset", required=True, choices=list(PRESETS),
                   help="named configuration (real Qwen3 shapes, or tiny for tests)")
    p.add_argument("--out", required=True,
                   help="output directory, created if missing (its parent must exist)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="weight seed, an integer in [0, 2**64) (default 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the model already in --out (a directory holding config.json) "
                        "once the new one is completely written; a non-empty directory "
                        "without one is refused even so")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="storage dtype (default bfloat16)")
    p.set_defaults(run=run)
    return p


def _check_out(text: str, overwrite: bool = False) -> str | None:
    """`_checked_out`, with a path that cannot even be looked at (a PermissionError from
    ``Path.exists`` for a directory the user may not enter) as one more reason."""
    try:
        return _checked_out(text, overwrite)
    except OSError as exc:
        return f"--out {text!r} cannot be used: {exc.strerror or exc}"


def _checked_out(text: str, overwrite: bool = False) -> str | None:
    """The reason ``text`` cannot be the output directory, or None; creates it if missing.

    Only the directory itself is created: a missing parent is refused, since a mistyped
    ``--out`` would otherwise leave a tree of new directories wherever the typo pointed. A
    non-empty directory must hold a model (a config.json), and is then replaced only with
    ``overwrite``: a non-empty directory without one (``/``, ``/tmp``, a home directory) is
    refused even with it, since the model files would be scattered among the user's files.
    A path that is not UTF-8 is refused before anything is created (`utf8_refused`)."""
    from pathlib import Path

    from engine.model_dir import utf8_refused

    if not text.strip():
        return "--out is empty; name the directory to write"
    refused = utf8_refused(text)
    if refused is not None:
        return f"--out {text!r} {refused}; choose another --out"
    path = Path(text)
    if path.exists() and not path.is_dir():
        return f"--out {text!r} exists and is not a directory"
    if not path.exists() and path.parent.exists() and not path.parent.is_dir():
        return (f"--out {text!r}: its parent {str(path.parent)!r} is not a directory; choose "
                "another --out")
    if not path.exists() and not path.parent.exists():
        return (f"--out {text!r}: its parent {str(path.parent)!r} does not exist; create it "
                "first or choose another --out")
    if path.is_dir() and any(path.iterdir()):
        if not (path / "config.json").is_file():
            return (f"--out {text!r} is not empty and holds no model (no config.json); "
                    "choose a new or empty directory")
        if not overwrite:
            if not any(path.glob("*.safetensors")):
                return (f"--out {text!r} holds a config.json but no weights (an interrupted "
                        "make-model?); pass --overwrite to write the model again")
            return (f"--out {text!r} already holds a model; pass --overwrite to replace it "
                    "(its config and weight shards are rewritten)")
        print(f"lockstep make-model: replacing the model directory {text!r}", file=sys.stderr)
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        return f"--out {text!r} cannot be created: {exc.strerror}"
    from lockstep.paths import write_refused

    refused = write_refused(path)
    return None if refused is None else f"--out {text!r} is not writable: {refused}"


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

SPACE_MARGIN = 1.02
"""Weights bytes times this, plus a MiB, must be free: safetensors headers, the index,
config and tokenizer files."""


def _check_space(text: str, preset: str, dtype: str) -> str | None:
    """The reason the disk of ``--out`` cannot hold the model, or None. Counted before anything
    is written, so that a full disk is named at once rather than after minutes of writing. A
    model already there (--overwrite) is not counted as free: it stays until the new one is
    complete (`engine.model_dir.write_model_dir`)."""
    import shutil
    from pathlib import Path

    from engine.model_dir import tensor_shapes

    need = sum(ITEMSIZE[dtype] * math.prod(shape) for _, shape in tensor_shapes(PRESETS[preset]))
    free = shutil.disk_usage(Path(text)).free
    if need * SPACE_MARGIN + (1 << 20) > free:
        return (f"--out {text!r}: the {preset} model ({dtype}) needs {need / 1e9:.2f} GB and "
                f"its disk has {free / 1e9:.2f} GB free; choose another --out"
                + (", a smaller preset, or a 2-byte --dtype" if ITEMSIZE[dtype] > 2
                   else " or a smaller preset"))
    return None



def _remove_stale_staging(text: str) -> None:
    """`engine.model_dir.remove_stale_staging` of ``--out`` where it is a directory, naming
    each directory removed on stderr; an --out that cannot be looked at is left to
    `_check_out` to name."""
    from pathlib import Path

    from engine.model_dir import remove_stale_staging

    try:
        removed = remove_stale_staging(Path(text)) if text.strip() and Path(text).is_dir() else []
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, to Path.resolve
        return
    for staging in removed:
        print(f"lockstep make-model: removed {str(staging)!r}, left by an earlier run that was "
              "killed while it wrote", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Write the directory; returns the exit status (0 on success, 2 on a bad --out or one
    whose disk is too small for the model, 1 if writing fails part-way, which leaves a model
    already in --out as it was). The staging directories of --out left by killed runs are
    removed first, so that neither the check of --out nor that of the disk counts them."""
    from pathlib import Path

    _remove_stale_staging(args.out)  # before the checks: not in their way
    existed = Path(args.out).exists()
    problem = _check_out(args.out, args.overwrite)
    if problem is None:
        problem = _check_space(args.out, args.preset, args.dtype)
        if problem is not None and not existed:  # leave no empty directory behind
            Path(args.out).rmdir()
    if problem:
        print(f"lockstep make-model: error: {problem}", file=sys.stderr)
        return 2
    from engine.model_dir import write_model_dir

    def progress(done: int, total: int) -> None:
        print(f"make-model: wrote shard {done}/{total}", file=sys.stderr, flush=True)

    try:
        out = write_model_dir(args.preset, args.out, seed=args.seed, dtype=args.dtype,
                              progress=progress)
    except OSError as exc:
        print(f"lockstep make-model: error: writing {args.out!r} failed: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"make-model: {args.preset} ({args.dtype}, seed {args.seed}) -> {out}")
    return 0
