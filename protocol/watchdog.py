"""The startup watchdog (I6).

A wedged startup sweep (a rank stuck in a driver call or in a collective whose peer never comes)
cannot be interrupted from inside; the only safe way out is to abort the process. Abort, not
exit: exit runs driver teardown that needs the driver lock the wedged threads hold, so it hangs
(pegainfer TP pre-capture PR). The watchdog must also be disarmed on every path out of the
sweep, errors included: disarmed only on success, it fires minutes after a handled error and
kills a healthy process (pegainfer PR #848 review). Time comes from an injected clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from protocol.errors import ConfigError, WatchdogExpired, shown


def read_clock(clock: Callable[[], float]) -> float:
    """``clock()``, checked to be a finite int or float (not a bool): the caller's clock that
    returned None part-way through raised a TypeError at a deadline comparison, and one that
    returned NaN compared false with every deadline, so the watchdog and the step timeout
    never fired and the run finished "done" (a hostile user's trial). One type check and one
    `math.isfinite` per reading: it runs at every controller step.

    Raises:
        ConfigError: "clock() returned VALUE: ...", naming the value.
    """
    now = clock()
    if isinstance(now, float) and math.isfinite(now):
        return now
    if isinstance(now, int) and type(now) is not bool:  # every int is finite
        return now
    raise ConfigError(f"clock() returned {shown(now)}: expected a finite int or float of "
                      "seconds (the clock passed to the controller)")


class Watchdog:
    """Deadline over the startup sweep.

    Args:
        clock: returns the current time in seconds (monotonic), a finite int or float
            (`read_clock`); the simulator injects its own.
        timeout_s: seconds from `arm` to expiry.
    """

    def __init__(self, clock: Callable[[], float], timeout_s: float):
        self._clock = clock
        self.timeout_s = timeout_s
        self.deadline: float | None = None

    @property
    def armed(self) -> bool:
        """True between `arm` and `disarm`."""
        return self.deadline is not None

    def arm(self) -> None:
        """Start the deadline now.

        Raises:
            ConfigError: the clock returned something other than a finite int or float
                (`read_clock`); the watchdog stays disarmed.
        """
        self.deadline = read_clock(self._clock) + self.timeout_s

    def disarm(self) -> None:
        """Stop the deadline; safe to call when not armed."""
        self.deadline = None

    def check(self, uncollected: tuple[int, ...], now: float | None = None) -> None:
        """Raise WatchdogExpired, naming the ranks not yet collected, if the deadline passed
        by ``now`` (None: read the clock).

        Raises:
            WatchdogExpired: the deadline passed.
            ConfigError: the clock returned something other than a finite int or float
                (`read_clock`); the watchdog stays armed.
        """
        if self.deadline is None:
            return
        if (read_clock(self._clock) if now is None else now) >= self.deadline:
            self.deadline = None
            ranks = ", ".join(map(str, uncollected)) or "none"
            raise WatchdogExpired(
                f"startup sweep exceeded its {self.timeout_s:g} s watchdog; ranks not collected: "
                f"{ranks}", uncollected)
