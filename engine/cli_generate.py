"""`lockstep generate`: generate from one prompt with a Qwen3 model directory.

Under torchrun (`torchrun --nproc-per-node N -m lockstep generate ... -tp N`), rank 0 drives
and prints, the other ranks serve its commands.

Only argparse runs at import time; torch is imported inside `run`.
"""

from __future__ import annotations

import argparse
import sys

from engine.cli_args import integer, number, seed as seed_arg, shown


def _ids(text: str) -> list[int]:
    """``1,2,3`` -> [1, 2, 3]; an empty item (``1,,2``, a trailing comma), anything but
    decimal digits (``int`` would also take ``1_0`` and ``+1``) or an item of more than
    MAX_DIGITS digits is refused, naming the item; the list is clipped in the message."""
    import re

    from lockstep.args import MAX_DIGITS, clipped, too_many_digits

    items = [t.strip() for t in text.split(",")]
    if not text.strip():
        raise argparse.ArgumentTypeError("'' is empty: give comma-separated token "
                                         "ids, e.g. 1,2,3")
    for i, t in enumerate(items):
        if not t:
            raise argparse.ArgumentTypeError(f"{clipped(text)!r}: item {i + 1} is empty; "
                                             "expected comma-separated integers, e.g. 1,2,3")
        if not re.fullmatch(r"-?[0-9]+", t):
            raise argparse.ArgumentTypeError(f"{clipped(text)!r}: {clipped(t)!r} is not an "
                                             "integer; expected comma-separated integers, "
                                             "e.g. 1,2,3")
        if too_many_digits(t):  # int() of over 4,300 digits raises
            raise argparse.ArgumentTypeError(f"{clipped(text)!r}: item {i + 1} has more than "
                                             f"{MAX_DIGITS} digits, above any token id")
    return [int(t) for t in items]


def add_parser(subparsers, name: str) -> argparse.ArgumentParser:
    """Register the subcommand `name` on `subparsers`; sets `run` as its handler."""
    p = subparsers.add_parser(name, help="generate tokens with a Qwen3 model directory",
                              description=__doc__.splitlines()[0],
                              epilog="A repeated option keeps its last value.")
    p.add_argument("--model", required=True,
                   help="HF-layout Qwen3 directory (e.g. from `lockstep make-model`)")
    p.add_argument("--tensor-parallel-size", "-tp", type=integer, default=1,
                   help="ranks (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (gloo between ranks) or cuda (rank r on GPU r, NCCL) (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter and KV-cache dtype (default: the checkpoint's dtype)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the model dir)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=integer, default=16, help="new tokens (default 16)")
    p.add_argument("--temperature", type=number, default=0.0,
                   help="divide the logits by this; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=integer, default=0,
                   help="keep the k most likely tokens; 0 or -1 = off (default 0); another "
                        "value needs --temperature above 0")
    p.add_argument("--top-p", type=number, default=1.0,
                   help="keep the most likely tokens up to this probability mass; 1 = off "
                        "(default 1); another value needs --temperature above 0")
    p.add_argument("--seed", type=seed_arg, default=None,
                   help="sampling seed, an integer in [0, 2**64) (default: a random one); "
                        "needs --temperature above 0 (greedy decoding draws nothing)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--logprobs", action="store_true", help="print each token's logprob")
    p.add_argument("--max-model-len", type=integer, default=None,
                   help="longest prompt + output (default min(config, 2048))")
    p.add_argument("--max-batch", type=integer, default=1,
                   help="decode slots; graphs are captured for every bucket up to it "
                        "(default 1; 256 captures all 36 buckets)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture decode CUDA graphs at startup and replay them (default: on "
                        "with --device cuda, off on cpu)")
    p.add_argument("--decode-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped scheduling: each step built and launched while the "
                        "previous one runs (default: on at -tp 1, off under TP)")
    p.add_argument("--gpu-memory-utilization", type=number, default=None,
                   help="--device cuda: fraction of each GPU's memory the engine may hold "
                        "(default 0.9)")
    p.add_argument("--startup-timeout", type=number, default=None,
                   help="startup sweep watchdog in seconds; on expiry the process aborts "
                        "(default: --step-timeout)")
    p.add_argument("--step-timeout", type=number, default=300.0,
                   help="seconds to wait for every rank's reply to one command; a rank that "
                        "does not answer by then is named as failed (default 300)")
    p.set_defaults(run=run)
    return p


def _number_checks(args: argparse.Namespace):
    """(flag, value, ok, expected) for every numeric flag, in the order of --help."""
    from engine.sampling import MIN_TEMPERATURE

    finite = lambda v: v == v and abs(v) != float("inf")  # noqa: E731
    return (
        ("--tensor-parallel-size", args.tensor_parallel_size, args.tensor_parallel_size >= 1,
         "an integer >= 1"),
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1, "an integer >= 1"),
        ("--temperature", args.temperature, finite(args.temperature) and args.temperature >= 0,
         "a finite number >= 0 (0 = greedy)"),
        ("--temperature", args.temperature, not 0 < args.temperature < MIN_TEMPERATURE,
         f"0 (greedy) or at least {MIN_TEMPERATURE:g}"),
        ("--top-k", args.top_k, args.top_k >= -1, "-1, 0 (off) or a positive integer"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "a number in (0, 1]"),
        ("--max-model-len", args.max_model_len,
         args.max_model_len is None or args.max_model_len >= 1, "at least 1"),
        ("--max-batch", args.max_batch, 1 <= args.max_batch <= 256, "an integer from 1 to 256"),
        ("--gpu-memory-utilization", args.gpu_memory_utilization,
         args.gpu_memory_utilization is None or 0 < args.gpu_memory_utilization <= 1,
         "a fraction in (0, 1]"),
        ("--startup-timeout", args.startup_timeout,
         args.startup_timeout is None or 0 < args.startup_timeout < 1e9,
         "positive, finite seconds below 1e9"),
        ("--step-timeout", args.step_timeout, 0 < args.step_timeout < 1e9,
         "positive, finite seconds below 1e9"),
    )


def check_flags(args: argparse.Namespace) -> None:
    """Reject an empty or non-UTF-8 prompt and a numeric flag out of range, naming the flag
    (not the engine's field); reads no file.

    Raises:
        RequestError: ``--FLAG VALUE must be EXPECTED``; --cuda-graph or
            --gpu-memory-utilization without --device cuda.
    """
    from engine.errors import RequestError, check_text

    if not args.model.strip():  # else read as '.', the current directory
        raise RequestError("--model is empty; name the model directory")
    if args.prompt is not None:  # before the model's config is read (transformers: seconds)
        if not args.prompt:
            raise RequestError("--prompt is empty")
        check_text(args.prompt, "--prompt")
    for flag, value, ok, expected in _number_checks(args):
        if not ok:
            raise RequestError(f"{flag} {shown(value)} must be {expected}")
    # cpu is the only other device; a fresh user who never gave --device read "(--device cpu
    # runs ...)" as something they had typed
    if args.cuda_graph and args.device != "cuda":
        raise RequestError("--cuda-graph needs --device cuda (--device cpu, the default, runs "
                           "eager only); give --device cuda or drop --cuda-graph")
    if args.gpu_memory_utilization is not None and args.device != "cuda":
        raise RequestError(f"--gpu-memory-utilization {shown(args.gpu_memory_utilization)} applies "
                           "to --device cuda only (--device cpu, the default, sizes its KV cache "
                           "without it); drop it")


def _ignored_when_greedy(args: argparse.Namespace) -> str | None:
    """Why a sampling flag would do nothing (greedy decoding reads neither --top-k, --top-p
    nor --seed), or None. Old behaviour (a fresh user's finding, as with
    --gpu-memory-utilization on CPU): `--top-p 0.9` without --temperature was taken and the
    tokens were greedy."""
    if args.temperature != 0:
        return None
    for flag, value, off in (("--top-k", args.top_k, args.top_k in (0, -1)),
                             ("--top-p", args.top_p, args.top_p == 1),
                             ("--seed", args.seed, args.seed is None)):
        if not off:
            return (f"{flag} {shown(value)} has no effect with --temperature 0 (greedy, the "
                    f"default); give a --temperature above 0 to sample, or drop {flag}")
    return None


def check_before_load(args: argparse.Namespace, params) -> None:
    """Reject a bad request, and `--device cuda` where torch sees no CUDA device, before any
    weight is read or any rank starts.

    Raises:
        ValueError (ModelDirError, RequestError): naming the bad value; --top-k, --top-p or
            --seed given with greedy decoding, which would ignore it.
    """
    from pathlib import Path

    from engine.config import load_model_config
    from engine.errors import RequestError, cuda_missing, tokens
    from engine.llm import torchrun_world

    check_flags(args)
    cfg = load_model_config(args.model)
    if args.top_k > cfg.vocab_size:  # named by its flag, before the request's own field check
        raise RequestError(f"--top-k {shown(args.top_k)} is above the vocabulary size {cfg.vocab_size}")
    params.validate(cfg.vocab_size)
    ignored = _ignored_when_greedy(args)
    if ignored is not None:
        raise RequestError(ignored)
    if args.prompt is not None:
        from engine.llm import LLM, has_tokenizer

        if not has_tokenizer(Path(args.model)):  # a tokenizer file that is a FIFO named so
            raise RequestError(f"text prompt given but {args.model} has no tokenizer; use "
                               "--prompt-ids")
        # tokenized here too, so a prompt too long is refused before any rank starts
        length = len(LLM._load_tokenizer(Path(args.model)).encode(args.prompt))
    else:
        for t in args.prompt_ids:
            if not 0 <= t < cfg.vocab_size:
                raise RequestError(f"prompt token id {t} outside the vocabulary "
                                   f"[0, {cfg.vocab_size})")
        length = len(args.prompt_ids)
    if args.max_model_len is not None and args.max_model_len > cfg.max_position:
        # named by its flag here; the engine's own check would name the field
        raise RequestError(f"--max-model-len {shown(args.max_model_len)} exceeds the model's "
                           f"max_position_embeddings {cfg.max_position}")
    limit = args.max_model_len if args.max_model_len is not None else min(cfg.max_position, 2048)
    if length + args.max_tokens > limit:
        raise RequestError(f"prompt of {tokens(length)} + --max-tokens {shown(args.max_tokens)} exceeds "
                           f"the max model length {limit}")
    problem = cuda_missing() if args.device == "cuda" else None
    if problem is not None:
        raise RequestError(f"--device cuda {problem}")
    if args.device == "cuda" and torchrun_world() is None:  # named by its flag, as above
        import torch

        visible = torch.cuda.device_count()
        if visible < args.tensor_parallel_size:
            raise RequestError(f"--tensor-parallel-size {shown(args.tensor_parallel_size)} with "
                               f"--device cuda needs that many GPUs; {visible} visible")


def _startup_failure(exc, args: argparse.Namespace) -> str:
    """The line for a rank failure while the engine started: its own, except that a load
    timeout under a startup timeout the user did not give says it defaulted to --step-timeout
    (a fresh user's finding: `--step-timeout 0.01` at -tp 2 was refused naming only
    --startup-timeout)."""
    from engine.errors import LoadTimeoutError

    if isinstance(exc, LoadTimeoutError) and args.startup_timeout is None:
        return LoadTimeoutError.line(exc.ranks, exc.timeout_s, "--startup-timeout, defaulting "
                                     f"to --step-timeout {shown(args.step_timeout)}")
    return str(exc)


def run(args: argparse.Namespace) -> int:
    """Load, generate, print the token ids (and text); returns the exit status.

    Exit status 2 for a bad model directory, parallel setting or request; 1 if a rank fails.
    """
    from engine.errors import RankError
    from engine.llm import LLM, serve_rank, torchrun_world
    from engine.sampling import SamplingParams

    llm_args = dict(tensor_parallel_size=args.tensor_parallel_size, device=args.device,
                    dtype=args.dtype, max_batch=args.max_batch, max_model_len=args.max_model_len,
                    cuda_graph=args.cuda_graph, decode_overlap=args.decode_overlap,
                    startup_timeout_s=args.startup_timeout, step_timeout_s=args.step_timeout)
    if args.gpu_memory_utilization is not None:  # else the engine's default
        llm_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    try:
        launched = torchrun_world()
    except ValueError as exc:  # a launcher's variables half set
        print(f"lockstep generate: error: {exc}", file=sys.stderr)
        return 2
    if launched is not None and launched[0] > 0:  # torchrun rank > 0: serve rank 0's commands
        try:
            return serve_rank(args.model, **llm_args)
        except ValueError as exc:  # rank 0 names it too; a traceback here named it again
            print(f"lockstep generate: error: rank {launched[0]}: {exc}", file=sys.stderr)
            return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        check_before_load(args, params)
    except ValueError as exc:
        print(f"lockstep generate: error: {exc}", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model, progress=True, **llm_args)
    except ValueError as exc:
        print(f"lockstep generate: error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:
        print(f"lockstep generate: error: {_startup_failure(exc, args)}", file=sys.stderr)
        return 1
    try:
        prompt = args.prompt if args.prompt is not None else args.prompt_ids
        out, = llm.generate([prompt], params)
    except RankError as exc:
        llm.shutdown()
        print(f"lockstep generate: error: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:  # Ctrl-C or SIGTERM mid-step: stop the ranks, no teardown
        llm._abort(exc)
        raise
    llm.shutdown()
    if out.error is not None:
        print(f"lockstep generate: error: {out.error}", file=sys.stderr)
        return 1 if out.finish_reason == "error" else 2  # the model failed, or the input
    print("token_ids:", ",".join(map(str, out.token_ids)))
    if out.text is not None:
        print("text:", out.text)
    if out.logprobs is not None:
        print("logprobs:", ",".join(f"{x:.4f}" for x in out.logprobs))
    print("finish_reason:", out.finish_reason)
    return 0
