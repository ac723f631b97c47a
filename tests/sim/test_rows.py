"""Rows of `lockstep check` run in parallel worker processes give the same table as in order."""

import pickle

import pytest

from protocol.errors import RankFailure, SlotError, WatchdogExpired
from sim.check import CheckSpec
from sim.rows import check_rows
from sim.scenario import TOPOLOGIES
from sim.variants import REGISTRY


def _table(rows):
    return [(r.variant, r.topology, r.got, r.stats.schedules, r.minimal_length,
             r.minimal.choices if r.minimal else None) for group in rows for r in group]


@pytest.mark.timeout(240)
def test_parallel_rows_match_serial_rows():
    variants = [REGISTRY[n] for n in ("correct", "split-eligibility", "single-warmup",
                                      "watchdog-armed-on-error")]
    spec = CheckSpec(schedules=20, clean_schedules=3, fault_schedules=3)
    finished = []
    parallel = check_rows(variants, TOPOLOGIES, CheckSpec(**{**spec.__dict__, "jobs": 2}),
                          on_rows=lambda rows, planned: finished.append(planned))
    serial = check_rows(variants, TOPOLOGIES, spec)
    assert _table(parallel) == _table(serial)
    assert [r.got for g in parallel for r in g].count("clean") == 2
    assert sorted(finished) == sorted([6, 6, 20, 20, 20, 20, 20, 20])


def test_protocol_errors_survive_pickling():
    failure = RankFailure("rank 1 failed", (1,), (0,), {1: "boom"}, {1: "oom"}, {1: "I9"}, step=7)
    back = pickle.loads(pickle.dumps(failure))
    assert (type(back), str(back), back.failed, back.uncollected, back.errors, back.kind,
            back.invariant, back.step) == (RankFailure, "rank 1 failed", (1,), (0,), {1: "boom"},
                                           "oom", "I9", 7)
    assert pickle.loads(pickle.dumps(WatchdogExpired("late", (2,)))).uncollected == (2,)
    assert pickle.loads(pickle.dumps(SlotError("slot 3", kind="x"))).kind == "x"
