"""Keeping a variant's own code from taking the checker down: one-line errors and a stall watchdog.

A variant's hooks are user code. When one raises, the check reports one line naming the
variant, the exception and where it was raised (`describe`), and the other variants' rows are
kept. When one never returns, the `watchdog` stops it: every `CHECK_S` seconds of CPU time it
looks whether the simulator still makes progress (`tick` is called once per simulated action; one action
takes microseconds) and raises `Stalled` in the main thread when it has not. Time budgets
stay cooperative (searches check them between runs); the watchdog only ends a search that is
stuck inside one call, which no budget check can reach.

CPU time the garbage collector spends is the interpreter's, not a hook's: an interval without
a `tick` in which the collector took at least half the CPU does not count as a stall (a full
collection of a large heap, as a long `--matrix` builds, took over `CHECK_S` and stopped a
correct search on a fresh user's machine).

The watchdog uses SIGPROF and ``ITIMER_PROF`` (CPU time), so it works in the main thread of a
POSIX process only (elsewhere it does nothing) and leaves SIGALRM to others (pytest-timeout).
A hook that blocks without using CPU (a sleep, a lock, a read) burns no CPU time, so the CPU
timer never fires; a helper thread watches wall time as well and, after `WALL_S` seconds without
a `tick` in which the process used next to no CPU, sends SIGPROF to the main thread itself, which
interrupts the blocking call (the worker pool's own deadline, `sim.workers.GRACE_S`, is the same
bound one level up).
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager

CHECK_S = 0.5
"""Seconds of CPU time without one simulated action that count as stuck."""

WALL_S = 5.0
"""Wall seconds without one simulated action (outside `paused`), and with next to no CPU time
used (`BLOCKED_CPU_S`), that count as stuck: a hook that blocks. The same grace the worker pool
gives a worker (`sim.workers.GRACE_S`)."""

BLOCKED_CPU_S = 0.05
"""CPU seconds a process may use in `WALL_S` of wall time and still count as blocked. A
process that computes between simulated actions but waits for a CPU on a loaded machine uses
more, and is left to the CPU-time bound (`CHECK_S`), which a loaded machine cannot trip."""

_WALL_POLL_S = 0.25
"""How often the wall-clock thread looks at the tick count."""

_LAZY = ("sim.waits", "sim.checks", "networkx")
_GC = [0.0, None]  # CPU seconds the collector spent while watched; start of one in progress


def _on_gc(phase: str, info: dict) -> None:
    """`gc.callbacks` entry of a watched process: adds up the collector's CPU time."""
    if phase == "start":
        _GC[1] = time.process_time()
    elif _GC[1] is not None:
        _GC[0] += time.process_time() - _GC[1]
        _GC[1] = None


def _collector_cpu() -> float:
    """CPU seconds the garbage collector has spent while watched, one in progress included."""
    return _GC[0] + (time.process_time() - _GC[1] if _GC[1] is not None else 0.0)


_TICKS = [0]
_RUN: list[list] = [[]]  # the choice list of the run in progress (`counting_choices`)
_PAUSED = [0]


def tick() -> None:
    """Record one simulated action (progress for the watchdog)."""
    _TICKS[0] += 1


def progress() -> int:
    """Simulated actions so far (what the watchdog watches): every `tick`, and the choices of
    the run in progress."""
    return _TICKS[0] + len(_RUN[0])


@contextmanager
def counting_choices(choices: list):
    """While a run lasts, count the entries of its choice list (one per action) as its
    progress, so that the run loop needs no `tick` per action; they become ticks when it ends."""
    previous, _RUN[0] = _RUN[0], choices
    try:
        yield
    finally:
        _TICKS[0] += len(choices)
        _RUN[0] = previous


class Stalled(BaseException):
    """A search made no progress for `CHECK_S` seconds (a hook that never returns).

    A BaseException so that a hook's own ``except Exception`` cannot swallow it.

    Attributes:
        where: ``file:line`` that was running when the watchdog fired.
    """

    def __init__(self, where: str, wall: bool = False):
        if wall:
            what = (f"no simulated action for {WALL_S:g} s of wall time (a hook that blocks: "
                    "a sleep, a lock, a read?)")
        else:
            what = f"no simulated action for {CHECK_S:g} s (a hook that never returns?)"
        super().__init__(f"{what}; stopped at {where}")
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
def resumed():
    """Inside `paused`, watch again: a search library that runs its own long computations
    (Hypothesis's generation and shrinking) between runs pauses the watchdog around itself and
    resumes it while the simulator runs a schedule, which ticks."""
    _PAUSED[0] -= 1
    try:
        yield
    finally:
        _PAUSED[0] += 1


@contextmanager
def watchdog():
    """Raise `Stalled` in this thread if this process spends `CHECK_S` seconds of CPU time, or
    `WALL_S` seconds of wall time, without a `tick` (unless `paused`, or the garbage collector
    took at least half of that CPU time: module docstring).

    The first bound counts CPU time (``ITIMER_PROF``), so a loaded machine that leaves the
    process waiting for a CPU never looks like a stall; a hook that loops burns CPU and is
    caught. The second catches a hook that blocks (a sleep: wall time passes, CPU time does
    not): a daemon thread sends SIGPROF to this thread, which interrupts the blocking call. A no-op outside the main thread, without
    ``setitimer``, or while another user of ``ITIMER_PROF`` (a sampling profiler) has it armed.
    """
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer") or signal.getitimer(signal.ITIMER_PROF)[0] > 0):
        yield
        return
    for name in _LAZY:  # imported inside a step on first use; load them before the clock runs
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    old_handler = signal.getsignal(signal.SIGPROF)
    seen = [progress(), _collector_cpu()]
    wall_stalled = [False]

    def fire(signum, frame):
        wall = wall_stalled[0]
        collecting = _collector_cpu() - seen[1] >= CHECK_S / 2
        if wall or (seen[0] == progress() and not _PAUSED[0] and not collecting):
            signal.setitimer(signal.ITIMER_PROF, 0)
            wall_stalled[0] = False
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?"
            raise Stalled(where, wall=wall)
        seen[0], seen[1] = progress(), _collector_cpu()

    stop = threading.Event()
    lock = threading.Lock()  # no SIGPROF is sent once the handler is being restored
    main = threading.main_thread().ident

    def watch_wall():
        last, since, since_cpu = progress(), time.monotonic(), time.process_time()
        while not stop.wait(_WALL_POLL_S):
            now, cpu = time.monotonic(), time.process_time()
            if progress() != last or _PAUSED[0] or cpu - since_cpu >= BLOCKED_CPU_S:
                last, since, since_cpu = progress(), now, cpu  # progress, or computing
            elif now - since > WALL_S:
                with lock:
                    if stop.is_set():
                        return
                    wall_stalled[0] = True
                    signal.pthread_kill(main, signal.SIGPROF)
                return

    gc.callbacks.append(_on_gc)
    signal.signal(signal.SIGPROF, fire)
    signal.setitimer(signal.ITIMER_PROF, CHECK_S, CHECK_S)
    thread = threading.Thread(target=watch_wall, name="lockstep-wall-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with lock:
            stop.set()
        thread.join()
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old_handler)
        gc.callbacks.remove(_on_gc)
        _GC[1] = None


__all__ = ["tick", "progress", "counting_choices", "watchdog", "paused", "resumed", "describe", "locate", "Stalled", "VariantCodeError", "CHECK_S", "WALL_S", "BLOCKED_CPU_S"]
