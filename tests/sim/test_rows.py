"""Rows of `lockstep check` run in parallel worker processes give the same table as in order."""

import pickle

import pytest

from protocol.errors import RankFailure, SlotError, WatchdogExpired
from sim.check import CheckSpec, check_variant
from sim.rows import check_rows
from sim.scenario import TOPOLOGIES
from sim.variants import REGISTRY


def _table(rows):
    return [(r.variant, r.topology, r.got, r.stats.schedules, r.minimal_length,
             r.minimal.choices if r.minimal else None) for group in rows for r in group]


@pytest.mark.timeout(240)
def test_parallel_rows_match_serial_rows(monkeypatch):
    variants = [REGISTRY[n] for n in ("correct", "split-eligibility", "single-warmup",
                                      "watchdog-armed-on-error")]
    spec = CheckSpec(schedules=20, clean_schedules=3, fault_schedules=3)
    finished = []
    # a worker that fails leaves its rows to this process, which gives the same table but no
    # parallelism (as when a counterexample's world did not pickle): make that fail here
    with monkeypatch.context() as patch:
        patch.setattr("sim.rows.check_variant", _no_serial_fallback)
        parallel = check_rows(variants, TOPOLOGIES, CheckSpec(**{**spec.__dict__, "jobs": 2}),
                              on_rows=lambda rows, planned: finished.append(planned))
    serial = check_rows(variants, TOPOLOGIES, spec)
    assert _table(parallel) == _table(serial)
    assert [r.got for g in parallel for r in g].count("clean") == 2
    assert sorted(finished) == sorted([6, 6, 20, 20, 20, 20, 20, 20])


def _no_serial_fallback(*args, **kwargs):
    raise AssertionError("a row ran in the parent process: a worker failed")


def test_a_counterexample_row_survives_pickling():
    rows = check_variant(REGISTRY["measure-once"], CheckSpec(), "shared")
    back = pickle.loads(pickle.dumps(rows))
    assert back[0].minimal is not None
    assert back[0].minimal.world.trace == rows[0].minimal.world.trace


def test_protocol_errors_survive_pickling():
    failure = RankFailure("rank 1 failed", (1,), (0,), {1: "boom"}, {1: "oom"}, {1: "I9"}, step=7)
    back = pickle.loads(pickle.dumps(failure))
    assert (type(back), str(back), back.failed, back.uncollected, back.errors, back.kind,
            back.invariant, back.step) == (RankFailure, "rank 1 failed", (1,), (0,), {1: "boom"},
                                           "oom", "I9", 7)
    assert pickle.loads(pickle.dumps(WatchdogExpired("late", (2,)))).uncollected == (2,)
    assert pickle.loads(pickle.dumps(SlotError("slot 3", kind="x"))).kind == "x"
