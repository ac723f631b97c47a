"""KV pages on demand in the simulator (I14): the correct protocol preempts and stays clean when
pages run out; a worker with its own page allocator is caught, naming the step and the rule."""

from dataclasses import replace

import pytest

from protocol.backend import AssignPages, Op
from protocol.commands import PageAssign
from protocol.worker import Worker
from sim.check import CheckSpec, check_bad, check_correct
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import REGISTRY
from sim.variants_paging import page_pressure

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)

pytestmark = pytest.mark.timeout(300)


def test_page_pressure_pool_holds_one_sequence_of_the_workload():
    sc = page_pressure(default_scenario(**SMALL), page_size=2)
    longest = max(len(a.request.prompt) + a.request.max_tokens - 1 for a in sc.workload)
    assert sc.config.max_kv_pages == sc.pages_per_seq == -(-longest // 2)


@pytest.mark.parametrize("topology", ["shared", "per-rank"])
def test_correct_protocol_preempts_and_stays_clean_when_pages_run_out(topology):
    variant = REGISTRY["paged-kv-pressure"]
    rows = check_correct(variant, CheckSpec(schedules=10, fault_schedules=0, time_budget=60),
                         topology)
    assert [r.got for r in rows] == ["clean"], [r.detail for r in rows]
    assert rows[0].stats.reached["preemption"] > 0


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_local_page_allocator_is_caught_at_any_page_size_and_correct_is_clean(page_size):
    sc = page_pressure(default_scenario(**SMALL), page_size=page_size)
    correct = run_schedule(sc, REGISTRY["correct"], RandomWalk(page_size))
    assert correct.outcome.verdict == "clean", correct.outcome.detail
    assert correct.reached["preemption"] > 0
    bad = run_schedule(sc, REGISTRY["local-pages"], RandomWalk(page_size))
    assert (bad.outcome.verdict, bad.outcome.invariant) == ("invariant", "I14")
    failing = bad.world.ctrl.current
    assert failing.preempts, "caught in the step whose preemption hands out the freed pages"
    assert f"refused command {failing.seq}" in bad.outcome.detail


def test_local_pages_report_names_step_rule_and_story():
    row = check_bad(REGISTRY["local-pages"], CheckSpec(schedules=5, fault_schedules=0), "shared")
    assert row.got == "invariant:I14"
    assert row.minimal.outcome.invariant == "I14"
    assert "not enough free KV pages" in row.minimal.outcome.detail


class LifoPagesWorker(Worker):
    """Frees every page the command names, but hands out its own most recently freed page
    first: its page tables agree with its peers' and disagree with the controller's."""

    def apply_page_changes(self, step):
        if self.pages is None:
            return super().apply_page_changes(step)
        free = getattr(self, "_stack", None)
        if free is None:
            free = self._stack = list(range(self.pages.num_pages))[::-1]
        for leaving in step.retires + step.preempts:
            self.pages.release(leaving.request_id, leaving.pages)
            free.extend(leaving.pages)
        ops = []
        for assign in step.pages:
            mine = tuple(free.pop() for _ in assign.pages)
            own = PageAssign(assign.request_id, assign.slot, assign.first_index, mine)
            self.pages.assign(own)
            ops.append(AssignPages(own.slot, own.first_index, own.pages))
        return ops


def test_page_tables_that_differ_from_the_controllers_are_a_divergence():
    variant = replace(REGISTRY["correct"], name="lifo-pages", worker_cls=LifoPagesWorker,
                      expected={"shared": "divergence", "per-rank": "divergence"})
    sc = page_pressure(default_scenario(**SMALL), page_size=2)
    result = run_schedule(sc, variant, RandomWalk(0))
    assert (result.outcome.verdict, result.outcome.invariant) == ("divergence", "I14")
    assert "KV page table differs from the controller's" in result.outcome.detail
