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


def special_kind(path) -> str | None:
    """What stands at ``path`` where it is there but is no regular file -- "a directory", "a
    FIFO", "a character device", "a block device", "a socket", "a loop of links", with "a
    link to '/dev/zero', " before it for a link -- or None for a regular file or nothing (a
    dangling link included). Asked with stat before a file is opened: opening a FIFO blocks
    until something writes to it, and /dev/zero reads forever.

    Raises:
        OSError: the OS will not let ``path`` be looked at (a directory on the way that may
            not be entered).
    """
    import errno
    import stat
    from pathlib import Path

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        return "a loop of links"
    if stat.S_ISREG(mode):
        return None
    kind = next((what for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                                         (stat.S_ISCHR, "a character device"),
                                         (stat.S_ISBLK, "a block device"),
                                         (stat.S_ISSOCK, "a socket")) if test(mode)),
                "another kind of file")
    if path.is_symlink():
        import os

        kind = f"a link to {os.readlink(path)!r}, {kind}"
    return kind


def refuse_not_regular(path) -> None:
    """Refuse a model file that is there but is no regular file; a regular file, or nothing
    there, passes (the caller names a missing file in its own words).

    Raises:
        ModelDirError: ``/m/tokenizer.json: not a regular file (a FIFO)``; where ``path``
            cannot be looked at, the `unreadable` error.
    """
    try:
        kind = special_kind(path)
    except OSError as exc:
        raise unreadable(path, exc) from None
    if kind is not None:
        raise ModelDirError(f"{path}: not a regular file ({kind})")


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


class SilentRanksError(RankError):
    """Ranks did not answer within a deadline, with no rank known to have failed: from
    outside, a rank blocked in a collective that waits for a silent peer is silent too.

    Attributes:
        ranks: the ranks not heard from. rank: the lowest of them. timeout_s: the limit (s).
    """

    def __init__(self, ranks: list[int], timeout_s: float, detail: str):
        RuntimeError.__init__(self, detail)  # not "rank N failed: ...": none is known to have
        self.rank, self.detail = ranks[0], detail
        self.ranks, self.timeout_s = ranks, timeout_s


class LoadTimeoutError(SilentRanksError):
    """The rank processes did not all load the model within the startup timeout (the startup
    watchdog's limit, I6, which covers loading under TP): no rank failed, they were slow."""

    def __init__(self, ranks: list[int], timeout_s: float):
        super().__init__(ranks, timeout_s, self.line(ranks, timeout_s))

    @staticmethod
    def line(ranks: list[int], timeout_s: float, limit: str = "") -> str:
        """The error's one line; ``limit``, where given, follows the seconds in parentheses
        to say where the limit came from (`lockstep generate`: "--startup-timeout, defaulting
        to --step-timeout 0.01", when the user gave only the step timeout)."""
        source = f" ({limit})" if limit else ""
        return (f"startup watchdog expired after {timeout_s:g} s{source} while the ranks loaded "
                f"the model (ranks not ready: {', '.join(map(str, ranks))}); a larger "
                "--startup-timeout gives them longer")


class ReplyTimeoutError(SilentRanksError):
    """Ranks sent no reply to a command within the step timeout. Every rank not heard from is
    named, and none is called failed for it (a fresh user's finding: "rank 0 failed: no reply
    within 0.001 s (ranks not collected: [0, 1])")."""

    def __init__(self, ranks: list[int], timeout_s: float):
        which = (f"rank {ranks[0]}" if len(ranks) == 1 else
                 f"ranks {', '.join(map(str, ranks))}")
        super().__init__(ranks, timeout_s,
                         f"no reply within {timeout_s:g} s (the step timeout) from {which}")


def tokens(n: int) -> str:
    """``1 token``, ``3 tokens``: a token count as messages write it."""
    return f"{n} token" if n == 1 else f"{n} tokens"


def not_utf8_text(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 -- "not valid UTF-8 text: '\\udcff' at character
    8" (a lone surrogate, such as Python makes of non-UTF-8 bytes on the command line or in a
    path) -- or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid UTF-8 text: {text[exc.start:exc.end]!r} at character {exc.start}"
    return None


def check_text(text: str, what: str) -> None:
    """Raises RequestError if ``text`` cannot be encoded as UTF-8 (`not_utf8_text`), naming
    where; the tokenizer would raise a TypeError from deep inside instead."""
    problem = not_utf8_text(text)
    if problem is not None:
        raise RequestError(f"{what} is {problem}")
