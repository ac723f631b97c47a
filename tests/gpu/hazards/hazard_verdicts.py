"""Verdicts of the hazard probes, computed from measured timings alone (pure Python, no CUDA).

A call *blocks* on a spinning kernel when it stayed inside the driver for the whole hold (the
time the host let the kernel spin) and returned only after the kernel had stopped; it *does
not block* when it returned while the kernel still spun. Anything else (an error, or a spin
that ended by its in-kernel bound before the hold was over) is `inconclusive`, never a guess.
A call that keeps the GIL while it waits delays the host's release, so its kernel ends by the
in-kernel bound instead: it still blocks, and `spin_end` says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

BLOCKS, RETURNS, INCONCLUSIVE, ERROR = "blocks", "does not block", "inconclusive", "error"
HOLDS, HOLDS_IN_PART, DOES_NOT_HOLD = "holds", "holds in part", "does not hold"
VERDICTS = (HOLDS, HOLDS_IN_PART, DOES_NOT_HOLD, INCONCLUSIVE)


@dataclass
class CallTiming:
    """One timed host call made while a kernel spun.

    Attributes:
        call: the call's name.
        call_s: seconds the call took (host wall clock).
        hold_s: seconds the host let the kernel spin before releasing it.
        spinning_at_return: whether the kernel still spun when the call returned (None: no
            spinner, or the call raised).
        released_after_s: seconds from the call's start to the host's release of the spin;
            None if the call returned before the release.
        spin_end: why the kernel stopped ("released by the host" or "in-kernel bound").
        spun_s: seconds the kernel spun (device clock).
        error: the exception the call raised, if any.
        holder_in_call: for the second call of a pair, whether the first (lock-holding) call
            was still inside the driver when the second started.
        notes: what the call's preparation recorded about it (e.g. whether a module was
            already loaded).
    """

    call: str
    call_s: float
    hold_s: float
    spinning_at_return: bool | None
    released_after_s: float | None
    spin_end: str
    spun_s: float
    error: str | None = None
    holder_in_call: bool | None = None
    notes: dict | None = None

    @property
    def outcome(self) -> str:
        """BLOCKS, RETURNS, INCONCLUSIVE or ERROR (see the module docstring)."""
        if self.error:
            return ERROR
        if self.spinning_at_return:
            return RETURNS
        if self.spinning_at_return is False and self.call_s >= 0.9 * self.hold_s:
            return BLOCKS
        return INCONCLUSIVE

    def record(self) -> dict:
        """The JSON form: every field plus the outcome."""
        return asdict(self) | {"outcome": self.outcome}


def aggregate(outcomes: list[str]) -> str:
    """The hazard's verdict over the outcomes of the calls it models: HOLDS if every
    conclusive one blocks, DOES_NOT_HOLD if none does, HOLDS_IN_PART if some do, INCONCLUSIVE
    if none is conclusive."""
    conclusive = [o for o in outcomes if o in (BLOCKS, RETURNS)]
    if not conclusive:
        return INCONCLUSIVE
    n = sum(o == BLOCKS for o in conclusive)
    return HOLDS if n == len(conclusive) else DOES_NOT_HOLD if n == 0 else HOLDS_IN_PART


def lock_verdict(pairs: list[tuple[CallTiming, CallTiming, str]]) -> str:
    """H1 over (holder, other, other's outcome alone) triples: a pair counts when the holder
    blocked on the device, was inside the driver when the other started, and the other
    returned promptly on its own. HOLDS if every such other blocked, DOES_NOT_HOLD if none
    did, HOLDS_IN_PART if some did, INCONCLUSIVE if no pair counts."""
    counted = [o.outcome for h, o, alone in pairs
               if h.outcome == BLOCKS and o.holder_in_call and alone == RETURNS]
    return aggregate(counted)


def async_verdict(returned_early: list[bool]) -> str:
    """H6: HOLDS if every enqueuing call returned while its device work still ran,
    DOES_NOT_HOLD if none did, else HOLDS_IN_PART."""
    if not returned_early:
        return INCONCLUSIVE
    n = sum(returned_early)
    return HOLDS if n == len(returned_early) else DOES_NOT_HOLD if n == 0 else HOLDS_IN_PART


def exit_verdict(exit_s: dict[str, float | None], spin_left_s: float) -> str:
    """H8 from the seconds each exit took (None: it did not end before the parent's limit).
    HOLDS if a plain exit with a thread blocked in the driver on a spinning kernel waited for
    most of the spin that was left (or hung), while os._exit did not; DOES_NOT_HOLD if it
    ended promptly; INCONCLUSIVE if the baseline (os._exit) itself waited."""
    held, fast = exit_s.get("exit_lock_held"), exit_s.get("os_exit_lock_held")
    if fast is None or fast > 0.5 * spin_left_s:
        return INCONCLUSIVE
    if held is None or held >= 0.8 * spin_left_s:
        return HOLDS
    return DOES_NOT_HOLD if held < 0.5 * spin_left_s else INCONCLUSIVE
