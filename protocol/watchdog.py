"""The startup watchdog (I6).

A wedged startup sweep (a rank stuck in a driver call or in a collective whose peer never comes)
cannot be interrupted from inside; the only safe way out is to abort the process. Abort, not
exit: exit runs driver teardown that needs the driver lock the wedged threads hold, so it hangs
(pegainfer TP pre-capture PR). The watchdog must also be disarmed on every path out of the
sweep, errors included: disarmed only on success, it fires minutes after a handled error and
kills a healthy process (pegainfer PR #848 review). Time comes from an injected clock.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.errors import WatchdogExpired


class Watchdog:
    """Deadline over the startup sweep.

    Args:
        clock: returns the current time in seconds (monotonic); the simulator injects its own.
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
        """Start the deadline now."""
        self.deadline = self._clock() + self.timeout_s

    def disarm(self) -> None:
        """Stop the deadline; safe to call when not armed."""
        self.deadline = None

    def check(self, uncollected: tuple[int, ...]) -> None:
        """Raise WatchdogExpired, naming the ranks not yet collected, if the deadline passed."""
        if self.deadline is not None and self._clock() >= self.deadline:
            self.deadline = None
            ranks = ", ".join(map(str, uncollected)) or "none"
            raise WatchdogExpired(
                f"startup sweep exceeded its {self.timeout_s:g} s watchdog; ranks not collected: "
                f"{ranks}", uncollected)
