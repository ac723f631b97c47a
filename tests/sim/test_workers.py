"""Parallel search workers: early stop and teardown never hang, dead or stuck workers are
reported, and no worker process outlives its pool (issue 13 item 18)."""

import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sim.check import CLEAN, Fixed
from sim.scenario import default_scenario
from sim.search import _parallel_sample_search
from sim.variants import REGISTRY
from sim.workers import WorkerError, WorkerPool


def _echo(job, task, deadline):
    return job + task


def _sleep_forever(job, task, deadline):
    while True:
        time.sleep(1)


def _exit(job, task, deadline):
    os._exit(3)


def _raise(job, task, deadline):
    raise ValueError(f"bad task {task}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        for pid, ppid in parents.items():
            if ppid == parent:
                found.append(pid)
                todo.append(pid)
    return found


def _burn(stop: float) -> None:
    while time.perf_counter() < stop:
        pass


@pytest.mark.timeout(20)
def test_pool_runs_every_task():
    with WorkerPool(_echo, 10, 2, time.perf_counter() + 10) as pool:
        got = sorted(value for _, _, value in pool.results(range(7)))
    assert got == [10 + i for i in range(7)]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("target, words", [(_exit, "exited with code 3"),
                                           (_raise, "ValueError: bad task 0")])
def test_pool_reports_a_dead_or_raising_worker_in_one_line(target, words):
    with WorkerPool(target, None, 1, time.perf_counter() + 10) as pool:
        with pytest.raises(WorkerError, match=words) as info:
            list(pool.results([0]))
    assert "\n" not in info.value.message


@pytest.mark.timeout(30)
def test_pool_gives_up_on_a_worker_that_never_answers(monkeypatch):
    """The pool waits on its workers with a timeout that ends `GRACE_S` past the deadline,
    never longer, then names the silent worker; the test's timeout bounds a hang."""
    import sim.workers
    monkeypatch.setattr(sim.workers, "GRACE_S", 0.5)
    timeouts = []

    def recorded_wait(objects, timeout=None):
        timeouts.append(timeout)
        return multiprocessing.connection.wait(objects, timeout)

    monkeypatch.setattr(sim.workers, "wait", recorded_wait)
    start = time.perf_counter()
    pool = WorkerPool(_sleep_forever, None, 2, start + 0.5)
    pids = [p.pid for p in pool._procs]
    with pool, pytest.raises(WorkerError, match="no answer 0.5 s past the time budget") as info:
        list(pool.results([0, 1, 2]))
    assert info.value.task == 0  # the first task handed out, not one never sent
    assert timeouts and all(t is not None and t <= 1.0 for t in timeouts)  # deadline + grace
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(30)
def test_cancel_kills_workers_running_later_tasks():
    pool = WorkerPool(_sleep_forever, None, 2, time.perf_counter() + 60)
    pids = [p.pid for p in pool._procs]
    with pool:
        results = pool.results([0, 1])
        pool.cancel_after(-1)
        assert list(results) == []
    assert not any(_alive(pid) for pid in pids)


def _stop_early_under_load(rounds: int) -> None:
    """Stop early ROUNDS times, with the CPUs busy and a monitor thread running in this process.

    Each search finds the fused-sweep failure in its first chunk and stops; the others'
    workers are killed mid-chunk. Under the old fork pool this could hang in teardown.
    """
    sc = default_scenario(buckets=(1, 2), max_batch=2)
    variant = REGISTRY["fused-sweep"]
    stop = time.perf_counter() + 600
    # this worker's share of the CPUs under pytest-xdist: burning them all starved the other
    # workers' tests, some of which time a step against a timeout (a reviewer's finding)
    share = (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    burners = [multiprocessing.get_context("spawn").Process(target=_burn, args=(stop,), daemon=True)
               for _ in range(max(1, share))]
    for b in burners:
        b.start()
    halt = threading.Event()
    monitor = threading.Thread(target=lambda: halt.wait(), daemon=True)  # a thread, as tqdm's
    monitor.start()
    try:
        for i in range(rounds):
            res = _parallel_sample_search(Fixed(sc), variant, CLEAN, "random", i, 0, 400,
                                          time.perf_counter() + 30, True, None, 2)
            assert res.failure is not None and res.failure.outcome.verdict == "deadlock"
    finally:
        halt.set()
        for b in burners:
            b.kill()
            b.join(5)
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(180)
def test_early_stop_never_hangs_under_load():
    _stop_early_under_load(100)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_early_stop_never_hangs_under_load_thorough():
    _stop_early_under_load(1000)


@pytest.mark.timeout(60)
def test_a_search_whose_deadline_is_hours_away_reads_its_workers_answers():
    """The pool waits in slices of at most an hour (a far deadline would overflow poll's
    timeout); a slice that ends with answers is read, however far away the deadline is (a
    `--time-budget` may be a day)."""
    sc = default_scenario(buckets=(1, 2), max_batch=2)
    res = _parallel_sample_search(Fixed(sc), REGISTRY["correct"], CLEAN, "random", 0, 0, 100,
                                  time.perf_counter() + 7200, True, None, 2)
    assert res.failure is None and res.stats.schedules == 100


SLOW_IN_WORKERS = '''
import multiprocessing
import time

from protocol.worker import Worker
from sim.variants import Variant


class SlowInWorkers(Worker):
    def _ops_launch(self, command):
        if multiprocessing.current_process().name != "MainProcess":
            time.sleep(0.2)  # a worker's chunk of runs takes minutes; the serial probe does not
        return super()._ops_launch(command)


VARIANTS = [Variant("slow-in-workers", "correct, slow in worker processes", "test",
                    {"shared": "clean", "per-rank": "clean"}, worker_cls=SlowInWorkers)]
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the workers from /proc")
@pytest.mark.timeout(90)
def test_no_worker_outlives_a_killed_check(tmp_path):
    """SIGKILL leaves the check no teardown: each worker must end itself when the check's end
    of its parent pipe closes (`sim.workers._exit_with_parent`). Without that a worker runs its
    chunk on to the time budget, here two minutes: its tree parent is the forkserver, which
    outlives the check, so PR_SET_PDEATHSIG, asked for before, never fired."""
    variants = tmp_path / "slow_in_workers.py"
    variants.write_text(SLOW_IN_WORKERS)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "lockstep", "check", "--variant-file",
                             str(variants), "--variant", "slow-in-workers", "--topology", "shared",
                             "--schedules", "1000", "--time-budget", "120", "--no-progress",
                             "--jobs", "2"], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 45
        while len(_descendants(proc.pid)) < 3 and time.monotonic() < deadline:  # server + 2
            time.sleep(0.2)
        time.sleep(1.0)  # the workers are inside their first chunk
        workers = _descendants(proc.pid)
        assert len(workers) >= 3
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in workers if _alive(pid)] == []
    finally:  # whatever outlived the check must not outlive the test
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
