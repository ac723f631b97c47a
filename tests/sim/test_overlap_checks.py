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
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
def test_overlap_rank0_samples_only_is_caught_on_a_rank_that_does_not_sample(topology):
    """The variant's ranks other than 0 skip the sampler, so I20 fires on one of them (rank 1
    at TP 2), and never on rank 0, whose device computed its ids. Mutant #3273 (``==`` made
    ``!=``) had rank 0 alone skip it: the mirrored bug, with the same verdict, and no test in
    the mutation tool's killers read the rank."""
    variant = REGISTRY["overlap-rank0-samples-only"]
    outcome = run_schedule(variant.scenario(default_scenario(topology, **SMALL)), variant,
                           RandomWalk(0)).outcome
    assert outcome.invariant == "I20", outcome.detail
    assert outcome.rank == 1 and "this rank did not sample" in outcome.detail, outcome.detail


@pytest.mark.timeout(120)
def test_the_correct_overlapped_protocol_reaches_fed_and_leftover_rows():
    variant = REGISTRY["overlapped-scheduling"]
    result = run_schedule(variant.scenario(default_scenario(**SMALL)), variant, RandomWalk(1))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached["fed_row"] > 0 and result.reached["leftover_row"] > 0
    assert result.reached["overlapped_step"] > 0


@pytest.mark.timeout(120)
def test_a_rank_blocked_in_await_step_is_explained_as_waiting_for_its_device():
    """The wait-for graph's await_step edge (sim.waits): a rank whose AwaitStep found its device
    still running the previous step waits for that device, not for another rank or the lock."""
    from protocol.backend import AwaitStep
    from sim.waits import wait_edges

    variant = REGISTRY["overlapped-scheduling"]
    seen = []

    def on_state(world):
        if seen:
            return
        enabled = set(world.enabled())
        for r, host in enumerate(world.hosts):
            if (isinstance(host.op, AwaitStep) and f"rank{r}" not in enabled
                    and world.devices[r].busy()):
                seen.append((r, host.op.seq, wait_edges(world)))
                return

    for seed in range(20):
        run_schedule(variant.scenario(default_scenario(**SMALL)), variant, RandomWalk(seed),
                     on_state=on_state)
        if seen:
            break
    assert seen, "no schedule left a rank blocked in await_step"
    r, seq, edges = seen[0]
    mine = [(a, b, text, hz) for a, b, text, hz in edges if a == f"rank{r}"]
    assert mine == [(f"rank{r}", f"device{r}",
                     f"rank {r}'s await_step waits for device {r} to finish command {seq}'s "
                     "work", None)]
