"""`LLM`: the offline generation API, the controller side of the engine.

The `protocol.controller.Controller` schedules (admission, slots, buckets, retirement, step
lock); this module only drives it: it sends each command to every rank through a transport
from `engine.ranks`, feeds the replies back, and turns finished requests into
`RequestOutput`s. Requests with bad parameters or prompts that do not fit are rejected on their
own, before submission, while the others run.
"""

from __future__ import annotations

import numbers
import os
import random
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from engine.errors import (ModelDirError, ParallelConfigError, RankError, RequestError, check_text,
                           refuse_not_regular, tokens)
from engine.sampling import SamplingParams, as_token_id
from engine.engine_config import EngineConfig, check_model_fits
from engine.startup import StartupReport, StartupWatchdog
from lockstep.args import clipped, one_line_repr


@dataclass
class RequestOutput:
    """The result of one request of `LLM.generate`, in input order.

    Attributes:
        prompt_token_ids: the prompt as token ids ([] if it could not be tokenized).
        token_ids: generated token ids (the stop token included when one ended it).
        text: decoded `token_ids` without special tokens (the stop token that ended it, as
            vLLM's default ``skip_special_tokens``), or None without a tokenizer.
        logprobs: natural-log probability of each generated token (SamplingParams.logprobs).
        logits: float32 tensor [len(token_ids), vocab] (SamplingParams.return_logits).
        finish_reason: "stop", "length", "error" (non-finite logits ended it), or None when
            rejected.
        error: the RequestError that rejected or ended this request, else None.
        seed: the sampling seed used.
        arrival_time, first_token_time, finish_time: `time.perf_counter()` seconds when the
            request was submitted, when its first token was sampled (end of its prefill step)
            and when its last one was; None when rejected. TTFT is first - arrival, TPOT is
            (finish - first) / (len(token_ids) - 1).
    """

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list[float] | None = None
    logits: object = None
    finish_reason: str | None = None
    error: RequestError | None = None
    seed: int | None = None
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


class LLM:
    """A Qwen3 model served by `tensor_parallel_size` ranks.

    Args:
        model: an `EngineConfig` (from `EngineConfig.create`), or an HF-layout Qwen3
            directory (see `lockstep make-model`) with the arguments of
            `EngineConfig.create` as keywords (each documented there): tensor_parallel_size
            (1 runs in this process, more spawn one process per rank), device, dtype,
            max_batch, max_model_len, page_size, kv_cache_pages (I14: pages are
            handed out as sequences grow; a short cache preempts for recompute),
            max_prefill_tokens, step_timeout_s,
            startup_timeout_s (the startup watchdog, I6: past it the process aborts),
            cuda_graph, gpu_memory_utilization, progress, record_trace (keep every command,
            backend op and reply as `protocol.trace.TraceEvent`s in `self.trace`).
    Raises:
        ModelDirError, ParallelConfigError (ValueError): bad directory or settings, before
            any rank starts or device memory is allocated; or, once the ranks measured the
            GPU, settings that leave no memory for one full-length sequence (the memory fit's
            `StartupRefused`, with the settings to change).
        RankError: a rank failed while starting.

    Under torchrun (WORLD_SIZE > 1) only rank 0 builds an LLM; the other ranks call
    `serve_rank` with the same arguments. There a rank failure ends rank 0's process with
    exit status 1 (an abort, so that torchrun stops the whole group).
    """

    def __init__(self, model: "str | Path | EngineConfig", **kwargs):
        self._closed, self._closed_by = True, "its start failed"
        self._busy = threading.Lock()  # held by generate and shutdown: one call at a time
        if "_fault" in kwargs:  # test hooks
            kwargs["fault"] = kwargs.pop("_fault")
        if "_graph_standin" in kwargs:
            kwargs["graph_standin"] = kwargs.pop("_graph_standin")
        if isinstance(model, EngineConfig):
            if kwargs:
                raise TypeError(f"LLM(EngineConfig, ...) takes no other arguments, got "
                                f"{sorted(kwargs)}")
            model.validate()  # built directly, its values were taken as given
            # the caller's own object where it holds its model config, else config.json read once
            config = model if model.model is not None else replace(model,
                                                                     model=model.model_config)
            check_model_fits(config.model, config.world_size, config.device)
        else:
            config = EngineConfig.create(model, **kwargs)
        progress = config.progress
        self._say = (lambda msg: print(f"lockstep: {msg}", flush=True,
                                       file=sys.stderr)) if progress else (
            lambda msg: None)
        self.config = config
        self.cfg = config.model_config
        pconfig = config.protocol_config()
        tensor_parallel_size, device, model_dir = config.world_size, config.device, config.model_dir
        record_trace = config.trace
        self.trace: list = []
        self.steps = {"replay": 0, "eager": 0}  # serving steps with decode rows, by path
        self._record_trace = record_trace
        self._startup = StartupReport()
        self._say(f"config {self.cfg.config_path} ok; weights indexed")
        from protocol.controller import Controller

        self.controller = Controller(pconfig, clock=time.monotonic,
                                     pages_per_seq=self.config.pages_per_seq)
        self.tokenizer = self._load_tokenizer(Path(model_dir))
        dtype = self.config.dtype
        self._say(f"starting {tensor_parallel_size} rank(s) on {device} ({dtype})")
        t0 = time.monotonic()
        from engine.ranks import InProcessRanks, SpawnedRanks, TorchrunRanks, torchrun_env

        self.protocol_config = pconfig
        launched = torchrun_env()
        if launched is not None and launched[1] > 1:
            if launched[0] != 0:
                raise RuntimeError("under torchrun only rank 0 builds an LLM; other ranks call "
                                   "engine.llm.serve_rank(...) with the same arguments")
            self.ranks = TorchrunRanks(self.config, pconfig, self.cfg)
        elif tensor_parallel_size == 1:
            self.ranks = InProcessRanks(self.config, pconfig, self.cfg)
        else:
            self.ranks = SpawnedRanks(self.config, pconfig)
        self._closed = False
        self._next_id = 0
        self._extras: dict[int, tuple[SamplingParams, int]] = {}
        self._side: dict[int, dict[str, list]] = {}
        self._first_token: dict[int, float] = {}   # request id -> perf_counter at first token
        self._finish: dict[int, float] = {}        # request id -> perf_counter at last token
        self._last_step_end = 0.0
        self._unread_admits: tuple = ()  # overlap: admissions whose first token is unread
        # set to [] to record one (kind, rows, admits, seconds, prompt tokens, controller
        # seconds) per step: seconds from the top of the driver loop (the controller absorbing
        # the last step and building this one) to this step's last reply
        self.step_log: list | None = None
        self._say(f"model loaded in {time.monotonic() - t0:.1f} s")
        watchdog = StartupWatchdog(pconfig.watchdog_timeout_s, self._watchdog_expired)
        watchdog.arm()
        try:
            self._drive()  # the startup sweep, under the watchdog (I6)
        except BaseException as exc:  # Ctrl-C or SIGTERM included: no rank outlives a failed start
            self._abort(exc)
            raise
        finally:
            watchdog.disarm()
        for line in self._startup.summary(self.controller, self.config, self.cfg).splitlines():
            self._say(line)
        self._say(f"ready in {time.monotonic() - t0:.1f} s")

    def _watchdog_expired(self) -> None:
        """The startup watchdog's expiry: name the command in flight, kill the rank
        processes, abort this process (never exit: driver teardown can hang, H8)."""
        cur = self.controller.current
        what = (f"command {cur.seq} ({type(cur).__name__})" if cur is not None
                else "the wait between two commands")
        print(f"lockstep: startup watchdog expired after {self.protocol_config.watchdog_timeout_s:g}"
              f" s during {what}; ranks not collected: "
              f"{', '.join(map(str, self.controller.uncollected())) or 'none'}; aborting (I6)",
              file=sys.stderr, flush=True)
        try:
            self.ranks.kill()
        finally:
            os.abort()

    @staticmethod
    def _load_tokenizer(d: Path):
        """The tokenizer of model directory ``d``, or None where it has none (`has_tokenizer`).

        Raises:
            ModelDirError: a tokenizer file is no regular file (`has_tokenizer`), or
                transformers cannot load the tokenizer (`_tokenizer_error`).
        """
        if not has_tokenizer(d):
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(d))
        # JSONDecodeError included; AttributeError: a file of JSON but not an object ([], 5);
        # RecursionError: JSON nested deeper than Python's parser follows
        except (ValueError, OSError, TypeError, KeyError, AttributeError,
                RecursionError) as exc:
            raise _tokenizer_error(d, exc) from None
        except Exception as exc:  # noqa: BLE001 - re-raised unless exactly Exception
            if type(exc) is not Exception:
                raise
            # the tokenizers library refusing tokenizer.json (its schema, or nesting past 128)
            raise _tokenizer_error(d, exc) from None

    # -- driving the controller ------------------------------------------------------------

    def _what_to_lower(self) -> str:
        """The settings a startup the memory fit refused can change, with their values."""
        c = self.config
        share = (f"raise gpu_memory_utilization (now {c.gpu_memory_utilization}), or "
                 if c.device == "cuda" else "")
        return (f"{share}lower max_batch (now {c.max_batch}) or max_model_len (now "
                f"{c.max_model_len})")

    def _drive(self) -> None:
        """Run commands until the controller is idle or done; a failure aborts every rank.

        Raises:
            ParallelConfigError: the memory fit refused the startup (`StartupRefused`): the
                settings ask for more memory than the GPU leaves.
            RankError: any other failure, naming the lowest failed rank.
        """
        from protocol.controller import Abort, Done, Idle, Wait
        from protocol.commands import Step
        from protocol.errors import StartupRefused

        while True:
            t_top = time.perf_counter()  # a step's wall counts the controller's work for it
            action = self.controller.next_action()
            t_ctrl = time.perf_counter() - t_top
            if isinstance(action, (Idle, Done)):
                if isinstance(action, Done) and self._record_trace:
                    self._event("controller", "done", "Done")
                return
            if isinstance(action, Abort):
                if self._record_trace:
                    self._event("controller", "abort", action.how, detail=str(action.error),
                                ok=False)
                self._startup.close()
                err = action.error
                self._abort(err)
                if isinstance(err, StartupRefused):  # the settings ask more than the GPU has
                    raise ParallelConfigError(f"{err}; {self._what_to_lower()}") from err
                rank = min(getattr(err, "failed", ()) or getattr(err, "uncollected", ()) or (0,))
                raise RankError(rank, str(err)) from err
            if isinstance(action, Wait):  # cannot happen: collect() returns every reply
                raise RuntimeError(f"controller waits for ranks {action.ranks} after collect")
            command = action.command
            self._startup.sent(command, self.controller, self.config.progress)
            if self._record_trace:
                self._event("controller", "send", type(command).__name__, command.seq)
            extras = None
            if isinstance(command, Step) and command.rows:
                self.steps["replay" if command.key is not None else "eager"] += 1
            if isinstance(command, Step) and command.admits:
                # a preempted request is admitted again: its extras stay until it finishes
                extras = {a.request_id: self._extras[a.request_id] for a in command.admits}
            if isinstance(command, Step) and not command.overlap:
                for r in command.retires:  # their last token came with the previous step
                    self._finish[r.request_id] = self._last_step_end
            try:
                self.ranks.send(command, extras)
                results = self.ranks.collect()
                for reply, outputs, events in results:
                    self.trace.extend(events)
                    self._startup.replied(command, reply)
                    t_reply = time.perf_counter()
                    self.controller.on_reply(reply)
                    t_ctrl += time.perf_counter() - t_reply
                    # a leftover row's token is dropped (overlap): so is what came with it
                    dropped = self.controller.dropped_tokens() if outputs else ()
                    for rid, out in outputs.items():
                        if rid in dropped:
                            continue
                        side = self._side.setdefault(rid, {})
                        for k, v in out.items():
                            side.setdefault(k, []).append(v)
            except BaseException as exc:
                self._startup.close()
                self._abort(exc)
                raise
            if isinstance(command, Step):
                now = self._last_step_end = time.perf_counter()
                admitted = command.admits
                if command.overlap:  # this reply carries the previous step's tokens
                    admitted, self._unread_admits = self._unread_admits, command.admits
                    for r in command.retires:  # by now their last token came, at the latest
                        self._finish[r.request_id] = now
                for a in admitted:
                    self._first_token[a.request_id] = now
                if self.step_log is not None:
                    prefills = bool(command.admits) or command.chunk is not None
                    self.step_log.append(("mixed" if prefills and command.rows else
                                          "prefill" if prefills else
                                          "decode" if command.rows else "retire",
                                          len(command.rows), len(command.admits), now - t_top,
                                          sum(len(a.tokens) for a in command.admits)
                                          + (len(command.chunk.tokens) if command.chunk else 0),
                                          t_ctrl))

    def _event(self, actor: str, kind: str, what: str, seq=None, detail: str = "",
               ok: bool = True) -> None:
        from protocol.trace import TraceEvent

        self.trace.append(TraceEvent(actor, kind, what, seq, None, detail, ok, time.monotonic()))

    def _abort(self, cause: BaseException | None = None) -> None:
        """Stop every rank now (no teardown handshake); ``cause``, what made the caller stop,
        is named by a later call's "this LLM is closed" error."""
        self._closed = True
        self._closed_by = ("aborted" if cause is None else
                           "interrupted by Ctrl-C" if isinstance(cause, KeyboardInterrupt)
                           else f"stopped by {type(cause).__name__}: "
                                f"{clipped((str(cause).strip().splitlines() or [''])[0], 200)}")
        self.ranks.close(abort=True)

    # -- public API ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids) with continuous batching.

        Args:
            prompts: texts (needs a tokenizer in the model dir) or token-id lists.
            params: one SamplingParams for all, or one per prompt; default SamplingParams().
        Returns:
            One RequestOutput per prompt, in order; a rejected request has `.error` set.
        Raises:
            RequestError: ``prompts`` is neither a prompt nor a list of prompts (a bad single
                prompt or SamplingParams is reported in its RequestOutput's ``error``).
            ValueError: a list of SamplingParams not one per prompt.
            RankError: a rank failed; the engine is then closed.
            RuntimeError: the engine is closed, saying why (shut down, interrupted, a rank
                failure or another error); a Ctrl-C during a call also closes it.
        """
        with self._one_call("generate()"):
            return self._generate(prompts, params)

    @contextmanager
    def _one_call(self, name: str):
        """Hold the LLM for one public call. Two threads' `generate` calls raced in the
        controller: one failed inside it ("controller waits for ranks ... after collect") and
        its accepted requests were never returned, left in the controller's tables.

        Raises:
            RuntimeError: another thread's call is running, before anything is submitted.
        """
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"{name} while another call runs on this LLM (another "
                               "thread's, or a signal handler's); an LLM serves one call at a "
                               "time: wait for it, or build one LLM per thread")
        try:
            yield
        finally:
            self._busy.release()

    def _generate(self, prompts, params) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError(f"this LLM is closed ({self._closed_by}); build a new LLM")
        from protocol.requests import Request

        if isinstance(prompts, str) or _is_id_list(prompts):
            prompts = [prompts]
        if (isinstance(prompts, Mapping) or getattr(prompts, "ndim", 1) == 0
                or not isinstance(prompts, Sequence) and not hasattr(prompts, "__len__")):
            raise RequestError(f"prompts = {one_line_repr(prompts)}, expected a text, a list "
                               "of token ids, or a list of those")
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if isinstance(params, (str, bytes, dict)) or not isinstance(params, Sequence):
            raise RequestError(f"params is a {type(params).__name__}, expected a SamplingParams "
                               "or a list of them (one per prompt)")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        outs: list[RequestOutput] = []
        stops: list[frozenset[int] | None] = []  # None: refused
        # Every request is checked before any is submitted: an error no check foresaw then
        # leaves nothing accepted behind in the controller, to run in a later call unreturned.
        for prompt, p in zip(prompts, params):
            out = RequestOutput(prompt_token_ids=[])
            outs.append(out)
            stops.append(None)
            try:
                out.prompt_token_ids = self._tokenize(prompt)
                self._check_request(out.prompt_token_ids, p)
            except RequestError as exc:
                out.error = exc
                continue
            stops[-1] = p.stop_ids() | (frozenset() if p.ignore_eos
                                        else frozenset(self.cfg.eos_token_ids))
        ids: list[int | None] = []
        for out, p, stop in zip(outs, params, stops):
            ids.append(None)
            if stop is None:
                continue
            rid = self._next_id
            self._next_id += 1
            seed = p.seed if p.seed is not None else random.randrange(2**62)
            out.seed = seed
            self._extras[rid] = (p, seed)
            self.controller.submit(Request(rid, tuple(out.prompt_token_ids), p.max_tokens,
                                           stop))
            out.arrival_time = time.perf_counter()
            ids[-1] = rid
        self._drive()
        for out, rid, p, stop in zip(outs, ids, params, stops):
            if rid is None:
                continue
            self._extras.pop(rid, None)
            out.token_ids = list(self.controller.outputs.pop(rid))
            out.first_token_time = self._first_token.pop(rid, None)
            out.finish_time = self._finish.pop(rid, None)
            self.controller.requests.pop(rid, None)
            side = self._side.pop(rid, {})
            out.finish_reason = "stop" if out.token_ids and out.token_ids[-1] in stop else "length"
            if rid in self.controller.failed_requests:
                self.controller.failed_requests.discard(rid)
                out.finish_reason = "error"
                out.error = RequestError(f"request {ids.index(rid)}: "
                                         f"{side.get('error', ['no token'])[-1]}; the model "
                                         "weights or activations hold NaN or inf")
            if p.logprobs:
                out.logprobs = side.get("logprob", [])
            if p.return_logits:
                import torch

                out.logits = torch.stack(side.get("logits", []))
            if self.tokenizer is not None:
                out.text = output_text(self.tokenizer, out.token_ids)
        return outs

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"text prompt {prompt[:40]!r} but {self.config.model_dir} "
                                   "has no tokenizer; pass token ids")
            check_text(prompt, "text prompt")
            ids = list(self.tokenizer.encode(prompt))
            vocab = self.cfg.vocab_size
            if ids and not (min(ids) >= 0 and max(ids) < vocab):
                bad = next(i for i in ids if not 0 <= i < vocab)
                raise RequestError(f"text prompt {prompt[:40]!r} encodes to token id {bad}, "
                                   f"outside the model's vocabulary [0, {vocab}): the "
                                   f"tokenizer in {self.config.model_dir} does not match "
                                   "the model")
            return ids
        if not hasattr(prompt, "__iter__") or isinstance(prompt, (bytes, Mapping)) \
                or getattr(prompt, "ndim", 1) != 1:
            raise RequestError(f"prompt {one_line_repr(prompt)} is neither a text nor a list "
                               "of token ids")
        if (type(prompt) in (list, tuple) and prompt and set(map(type, prompt)) == {int}
                and min(prompt) >= 0 and max(prompt) < self.cfg.vocab_size):
            # plain Python ints in range (bool is not `int` by type): checked by C-level
            # passes; workload W's 143,618 prompt tokens took 34 ms one by one, 9 ms so
            return list(prompt)
        ids = []
        for t in prompt:
            i = as_token_id(t)
            if i is None:
                raise RequestError(f"prompt token id {t!r} is a {type(t).__name__}, expected "
                                   "an integer")
            if not 0 <= i < self.cfg.vocab_size:
                raise RequestError(f"prompt token id {t!r} outside the vocabulary "
                                   f"[0, {self.cfg.vocab_size})")
            ids.append(i)
        return ids

    def _check_request(self, prompt: list[int], p: SamplingParams) -> None:
        if not isinstance(p, SamplingParams):
            raise RequestError(f"sampling params {p!r} is not a SamplingParams")
        p.validate(self.cfg.vocab_size)
        if not prompt:
            raise RequestError("prompt is empty")
        total = len(prompt) + p.max_tokens
        if total > self.config.max_model_len:
            raise RequestError(f"prompt of {tokens(len(prompt))} + max_tokens "
                               f"{one_line_repr(p.max_tokens)} = {one_line_repr(total)} exceeds "
                               f"max_model_len {self.config.max_model_len}")

    def shutdown(self) -> None:
        """Tear down every rank (graphs, then communicator) and join their processes.

        Raises:
            RuntimeError: another thread's `generate` is running (`_one_call`).
        """
        with self._one_call("shutdown()"):
            self._shutdown()

    def _shutdown(self) -> None:
        if self._closed:
            return
        self.controller.shutdown()
        self._say(f"decode steps: {self.steps['replay']} replayed from graphs, "
                  f"{self.steps['eager']} eager")
        try:
            self._drive()
        finally:
            self._closed, self._closed_by = True, "shut down"
            self.ranks.close(abort=False)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        # waits for a call another thread still runs (each step is bounded by step_timeout_s),
        # so that leaving the block shuts the engine down and never masks the block's error
        with self._busy:
            self._shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.ranks.close(abort=True)
            except Exception:
                pass


TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json")
"""The JSON files of a model directory that `transformers.AutoTokenizer` reads."""

TOKENIZERS_MAX_DEPTH = 128
"""The deepest nesting of arrays and objects the tokenizers library parses in tokenizer.json:
serde_json's recursion limit (128 by default; "recursion limit exceeded" past it). Python's json
follows about 1,000 levels, so a tokenizer file nested deeper than this is too deep for one of
the two."""


def output_text(tokenizer, token_ids: list[int]) -> str:
    """``token_ids`` decoded by ``tokenizer`` without its special tokens: the end-of-sequence
    token that stopped a request is in `RequestOutput.token_ids`, not in its text (vLLM's
    default ``skip_special_tokens=True``)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def has_tokenizer(d: Path) -> bool:
    """Whether model directory ``d`` holds tokenizer.json or tokenizer_config.json.

    Raises:
        ModelDirError: a tokenizer file (`TOKENIZER_JSON`) is there but no regular file
            (`engine.errors.refuse_not_regular`): a FIFO as tokenizer.json read as "missing", one as
            tokenizer_config.json was passed over, and transformers would block opening one.
    """
    for name in TOKENIZER_JSON:
        refuse_not_regular(d / name)
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _tokenizer_error(d: Path, exc: Exception) -> ModelDirError:
    """The line for a tokenizer that `transformers.AutoTokenizer` could not load from ``d``.

    Where the failure is a parser's depth limit -- a RecursionError (Python's json, or
    transformers walking what it parsed), or the tokenizers library's bare Exception -- and a
    tokenizer file is nested deeper than TOKENIZERS_MAX_DEPTH, that file alone is named, as
    nested too deeply (the deepest, where several are). Where it is a UnicodeDecodeError, the
    first tokenizer file that is not UTF-8 is named, with its bad byte. Otherwise the tokenizer
    files and transformers' reason, on one line. Old behaviour: "maximum recursion depth exceeded"
    naming tokenizer.json and tokenizer_config.json whichever was deep, and tokenizer.json
    nested 200 deep a bare Exception traceback."""
    from engine.config_json import nesting_depth, not_utf8

    if isinstance(exc, UnicodeDecodeError):  # it named neither the file nor the problem
        for name in TOKENIZER_JSON:
            try:
                if (d / name).is_file():  # a FIFO would block the read
                    (d / name).read_text(encoding="utf-8")
            except UnicodeDecodeError as bad:
                return ModelDirError(f"{d / name}: the tokenizer cannot be read: "
                                     f"{not_utf8(bad)}")
            except OSError:
                pass
    if isinstance(exc, RecursionError) or type(exc) is Exception:
        depths = {}
        for name in TOKENIZER_JSON:
            try:
                depths[name] = nesting_depth((d / name).read_text())
            except (OSError, ValueError):  # absent, or not text: not the one nested too deeply
                pass
        deepest = max(depths, key=depths.get, default=None)
        if deepest is not None and depths[deepest] > TOKENIZERS_MAX_DEPTH:
            return ModelDirError(f"{d / deepest}: the tokenizer cannot be read: arrays or "
                                 f"objects nested {depths[deepest]} deep, too deeply to parse")
    names = [f for f in ("tokenizer.json", "tokenizer_config.json") if (d / f).is_file()]
    line = " ".join(str(exc).split()) or type(exc).__name__  # all of it, one line
    # transformers' words for a config without its tokenizer.json speak of packages
    missing = "" if "tokenizer.json" in names else " (tokenizer.json is missing)"
    return ModelDirError(f"{d}: the tokenizer ({', '.join(names)}) cannot be read{missing}: "
                         f"{line}")


def _is_id_list(prompts) -> bool:
    """True if ``prompts`` is one prompt of token ids, not a batch: its first item is a scalar
    (an int, or a float, bool or 0-d array that `_tokenize` then names as no token id), or it
    is an empty 1-D array or tensor. A batch's items are texts or sequences; an empty list is
    an empty batch. ``[1.0, 2.0]`` was read as a batch of two prompts, each refused, so
    ``out, = llm.generate(...)`` failed to unpack rather than showing the error."""
    if isinstance(prompts, Mapping):  # {0: 5}[0] is integer-like, but a dict is no prompt
        return False
    try:
        if len(prompts) == 0:
            return getattr(prompts, "ndim", None) == 1 and _numeric(prompts)
        first = prompts[0]
    except (TypeError, KeyError, IndexError):
        return False
    if isinstance(first, (str, bytes)):
        return False
    return (as_token_id(first) is not None or isinstance(first, numbers.Number)
            or getattr(first, "ndim", None) == 0 and _numeric(first))


def _numeric(array) -> bool:
    """Whether a numpy array or scalar, or a torch tensor, holds numbers or bools (not text or
    objects: an empty array of str is an empty batch of texts, a 0-d one a text)."""
    kind = getattr(getattr(array, "dtype", None), "kind", None)  # numpy; a torch dtype has none
    return kind in tuple("biufc") if kind is not None else hasattr(array, "is_floating_point")


def torchrun_world():
    """(rank, world size) under torchrun, else None."""
    from engine.ranks import torchrun_env

    return torchrun_env()


def serve_rank(model_dir, tensor_parallel_size: int, **kwargs) -> int:
    """Under torchrun, the body of ranks > 0: build the same settings as rank 0's `LLM(...)`
    (pass the same arguments, minus `progress`) and serve commands until teardown."""
    from engine.ranks import serve_torchrun_rank

    kwargs.pop("progress", None)
    fault = kwargs.pop("_fault", None)
    standin = kwargs.pop("_graph_standin", False)
    config = EngineConfig.create(model_dir, tensor_parallel_size, fault=fault,
                                 graph_standin=standin, **kwargs)
    return serve_torchrun_rank(config, config.protocol_config())
