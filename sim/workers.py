"""Worker processes for parallel schedule search, built so that stopping early cannot hang.

`multiprocessing.Pool` hung in teardown under load (issue 13 item 18): `Pool.terminate` joined
its task-handler thread, which sat on the shared task queue's lock after the workers had died;
the pool had also been forked from a process that already ran threads (tqdm's monitor). This
module avoids each ingredient of that hang:

- every worker owns one duplex `Pipe`; there is no shared queue, no lock, and no feeder,
  handler or result thread in the parent;
- tasks are handed out lazily, one to each idle worker, so nothing is ever queued that would
  have to be cancelled; `cancel_after` drops the rest and kills the workers running them;
- the parent waits on every pipe and every process sentinel at once
  (`multiprocessing.connection.wait`) with a timeout, so a worker that dies or stops answering
  is noticed instead of waited for;
- teardown sends SIGKILL to every live worker and joins each with a timeout; it needs nothing
  from a worker;
- workers come from the forkserver (a single-threaded server process), never from forking the
  caller; they ignore SIGINT (the parent owns Ctrl-C) and end themselves as soon as the process
  that started them is gone (`_exit_with_parent`), so no worker outlives a killed parent.

The job is pickled once per worker; a job that cannot be pickled makes `WorkerPool` raise
`JobNotPicklable` at construction so the caller can run serially instead.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait

from sim.guard import locate, paused

GRACE_S = 5.0
"""Seconds past the deadline a worker may take to answer before it counts as stuck."""

_PRELOAD = ["sim.search", "sim.check", "sim.variants", "sim.waits", "sim.checks", "networkx"]
"""Imported once by the forkserver, so that workers start with them (a missing one is skipped)."""


class JobNotPicklable(Exception):
    """The job (or target) cannot be sent to a worker process."""


class WorkerError(Exception):
    """A worker process failed: its task raised, it died, or it stopped answering.

    Attributes:
        task: the task it was running.
        message: one line saying what happened.
    """

    def __init__(self, task, message: str):
        super().__init__(message)
        self.task = task
        self.message = message


def _context():
    """The forkserver context where the platform has one, else spawn (never plain fork)."""
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def start_server() -> None:
    """Start the forkserver and its preload imports now, without waiting for them.

    `lockstep check` calls this before its own imports, so that the server imports the
    simulator while the check's process does the same instead of after it (each takes 0.3-0.4 s
    where bytecode is not cached; the default check's wall time drops by about 0.5 s); the first
    `WorkerPool` then finds the server running. A check that makes no pool leaves the server
    idle until the process exits. A no-op where workers are spawned.
    """
    if _context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _exit_with_parent() -> None:
    """End this process as soon as the process that started it is gone, however it went
    (SIGKILL included), from a daemon thread.

    A busy worker would otherwise run its task on to the deadline -- with a slow hook, up to the
    whole time budget -- before its answer found the pipe closed. Its parent in the process
    tree is the forkserver, not the check, and the forkserver outlives a killed check for as
    long as any of its children holds its "alive" pipe, as each one does; so the kernel's
    ``PR_SET_PDEATHSIG``, which this used to ask for, never fired. `multiprocessing`'s parent
    sentinel is the starting process's own end of a pipe, readable (at end of file) once that
    process is gone, whatever the start method."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="lockstep-parent-watch", daemon=True).start()


def _worker_main(conn, target, job) -> None:
    """Worker loop: receive a task, answer ``("ok", result)`` or ``("error", line)``; stop on None/EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    from sim.run import freeze_imports  # here, not above: `start_server` keeps this module light

    freeze_imports()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task, seconds_left = message
        try:
            answer = ("ok", target(job, task, time.perf_counter() + seconds_left))
        except BaseException as exc:  # noqa: BLE001 - a hook's SystemExit or a Stall included
            answer = ("error", locate(exc))
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return


class WorkerPool:
    """``workers`` processes running ``target(job, task, deadline)`` for tasks handed out lazily.

    Args:
        target: a module-level function ``(job, task, deadline) -> result``; ``deadline`` is a
            `time.perf_counter` value in the worker's clock.
        job: what every task shares (pickled once per worker).
        workers: number of worker processes (>= 1).
        deadline: `time.perf_counter` value; a worker silent for `GRACE_S` past it is stuck.

    Raises:
        JobNotPicklable: ``target`` or ``job`` cannot be pickled.

    Use as a context manager; leaving it kills every worker (see `close`).
    """

    def __init__(self, target: Callable, job, workers: int, deadline: float):
        try:
            pickle.dumps((target, job))
        except Exception as exc:  # noqa: BLE001 - any pickling failure means: run serially
            raise JobNotPicklable(locate(exc)) from None
        self.deadline = deadline
        self._cutoff: int | None = None
        self._draining = False
        self._procs: list = []
        self._conns: list = []
        with paused():  # the first start also starts the forkserver, which imports the preloads
            try:
                self._start(workers, target, job)
            except BaseException:
                self.close()
                raise

    def _start(self, workers: int, target: Callable, job) -> None:
        ctx = _context()
        for _ in range(workers):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, args=(child_conn, target, job),
                               daemon=True)
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)

    def cancel_after(self, index: int) -> None:
        """Hand out no task past position ``index`` and kill the workers running one."""
        self._cutoff = index if self._cutoff is None else min(self._cutoff, index)

    def drain(self) -> None:
        """Hand out no further task; tasks already running finish and are still yielded."""
        self._draining = True

    def results(self, tasks: Iterable) -> Iterator[tuple[int, object, object]]:
        """Yield ``(position, task, result)`` as workers finish, in completion order.

        Raises:
            WorkerError: a task raised (the worker's one-line account), a worker died, or no
                worker answered within `GRACE_S` after the deadline.
        """
        pending = list(enumerate(tasks))
        pending.reverse()
        busy: dict[int, tuple[int, object]] = {}  # worker -> (position, task)
        idle = list(range(len(self._procs)))
        while True:
            if self._cutoff is not None:
                pending = [p for p in pending if p[0] <= self._cutoff]
                for w, (pos, _) in list(busy.items()):
                    if pos > self._cutoff:
                        self._kill(w)
                        del busy[w]
            if self._draining:
                pending = []
            while idle and pending:
                w = idle.pop()
                pos, task = pending.pop()
                self._conns[w].send((task, max(0.0, self.deadline - time.perf_counter())))
                busy[w] = (pos, task)
            if not busy:
                return
            timeout = self.deadline + GRACE_S - time.perf_counter()
            with paused():  # the workers watch their own progress
                # in slices of at most an hour: a far deadline must not overflow poll's timeout
                ready = wait([self._conns[w] for w in busy] + [self._procs[w].sentinel for w in busy],
                             timeout=min(max(0.0, timeout), 3600.0))
            if not ready and timeout > 3600.0:
                continue
            if not ready:
                pos, task = min(busy.values(), key=lambda b: b[0])
                raise WorkerError(task, f"no answer {GRACE_S:g} s past the time budget "
                                        "(a hook that never returns?)")
            for w in list(busy):
                conn = self._conns[w]
                if conn not in ready:
                    continue
                pos, task = busy.pop(w)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    raise WorkerError(task, self._death(w)) from None
                if status == "error":
                    raise WorkerError(task, value)
                idle.append(w)
                yield pos, task, value
            for w in list(busy):
                if self._procs[w].sentinel in ready and self._conns[w] not in ready:
                    pos, task = busy.pop(w)
                    raise WorkerError(task, self._death(w))

    def _death(self, w: int) -> str:
        proc = self._procs[w]
        proc.join(1.0)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"worker process killed by signal {-code}"
        return f"worker process exited with code {code}"

    def _kill(self, w: int) -> None:
        proc = self._procs[w]
        if proc.is_alive():
            try:
                proc.kill()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Kill every worker and reap it (each join bounded); never waits on a worker's help."""
        for w in range(len(self._procs)):
            self._kill(w)
        with paused():
            for proc, conn in zip(self._procs, self._conns):
                proc.join(2.0)
                conn.close()
        self._procs = []
        self._conns = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["WorkerPool", "WorkerError", "JobNotPicklable", "GRACE_S", "start_server"]
