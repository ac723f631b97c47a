"""The protocol trace: what both drivers record, so one set of checkers validates both.

The simulator and the engine append the same events -- commands sent, backend ops run per
rank, replies, aborts, watchdog transitions -- and `protocol.invariants` checks I1..I15 on either.
"""

from __future__ import annotations

from typing import NamedTuple

from protocol.commands import Chunk, Step
from protocol.keys import GraphKey


class TraceEvent(NamedTuple):
    """One event.

    Attributes:
        actor: ``"controller"``, ``"rank<r>"``, ``"device<r>"`` or ``"collectives"``.
        kind: ``send`` (a command to every rank), ``op`` (a backend op finished on a rank),
            ``reply``, ``kernel``, ``collective``, ``abort``, ``exit``, ``watchdog-arm``,
            ``watchdog-disarm``, ``watchdog-fire``, ``done``.
        what: the command class, op name or kernel label.
        seq: the command's sequence number, when there is one.
        rank: the rank, when there is one.
        detail: short human-readable arguments.
        ok: False for a failed reply or op.
        time: the driver's clock in seconds.
        data: for a serving replay whose backend reports what it read (`ReplayRows`), the
            step's rows and the rows the replay read, as `ReplayRows.text` (I12); else empty.
    """

    actor: str
    kind: str
    what: str
    seq: int | None = None
    rank: int | None = None
    detail: str = ""
    ok: bool = True
    time: float = 0.0
    data: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """Plain dict for JSON output."""
        out = self._asdict()
        out["data"] = list(self.data)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "TraceEvent":
        """Inverse of `to_json`."""
        return cls(**{**data, "data": tuple(data.get("data", ()))})


def describe_args(args: tuple) -> str:
    """Short text of op arguments: graph keys and numbers as is, a `Step` by its sequence
    number, a prefill chunk by its request and positions, a tuple by its length; an absent
    optional argument (None) is left out."""
    if not args:
        return ""
    if len(args) == 1:  # most ops: one graph key or one number
        arg = args[0]
        if arg.__class__ is int or arg.__class__ is GraphKey:
            return str(arg)
    parts = []
    for arg in args:
        if arg.__class__ is int or arg.__class__ is GraphKey:  # the common cases, first
            parts.append(str(arg))
        elif arg is None:
            continue
        elif isinstance(arg, Chunk):
            parts.append(f"chunk r{arg.request_id}[{arg.start}:{arg.end}]")
        elif isinstance(arg, Step):
            parts.append(f"step {arg.seq}")
        elif isinstance(arg, tuple):
            parts.append(f"{len(arg)} items")
        else:
            parts.append(str(arg))
    return ", ".join(parts)
