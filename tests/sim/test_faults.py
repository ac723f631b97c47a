"""Faults everywhere (issue 10 item 8): fault sites come from every op a run executes, in the
sweep and in serving, at any occurrence; coverage is counted per phase and per op."""

import pytest

from sim.check import WithRandomFault
from sim.faults import fault_coverage, fault_sites, random_fault
from sim.scenario import default_scenario
from sim.search import sample_search
from sim.variants import REGISTRY

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)


@pytest.mark.timeout(60)
def test_sites_cover_every_op_of_both_phases():
    sites = fault_sites(default_scenario(**SMALL))
    serving_ops = {op for _, op, _ in sites["serving"]}
    assert {"prefill", "prepare_replay", "launch", "move_slot", "enqueue_sample",
            "read_tokens"} <= serving_ops
    # every decode step replays here (mixed steps too); served without graphs, each is eager
    eager = fault_sites(default_scenario(**SMALL, cuda_graphs=False))
    assert "run_eager" in {op for _, op, _ in eager["serving"]}
    assert {"record", "instantiate", "upload", "launch", "allocate_kv"} <= {op for _, op, _ in sites["sweep"]}
    assert max(n for _, _, n in sites["serving"]) > 10  # late occurrences, not only the first calls


@pytest.mark.timeout(60)
def test_random_faults_land_anywhere():
    sc = default_scenario(**SMALL)
    faults = [random_fault(sc, i, 0) for i in range(300)]
    assert len({f.op for f in faults}) >= 10 and max(f.occurrence for f in faults) > 10
    assert {f.rank for f in faults} == {0, 1} and {f.kind for f in faults} == {"raise", "oom", "slow", "hang", "die"}


@pytest.mark.timeout(120)
def test_correct_protocol_fails_loudly_under_faults_in_both_phases():
    sc = default_scenario(**SMALL)
    ok = lambda r: r.outcome.verdict in ("clean", "abort")  # noqa: E731
    res = sample_search(WithRandomFault(sc, 0), REGISTRY["correct"], ok, "random", 60, 100, 0)
    assert res.failure is None, res.failure and res.failure.outcome.detail
    reached = res.stats.reached
    assert reached["fault_fired_sweep"] > 0 and reached["fault_fired_serving"] > 0
    text = fault_coverage(reached)
    assert text.startswith("faults fired: sweep ") and "serving" in text and "by op: " in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["sweep", "serving"])
def test_a_dead_rank_is_named_by_the_liveness_signal(phase):
    from sim.run import run_schedule
    from sim.scenario import Fault
    from sim.strategies import RandomWalk

    sc = default_scenario(topology="per-rank", **SMALL)
    rank, op, occurrence = next(s for s in fault_sites(sc)[phase] if s[0] == 1)
    faulted = sc.with_(faults=(Fault("die", rank, op, occurrence),))
    result = run_schedule(faulted, REGISTRY["correct"], RandomWalk(0))
    assert result.outcome.verdict == "abort" and result.outcome.rank == 1, result.outcome.detail
    assert "rank 1 died" in result.outcome.detail
    assert any(e.kind == "liveness" for e in result.world.trace)
    bad = run_schedule(faulted, REGISTRY["no-liveness"], RandomWalk(0)).outcome
    assert (bad.verdict, bad.invariant, bad.rank) == ("invariant", "I13", 1)


def test_a_hang_with_no_cycle_names_the_wedged_rank_and_its_call():
    """`explain_blocked`, the story of a hang that no wait-for cycle explains, puts the rank
    an injected hang wedged first, naming the call it is stuck in."""
    from types import SimpleNamespace

    from protocol.backend import Instantiate
    from protocol.keys import GraphKey
    from sim.common import FOREVER
    from sim.scenario import Fault
    from sim.waits import explain_blocked
    from sim.world import World

    world = World(default_scenario(**SMALL), REGISTRY["correct"])
    assert explain_blocked(world) == "every actor is idle but the run did not finish."
    host = world.hosts[1]
    host.run = SimpleNamespace(op=Instantiate(GraphKey(8)), command=None)  # in its instantiate
    host.fault_armed, host.ready_at = Fault("hang", 1, "instantiate", 1), FOREVER
    assert explain_blocked(world).startswith(
        "rank 1 is wedged in instantiate decode@8 (injected hang)")
    host.ready_at = world.clock + 1.0  # a slow call, not a hang: due on the clock
    assert "wedged" not in explain_blocked(world)


def test_a_hang_in_a_lock_taking_call_holds_the_driver_lock_for_good():
    """H1: a call that takes the process's driver lock and never returns keeps it, so every
    other thread of the process that needs the lock waits behind it (the exit-on-timeout
    story); the hung host holds it as a lock-holding call does."""
    from types import SimpleNamespace

    from protocol.backend import Instantiate
    from protocol.keys import GraphKey
    from sim.common import FOREVER, PROGRESS
    from sim.scenario import Fault
    from sim.world import World

    world = World(default_scenario(**SMALL), REGISTRY["correct"])
    host = world.hosts[1]
    host.run = SimpleNamespace(op=Instantiate(GraphKey(8)), command=SimpleNamespace(seq=3))
    fault = Fault("hang", 1, "instantiate", 1)
    assert world._fire(1, host, Instantiate(GraphKey(8)), fault) == PROGRESS
    assert host.ready_at == FOREVER and host.fault_armed is fault
    assert world.locks[host.proc] == 1 and host.holding
    world.release_lock(host)  # what the process's death or abort does
    assert world.locks[host.proc] is None


def test_slow_faults_straddle_the_watchdog():
    """A random slow fault takes a tenth of the watchdog's timeout (the run must ride it out)
    or twice it (the watchdog must fire): both sides of the deadline get searched."""
    sc = default_scenario(**SMALL)
    timeout = sc.config.watchdog_timeout_s
    delays = {random_fault(sc, i, 0).delay_s for i in range(300)}
    assert delays == {0.1 * timeout, 2.0 * timeout}


def test_fault_coverage_lists_ops_by_count_then_name():
    reached = {"fault_fired_sweep": 3, "fault_fired_serving": 6, "fault_op_upload": 2,
               "fault_op_launch": 5, "fault_op_record": 2, "fault_op_prefill": 0}
    assert fault_coverage(reached) == ("faults fired: sweep 3, serving 6; by op: launch 5, "
                                       "record 2, upload 2")


def test_a_fault_family_is_every_op_site_of_a_fault_free_run():
    """`FaultFamily.members` walks the same fault-free run as `fault_sites`: the any-op family
    is every op site of both phases, in run order, and a named op or phase narrows it."""
    from sim.faults import FaultFamily

    sc = default_scenario(**SMALL)
    sites = fault_sites(sc)
    everything = FaultFamily("raise").members(sc, REGISTRY["correct"])
    assert [(f.rank, f.op, f.occurrence) for f in everything] == sites["sweep"] + sites["serving"]
    assert all(f.kind == "raise" for f in everything)
    launches = FaultFamily("hang", "launch", "serving").members(sc, REGISTRY["correct"])
    assert [(f.rank, f.op, f.occurrence) for f in launches] == [
        s for s in sites["serving"] if s[1] == "launch"]
    assert FaultFamily("hang", "instantiate").describe() == "instantiate"
    assert FaultFamily("raise", phase="serving").describe() == "any op in serving"
    assert FaultFamily("raise").describe() == "any op"

