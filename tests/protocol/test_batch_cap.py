"""A batch cap counts rows: the bucket a full batch pads to is kept, measured and replayed
(issue 13, item 1: max_batch=3 with buckets 1, 2, 4 ran every full batch eagerly)."""

import pytest

from protocol.commands import MeasureGraphs, MemoryReport, Step
from protocol.config import ProtocolConfig
from protocol.controller import Done
from protocol.eligibility import GraphPlan
from protocol.keys import GraphKey
from protocol.memory import kept_buckets, plan_memory
from protocol.requests import Request
from tests.protocol.driver import drive


@pytest.mark.parametrize("max_batch, bucket", [(3, 4), (5, 8), (7, 8)])
def test_full_batch_below_a_bucket_replays_that_bucket(max_batch, bucket):
    config = ProtocolConfig(buckets=(1, 2, 4, 8), max_batch=max_batch)
    reqs = [Request(i, (1, 2), max_tokens=4) for i in range(max_batch)]
    ctrl, workers, _, sent, action = drive(config, reqs)
    assert isinstance(action, Done)
    assert ctrl.memory.batch_cap == max_batch
    assert GraphKey(bucket) in ctrl.plan.keys()
    full = [c for c in sent if isinstance(c, Step) and len(c.rows) == max_batch and not c.admits]
    assert full and all(c.key == GraphKey(bucket) for c in full)
    assert all(GraphKey(bucket) in w.captured for w in workers)


def test_plan_cap_in_rows_keeps_the_bucket_that_holds_it():
    plan = GraphPlan.from_config(ProtocolConfig(buckets=(1, 2, 4, 8), max_batch=8)).fitted(3)
    assert plan.keys() == (GraphKey(4), GraphKey(2), GraphKey(1))
    assert plan.key_for(3, 10) == (GraphKey(4), 4)
    assert plan.key_for(4, 10) == (None, 4)  # more rows than the cap: eager


def test_reserve_covers_the_bucket_that_holds_the_cap():
    graphs = {GraphKey(b): 10 * b for b in (1, 2, 4)}
    reports = {0: MemoryReport(10_000, 0), 1: MemoryReport(10_000, 0)}
    plan = plan_memory(reports, graphs, (1, 2, 4), 3, page_bytes=10, pages_per_seq=1)
    assert plan.batch_cap == 3
    assert plan.graph_reserve_bytes == 70
    assert kept_buckets((1, 2, 4, 8), 5) == (1, 2, 4, 8)


def test_memory_is_measured_again_on_the_kept_set():
    """When the fit keeps fewer graphs than it measured, the kept set is measured again, and
    the reserve is the second measurement's sum."""
    config = ProtocolConfig(buckets=(1, 2, 4, 8), max_batch=8, kv_page_bytes=100)
    # 500 bytes: 4 graphs (400) leave no room for a page beside the padding page; 3 graphs do
    ctrl, _, _, sent, action = drive(config, [Request(0, (1,), max_tokens=1)], free_bytes=500)
    assert isinstance(action, Done)
    measures = [c for c in sent if isinstance(c, MeasureGraphs)]
    assert len(measures) == 2
    assert set(measures[1].keys) == set(ctrl.plan.keys()) != set(measures[0].keys)
    assert ctrl.memory.batch_cap == 4
    assert ctrl.memory.graph_reserve_bytes == 100 * len(measures[1].keys)
