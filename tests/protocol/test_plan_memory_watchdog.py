"""I7 (one eligibility owner), I9 (memory reservation) and I6 (watchdog) in isolation."""

import pytest

from protocol.commands import MemoryReport
from protocol.config import ProtocolConfig
from protocol.eligibility import GraphPlan
from protocol.errors import ConfigError, EligibilityError, WatchdogExpired
from protocol.keys import GraphKey
from protocol.memory import plan_memory
from protocol.watchdog import Watchdog


def test_plan_keys_largest_first_and_cap():
    plan = GraphPlan.from_config(ProtocolConfig(graph_batch_cap=16))
    keys = plan.keys()
    assert keys[0] == GraphKey(16) and keys[-1] == GraphKey(1)
    assert plan.key_for(5, 10) == (GraphKey(8), 8)
    assert plan.key_for(17, 10) == (None, 20)
    assert plan.key_for(0, 0) == (None, 0)


def test_plan_refuses_ineligible_explicitly():
    plan = GraphPlan.from_config(ProtocolConfig(graph_batch_cap=16))
    with pytest.raises(EligibilityError, match="capture of graph decode@32 refused"):
        plan.require_eligible(GraphKey(32), "capture")
    off = GraphPlan.from_config(ProtocolConfig(cuda_graphs=False))
    assert off.keys() == ()
    with pytest.raises(EligibilityError, match="cuda_graphs=False"):
        off.require_eligible(GraphKey(1), "replay")


def test_plan_fitted_takes_smaller_cap():
    plan = GraphPlan.from_config(ProtocolConfig(graph_batch_cap=64))
    assert plan.fitted(32).batch_cap == 32
    assert plan.fitted(128).batch_cap == 64


def _reports(free0, free1, peak=0):
    return {0: MemoryReport(free0, peak), 1: MemoryReport(free1, peak)}


def test_memory_reserves_every_kept_graph_from_the_tightest_rank():
    graphs = {GraphKey(b): 10 for b in (1, 2, 4, 8)}
    plan = plan_memory(_reports(1000, 500), graphs, (1, 2, 4, 8), 8, page_bytes=10, pages_per_seq=1)
    assert plan.batch_cap == 8
    assert plan.graph_reserve_bytes == 40
    assert plan.kv_pages == (500 - 40) // 10 - 1


def test_memory_fits_smaller_batch_when_tight():
    graphs = {GraphKey(b): 100 for b in (1, 2, 4, 8)}
    plan = plan_memory(_reports(10_000, 300), graphs, (1, 2, 4, 8), 8, page_bytes=10, pages_per_seq=4)
    assert plan.batch_cap < 8
    assert plan.graph_reserve_bytes == 100 * sum(1 for b in (1, 2, 4, 8) if b <= plan.batch_cap)
    assert plan.kv_pages >= plan.batch_cap * 4


def test_memory_refusal_names_rank():
    with pytest.raises(ConfigError, match="startup refused: rank 1"):
        plan_memory(_reports(1000, 5), {GraphKey(1): 1}, (1,), 1, page_bytes=10, pages_per_seq=1)
    with pytest.raises(ConfigError, match="no memory reports"):
        plan_memory({}, {}, (1,), 1, 10, 1)


def test_watchdog_expires_naming_uncollected_ranks_and_disarms():
    now = [0.0]
    dog = Watchdog(lambda: now[0], 5.0)
    dog.check((1,))  # not armed: nothing
    dog.arm()
    now[0] = 4.9
    dog.check((1,))
    now[0] = 5.0
    with pytest.raises(WatchdogExpired, match="ranks not collected: 1, 3") as info:
        dog.check((1, 3))
    assert info.value.uncollected == (1, 3)
    assert not dog.armed
    dog.arm()
    dog.disarm()
    now[0] = 100
    dog.check((0,))


def test_memory_is_fitted_to_the_rank_with_least_free_after_activations_less_the_headroom():
    # rank 0 has more free bytes but a larger activation peak: 10000 - 5000 leaves 5000,
    # rank 1's 8000 - 1000 leaves 7000, so rank 0 is the tight one; the headroom comes off it
    reports = {0: MemoryReport(free_bytes=10_000, peak_activation_bytes=5_000),
               1: MemoryReport(free_bytes=8_000, peak_activation_bytes=1_000)}
    graphs = {GraphKey(1): 100, GraphKey(2): 100}
    plan = plan_memory(reports, graphs, (1, 2), 2, page_bytes=10, pages_per_seq=1)
    assert (plan.batch_cap, plan.graph_reserve_bytes) == (2, 200)
    assert plan.kv_pages == (5_000 - 200) // 10 - 1
    kept = plan_memory(reports, graphs, (1, 2), 2, page_bytes=10, pages_per_seq=1,
                       headroom_bytes=1_000)
    assert kept.kv_pages == (5_000 - 1_000 - 200) // 10 - 1
    with pytest.raises(ConfigError, match="rank 0 has 300 bytes after activations and headroom"):
        plan_memory(reports, graphs, (1, 2), 2, page_bytes=10, pages_per_seq=100,
                    headroom_bytes=4_700)
    # nothing left: the parts, not a negative byte count (a user's -33569792 bytes)
    with pytest.raises(ConfigError, match=r"rank 0 has no bytes \(10000 free, 5000 of "
                       r"activations, 6000 of headroom\) after activations and headroom"):
        plan_memory(reports, graphs, (1, 2), 2, page_bytes=10, pages_per_seq=1,
                    headroom_bytes=6_000)
