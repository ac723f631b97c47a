"""`run_schedule` turns the cyclic collector off during a run and leaves it as it found it."""

import gc

import pytest

from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import REGISTRY

TINY = dict(buckets=(1, 2), max_batch=2)


class _Failing:
    def choose(self, enabled, step):
        raise RuntimeError("chooser failed")


def test_the_collector_is_off_during_a_run_and_restored_after():
    seen = []

    def note(world):
        seen.append(gc.isenabled())

    assert gc.isenabled()
    result = run_schedule(default_scenario(**TINY), REGISTRY["correct"], RandomWalk(0), on_state=note)
    assert result.outcome.verdict == "clean"
    assert seen and not any(seen)
    assert gc.isenabled()


def test_the_collector_is_restored_when_a_run_raises():
    with pytest.raises(RuntimeError):
        run_schedule(default_scenario(**TINY), REGISTRY["correct"], _Failing())
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_caller_stays_off():
    gc.disable()
    try:
        run_schedule(default_scenario(**TINY), REGISTRY["correct"], RandomWalk(0))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collector_off_collects_now_and_then_and_is_restored_on_error(monkeypatch):
    """A long serial search keeps the collector off but bounded: faulted runs leave cycles."""
    import gc

    import sim.run

    calls, runs = [], []
    monkeypatch.setattr(sim.run, "COLLECT_EVERY", 3)
    monkeypatch.setattr(sim.run.gc, "collect", lambda: calls.append(len(runs)) or 0)
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with sim.run.collector_off() as ran:
            assert not gc.isenabled()
            for run in range(7):
                runs.append(run)
                ran()
            raise RuntimeError("a run raised")
    assert calls == [3, 6] and gc.isenabled()  # after every third run, not the first two


def test_the_watchdog_sees_every_action_of_a_run_as_progress():
    from sim import guard

    seen = []
    start = guard.progress()
    result = run_schedule(default_scenario(**TINY), REGISTRY["correct"], RandomWalk(0),
                          on_state=lambda world: seen.append(guard.progress()))
    assert seen == list(range(start + 1, start + 1 + result.actions))
    assert guard.progress() == start + result.actions  # counted once the run is over, too
