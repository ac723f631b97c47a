"""Keeping a variant's own code from taking the checker down: one-line errors and a stall watchdog.

A variant's hooks are user code. When one raises, the check reports one line naming the
variant, the exception and where it was raised (`describe`), and the other variants' rows are
kept. When one never returns, the `watchdog` stops it: every `CHECK_S` seconds it looks whether
the simulator still makes progress (`tick` is called once per simulated action; one action
takes microseconds) and raises `Stalled` in the main thread when it has not. Time budgets
stay cooperative (searches check them between runs); the watchdog only ends a search that is
stuck inside one call, which no budget check can reach.

The watchdog uses SIGALRM and ``ITIMER_REAL``, so it works in the main thread of a POSIX
process only (elsewhere it does nothing); it nests with an outer user of the same timer (as
pytest-timeout's signal method), whose alarm it hands on when that falls first.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager

CHECK_S = 1.0
"""Seconds without one simulated action that count as stuck."""

_TICKS = [0]
_PAUSED = [0]


def tick() -> None:
    """Record one simulated action (progress for the watchdog)."""
    _TICKS[0] += 1


class Stalled(BaseException):
    """A search made no progress for `CHECK_S` seconds (a hook that never returns).

    A BaseException so that a hook's own ``except Exception`` cannot swallow it.

    Attributes:
        where: ``file:line`` that was running when the watchdog fired.
    """

    def __init__(self, where: str):
        super().__init__(f"no simulated action for {CHECK_S:g} s (a hook that never returns?); "
                         f"stopped at {where}")
        self.where = where


class VariantCodeError(Exception):
    """A variant's code raised, or never returned; ``str`` is one line naming the variant."""


def _project_dirs() -> tuple[str, ...]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tuple(os.path.join(root, d) + os.sep for d in ("sim", "protocol"))


def locate(exc: BaseException) -> str:
    """One line: ``Type: message (at file:line)``.

    The location is the innermost frame outside this project's ``sim/`` and ``protocol/``
    (a variant's own code) when there is one, else the innermost frame.
    """
    if isinstance(exc, Stalled):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    ours = _project_dirs()
    theirs = [f for f in frames if not os.path.abspath(f.filename).startswith(ours)]
    frame = (theirs or frames or [None])[-1]
    where = f" (at {os.path.basename(frame.filename)}:{frame.lineno})" if frame else ""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}{': ' + text if text else ''}{where}"


def describe(variant_name: str, exc: BaseException | str) -> str:
    """One line naming the variant: ``variant 'NAME': `` then `locate` (or the given text)."""
    return f"variant {variant_name!r}: {exc if isinstance(exc, str) else locate(exc)}"


@contextmanager
def paused():
    """While waiting on worker processes (which watch themselves), the watchdog only waits."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


@contextmanager
def watchdog():
    """Raise `Stalled` in this thread if no `tick` happens for `CHECK_S` seconds (unless
    `paused`). A no-op outside the main thread or without SIGALRM."""
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer")):
        yield
        return
    old_handler = signal.getsignal(signal.SIGALRM)
    old_delay, old_interval = signal.getitimer(signal.ITIMER_REAL)
    now = time.perf_counter()
    outer = now + old_delay if old_delay > 0 else None
    seen = [_TICKS[0]]

    def arm(at: float) -> None:
        if outer is not None:
            at = min(at, outer)
        signal.setitimer(signal.ITIMER_REAL, max(at - time.perf_counter(), 1e-3))

    def fire(signum, frame):
        now = time.perf_counter()
        if outer is not None and now >= outer - 1e-3:
            signal.signal(signal.SIGALRM, old_handler)
            if old_interval:
                signal.setitimer(signal.ITIMER_REAL, old_interval, old_interval)
            if callable(old_handler):
                old_handler(signum, frame)
            return
        if seen[0] == _TICKS[0] and not _PAUSED[0]:
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?"
            raise Stalled(where)
        seen[0] = _TICKS[0]
        arm(now + CHECK_S)

    signal.signal(signal.SIGALRM, fire)
    arm(now + CHECK_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if outer is not None:
            signal.setitimer(signal.ITIMER_REAL, max(outer - time.perf_counter(), 1e-3), old_interval)


__all__ = ["tick", "watchdog", "paused", "describe", "locate", "Stalled", "VariantCodeError", "CHECK_S"]
