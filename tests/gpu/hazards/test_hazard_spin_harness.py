"""CPU tests of the spin harness (hazard_spin) against a stand-in driver whose 'kernel' is a
host thread reading and writing the same words the real kernel does: a call that waits for
the spin is classified as blocking, one that does not as returning, and a call that waits
for a lock held by a blocked call shows H1."""

from __future__ import annotations

import ctypes
import threading
import time

from hazard_spin import Call, Spinner, pair_under_spin, under_spin
from hazard_verdicts import BLOCKS, ERROR, RETURNS


class StandInDriver:
    """The driver calls Spinner makes; `launch` runs the spin's semantics on a host thread."""

    def __init__(self):
        self.buf = ctypes.create_string_buffer(64)
        self.kernel = None
        self.lock = threading.Lock()  # the modelled driver lock (H1)

    def set_context(self, ctx):
        pass

    def module_load(self, image):
        return "module"

    def function(self, mod, name):
        return name

    def stream(self):
        return "stream"

    def host_alloc(self, nbytes):
        addr = ctypes.addressof(self.buf)
        return addr, addr

    def launch(self, fn, stream, flag, out, max_ns):
        def spin():
            t0 = time.monotonic()
            ctypes.c_uint32.from_address(out).value = 1
            reason = 3
            while time.monotonic() - t0 < max_ns / 1e9:
                if ctypes.c_uint32.from_address(flag).value:
                    reason = 2
                    break
                time.sleep(0.0005)
            ctypes.c_uint64.from_address(out + 8).value = int((time.monotonic() - t0) * 1e9)
            ctypes.c_uint32.from_address(out + 4).value = reason

        self.kernel = threading.Thread(target=spin, daemon=True)
        self.kernel.start()

    def sync(self, stream):
        self.kernel.join()

    def wait_idle(self):
        """A call that waits until the 'device' is idle."""
        while self.kernel.is_alive():
            time.sleep(0.001)


def _spinner():
    drv = StandInDriver()
    return drv, Spinner(drv, None, bound_s=2.0)


def test_a_call_that_waits_for_the_device_blocks():
    drv, sp = _spinner()
    t = under_spin(drv, sp, Call("wait", dict, lambda st: drv.wait_idle()), hold_s=0.2)
    assert t.outcome == BLOCKS
    assert t.spin_end == "released by the host"
    assert 0.2 <= t.call_s < 1.0 and t.released_after_s is not None


def test_a_call_that_does_not_wait_returns_while_the_kernel_spins():
    drv, sp = _spinner()
    t = under_spin(drv, sp, Call("quick", dict, lambda st: None), hold_s=0.2)
    assert t.outcome == RETURNS
    assert t.spinning_at_return and t.released_after_s is None


def test_a_failing_call_is_an_error_not_a_verdict():
    drv, sp = _spinner()

    def fail(st):
        raise RuntimeError("boom")

    t = under_spin(drv, sp, Call("fail", dict, fail), hold_s=0.2)
    assert t.outcome == ERROR and "boom" in t.error


def test_pair_shows_a_lock_held_while_waiting_on_the_device():
    drv, sp = _spinner()

    def holder(st):
        with drv.lock:
            drv.wait_idle()

    def other(st):
        with drv.lock:
            pass

    th, to = pair_under_spin(drv, sp, Call("holder", dict, holder),
                             Call("other", dict, other), hold_s=0.3)
    assert th.outcome == BLOCKS and to.outcome == BLOCKS and to.holder_in_call
    th, to = pair_under_spin(drv, sp, Call("holder", dict, lambda st: drv.wait_idle()),
                             Call("other", dict, other), hold_s=0.3)
    assert th.outcome == BLOCKS and to.outcome == RETURNS and to.holder_in_call
