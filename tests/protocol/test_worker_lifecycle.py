"""The worker's lifecycle rule (`Worker.check_lifecycle`): one KV allocation, before any capture
(I15), no startup
command once serving (I3), nothing after Teardown; the commands of a normal startup pass."""

import pytest

from protocol.commands import (AllocateKV, Capture, Finalize, Launch, MeasureGraphs,
                               ProfileMemory, Step, Teardown, Warmup)
from protocol.config import ProtocolConfig
from protocol.eligibility import GraphPlan
from protocol.errors import ProtocolError
from protocol.keys import GraphKey
from protocol.worker import STARTUP_COMMANDS, Worker
from tests.protocol.driver import drive

CONFIG = ProtocolConfig(max_batch=4, world_size=2, buckets=(1, 2, 4))


def _worker() -> Worker:
    return Worker(0, 2, GraphPlan.from_config(CONFIG), CONFIG.max_batch)


def _one_of_each(seq: int) -> list:
    key = GraphKey(1)
    return [Warmup(seq, (64,)), ProfileMemory(seq, 4), MeasureGraphs(seq, (key,)),
            AllocateKV(seq, 8, None, 4), Capture(seq, key), Launch(seq, key), Finalize(seq, ())]


def test_every_startup_command_type_is_listed():
    assert {type(c) for c in _one_of_each(0)} == set(STARTUP_COMMANDS)


@pytest.mark.parametrize("command", _one_of_each(7), ids=lambda c: type(c).__name__)
def test_a_serving_rank_refuses_every_startup_command(command):
    w = _worker()
    w.reply(AllocateKV(0, 8, None, 4), [None, None])
    w.reply(Finalize(1, ()), [0, None])
    with pytest.raises(ProtocolError) as info:
        w.ops_for(command)
    assert info.value.invariant == ("I15" if isinstance(command, AllocateKV) else "I3")
    assert f"{type(command).__name__} (command 7)" in str(info.value)
    assert "rank 0" in str(info.value)


def test_the_kv_cache_is_allocated_once_even_during_startup():
    w = _worker()
    assert w.ops_for(AllocateKV(0, 8, None, 4))
    w.reply(AllocateKV(0, 8, None, 4), [None, None])
    with pytest.raises(ProtocolError, match="allocated already") as info:
        w.ops_for(AllocateKV(1, 8, None, 4))
    assert info.value.invariant == "I15"
    assert w.pages.num_pages == 8  # the first allocation's page map is kept


def test_a_capture_before_the_kv_cache_is_allocated_is_refused():
    """A serving graph must capture the KV cache that serves, not the placeholder the
    measurement graphs read; MeasureGraphs itself runs before AllocateKV."""
    w = _worker()
    assert w.ops_for(MeasureGraphs(0, (GraphKey(1),)))
    with pytest.raises(ProtocolError, match=r"Capture of decode@2 \(command 1\) before "
                       r"AllocateKV") as info:
        w.ops_for(Capture(1, GraphKey(2)))
    assert info.value.invariant == "I15" and not w.uploaded
    w.reply(AllocateKV(2, 8, None, 4), [None, None])
    assert [op.name for op in w.ops_for(Capture(3, GraphKey(2)))][0] == "record"


def test_before_finalize_the_startup_commands_run():
    w = _worker()
    for command in _one_of_each(0)[:-1]:
        assert w.ops_for(command), type(command).__name__
        if isinstance(command, (AllocateKV, Capture)):  # what Launch and a 2nd AllocateKV read
            w.reply(command, [None] * 4)


@pytest.mark.parametrize("command", _one_of_each(3) + [Step(3), Teardown(3)],
                         ids=lambda c: type(c).__name__)
def test_a_torn_down_rank_runs_nothing(command):
    w = _worker()
    w.ops_for(Teardown(2))
    w.reply(Teardown(2), [None, None, None])
    with pytest.raises(ProtocolError, match=r"after Teardown; a torn-down rank runs nothing") as info:
        w.ops_for(command)
    assert info.value.invariant is None


def test_the_correct_controller_never_meets_the_rule():
    """A whole correct run (startup, serving, teardown) on two ranks passes the rule."""
    from protocol.controller import Done
    from protocol.requests import Request
    requests = [Request(rid, prompt=(1, 2, 3), max_tokens=3) for rid in range(3)]
    ctrl, workers, _, sent, action = drive(CONFIG, requests)
    assert isinstance(action, Done)
    assert any(isinstance(c, Step) for c in sent)
    assert all(w.torn_down and w.poisoned is None for w in workers)
