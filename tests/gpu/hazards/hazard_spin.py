"""A kernel that spins on one device until the host releases it, and the timing of a call made
from another host thread meanwhile: did the call return while the kernel still spun, or only
once it ended?

The spin is bounded twice: in the kernel (`%globaltimer`, `bound_s`) and by a watchdog
(`faulthandler.dump_traceback_later(..., exit=True)`, a C thread that needs no GIL) that ends
the whole probe process, so no probe can wedge a GPU past its process.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

from hazard_driver import PTX, Driver
from hazard_verdicts import CallTiming

_FLAG, _STARTED, _REASON, _SPUN_NS = 0, 16, 20, 24  # byte offsets in the pinned word block
REASONS = {0: "running", 2: "released by the host", 3: "in-kernel bound"}


class Spinner:
    """The spin kernel on `ctx`'s device, on its own non-blocking stream.

    Args:
        drv: the driver.
        ctx: the primary context of the device that spins.
        bound_s: the in-kernel bound in seconds (the kernel ends by itself after it).
    """

    def __init__(self, drv: Driver, ctx, bound_s: float):
        self.drv, self.ctx, self.bound_s = drv, ctx, bound_s
        drv.set_context(ctx)
        self.module = drv.module_load(PTX.encode())
        self.fn = drv.function(self.module, "spin")
        self.stream = drv.stream()
        self.host, self.dev = drv.host_alloc(64)

    def _u32(self, off: int) -> ctypes.c_uint32:
        return ctypes.c_uint32.from_address(self.host + off)

    @property
    def done(self) -> bool:
        """True once the kernel has written its exit reason (it has stopped spinning)."""
        return self._u32(_REASON).value != 0

    def args(self, bound_s: float | None = None) -> tuple[int, int, int]:
        """The kernel's arguments (flag, out, max_ns), e.g. to capture it into a graph."""
        return self.dev, self.dev + _STARTED, int((bound_s or self.bound_s) * 1e9)

    def reset(self) -> None:
        """Clear the flag and the kernel's output words."""
        ctypes.memset(self.host, 0, 64)

    def enqueue(self, bound_s: float | None = None) -> None:
        """Launch the spin on its stream and return at once."""
        self.drv.set_context(self.ctx)
        self.reset()
        self.drv.launch(self.fn, self.stream, *self.args(bound_s))

    def start(self, wait_s: float = 10.0) -> None:
        """Launch the spin and return once it runs on the device. Raises RuntimeError if it
        does not start within `wait_s`."""
        self.enqueue()
        t_end = time.monotonic() + wait_s
        while self._u32(_STARTED).value == 0:
            if time.monotonic() > t_end:
                raise RuntimeError(f"the spin kernel did not start within {wait_s} s")
            time.sleep(0.0005)

    def release(self) -> None:
        """Set the host flag; the kernel sees it within microseconds."""
        self._u32(_FLAG).value = 1

    def finish(self) -> tuple[str, float]:
        """Release, wait for the kernel; (why it ended, seconds it spun)."""
        self.release()
        self.drv.set_context(self.ctx)
        self.drv.sync(self.stream)
        reason = REASONS.get(self._u32(_REASON).value, "?")
        spun = ctypes.c_uint64.from_address(self.host + _SPUN_NS).value / 1e9
        return reason, spun


@dataclass
class Call:
    """A host call under test: `prepare()` makes its state with the device idle, `run(state)`
    is the timed call (in another thread), `cleanup(state)` runs once the device is idle
    again. `ctx` is made current in the calling thread first (None: the caller sets it)."""

    name: str
    prepare: object
    run: object
    cleanup: object = None
    ctx: object = None


class _Timed(threading.Thread):
    def __init__(self, drv: Driver, call: Call, state, spinner: Spinner | None):
        super().__init__(daemon=True, name=f"probe-{call.name}")
        self.drv, self.call, self.state, self.spinner = drv, call, state, spinner
        self.t0 = self.t1 = None
        self.spinning_at_return = None
        self.error = None

    def run(self) -> None:
        try:
            if self.call.ctx is not None:
                self.drv.set_context(self.call.ctx)
            self.t0 = time.monotonic()
            self.call.run(self.state)
            self.t1 = time.monotonic()
            if self.spinner is not None:
                self.spinning_at_return = not self.spinner.done
        except BaseException as exc:  # recorded in the probe's JSON
            self.t1 = time.monotonic()
            self.error = f"{type(exc).__name__}: {exc}"


def _prepare(drv: Driver, call: Call):
    if call.ctx is not None:
        drv.set_context(call.ctx)
    return call.prepare()


def _cleanup(drv: Driver, call: Call, state) -> None:
    if call.cleanup is not None:
        if call.ctx is not None:
            drv.set_context(call.ctx)
        call.cleanup(state)


def baseline(drv: Driver, call: Call) -> float:
    """Seconds the call takes with every device idle (the median of three)."""
    times = []
    for _ in range(3):
        state = _prepare(drv, call)
        t = _Timed(drv, call, state, None)
        t.start()
        t.join()
        _cleanup(drv, call, state)
        if t.error:
            raise RuntimeError(f"{call.name} failed with the device idle: {t.error}")
        times.append(t.t1 - t.t0)
    return sorted(times)[1]


def under_spin(drv: Driver, spinner: Spinner, call: Call, hold_s: float) -> CallTiming:
    """Time `call` from a second thread while `spinner` spins; release the spin after `hold_s`
    if the call has not returned by then."""
    state = _prepare(drv, call)
    spinner.start()
    t = _Timed(drv, call, state, spinner)
    t.start()
    t.join(hold_s)
    released_at = None
    if t.is_alive():
        released_at = time.monotonic()
    reason, spun = spinner.finish()
    t.join(spinner.bound_s + 5.0)
    if t.is_alive():
        raise RuntimeError(f"{call.name} did not return {spinner.bound_s + 5.0} s after the "
                           "spin ended")
    _cleanup(drv, call, state)
    return CallTiming(call=call.name, call_s=t.t1 - t.t0, hold_s=hold_s,
                      spinning_at_return=t.spinning_at_return,
                      released_after_s=None if released_at is None else released_at - t.t0,
                      spin_end=reason, spun_s=spun, error=t.error,
                      notes=state.get("notes") if isinstance(state, dict) else None)


def pair_under_spin(drv: Driver, spinner: Spinner, holder: Call, other: Call,
                    hold_s: float) -> tuple[CallTiming, CallTiming]:
    """H1: while `holder` (a call that blocks on the spinning device) waits in one thread, time
    `other` (a call that did not block on its own) from a third thread."""
    s_holder, s_other = _prepare(drv, holder), _prepare(drv, other)
    spinner.start()
    th = _Timed(drv, holder, s_holder, spinner)
    th.start()
    th.join(0.2)  # let the holder get into the driver
    holder_in_call = th.is_alive()
    to = _Timed(drv, other, s_other, spinner)
    to.start()
    to.join(hold_s)
    if th.t0 is not None:  # the holder too stays unreleased for a whole hold
        th.join(max(0.0, hold_s - (time.monotonic() - th.t0)))
    released_at = time.monotonic() if to.is_alive() or th.is_alive() else None
    reason, spun = spinner.finish()
    for t in (th, to):
        t.join(spinner.bound_s + 5.0)
        if t.is_alive():
            raise RuntimeError(f"{t.call.name} did not return after the spin ended")
    _cleanup(drv, holder, s_holder)
    _cleanup(drv, other, s_other)
    out = []
    for t, extra in ((th, None), (to, holder_in_call)):
        out.append(CallTiming(call=t.call.name, call_s=t.t1 - t.t0, hold_s=hold_s,
                              spinning_at_return=t.spinning_at_return,
                              released_after_s=None if released_at is None
                              else released_at - t.t0,
                              spin_end=reason, spun_s=spun, error=t.error,
                              holder_in_call=extra))
    return out[0], out[1]
