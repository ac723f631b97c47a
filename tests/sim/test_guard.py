"""The stall watchdog (`sim.guard`) on real searches: every search counts as progress, a hook
that loops is stopped in the main process even after a parallel search paused the watchdog, a
hook that blocks for less than `WALL_S` is left alone, and an error names the hook's own line.

`tests/sim/test_check_robustness.py` covers the same ground through the command line; these
are the cheap cases, in a file the mutation tool's simulator killer runs."""

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.check import CLEAN, CheckSpec, Fixed, check_variant
from sim.scenario import default_scenario
from sim.search import sample_search
from sim.variants import REGISTRY, load_variant_file

ROOT = Path(__file__).resolve().parents[2]

HOOKS = '''
import time

from protocol.worker import Worker
from sim.variants import Variant

_NAPPED = []


class LoopingWorker(Worker):
    def _ops_launch(self, command):
        while True:
            pass


class RaisingWorker(Worker):
    def _ops_launch(self, command):
        raise ValueError("boom")


class NappingWorker(Worker):
    def _ops_launch(self, command):
        if not _NAPPED:  # one short block (a slow read, say), well under the wall bound
            _NAPPED.append(1)
            time.sleep(1.0)
        return super()._ops_launch(command)


E = {"shared": "deadlock", "per-rank": "deadlock"}
C = {"shared": "clean", "per-rank": "clean"}
VARIANTS = [Variant("guard-loops", "never returns", "test", E, worker_cls=LoopingWorker),
            Variant("guard-raises", "raises", "test", E, worker_cls=RaisingWorker),
            Variant("guard-naps", "correct, blocks 1 s once", "test", C, worker_cls=NappingWorker)]
'''


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    path = tmp_path_factory.mktemp("guard") / "guard_hooks.py"
    path.write_text(HOOKS)
    load_variant_file(path)
    return path


@pytest.mark.timeout(60)
def test_an_exhaustive_search_is_progress_for_the_watchdog():
    """Exhaustive search runs its own loop, not `run_schedule`, and ticks once per action;
    without the ticks the watchdog stopped it after half a second of CPU as a stalled hook."""
    spec = CheckSpec(strategy="exhaustive", time_budget=2, fault_schedules=0, jobs=1)
    rows = check_variant(REGISTRY["correct"], spec, "shared")
    assert rows[0].got in ("clean", "incomplete"), rows[0].detail
    assert "distinct states" in rows[0].detail


@pytest.mark.timeout(40)  # a watchdog that stays paused lets the looping hook run for ever
def test_a_looping_hook_is_stopped_in_the_main_process_after_a_parallel_search(hooks):
    """A parallel search pauses the watchdog while it waits on its workers; leaving the pool
    must resume it, or the next variant's looping hook (run in this process: a sample search
    probes serially first) is never stopped."""
    sc = default_scenario(buckets=(1, 2), max_batch=2)
    res = sample_search(Fixed(sc), REGISTRY["correct"], CLEAN, schedules=12, time_budget=20, jobs=2)
    assert res.failure is None and res.stats.schedules == 12
    rows = check_variant(REGISTRY["guard-loops"], CheckSpec(schedules=4, time_budget=5, jobs=1),
                         "shared")
    assert [r.got for r in rows] == ["error"]
    assert rows[0].detail.startswith("variant 'guard-loops': no simulated action for 0.5 s "
                                     "(a hook that never returns?); stopped at guard_hooks.py:")


@pytest.mark.timeout(60)
def test_a_hook_that_blocks_for_less_than_the_wall_bound_is_left_alone(hooks):
    start = time.perf_counter()
    rows = check_variant(REGISTRY["guard-naps"], CheckSpec(schedules=2, fault_schedules=0,
                                                          time_budget=20, jobs=1), "shared")
    assert [r.got for r in rows] == ["clean"], rows[0].detail
    assert time.perf_counter() - start >= 1.0  # the nap did happen, inside the watched search


@pytest.mark.timeout(60)
def test_a_raising_hook_is_named_at_its_own_line(hooks):
    """The location is the innermost frame outside the project's own `sim/` and `protocol/`:
    the hook's `raise`, not the simulator frame that called it."""
    rows = check_variant(REGISTRY["guard-raises"], CheckSpec(schedules=4, time_budget=5, jobs=1),
                         "shared")
    assert [r.got for r in rows] == ["error"]
    line = HOOKS.splitlines().index('        raise ValueError("boom")') + 1
    assert rows[0].detail == f"variant 'guard-raises': ValueError: boom (at guard_hooks.py:{line})"


@pytest.mark.timeout(60)
def test_the_watchdog_loads_the_modules_a_step_imports_before_its_clock_runs():
    """A deadlock's explanation imports `sim.waits` (and networkx) inside a step on first use.
    Where no bytecode is cached that import took 0.55 s of CPU here, past `CHECK_S`, with no
    simulated action: the watchdog would stop a correct search as a stalled hook. Whether it
    does depends on where its timer falls, so this looks at the cause instead: in a fresh
    interpreter, entering the watchdog has loaded them."""
    code = ("import sys\nfrom sim.guard import watchdog\nwith watchdog():\n"
            "    print(*[n in sys.modules for n in ('sim.waits', 'sim.checks', 'networkx')])")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=50, check=True).stdout
    assert out.split() == ["True", "True", "True"]


def _burn(seconds: float) -> None:
    """Spend `seconds` of CPU time without a simulated action."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.timeout(30)
def test_cpu_time_in_the_garbage_collector_is_not_a_stalled_hook():
    """A fresh user's `--matrix` stopped a correct search with "no simulated action for 0.5 s"
    between two runs: a full collection of the heap the matrix had built. CPU time spent
    collecting (here a collection reported to the watchdog's `gc.callbacks` entry around
    the burn) does not count; the same burn outside one does."""
    from sim import guard

    with guard.watchdog():
        assert guard._on_gc in gc.callbacks
        guard._on_gc("start", {})
        _burn(3 * guard.CHECK_S)
        guard._on_gc("stop", {})
    assert guard._on_gc not in gc.callbacks
    with pytest.raises(guard.Stalled, match="no simulated action for 0.5 s"):
        with guard.watchdog():
            _burn(3 * guard.CHECK_S)
