"""I22: the short-context decode path is chosen by the controller, for the whole step, from the
longest context of its decode rows (position + 1, the token the step writes included)."""

import pytest

from protocol.commands import MeasureGraphs, Step
from protocol.config import ProtocolConfig
from protocol.controller import Done
from protocol.eligibility import GraphPlan
from protocol.errors import ConfigError, EligibilityError
from protocol.keys import DECODE, SHORT, GraphKey
from protocol.requests import Request
from tests.protocol.driver import drive

BUCKETS = (1, 2, 4, 8, 16)


def _plan(short_context=32, short_max_bucket=8, **kwargs):
    return GraphPlan.from_config(ProtocolConfig(buckets=BUCKETS, max_batch=16,
                                                short_context=short_context,
                                                short_max_bucket=short_max_bucket, **kwargs))


@pytest.mark.parametrize("longest, path", [(1, SHORT), (31, SHORT), (32, SHORT), (33, DECODE),
                                           (10_000, DECODE)])
def test_the_boundary_is_at_short_context_tokens_of_context(longest, path):
    # a context of exactly short_context fits the one tile; one token more does not
    assert _plan().key_for(3, longest) == (GraphKey(4, path), 4)


@pytest.mark.parametrize("rows, key", [(5, GraphKey(8, SHORT)), (8, GraphKey(8, SHORT)),
                                       (9, GraphKey(16, DECODE)), (16, GraphKey(16, DECODE))])
def test_buckets_above_the_short_cap_take_the_decode_path(rows, key):
    assert _plan().key_for(rows, 4) == (key, key.bucket)


def test_the_short_cap_is_a_bucket_limit():
    # a cap between buckets keeps the buckets at or below it: 4 rows take the short path, 5
    # rows pad to 8, which has no short graph
    plan = _plan(short_max_bucket=6)
    assert plan.key_for(4, 4) == (GraphKey(4, SHORT), 4)
    assert plan.key_for(5, 4) == (GraphKey(8, DECODE), 8)


def test_the_keys_hold_both_paths_largest_bucket_first():
    assert _plan().keys() == (GraphKey(16), GraphKey(8), GraphKey(8, SHORT), GraphKey(4),
                              GraphKey(4, SHORT), GraphKey(2), GraphKey(2, SHORT), GraphKey(1),
                              GraphKey(1, SHORT))


def test_off_by_default_nothing_changes():
    plan = GraphPlan.from_config(ProtocolConfig(buckets=BUCKETS, max_batch=16))
    assert plan.paths == (DECODE,) and all(k.path == DECODE for k in plan.keys())
    assert plan.key_for(3, 1) == (GraphKey(4), 4)
    with pytest.raises(EligibilityError, match="decode-short@4 refused"):
        plan.require_eligible(GraphKey(4, SHORT), "capture")


def test_a_short_key_above_the_cap_is_refused_naming_the_cap():
    with pytest.raises(EligibilityError, match="short_max_bucket=8"):
        _plan().require_eligible(GraphKey(16, SHORT), "replay")


def test_the_batch_cap_and_cuda_graphs_bound_the_short_path_too():
    assert _plan().fitted(3).key_for(4, 4) == (None, 4)  # more rows than the memory fit: eager
    assert _plan().fitted(3).key_for(3, 4) == (GraphKey(4, SHORT), 4)
    assert _plan(cuda_graphs=False).key_for(3, 4) == (None, 4)
    assert _plan(cuda_graphs=False).keys() == ()


def test_no_rows_no_key_and_a_nonsense_context_is_refused():
    assert _plan().key_for(0, 0) == (None, 0)
    # a count gone wrong at serving time, not a configuration value: not a ConfigError, which
    # drivers report as a bad setting before anything starts
    with pytest.raises(EligibilityError, match="longest context 0 of 2 decode rows") as caught:
        _plan().key_for(2, 0)
    assert not isinstance(caught.value, ConfigError) and caught.value.kind == "eligibility"


def test_a_plan_with_one_half_of_the_short_path_is_refused():
    with pytest.raises(ConfigError, match="short path needs a short_context"):
        GraphPlan(buckets=BUCKETS, paths=(DECODE, SHORT))
    with pytest.raises(ConfigError, match="short path needs a short_context"):
        GraphPlan(buckets=BUCKETS, short_context=8)


@pytest.mark.parametrize("kwargs, match", [
    ({"short_context": 0}, "short_context=0 must be a positive integer"),
    ({"short_context": -4}, "short_context=-4 must be a positive integer"),
    ({"short_context": 2.5}, "short_context=2.5 must be a positive integer"),
    ({"short_context": True}, "short_context=True must be a positive integer"),
    ({"short_context": "64"}, "short_context='64' must be a positive integer"),
    ({"short_max_bucket": 0}, "short_max_bucket=0 must be a positive integer"),
    ({"short_max_bucket": None, "short_context": 64}, "short_max_bucket=None must be a positive"),
    ({"short_context": 64, "short_max_bucket": 2, "buckets": (4, 8), "max_batch": 8},
     "short_max_bucket=2 is below the smallest bucket 4"),
])
def test_bad_short_path_settings_are_refused_naming_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match) as caught:
        ProtocolConfig(**kwargs)
    assert "\n" not in str(caught.value)
    assert caught.value.fields[0] in kwargs


def test_the_smallest_valid_short_settings_are_accepted():
    # a cap equal to the smallest bucket keeps that bucket's short graph; a tile of one token
    # is a valid (if useless) short path; the cap defaults to 8 rows in both places
    config = ProtocolConfig(buckets=(1, 2, 4), max_batch=4, short_context=1, short_max_bucket=1)
    assert GraphPlan.from_config(config).key_for(1, 1) == (GraphKey(1, SHORT), 1)
    assert ProtocolConfig().short_max_bucket == 8 == GraphPlan(buckets=(1,)).short_max_bucket
    assert ProtocolConfig(buckets=(4, 8), max_batch=8, short_context=9,
                          short_max_bucket=4).short_max_bucket == 4


def test_each_step_takes_the_path_of_its_longest_decode_row():
    # prompts of 2 and 4 tokens, short_context 6: a step replays the short path exactly while
    # its longest row's position + 1 is at most 6
    config = ProtocolConfig(buckets=(1, 2, 4, 8), max_batch=4, short_context=6)
    reqs = [Request(0, (1, 2), max_tokens=8), Request(1, (1, 2, 3, 4), max_tokens=8)]
    ctrl, workers, _, sent, action = drive(config, reqs)
    assert isinstance(action, Done)
    steps = [c for c in sent if isinstance(c, Step) and c.rows]
    assert steps
    for step in steps:
        longest = max(step.rows.positions) + 1
        assert step.key.path == (SHORT if longest <= 6 else DECODE), (step.seq, longest)
    assert {s.key.path for s in steps} == {SHORT, DECODE}  # both sides of the boundary ran
    for worker in workers:  # captured at startup on every rank, never in serving
        assert GraphKey(2, SHORT) in worker.captured and GraphKey(2) in worker.captured


def test_the_startup_sweep_measures_captures_and_finalizes_the_short_graphs():
    config = ProtocolConfig(buckets=(1, 2, 4), max_batch=4, short_context=16, short_max_bucket=2)
    ctrl, workers, _, sent, action = drive(config, [Request(0, (1, 2), max_tokens=3)])
    assert isinstance(action, Done)
    want = (GraphKey(4), GraphKey(2), GraphKey(2, SHORT), GraphKey(1), GraphKey(1, SHORT))
    assert ctrl.plan.keys() == want
    measured = [c for c in sent if isinstance(c, MeasureGraphs)]
    assert measured and measured[-1].keys == want
    assert all(w.captured == set(want) for w in workers)
    # the reserve covers every retained graph, the short ones included (100 bytes each)
    assert ctrl.memory.graph_reserve_bytes == 100 * len(want)
