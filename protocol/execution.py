"""The reference driver of one rank: a command in, backend ops run in order, a reply out.

`CommandRun` is the sans-IO state of one command on one rank: the worker's op list, the results
so far, and the trace events (one per op, one for the reply). `run_command` drives it to the end
against a `Backend` (the engine and the bench); the simulator drives the same `CommandRun` one
op at a time, interleaving ranks between ops. So the order "ops, then reply from their results,
or a failed reply that poisons the worker" is one code path for every driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.backend import SYNC, AwaitStep, Backend, Op, ReadTokens, ReplayRows, perform
from protocol.commands import Command, Reply, Step
from protocol.errors import ProtocolError
from protocol.trace import TraceEvent
from protocol.worker import hook_ops

_tuple_new = tuple.__new__


class CommandRun:
    """One command executing on one rank.

    Args:
        worker: the rank's `protocol.worker.Worker`.
        command: the command to run.
        record: called with each `TraceEvent` (op finished, op failed, reply); None records none.
        clock: the driver's clock in seconds, for the events' ``time``.
        sync_after: ops after which the driver inserts a synchronize whose result is not a
            worker result (the simulator's H6-off mode: host calls block).

    After construction either ``reply`` is set (the worker refused the command, or it has no
    ops) or ``op`` is the first op to run.
    """

    def __init__(self, worker, command: Command,
                 record: Callable[[TraceEvent], Any] | None = None,
                 clock: Callable[[], float] = lambda: 0.0,
                 sync_after: tuple[type, ...] = ()):
        self.worker = worker
        self.command = command
        self._record = record
        self._clock = clock
        self._sync_after = sync_after
        self.results: list[Any] = []
        self.reply: Reply | None = None
        self._actor = f"rank{worker.rank}"  # the events' actor, formatted once per command
        self._extra_sync = False
        try:
            self.ops: list[Op] = list(hook_ops(worker.ops_for(command),
                                               f"ops_for({type(command).__name__})"))
        except ProtocolError as exc:
            self.ops = []
            self._finish(worker.fail(command, exc))
            return
        self.pc = 0
        if self.ops:
            self.op = self.ops[0]
        else:
            self._complete()

    op: Op | None = None
    """The op to run next, or None once the reply is out (a plain attribute, kept up to date by
    `done`, `fail` and the reply: drivers read it before every op and every readiness probe)."""

    def done(self, result: Any = None) -> Reply | None:
        """The current op finished with ``result``; returns the reply once the last op is done."""
        op = self.op
        if self._record is not None:
            data = ()
            if isinstance(result, ReplayRows) and isinstance(self.command, Step):
                # what the replay read, beside what the step commands: I12 compares them
                n = len(self.command.rows)
                read = result.first(n)
                if self.command.feed is not None:  # fed tokens: checked on the device (I20)
                    read = ReplayRows(self.command.rows.tokens, read.positions, read.slots)
                data = (ReplayRows.of_step(self.command).text(), read.text())
            elif type(op) is ReadTokens and op.step.seq != self.command.seq:
                data = (op.step.seq,)  # an earlier step's tokens (overlapped scheduling, I11)
            elif type(op) is AwaitStep:  # the step whose device work it waited for (I11)
                data = (op.seq,)
            # `_event`, inlined: one event per op
            self._record(_tuple_new(TraceEvent, (self._actor, "op", op.name, self.command.seq,
                                                 self.worker.rank, op.described, True,
                                                 self._clock(), data)))
        if self._extra_sync:
            self._extra_sync = False
        else:
            self.results.append(result)
            self.pc += 1
            if isinstance(op, self._sync_after):
                self._extra_sync = True
                self.op = SYNC
                return None
        if self.pc == len(self.ops):
            self._complete()
        else:
            self.op = self.ops[self.pc]
        return self.reply

    def fail(self, error: BaseException) -> Reply:
        """The current op raised ``error``: the worker is poisoned and replies with the error."""
        op = self.op
        if op is not None:
            self._event("op", op.name, f"{op.described}: {error}", False)
        return self._finish(self.worker.fail(self.command, error))

    def _complete(self) -> None:
        try:
            reply = self.worker.reply(self.command, self.results)
        except ProtocolError as exc:
            reply = self.worker.fail(self.command, exc)
        self._finish(reply)

    def _finish(self, reply: Reply) -> Reply:
        self.reply = reply
        self.op = None
        self._event("reply", "Reply", reply.error or "", reply.ok)
        return reply

    def _event(self, kind: str, what: str, detail: str, ok: bool, data: tuple = ()) -> None:
        if self._record is not None:
            # every field given, so the tuple is built directly (no NamedTuple __new__ frame)
            self._record(_tuple_new(TraceEvent, (self._actor, kind, what, self.command.seq,
                                                 self.worker.rank, detail, ok, self._clock(),
                                                 data)))


def run_command(worker, backend: Backend, command: Command,
                record: Callable[[TraceEvent], Any] | None = None,
                clock: Callable[[], float] = lambda: 0.0) -> Reply:
    """Run ``command`` on one rank to its reply: every op through `perform`, in order.

    Any exception an op raises becomes a failed reply that poisons the worker (I13), a
    memory report of the wrong kind too (`protocol.backend.perform` checks those). An exception
    from the worker's own code (a subclass's hook) propagates: it is the caller's bug, not the
    rank's. ``record`` receives the trace events (see `CommandRun`).
    """
    run = CommandRun(worker, command, record, clock)
    while run.op is not None:
        try:
            result = perform(backend, run.op)
        except Exception as exc:  # any backend failure is the rank's failure (I13)
            return run.fail(exc)
        run.done(result)
    return run.reply
