"""Direct checks of overlapped scheduling in the simulator (I20, I12, I11), each made to fire by
a design that breaks only it."""

from __future__ import annotations

import pytest

from protocol.backend import EnqueueSample, Op
from protocol.commands import Step
from protocol.worker import Worker
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import REGISTRY, Variant
from sim.variants_overlap import overlapped

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)


class EveryOtherStepWorker(Worker):
    """Ranks other than 0 sample only in even steps: in odd steps their rows read the ids of
    the step before last, whose slot order is usually the same (so only the step check, not
    the request check, can tell)."""

    def overlapped_tail(self, step: Step) -> list[Op]:
        ops = super().overlapped_tail(step)
        if self.rank == 0 or step.seq % 2 == 0:
            return ops
        return [op for op in ops if type(op) is not EnqueueSample]


@pytest.mark.timeout(120)
def test_rows_fed_from_an_older_steps_ids_are_i20_even_when_the_requests_match():
    variant = Variant(name="every-other-step", summary="test", source="test",
                      expected={"shared": "invariant:I20", "per-rank": "invariant:I20"},
                      worker_cls=EveryOtherStepWorker, symmetric=False, adjust=overlapped)
    outcome = run_schedule(variant.scenario(default_scenario(**SMALL)), variant,
                           RandomWalk(0)).outcome
    assert outcome.invariant == "I20", outcome.detail
    assert outcome.rank == 1 and "not step" in outcome.detail


@pytest.mark.timeout(120)
def test_the_correct_overlapped_protocol_reaches_fed_and_leftover_rows():
    variant = REGISTRY["overlapped-scheduling"]
    result = run_schedule(variant.scenario(default_scenario(**SMALL)), variant, RandomWalk(1))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached["fed_row"] > 0 and result.reached["leftover_row"] > 0
    assert result.reached["overlapped_step"] > 0
