"""The decode bench runs its timed steps through the protocol's reference driver (issue 11 item
8): `protocol.execution.run_command` on a worker, as the engine and the simulator do, so a step
the worker refuses fails the bench instead of being timed."""

from __future__ import annotations

import dataclasses

import pytest

from engine.bench.decode import BenchBackend, bench_worker, time_steps
from engine.bench.host_overhead import CpuPhaseTimer
from engine.engine_config import EngineConfig
from engine.executor import RankExecutor
from engine.parallel import SINGLE
from protocol.commands import DecodeRow, Step
from protocol.keys import GraphKey

KEY = GraphKey(4)


def Timer():
    """The CPU twin of the executor's `PhaseTimer`, the interface `time_steps` drives (a
    hand-written stub here once hid a change of that interface from the tests)."""
    return CpuPhaseTimer()


class LoggedBackend(BenchBackend):
    """`BenchBackend` that records which of its methods each op reached."""

    def __init__(self, executor):
        super().__init__(executor, hold=lambda: self.log.append("hold"))
        self.log: list[str] = []

    def prepare_replay(self, step):
        self.log.append("prepare_replay")
        super().prepare_replay(step)

    def launch(self, key):
        self.log.append("launch")
        return super().launch(key)

    def run_eager(self, step):
        self.log.append("run_eager")
        super().run_eager(step)

    def synchronize(self):
        self.log.append("synchronize")
        super().synchronize()

    def enqueue_sample(self, step):
        self.log.append("enqueue_sample")
        super().enqueue_sample(step)

    def read_tokens(self, step):
        self.log.append("read_tokens")
        return super().read_tokens(step)


@pytest.fixture
def bench(tiny_dir):
    settings = EngineConfig.create(tiny_dir, max_batch=4, max_model_len=32, page_size=16,
                                   cuda_graph=True, graph_standin=True)
    ex = RankExecutor(settings, SINGLE)
    ex.load_model()
    ex.allocate_kv(ex.pages_needed())
    ex.assign_pages_per_slot()
    for op in (ex.record, ex.instantiate, ex.upload):
        op(KEY)
    return settings, ex


def _steps(n: int, batch: int, key=KEY, request_of=lambda slot: slot) -> list[Step]:
    return [Step(seq=i, rows=tuple(DecodeRow(slot=s, request_id=request_of(s), token=10 + s + i,
                                             position=5) for s in range(batch)),
                 key=key, bucket=KEY.bucket) for i in range(n)]


@pytest.mark.timeout(120)
def test_timed_steps_are_the_workers_ops_run_by_the_reference_driver(bench):
    settings, ex = bench
    backend = LoggedBackend(ex)
    ex.phases = timer = Timer()
    times = time_steps(bench_worker(0, settings, 3, {KEY}), backend, _steps(2, 3), timer)
    # one decode time per step, from the phases the executor recorded around each launch
    assert len(times) == 2 and all(t > 0 for t in times)
    assert [s["rows"] for s in timer.steps] == [3, 3]
    # the worker's op list for a replayed step on rank 0, in order, with the hold before the launch
    assert backend.log == ["prepare_replay", "hold", "launch", "enqueue_sample", "synchronize",
                           "read_tokens"] * 2
    assert ex.input_ids[:3].tolist() == [11, 12, 13]  # the last step's rows reached the replay
    eager = LoggedBackend(ex)
    ex.phases = timer = Timer()
    two = dataclasses.replace(settings, world_size=2)  # a rank 1 exists only in a world of two
    assert time_steps(bench_worker(1, two, 2), eager, _steps(1, 2, key=None), timer)[0] > 0
    assert eager.log == ["run_eager", "hold", "synchronize"]  # rank 1 samples nothing


@pytest.mark.timeout(120)
def test_a_step_the_worker_refuses_fails_the_bench_and_is_not_timed(bench):
    """Row 0 names request 9, which slot 0 does not hold (I8): the driver refuses the step
    before any op, and the worker, poisoned, refuses the next one too."""
    settings, ex = bench
    backend = LoggedBackend(ex)
    worker = bench_worker(0, settings, 2, {KEY})
    timer = Timer()
    with pytest.raises(RuntimeError, match="failed on rank 0: .*row 0 names slot 0 request 9"):
        time_steps(worker, backend, _steps(1, 2, request_of=lambda s: 9 - s), timer)
    assert backend.log == [] and timer.steps == []
    with pytest.raises(RuntimeError, match="poisoned"):
        time_steps(worker, backend, _steps(1, 2), timer)
    with pytest.raises(RuntimeError, match="asks to replay GraphKey|not captured"):
        time_steps(bench_worker(0, settings, 2), backend, _steps(1, 2), timer)
    assert backend.log == []
