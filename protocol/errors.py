"""Errors of the TP step protocol.

Every error names the offending value (a rank, a key, a slot, a setting) so that a log line
alone says what went wrong and where.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error the protocol raises."""


class ConfigError(ProtocolError, ValueError):
    """A configuration value is invalid; raised before any rank starts or memory is allocated."""


class StepLockViolation(ProtocolError):
    """The controller was asked for command N+1 before it held every rank's reply for N (I1)."""


class ReplyError(ProtocolError):
    """A reply is malformed: unknown rank, duplicate, wrong sequence number, missing payload."""


class SlotError(ProtocolError):
    """A slot move or retirement does not match the worker's slot occupancy (I8)."""


class PageError(ProtocolError):
    """A page assignment or release does not match the rank's page map, or the pool is short (I14)."""


class EligibilityError(ProtocolError):
    """A capture or replay was asked for a graph key the plan does not allow or hold (I3, I7)."""


class WatchdogExpired(ProtocolError):
    """The startup watchdog's deadline passed (I6); the driver must abort, not exit."""

    def __init__(self, message: str, uncollected: tuple[int, ...]):
        super().__init__(message)
        self.uncollected = uncollected


class RankFailure(ProtocolError):
    """One or more ranks failed; the failure is global (I13).

    Attributes:
        failed: ranks whose reply carried an error, ascending.
        uncollected: ranks whose reply for the failing command never arrived, ascending.
        errors: rank -> error text as the rank reported it.
    """

    def __init__(self, message: str, failed: tuple[int, ...], uncollected: tuple[int, ...],
                 errors: dict[int, str]):
        super().__init__(message)
        self.failed = failed
        self.uncollected = uncollected
        self.errors = errors
