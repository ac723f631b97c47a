"""KV pages on demand in the simulator (I14): the correct protocol preempts and stays clean when
pages run out; a worker with its own page allocator is caught, naming the step and the rule."""

from dataclasses import replace

import pytest

from protocol.backend import AssignPages
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


def test_paged_kv_reads_through_page_tables_and_versions_pages():
    from sim.paged_kv import NEVER_WRITTEN, PagedKV

    kv = PagedKV(slots=3, pages=4, page_size=2)
    kv.assign(0, 0, (3, 1))
    for position, token in enumerate((10, 11, 12)):
        kv.write(0, position, token)
    assert kv.read(0, 2) == (10, 11, 12) and kv.cells[3] == [10, 11]
    assert kv.read(0, 4) == (10, 11, 12, NEVER_WRITTEN, NEVER_WRITTEN)
    assert kv.version(1) == 1 and kv.version(0) == 0
    kv.copy(0, 2)                        # a slot move moves the row, not the pages
    assert kv.read(2, 2) == (10, 11, 12) and kv.tables.get(0) is None
    kv.write(1, 0, 99)                   # no row: the padding page takes the write
    assert kv.page_of(1, 0) == kv.padding_page == 4
    kv.clear(2)
    assert kv.read(2, 0) == (99,)
    # a row assigned past its end (a controller that skipped a page) leaves the padding page
    # at the skipped index, so the page lands at its own index, not the first free one
    kv.assign(1, 2, (2,))
    assert kv.tables[1] == [4, 4, 2] and kv.page_of(1, 4) == 2 and kv.page_of(1, 0) == 4


class DropPagesWorker(Worker):
    """Checks the command's pages but never writes them into the device page table."""

    def apply_page_changes(self, step):
        return [op for op in super().apply_page_changes(step) if not isinstance(op, AssignPages)]


def test_paged_kv_model_turns_a_missing_page_table_write_into_wrong_tokens():
    variant = replace(REGISTRY["correct"], name="drop-pages", worker_cls=DropPagesWorker,
                      expected={"shared": "divergence", "per-rank": "divergence"})
    result = run_schedule(page_pressure(default_scenario(**SMALL)), variant, RandomWalk(0))
    assert result.outcome.verdict == "divergence", result.outcome.detail


def test_unfenced_preempt_store_is_found_by_search_and_needs_h6():
    from sim.hazards import HazardModel

    variant = REGISTRY["unfenced-preempt-store"]
    sc = page_pressure(default_scenario(**SMALL))
    verdicts = [run_schedule(sc, variant, RandomWalk(seed)).outcome for seed in range(30)]
    caught = [o for o in verdicts if o.invariant == "I14"]
    assert caught and len(caught) < len(verdicts), "some schedules run the copy first"
    assert {o.verdict for o in verdicts} == {"invariant", "clean"}
    story = caught[0].detail
    assert f"step {caught[0].step} preempted request" in story and "I14 violated" in story
    assert "before the step's asynchronous store" in story
    no_h6 = sc.with_(hazards=HazardModel().without("h6"))
    assert all(run_schedule(no_h6, variant, RandomWalk(seed)).outcome.verdict == "clean"
               for seed in range(10))


def test_unfenced_preempt_store_report_is_reduced_and_names_rule():
    row = check_bad(REGISTRY["unfenced-preempt-store"],
                    CheckSpec(schedules=20, fault_schedules=0), "per-rank")
    assert row.got == "invariant:I14"
    assert row.minimal.outcome.step is not None and row.minimal.outcome.rank is not None
