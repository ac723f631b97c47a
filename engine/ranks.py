"""Rank execution: how commands reach each rank's executor and replies come back.

`execute` runs one command on one rank: the protocol `Worker` turns it into backend operations,
the `RankExecutor` performs them, the worker turns the results into a `Reply` (or a failed
reply that poisons it). Two transports carry commands:

    `InProcessRanks`   world size 1: the executor lives in the caller's process.
    `SpawnedRanks`     one process per rank (torch.multiprocessing spawn context), a duplex
                       pipe per rank as the command channel; gloo on CPU, NCCL on CUDA; the
                       ranks meet at a store the controller holds (`engine.rendezvous`).
    `TorchrunRanks`    processes launched by `torchrun` (env:// rendezvous, so multi-node
                       works): rank 0 drives and runs its own executor; the command channel is
                       a separate gloo group (broadcast the command, gather the replies);
                       ranks > 0 run `serve_torchrun_rank`.

A rank that raises replies with ok=False; a rank that dies is seen through its process
sentinel at once; a rank that does not answer within `step_timeout_s` is declared failed. Every
failure ends in `close(abort=True)`, which kills every rank process (SIGKILL: an abort, never
an exit that would run driver teardown, H8) and joins it, so no process is left behind.
"""

from __future__ import annotations

import os
import time
import traceback
from contextlib import contextmanager
from multiprocessing.connection import wait as mp_wait
from typing import Any

from engine.errors import (LoadTimeoutError, ParallelConfigError, RankError,
                           ReplyTimeoutError)
from engine.engine_config import EngineConfig
from engine.rendezvous import HeldStore, StoreAddress, join_process_group

# Seconds a killed rank process is given to be reaped before we stop waiting for it.
JOIN_TIMEOUT_S = 10.0
# Seconds a spawned rank's collectives wait beyond the step timeout: the controller's step
# timeout must fire first, so that it names the silent (stopped, wedged) rank rather than the
# healthy rank whose collective timed out waiting for it.
COLLECTIVE_GRACE_S = 30.0


def reap(procs, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Join each started process for up to `timeout_s` seconds; SIGKILL one that is still alive
    and join it again for as long. Processes never started are skipped (joining one raises).

    Args:
        procs: `multiprocessing.Process` objects (any start method).
        timeout_s: seconds to wait for each process, before and again after its kill.
    """
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join(timeout_s)


def execute(worker, executor, command, extras: dict | None) -> tuple[Any, dict, list]:
    """Run `command` on one rank.

    Returns (protocol Reply, side outputs of rank 0's sampler, trace events): the events are
    one `protocol.trace.TraceEvent` per backend op run and one for the reply, when
    `executor.settings.trace` is set, else []. `extras` carries engine data for this command
    (sampling parameters of admitted requests); it never carries a protocol decision.
    """
    from protocol.execution import run_command

    tracing = getattr(executor.settings, "trace", False)
    events: list = []
    if extras:
        try:
            executor.register(extras)
        except Exception as exc:  # engine data that cannot be registered fails the command
            return worker.fail(command, exc), {}, events
    reply = run_command(worker, executor, command, events.append if tracing else None,
                        time.monotonic)
    outputs, executor.outputs = executor.outputs, {}
    return reply, outputs, events


def _make_worker(settings: EngineConfig, protocol_config, rank: int):
    from protocol.eligibility import GraphPlan
    from protocol.worker import Worker

    return Worker(rank, settings.world_size, GraphPlan.from_config(protocol_config),
                  settings.max_batch)


class InProcessRanks:
    """World size 1: one executor in this process.

    Raises:
        ValueError: the model directory's files refused while loading (`ModelDirError`).
        RankError: any other start-up failure (an allocation the device or host cannot make,
            say), in one line as a spawned rank reports it: "rank 0 failed: start-up failed:
            ...".
    """

    def __init__(self, settings: EngineConfig, protocol_config, cfg=None):
        from engine.executor import RankExecutor
        from engine.parallel import SINGLE

        try:
            if settings.device == "cuda":
                import torch

                torch.cuda.set_device(0)
            self.executor = RankExecutor(settings, SINGLE, cfg)
            self.executor.load_model()
        except ValueError:
            raise
        except Exception as exc:  # as `_serve` sends it from a spawned rank
            raise RankError(0, "start-up failed: "
                            + _last_line(f"{type(exc).__name__}: {exc}")) from exc
        self.worker = _make_worker(settings, protocol_config, 0)
        self._pending: tuple | None = None
        self.fault = settings.fault

    def send(self, command, extras: dict | None) -> None:
        """Run `command` now; its reply is returned by the next `collect`."""
        if self.fault and self.fault[0] == 0 and self.fault[1] == command.seq:
            if self.fault[2] == "hang":  # a wedge: only the startup watchdog ends it
                time.sleep(3600)
            # in-process, the other fault kinds are a failed reply: no process to kill
            self._pending = (self.worker.fail(command, RuntimeError(
                f"injected fault at command {command.seq}")), {}, [])
            return
        self._pending = execute(self.worker, self.executor, command, extras)

    def collect(self) -> list[tuple[Any, dict, list]]:
        """[(reply, side outputs, trace events)] of the last command."""
        out, self._pending = [self._pending], None
        return out

    def close(self, abort: bool = False) -> None:
        """Nothing to stop in-process."""

    def kill(self) -> None:
        """Nothing to kill in-process (the watchdog aborts this process)."""


def rank_title(rank: int, settings: EngineConfig) -> str:
    """The process title of a rank process, as `ps` shows it."""
    return (f"lockstep rank {rank}/{settings.world_size} ({settings.device}, "
            f"{os.path.basename(os.path.normpath(settings.model_dir))})")


MAIN_GUARD_EXIT = 86
"""Exit status of a spawned process that found itself re-running the caller's script (no
``if __name__ == "__main__":`` guard) instead of starting as a rank."""


def _exit_if_importing_main() -> None:
    """In a spawned child that is still importing the parent's main module (multiprocessing's
    bootstrap phase), the script builds an LLM at module level: stop quietly with
    MAIN_GUARD_EXIT, which the parent turns into one line saying what to do."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(MAIN_GUARD_EXIT)


def _death(p) -> str:
    """How a rank process ended, in words."""
    import signal

    code = p.exitcode
    if code is not None and code < 0:
        try:
            return f"process killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"process killed by signal {-code}"
    return f"process exited with code {code}"


def _stopped(p) -> bool:
    """True if the process is stopped (SIGSTOP, SIGTSTP or a debugger): Linux /proc only."""
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def rank_main(rank: int, settings: EngineConfig, protocol_config, conn,
              store_address: StoreAddress | None) -> None:
    """Body of one rank process: set up the group (through the held store at `store_address`,
    or with `settings.dist_init_method` where that is None), load the model, serve commands.

    Sends ("ready", rank) once loaded, or ("error", text) if setup fails, then one
    (reply, outputs) per command until Teardown.
    """
    import signal

    # The parent owns Ctrl-C (the terminal sends it to the whole group) and stops the ranks
    # itself; a rank that took it would print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(rank, settings, protocol_config, conn, store_address)
    except (EOFError, OSError):  # the parent went away (killed, or it closed our pipe): stop
        return


def _serve(rank: int, settings: EngineConfig, protocol_config, conn,
           store_address: StoreAddress | None) -> None:
    try:
        try:  # a dependency in pyproject; a bare GPU machine may lack it: titles are cosmetic
            import setproctitle
        except ImportError:
            setproctitle = None
        if setproctitle is not None:
            setproctitle.setproctitle(rank_title(rank, settings))
        import torch
        import torch.distributed as dist

        from engine.executor import RankExecutor
        from engine.parallel import TPGroup

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.world_size))
        if settings.device == "cuda":
            torch.cuda.set_device(rank)
        backend = "nccl" if settings.device == "cuda" else "gloo"
        import datetime

        timeout = datetime.timedelta(seconds=settings.step_timeout_s + COLLECTIVE_GRACE_S)
        if store_address is not None:
            join_process_group(backend, store_address, rank, settings.world_size, timeout)
        else:
            dist.init_process_group(backend, init_method=settings.dist_init_method, rank=rank,
                                    world_size=settings.world_size, timeout=timeout)
        executor = RankExecutor(settings, TPGroup(rank, settings.world_size))
        executor.load_model()
        worker = _make_worker(settings, protocol_config, rank)
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=4)))
        return
    conn.send(("ready", rank))
    from protocol.commands import Teardown

    while True:
        command, extras = conn.recv()  # EOFError or OSError: the controller went away
        fault = settings.fault
        if fault and fault[0] == rank and fault[1] == command.seq:
            if fault[2] == "exit":
                os._exit(17)  # a crash: no reply, no cleanup
            if fault[2] in ("kill", "stop"):  # as `kill -9` / `kill -STOP` from a shell
                import signal

                os.kill(os.getpid(), signal.SIGKILL if fault[2] == "kill" else signal.SIGSTOP)
            if fault[2] == "hang":
                time.sleep(3600)  # a wedge: alive, silent
            conn.send((worker.fail(command, RuntimeError(
                f"injected fault at command {command.seq}")), {}, []))
            continue
        conn.send(execute(worker, executor, command, extras))
        if isinstance(command, Teardown):
            return


def _last_line(text: str) -> str:
    """The last non-empty line of a traceback: the exception itself."""
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def _message_text(message) -> str:
    """One line for a failed start-up message or failed reply."""
    if isinstance(message, tuple) and message and message[0] == "error":
        return _last_line(message[1])
    reply = message[0] if isinstance(message, tuple) else message
    return _last_line(getattr(reply, "error", "") or "")


def _is_failure(message) -> bool:
    """True for a start-up error or a failed protocol reply."""
    if isinstance(message, tuple) and message and message[0] == "error":
        return True
    reply = message[0] if isinstance(message, tuple) else None
    return getattr(reply, "ok", True) is False


@contextmanager
def sigint_ignored_by_children():
    """SIGINT ignored in this process while a rank is started in it, so that the rank starts
    with it ignored: an ignored disposition survives the spawn's exec, while `rank_main`, which
    ignores it too, runs only after the child has imported the main module and unpickled its
    arguments. A terminal's Ctrl-C reaches the whole process group, and a rank still importing
    printed a KeyboardInterrupt traceback (a fresh user's finding, TP 2 on the CPU). Only the
    main thread may set a handler; elsewhere this does nothing. A Ctrl-C in the few
    milliseconds of a start is not seen by this process either."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class SpawnedRanks:
    """One process per rank, spawned; commands over duplex pipes.

    Raises (constructor):
        RankError: a rank failed to start (its error text), or died during start.
    """

    def __init__(self, settings: EngineConfig, protocol_config):
        import torch.multiprocessing as mp

        _exit_if_importing_main()
        self.settings = settings
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        # without an init method of the caller's, the ranks meet at a store this process
        # holds from before they start until close (engine.rendezvous)
        self._store = None if settings.dist_init_method else HeldStore()
        address = self._store.address if self._store is not None else None
        try:
            for rank in range(settings.world_size):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=rank_main,
                                args=(rank, settings, protocol_config, child, address),
                                name=f"lockstep-rank{rank}", daemon=True)
                with sigint_ignored_by_children():
                    p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
            for rank, msg in self._gather(settings.startup_timeout_s, loading=True):
                if msg[0] != "ready":
                    raise RankError(rank, f"start-up failed: {_last_line(msg[1])}")
        except BaseException:
            self.close(abort=True)
            raise

    def _gather(self, timeout_s: float, loading: bool = False) -> list[tuple[int, Any]]:
        """One message from every rank, in rank order; raises RankError for a dead rank (the
        lowest such rank is named), ReplyTimeoutError naming the silent ones, and
        LoadTimeoutError for ranks still loading the model (`loading`) at the deadline.
        Returns early, with the messages so far, once a rank reports a failure: its peers may
        be blocked in a collective that will never complete, and the controller aborts them
        (I13)."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.conns):
            if any(_is_failure(m) for m in got.values()):
                break
            waiting = {r: c for r, c in enumerate(self.conns) if r not in got}
            sentinels = {self.procs[r].sentinel: r for r in waiting}
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(waiting)
                stopped = [r for r in missing if _stopped(self.procs[r])]
                if stopped:
                    raise RankError(stopped[0], f"process {self.procs[stopped[0]].pid} is "
                                                "stopped (SIGSTOP or a debugger): no reply "
                                                f"within {timeout_s:g} s")
                if loading:
                    raise LoadTimeoutError(missing, timeout_s)
                raise ReplyTimeoutError(missing, timeout_s)
            ready = mp_wait(list(waiting.values()) + list(sentinels), timeout=left)
            dead = None
            for r, c in waiting.items():
                if c in ready or self.procs[r].sentinel in ready:
                    try:
                        if c.poll(0):
                            got[r] = c.recv()
                            continue
                    except (EOFError, OSError):
                        pass
                    if not self.procs[r].is_alive() or self.procs[r].sentinel in ready:
                        dead = r if dead is None else min(dead, r)
            if dead is not None and dead not in got:
                p = self.procs[dead]
                p.join(1)
                self._raise_if_main_unguarded(p)
                raise RankError(dead, f"{_death(p)} before replying")
        failed = [r for r, m in sorted(got.items()) if _is_failure(m)]
        if failed:
            self._blame_dead_or_stopped(set(range(len(self.conns))) - set(got), failed[0],
                                        got[failed[0]])
        return sorted(got.items())

    def _blame_dead_or_stopped(self, silent: set[int], failed: int, message) -> None:
        """A rank's failure is often a peer's death seen through a collective (a gloo
        "connection closed" or timeout): if a silent peer died or is stopped, name it, not the
        rank whose collective failed. Dead peers are given up to a second to be reaped."""
        deadline = time.monotonic() + 1.0
        while silent:
            for r in sorted(silent):
                p = self.procs[r]
                if not p.is_alive():
                    p.join(1)
                    raise RankError(r, f"{_death(p)} before replying; rank {failed} then "
                                       f"failed: {_message_text(message)}")
                if _stopped(p):
                    raise RankError(r, f"process {p.pid} is stopped (SIGSTOP or a debugger) "
                                       f"and did not reply; rank {failed} then failed: "
                                       f"{_message_text(message)}")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            mp_wait([self.procs[r].sentinel for r in silent], timeout=left)

    def _raise_if_main_unguarded(self, p) -> None:
        from engine.errors import ParallelConfigError

        if p.exitcode == MAIN_GUARD_EXIT:
            import sys

            script = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
            raise ParallelConfigError(
                f"tensor_parallel_size = {self.settings.world_size} starts one process per "
                f"rank, and each re-ran {script} from the top: put the code that builds the "
                "LLM under `if __name__ == \"__main__\":`")

    def send(self, command, extras: dict | None) -> None:
        """Send `command` to every rank (extras go to rank 0 only, or to every rank under
        overlapped scheduling, where every rank samples)."""
        everyone = self.settings.decode_overlap
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((command, extras if rank == 0 or everyone else None))
            except (BrokenPipeError, OSError) as exc:
                raise RankError(rank, f"command channel closed ({exc})") from exc

    def collect(self) -> list[tuple[Any, dict, list]]:
        """Every rank's (reply, side outputs, trace events) for the last command, in rank
        order."""
        return [msg for _, msg in self._gather(self.settings.step_timeout_s)]

    def kill(self) -> None:
        """SIGKILL every rank process now, without joining (the startup watchdog's path:
        it must not block on a wedged rank)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self, abort: bool = False) -> None:
        """Stop every rank process: join after Teardown, or kill (abort) and reap; then stop
        the store they met at, even when interrupted."""
        try:
            if abort:
                self.kill()
            reap(self.procs)
            for c in self.conns:
                c.close()
            self.procs, self.conns = [], []
        finally:
            if self._store is not None:
                self._store.close()
                self._store = None


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (TORCHELASTIC_RUN_ID or
    LOCAL_RANK set), else None.

    Raises:
        ParallelConfigError: one of those is set but RANK or WORLD_SIZE is missing or not an
            integer, or RANK is outside [0, WORLD_SIZE) (a LOCAL_RANK left over from another
            launcher's shell, say); the line names the variable and its value.
    """
    launcher = next((name for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
                     if name in os.environ), None)
    if launcher is None:
        return None
    values = []
    for name in ("RANK", "WORLD_SIZE"):
        text = os.environ.get(name)
        if text is None:
            raise ParallelConfigError(f"{launcher} is set, as torchrun sets it, but {name} is "
                                      f"not; start the ranks with torchrun, or unset {launcher}")
        try:
            values.append(int(text))
        except ValueError:
            raise ParallelConfigError(f"{name}={text!r} is not an integer ({launcher} is set, "
                                      "as torchrun sets it)") from None
    rank, world = values
    if not 0 <= rank < world:
        raise ParallelConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world}) ({launcher} "
                                  "is set, as torchrun sets it)")
    return rank, world


def _init_torchrun(settings: EngineConfig):
    """Initialise the default group (gloo or NCCL) and a gloo command group from env://."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = torchrun_env()
    if world != settings.world_size:
        raise ValueError(f"torchrun started {world} processes but tensor_parallel_size = "
                         f"{settings.world_size}; they must be equal")
    if settings.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    timeout = datetime.timedelta(seconds=settings.step_timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if settings.device == "cuda" else "gloo",
                                init_method="env://", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    model_group = dist.new_group(backend="nccl" if settings.device == "cuda" else "gloo",
                                 timeout=timeout)
    return rank, control, model_group


class TorchrunRanks:
    """Rank 0's view of a torchrun-launched group (see the module docstring).

    Failure handling is bounded by `step_timeout_s` (the gloo timeout of both groups); a rank
    that dies makes torchrun's agent stop every process of the group.
    """

    def __init__(self, settings: EngineConfig, protocol_config, cfg=None):
        from engine.executor import RankExecutor
        from engine.parallel import TPGroup

        self.rank, self.control, group = _init_torchrun(settings)
        assert self.rank == 0, "only rank 0 builds TorchrunRanks; others serve_torchrun_rank"
        self.executor = RankExecutor(settings, TPGroup(0, settings.world_size, group), cfg)
        self.executor.load_model()
        self.worker = _make_worker(settings, protocol_config, 0)
        self.world_size = settings.world_size
        self._mine = None

    def send(self, command, extras: dict | None) -> None:
        """Broadcast the command, then run it on rank 0."""
        import torch.distributed as dist

        everyone = self.executor.settings.decode_overlap  # every rank samples (I20)
        dist.broadcast_object_list([(command, extras if everyone else None)], src=0,
                                   group=self.control)
        self._mine = execute(self.worker, self.executor, command, extras)

    def collect(self) -> list[tuple[Any, dict, list]]:
        """Gather every rank's (reply, outputs, trace events)."""
        import torch.distributed as dist

        out: list = [None] * self.world_size
        try:
            dist.gather_object(self._mine, out, dst=0, group=self.control)
        except Exception as exc:  # gloo timeout or a peer gone
            raise RankError(1, f"command channel failed ({exc})") from exc
        return out

    def kill(self) -> None:
        """Nothing to kill from rank 0: its abort makes torchrun stop the group."""

    def close(self, abort: bool = False) -> None:
        """After Teardown the peers return; on abort, exit hard so torchrun stops the group."""
        if abort:
            os._exit(1)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def serve_torchrun_rank(settings: EngineConfig, protocol_config) -> int:
    """Body of a torchrun rank > 0: execute broadcast commands until Teardown; returns 0."""
    import torch.distributed as dist

    from engine.executor import RankExecutor
    from engine.parallel import TPGroup
    from protocol.commands import Teardown

    rank, control, group = _init_torchrun(settings)
    executor = RankExecutor(settings, TPGroup(rank, settings.world_size, group))
    executor.load_model()
    worker = _make_worker(settings, protocol_config, rank)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        command, extras = box[0]
        dist.gather_object(execute(worker, executor, command, extras), None, dst=0,
                           group=control)
        if isinstance(command, Teardown):
            dist.destroy_process_group()
            return 0
