"""Vocabulary shared by the simulator's modules: op statuses, verdicts, the modelled model."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ProtocolError

BLOCKED, PROGRESS, DONE = 0, 1, 2
"""What an op attempt did: nothing, changed state without finishing, finished."""

FOREVER = float("inf")


class SimFault(ProtocolError):
    """An error a modelled backend op raised.

    ``kind`` is ``"injected"`` (a fault the scenario placed), ``"oom"`` (the modelled memory
    ran out: H7), ``"lazy-connect"`` (a collective connected inside capture: H4) or
    ``"unmodelled"``; ``invariant`` names the rule the failure shows broken, if any.
    """

    kind = "sim"


@dataclass
class Outcome:
    """How a run ended: a structured verdict.

    Attributes:
        verdict: ``clean``, ``abort``, ``deadlock``, ``hang``, ``hang-at-exit``, ``divergence``,
            ``oom``, ``startup-refused``, ``invariant``, ``livelock``, ``budget``.
        detail: one-paragraph explanation (the wait-for cycle for a deadlock).
        invariant: the invariant named by the verdict (``"I6"``), if any.
        cycle: wait-for cycle as (node, sentence) pairs, for deadlocks.
        rank: the rank the verdict blames, when one is to blame.
        step: the command sequence number at which the failure happened, when known.
    """

    verdict: str
    detail: str = ""
    invariant: str | None = None
    cycle: tuple = ()
    rank: int | None = None
    step: int | None = None

    @property
    def kind(self) -> str:
        """The verdict's kind (same as ``verdict``)."""
        return self.verdict


@dataclass(frozen=True)
class Signature:
    """What a collective is, for matching across ranks (H3).

    Attributes:
        op: ``"all-reduce"``.
        count: collectives this kernel stands for (a graph's all-reduces, one per layer half).
        nbytes: message size of each.
        label: where it comes from (``"graph decode@8"``, ``"warm-up"``), for reports only.
    """

    op: str
    count: int
    nbytes: int
    label: str = ""

    def matches(self, other: "Signature") -> bool:
        """Same op, count and size: the label does not take part."""
        return (self.op, self.count, self.nbytes) == (other.op, other.count, other.nbytes)


@dataclass(frozen=True)
class Collective:
    """A collective kernel on a stream: the ``index``-th this device enqueued, and its signature."""

    index: int
    sig: Signature

    def __str__(self) -> str:
        return sig_text(self)


def sig_text(kernel: Collective) -> str:
    """``all-reduce #7 (graph decode@8: 73 x 40960 bytes)``."""
    sig = kernel.sig
    return f"{sig.op} #{kernel.index} ({sig.label}: {sig.count} x {sig.nbytes} bytes)"
