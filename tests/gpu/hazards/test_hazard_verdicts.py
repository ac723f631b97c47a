"""CPU tests of the hazard probes: verdicts from timings, and bad arguments refused with a
one-line error before any GPU work."""

from __future__ import annotations

import importlib

import pytest

from hazard_verdicts import (BLOCKS, DOES_NOT_HOLD, ERROR, HOLDS, HOLDS_IN_PART, INCONCLUSIVE,
                             RETURNS, CallTiming, aggregate, async_verdict, exit_verdict,
                             lock_verdict)

RELEASED, BOUND = "released by the host", "in-kernel bound"


def timing(call_s, spinning, released_after=None, spin_end=RELEASED, error=None,
           holder_in_call=None, hold_s=1.0):
    return CallTiming(call="c", call_s=call_s, hold_s=hold_s, spinning_at_return=spinning,
                      released_after_s=released_after, spin_end=spin_end, spun_s=1.0,
                      error=error, holder_in_call=holder_in_call)


@pytest.mark.parametrize("t,outcome", [
    (timing(0.001, True), RETURNS),                       # back while the kernel spun
    (timing(1.2, True), RETURNS),                         # slow, but not waiting on it
    (timing(1.0005, False, released_after=1.0), BLOCKS),  # in for the hold, out after the end
    (timing(8.0, False, spin_end=BOUND), BLOCKS),         # kept the GIL: bound ended the spin
    (timing(0.3, False, spin_end=BOUND), INCONCLUSIVE),   # the spin ended before the hold
    (timing(0.01, None, error="DriverError: x"), ERROR),
])
def test_call_outcome(t, outcome):
    assert t.outcome == outcome
    assert t.record()["outcome"] == outcome


@pytest.mark.parametrize("outcomes,verdict", [
    ([BLOCKS, BLOCKS, INCONCLUSIVE], HOLDS),
    ([RETURNS, RETURNS], DOES_NOT_HOLD),
    ([BLOCKS, RETURNS, ERROR], HOLDS_IN_PART),
    ([INCONCLUSIVE, ERROR], INCONCLUSIVE),
    ([], INCONCLUSIVE),
])
def test_aggregate(outcomes, verdict):
    assert aggregate(outcomes) == verdict


def test_lock_verdict_counts_only_pairs_with_a_blocked_holder_and_a_free_other():
    holder = timing(1.0, False, released_after=1.0)
    blocked_other = timing(0.8, False, released_after=0.8, holder_in_call=True, hold_s=0.8)
    free_other = timing(0.001, True, holder_in_call=True)
    late_other = timing(0.8, False, released_after=0.8, holder_in_call=False, hold_s=0.8)
    assert lock_verdict([(holder, blocked_other, RETURNS)]) == HOLDS
    assert lock_verdict([(holder, free_other, RETURNS)]) == DOES_NOT_HOLD
    assert lock_verdict([(holder, blocked_other, RETURNS),
                         (holder, free_other, RETURNS)]) == HOLDS_IN_PART
    # not counted: the other blocks on its own, or the holder had left the driver already,
    # or the holder never blocked
    assert lock_verdict([(holder, blocked_other, BLOCKS)]) == INCONCLUSIVE
    assert lock_verdict([(holder, late_other, RETURNS)]) == INCONCLUSIVE
    assert lock_verdict([(timing(0.001, True), blocked_other, RETURNS)]) == INCONCLUSIVE


def test_async_verdict():
    assert async_verdict([True, True]) == HOLDS
    assert async_verdict([False]) == DOES_NOT_HOLD
    assert async_verdict([True, False]) == HOLDS_IN_PART
    assert async_verdict([]) == INCONCLUSIVE


@pytest.mark.parametrize("held,fast,verdict", [
    (2.6, 0.05, HOLDS),           # exit waited out the spin that was left (2.7 s)
    (None, 0.05, HOLDS),          # exit never ended: the parent killed it
    (0.1, 0.05, DOES_NOT_HOLD),
    (1.7, 0.05, INCONCLUSIVE),    # between the two thresholds
    (2.6, 2.6, INCONCLUSIVE),     # os._exit waited too: nothing to compare against
])
def test_exit_verdict(held, fast, verdict):
    assert exit_verdict({"exit_lock_held": held, "os_exit_lock_held": fast}, 2.7) == verdict


@pytest.mark.parametrize("module,argv,names", [
    ("hazard_probe_block", ["--hold-s", "0"], "--hold-s"),
    ("hazard_probe_block", ["--spin-device", "99"], "device 99"),
    ("hazard_probe_async", ["--work-s", "-1"], "-1"),
    ("hazard_probe_memory", ["--buckets", "1,x"], "'1,x'"),
    ("hazard_probe_memory", ["--copies", "0"], "copies 0"),
    ("hazard_probe_exit", ["--bound-s", "0.1"], "0.1"),
])
def test_probe_refuses_bad_arguments(tmp_path, module, argv, names):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "x.json"), *argv])
    msg = str(exc.value)
    assert names in msg and "\n" not in msg
    assert not (tmp_path / "x.json").exists()
