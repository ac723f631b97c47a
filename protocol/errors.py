"""Errors of the TP step protocol.

Every error names the offending value (a rank, a key, a slot, a setting) so that a log line
alone says what went wrong and where. Errors are also data (as h11 carries a status hint on its
errors): ``kind`` says what class of failure it is and ``invariant`` which rule it breaks, if
any, so a driver chooses a verdict from fields, never from the message text.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error the protocol raises.

    Attributes:
        kind: the failure class (``"error"``, ``"config"``, ``"slot"``, ``"oom"`` ...); a
            subclass sets its own, an instance may override it.
        invariant: the invariant the failure breaks (``"I5"``), or None.
    """

    kind: str = "error"
    invariant: str | None = None

    def __init__(self, message: str = "", *, kind: str | None = None,
                 invariant: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        if invariant is not None:
            self.invariant = invariant

    def __reduce__(self):
        # Rebuilt from args and attributes, not by calling __init__ (whose signature differs
        # by subclass), so that every protocol error survives pickling to and from a process.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type, args: tuple, state: dict) -> ProtocolError:
    """Unpickle a `ProtocolError` subclass: its args and attributes, without ``__init__``."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(ProtocolError, ValueError):
    """A configuration value is invalid; raised before any rank starts or memory is allocated.

    Attributes:
        fields: the configuration fields whose Python names the message uses (``max_batch``
            in ``max_batch=300 exceeds ...``), the bad one first; empty when it names none. A
            command line whose options set those fields spells them as its flags instead
            (`lockstep check` does), so the error names what its user typed.
    """

    kind = "config"
    fields: tuple[str, ...] = ()

    def __init__(self, message: str = "", *, fields: tuple[str, ...] = (), **kwargs):
        super().__init__(message, **kwargs)
        if fields:
            self.fields = tuple(fields)


class StartupRefused(ConfigError):
    """The memory fit leaves no room for even one sequence on the tightest rank (I9)."""

    kind = "startup-refused"


class StepLockViolation(ProtocolError):
    """The controller was asked for command N+1 before it held every rank's reply for N (I1)."""

    kind = "step-lock"
    invariant = "I1"


class ReplyError(ProtocolError):
    """A reply is malformed: unknown rank, duplicate, wrong sequence number, missing payload."""

    kind = "reply"


class SlotError(ProtocolError):
    """A slot move or retirement does not match the worker's slot occupancy (I8)."""

    kind = "slot"
    invariant = "I8"


class PageError(ProtocolError):
    """A page assignment or release does not match the rank's page map, or the pool is short (I14)."""

    kind = "page"
    invariant = "I14"


class EligibilityError(ProtocolError):
    """A capture or replay was asked for a graph key the plan does not allow or hold (I3, I7),
    or a step's key was asked for from decode rows no step can have (`GraphPlan.key_for`)."""

    kind = "eligibility"


class WatchdogExpired(ProtocolError):
    """The startup watchdog's deadline passed (I6); the driver must abort, not exit."""

    kind = "watchdog"

    def __init__(self, message: str, uncollected: tuple[int, ...]):
        super().__init__(message)
        self.uncollected = uncollected


class RankFailure(ProtocolError):
    """One or more ranks failed; the failure is global (I13).

    Attributes:
        failed: ranks whose reply carried an error, ascending.
        uncollected: ranks whose reply for the failing command never arrived, ascending.
        errors: rank -> error text as the rank reported it.
        kinds: rank -> the failure kind the rank reported (`ProtocolError.kind`).
        invariants: rank -> the invariant the rank's failure names, where it names one.
        step: the sequence number of the failing command, when known.
    The failure's own ``kind`` and ``invariant`` are those of its first failed rank, unless
    given explicitly.
    """

    kind = "rank-failure"

    def __init__(self, message: str, failed: tuple[int, ...], uncollected: tuple[int, ...],
                 errors: dict[int, str], kinds: dict[int, str] | None = None,
                 invariants: dict[int, str | None] | None = None, step: int | None = None,
                 *, kind: str | None = None, invariant: str | None = None):
        kinds = dict(kinds or {})
        invariants = dict(invariants or {})
        first = failed[0] if failed else None
        super().__init__(message, kind=kind or kinds.get(first),
                         invariant=invariant or invariants.get(first))
        self.failed = failed
        self.uncollected = uncollected
        self.errors = errors
        self.kinds = kinds
        self.invariants = invariants
        self.step = step

    @property
    def rank(self) -> int | None:
        """The first failed rank, or None when the failure is a timeout of uncollected ranks."""
        return self.failed[0] if self.failed else None


def is_int(value) -> bool:
    """Whether ``value`` is an int and not a bool (True passed as rank 1, as a count of 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value, limit: int = 60) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters with "..." (an integer too long
    for repr, past 4,300 digits, described by its length): for an error naming a bad value."""
    try:
        text = " ".join(repr(value).split())
    except ValueError:  # the description is short enough to show whole
        return (f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
                if isinstance(value, int) else
                f"<a {type(value).__name__} holding an integer too long to print>")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def checked_hook_result(value, hook: str, valid: bool, want: str):
    """``value``, returned by the overridable hook ``hook`` (``"Controller.fit_memory"``), when
    ``valid``. A variant's subclass that returned the wrong kind of value failed deep inside the
    protocol, naming no hook (a fresh variant author's finding).

    Raises:
        TypeError: not ``valid``: "HOOK returned VALUE; expected WANT".
    """
    if not valid:
        raise TypeError(f"{hook} returned {shown(value, 80)}; expected {want}")
    return value
