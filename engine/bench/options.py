"""Benchmark options and their checks, before any GPU memory is touched.

Every check raises `BenchArgError` with one line naming the bad value; the CLI prints it and
exits with status 2.

A repeated option keeps its last value, in `lockstep bench` and in every tool of
`engine.bench` with a parser (argparse's plain store; no option appends or refuses a repeat):
a command line built by a script can override one of its options by giving it again.
(`lockstep check` refuses a repeated option instead, as its `--replay` always did: there a
dropped value changes what a verdict covers.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine.cli_args import shown
from engine.presets import PRESETS

# The engine's largest decode bucket (protocol.buckets.DEFAULT_DECODE_BUCKETS[-1]).
MAX_BATCH = 256

MAX_STEPS = 100_000
"""The most --steps, and the most --warmup, of one point: a point's steps are built on the host
before it runs, about 16 KB and 0.35 ms a step at 256 rows (1.6 GB and 35 s at this bound), and
100,000 steps of 10 ms are 17 minutes per path. `--steps 10**22` passed every check and failed
with a traceback once the weights were on the GPU (a fresh user's finding)."""


class BenchArgError(ValueError):
    """A bad `lockstep bench` argument; the message is one line naming the value."""


@dataclass
class BenchOptions:
    """What one `lockstep bench` run measures.

    Attributes:
        preset / model: exactly one: a preset name (random weights written to a temp dir)
            or an HF-layout model directory.
        batch_sizes: decode batch sizes (rows per step), each 1..256.
        context_lens: tokens already cached per row before the measured step, each >= 1.
        tensor_parallel_size: ranks (one GPU each).
        steps: timed decode steps per point (median and p90 over them); warmup: untimed first.
        graphs / eager: measure the graph-replay path / the eager path.
        capture_sweep: time capturing every default bucket (36) once, with graph memory.
        compare: "hf" to add HF StaticCache + torch.compile at hf_batch_sizes.
        json_path / plot_path: outputs (plot needs matplotlib; skipped without it).
        dtype: model dtype. seed: weight seed (presets) and input seed.
        decode_gemm: "auto" (skinny GEMM where measured faster) or "cublas" (A/B baseline).
        profile: per point, kernels launched per step and each GEMM's weight-read bandwidth
            (`engine.bench.kernel_profile`; a few seconds per point).
    """

    preset: str | None = None
    model: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 64, 256])
    context_lens: list[int] = field(default_factory=lambda: [128])
    tensor_parallel_size: int = 1
    steps: int = 200
    warmup: int = 20
    graphs: bool = True
    eager: bool = True
    capture_sweep: bool = True
    compare: str | None = None
    hf_batch_sizes: list[int] | None = None
    json_path: str | None = None
    plot_path: str | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    decode_gemm: str = "auto"
    profile: bool = True


def cuda_missing(tool: str) -> bool:
    """True, after printing "TOOL: error: " and `engine.errors.NO_CUDA_GPU` to stderr, when
    torch sees no CUDA device: the GPU tools' one check before they touch the device (exit
    status 2)."""
    from engine import errors

    problem = errors.cuda_missing()
    if problem is not None:
        print(f"{tool}: error: {problem}", file=sys.stderr)
    return problem is not None


def check_switches() -> None:
    """`engine.env.check_switches` as a bench argument check: an environment switch set to
    other than 0 or 1 is refused like a bad flag, before any GPU work (the kernels read
    LOCKSTEP_PDL at each launch, where it would be a traceback).

    Raises:
        BenchArgError: naming the variable and its value.
    """
    from engine import env
    from engine.errors import ParallelConfigError

    try:
        env.check_switches()
    except ParallelConfigError as exc:
        raise BenchArgError(str(exc)) from None


def check_range(flag: str, value: int, least: int, most: int | None = None) -> None:
    """Refuse a command-line integer outside least..most (no upper bound when `most` is None).

    Raises:
        BenchArgError: "FLAG VALUE: expected >= LEAST" or "... expected LEAST..MOST".
    """
    if most is None and value < least:
        raise BenchArgError(f"{flag} {shown(value)}: expected >= {least}")
    if most is not None and not least <= value <= most:
        raise BenchArgError(f"{flag} {shown(value)}: expected {least}..{most}")


def parse_int_list(text: str, name: str, example: str = "1,8,64") -> list[int]:
    """"1,8,64" -> [1, 8, 64], each item spelt as every integer option is
    (`lockstep.args.option_integer`: ASCII digits, no underscores, at most MAX_DIGITS digits).

    Raises:
        BenchArgError: naming `name`, the list (clipped) and the bad item (with `example` as
            the hint), or the first value given twice.
    """
    from lockstep.args import clipped, option_integer, too_many_digits

    items = [t.strip() for t in str(text).split(",")]
    out = []
    for t in items:
        try:
            value = option_integer(t)
        except ValueError as exc:  # the hint where the spelling is wrong, not the size
            hint = ("" if too_many_digits(t)
                    else f" (expected comma-separated integers, e.g. {example})")
            raise BenchArgError(f"{name} {clipped(str(text))!r}: {exc}{hint}") from None
        if value in out:
            raise BenchArgError(f"{name} {clipped(str(text))!r}: {value} is given twice")
        out.append(value)
    return out


def parse_name_list(text: str, name: str) -> list[str]:
    """"qwen3-0.6b, qwen3-4b" -> ["qwen3-0.6b", "qwen3-4b"] (items stripped; whether each is
    known is the caller's check). Raises BenchArgError naming `name` and the first item given
    twice, as `parse_int_list` refuses a repeated integer."""
    out: list[str] = []
    for item in (t.strip() for t in str(text).split(",")):
        if item in out:
            raise BenchArgError(f"{name} {text!r}: {item!r} is given twice")
        out.append(item)
    return out


def model_shape(opts: BenchOptions) -> dict:
    """The config dict of the preset or of `model`/config.json, the directory checked as
    `lockstep generate` checks it (`engine.config.load_model_config`: transformers reads it).

    Raises:
        BenchArgError: no such preset; the model directory's ModelDirError, in its words.
    """
    if opts.model is not None and not opts.model.strip():
        raise BenchArgError("--model is empty; name the model directory")
    if opts.preset is not None:
        if opts.preset not in PRESETS:
            raise BenchArgError(f"--preset {opts.preset!r}: unknown; choose one of "
                                f"{', '.join(PRESETS)}")
        return dict(PRESETS[opts.preset])
    from engine.config import load_model_config
    from engine.errors import ModelDirError

    try:
        cfg = load_model_config(opts.model)
    except ModelDirError as exc:
        raise BenchArgError(str(exc)) from None
    return json.loads(cfg.config_path.read_text())


def validate(opts: BenchOptions) -> dict:
    """Check every option; returns the model's config dict.

    Raises:
        BenchArgError: the first bad option, named with its value.
    """
    if (opts.preset is None) == (opts.model is None):
        raise BenchArgError("give exactly one of --preset NAME or --model DIR")
    cfg = model_shape(opts)
    for flag, sizes in (("--batch-sizes", opts.batch_sizes),
                        ("--hf-batch-sizes", opts.hf_batch_sizes or [])):
        for b in sizes:
            if not 1 <= b <= MAX_BATCH:
                raise BenchArgError(f"{flag}: batch size {b}: expected 1..{MAX_BATCH}")
    if not opts.batch_sizes:
        raise BenchArgError("--batch-sizes is empty")
    max_pos = max_positions(cfg)
    for c in opts.context_lens:
        if c < 1:
            raise BenchArgError(f"--context-lens: context length {c}: expected >= 1")
        if max_pos and c + 1 > max_pos:
            raise BenchArgError(f"--context-lens: context length {c}: the model holds at most "
                                f"{max_pos - 1} cached tokens (max_position_embeddings "
                                f"{max_pos})")
    if not opts.context_lens:
        raise BenchArgError("--context-lens is empty")
    tp = opts.tensor_parallel_size
    check_range("--tensor-parallel-size", tp, 1)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size"):
        if key in cfg and cfg[key] % tp:
            raise BenchArgError(f"--tensor-parallel-size {shown(tp)}: {key} {cfg[key]} is not "
                                f"divisible by it")
    check_range("--steps", opts.steps, 1, MAX_STEPS)
    check_range("--warmup", opts.warmup, 0, MAX_STEPS)
    if not (opts.graphs or opts.eager or opts.compare):
        raise BenchArgError("nothing to measure: --no-graphs and --no-eager given without "
                            "--compare")
    if opts.compare not in (None, "hf"):
        raise BenchArgError(f"--compare {opts.compare!r}: expected 'hf'")
    if opts.dtype not in ("bfloat16", "float16", "float32"):
        raise BenchArgError(f"--dtype {opts.dtype!r}: expected bfloat16, float16 or float32")
    for flag, p in (("--json", opts.json_path), ("--plot", opts.plot_path)):
        if p is not None:
            check_output_path(flag, p)
    if opts.json_path and opts.plot_path and _same_file(opts.json_path, opts.plot_path):
        raise BenchArgError(f"--plot {opts.plot_path!r} is the --json file too: the plot "
                            "would overwrite the JSON; give another --plot")
    check_switches()
    return cfg


def _same_file(a: str, b: str) -> bool:
    """Whether the paths ``a`` and ``b`` name one file (resolved, links followed)."""
    return Path(a).resolve() == Path(b).resolve()


def max_positions(cfg: dict) -> int:
    """The model's max_position_embeddings (the config dict `validate` returns), 0 if unset.

    Raises:
        BenchArgError: the value is not an integer (a hand-edited config.json).
    """
    value = cfg.get("max_position_embeddings", 0) or 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BenchArgError(f"max_position_embeddings {value!r} in the model's config: "
                            "expected an integer") from None


def json_problem(exc: BaseException) -> str:
    """What is wrong with a tool's --json that failed to load, in words: a missing field by its
    name (not "KeyError('records')"), too deep a nesting, else the exception's own message."""
    if isinstance(exc, KeyError) and exc.args:
        return f"no {exc.args[0]!r} field"
    if isinstance(exc, RecursionError):
        return "nested too deep"
    return str(exc) or type(exc).__name__


def read_tool_json(flag: str, path: str, what: str, read):
    """`read(Field(value))` of the JSON value in the file `path`, given as `flag`: a tool's own
    --json read back (`engine.json_fields`), each field checked by `read`.

    Raises:
        BenchArgError: "FLAG PATH: <the OS's reason>" where the file cannot be read; "FLAG PATH:
            not WHAT (<what is wrong>)" where it is not JSON or `read` refuses a field (its
            path named), in one line.
    """
    from engine.json_fields import Field

    try:
        with open(path) as f:
            raw = json.load(f)
        return read(Field(raw))
    except OSError as exc:
        raise BenchArgError(f"{flag} {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise BenchArgError(f"{flag} {path}: not {what} ({json_problem(exc)})"[:300]) from None


def check_output_path(flag: str, p: str) -> None:
    """Check, before a run, that the output file ``p`` given as ``flag`` can be written: not a
    directory or another non-regular file (a device, a FIFO), in a directory that exists (a
    file where a directory of the path should be is named as not a directory), and writable
    there.

    Writability is tested by creating and removing a temporary file in the target directory
    (and, where ``p`` exists, opening it for appending without changing it), not with
    ``os.access``: that is true for root everywhere, ``/proc`` and ``/sys`` included, where the
    write at the end of the run would then fail.

    Raises:
        BenchArgError: naming the flag and the path, a path that cannot even be looked at (a
            PermissionError from ``Path.is_dir``) included.
    """
    try:
        _check_output_path(flag, p)
    except OSError as exc:
        raise BenchArgError(f"{flag} {p!r} cannot be used: {exc.strerror or exc}") from None


def _check_output_path(flag: str, p: str) -> None:
    from lockstep.paths import nearest_existing, write_refused

    if not p:
        raise BenchArgError(f"{flag} '': give a file path")
    path = Path(p)
    if path.is_dir():
        raise BenchArgError(f"{flag} {p!r} is a directory; give a file path")
    if path.exists() and not path.is_file():  # a FIFO would block the test-open below
        raise BenchArgError(f"{flag} {p!r} is not a regular file; give a file path")
    parent = path.resolve().parent
    blocking = nearest_existing(parent)
    if not blocking.is_dir():  # it read "does not exist or is not writable" of a file there
        raise BenchArgError(f"{flag} {p!r}: {str(blocking)!r} is not a directory; give a "
                            "path in a directory")
    if not parent.is_dir():
        raise BenchArgError(f"{flag} {p!r}: directory {str(parent)!r} does not exist; "
                            f"create it first or choose another {flag}")
    refused = write_refused(parent)
    if refused is None and path.exists():
        try:
            with open(path, "a"):
                pass
        except OSError as exc:
            refused = exc.strerror or str(exc)
    if refused:
        raise BenchArgError(f"{flag} {p!r}: cannot write in directory {str(parent)!r}: "
                            f"{refused}")
