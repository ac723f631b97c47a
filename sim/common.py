"""Vocabulary shared by the simulator's modules: op statuses, verdicts, the modelled model."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ProtocolError

BLOCKED, PROGRESS, DONE = 0, 1, 2
"""What an op attempt did: nothing, changed state without finishing, finished."""

FOREVER = float("inf")


class SimFault(ProtocolError):
    """An error a modelled backend op raised (injected fault, OOM, lazy connect in capture)."""


def token_fn(request_id: int, position: int, token: int, vocab: int) -> int:
    """The modelled model: next token of ``request_id`` after ``token`` at ``position``."""
    return (request_id * 7919 + position * 104729 + token * 31 + 17) % vocab


@dataclass
class Outcome:
    """How a run ended.

    Attributes:
        verdict: ``clean``, ``abort``, ``deadlock``, ``hang``, ``hang-at-exit``, ``divergence``,
            ``oom``, ``startup-refused``, ``invariant``, ``livelock``.
        detail: one-paragraph explanation (the wait-for cycle for a deadlock).
        invariant: the invariant named by the verdict (``"I6"``), if any.
        cycle: wait-for cycle as (node, sentence) pairs, for deadlocks.
    """

    verdict: str
    detail: str = ""
    invariant: str | None = None
    cycle: tuple = ()


def sig_text(kernel: tuple) -> str:
    _, seq, (kind, count, nbytes, label) = kernel
    return f"{kind} #{seq} ({label}: {count} x {nbytes} bytes)"


