"""Errors of the engine that a caller can act on.

Every message names the offending value and, where there is one, the file it came from, so a
log line alone says what to fix. All are raised before any rank starts or device memory is
allocated, unless the class says otherwise.
"""

from __future__ import annotations

NO_CUDA_GPU = "needs a CUDA GPU; torch.cuda.is_available() is False"
"""The one wording for a command or setting refused where torch sees no CUDA device, after
what needs it: "gemm_sweep: error: needs a CUDA GPU; ...", "--device cuda needs a CUDA GPU;
..."."""


def cuda_missing() -> str | None:
    """`NO_CUDA_GPU` when torch sees no CUDA device, else None: the check a command makes
    before it touches the GPU (it imports torch)."""
    import torch

    return None if torch.cuda.is_available() else NO_CUDA_GPU


class ModelDirError(ValueError):
    """A model directory is unusable: missing, incomplete, wrong architecture, bad shapes."""


def unreadable(path, exc: OSError) -> ModelDirError:
    """The error for a model file or directory the OS will not let the engine read, with the
    OS's reason: ``/m/config.json: cannot read: Permission denied``."""
    return ModelDirError(f"{path}: cannot read: {exc.strerror or exc}")


class ParallelConfigError(ValueError):
    """The model cannot be split at the requested tensor-parallel size (heads, intermediate,
    vocab not divisible), or the parallel settings themselves are invalid."""


class RequestError(ValueError):
    """One request is invalid (bad sampling parameters, prompt too long, unknown token id).

    Raised or reported for that request only; other requests in the same call still finish.
    """


class RankError(RuntimeError):
    """A rank process raised, died, or did not answer within its deadline.

    Attributes:
        rank: the failing rank (the lowest one when several failed).
        detail: the rank's error text, or how it died (exit code / signal / timeout).
    """

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank
        self.detail = detail


class LoadTimeoutError(RankError):
    """The rank processes did not all load the model within the startup timeout (the startup
    watchdog's limit, I6, which covers loading under TP): no rank failed, they were slow.

    Attributes:
        ranks: the ranks not ready. rank: the lowest of them. timeout_s: the limit (s).
    """

    def __init__(self, ranks: list[int], timeout_s: float):
        detail = self.line(ranks, timeout_s)
        RuntimeError.__init__(self, detail)  # not "rank N failed: ...": no rank failed
        self.rank, self.detail = ranks[0], detail
        self.ranks, self.timeout_s = ranks, timeout_s

    @staticmethod
    def line(ranks: list[int], timeout_s: float, limit: str = "") -> str:
        """The error's one line; ``limit``, where given, follows the seconds in parentheses
        to say where the limit came from (`lockstep generate`: "--startup-timeout, defaulting
        to --step-timeout 0.01", when the user gave only the step timeout)."""
        source = f" ({limit})" if limit else ""
        return (f"startup watchdog expired after {timeout_s:g} s{source} while the ranks loaded "
                f"the model (ranks not ready: {', '.join(map(str, ranks))}); a larger "
                "--startup-timeout gives them longer")


def tokens(n: int) -> str:
    """``1 token``, ``3 tokens``: a token count as messages write it."""
    return f"{n} token" if n == 1 else f"{n} tokens"


def check_text(text: str, what: str) -> None:
    """Raises RequestError if ``text`` cannot be encoded as UTF-8 (a lone surrogate, such as
    Python makes of non-UTF-8 bytes on the command line), naming where; the tokenizer would
    raise a TypeError from deep inside instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} is not valid UTF-8 text: {text[exc.start:exc.end]!r} at "
                           f"character {exc.start}") from None
