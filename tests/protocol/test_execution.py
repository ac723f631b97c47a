"""The reference driver (`protocol.execution`) and typed dispatch: commands reach worker handlers
and ops reach backend methods by `match` on their types; errors are data (kind, invariant)."""

from dataclasses import dataclass

import pytest

from protocol.backend import SYNC, Backend, LaunchGraph, Op, Record, perform
from protocol.commands import AllocateKV, Capture, Command, Launch, Warmup
from protocol.config import ProtocolConfig
from protocol.eligibility import GraphPlan
from protocol.errors import ProtocolError, RankFailure, SlotError
from protocol.execution import CommandRun, run_command
from protocol.invariants import check_trace
from protocol.keys import GraphKey
from protocol.worker import Worker


class LoggingBackend(Backend):
    """Every method logs its call; ``fail`` names a method that raises."""

    def __init__(self, fail=None):
        self.log, self.fail = [], fail

    def _call(self, name, *args):
        self.log.append((name, args))
        if name == self.fail:
            raise RuntimeError(f"boom in {name}")

    def warmup_collective(self, nbytes): self._call("warmup_collective", nbytes)
    def profile_memory(self, rows): self._call("profile_memory", rows); return (10, 1)
    def record(self, key): self._call("record", key)
    def instantiate(self, key): self._call("instantiate", key)
    def upload(self, key): self._call("upload", key)
    def launch(self, key): self._call("launch", key)
    def graph_memory(self): self._call("graph_memory"); return 0
    def free_graphs(self): self._call("free_graphs")
    def allocate_kv(self, pages): self._call("allocate_kv", pages)
    def move_slot(self, src, dst): self._call("move_slot", src, dst)
    def release_slot(self, slot): self._call("release_slot", slot)
    def assign_pages(self, slot, first, pages): self._call("assign_pages", slot, first, pages)
    def prefill(self, admits): self._call("prefill", admits)
    def prepare_replay(self, step): self._call("prepare_replay", step)
    def run_eager(self, step): self._call("run_eager", step)
    def synchronize(self): self._call("synchronize")
    def enqueue_sample(self, step): self._call("enqueue_sample", step)
    def read_tokens(self, step): self._call("read_tokens", step); return {}
    def mark_step(self, seq): self._call("mark_step", seq)
    def await_step(self, seq): self._call("await_step", seq)
    def destroy_communicator(self): self._call("destroy_communicator")


def worker(rank=0):
    """A rank's worker whose KV cache is allocated, so it may capture."""
    config = ProtocolConfig(buckets=(1, 2), max_batch=2)
    w = Worker(rank, 2, GraphPlan.from_config(config), 2)
    w.reply(AllocateKV(0, pages=4, page_size=16), [None, None])
    return w


def test_run_command_runs_ops_in_order_and_records_the_trace():
    w, backend, events = worker(), LoggingBackend(), []
    reply = run_command(w, backend, Capture(3, GraphKey(2)), events.append)
    assert reply.ok and GraphKey(2) in w.uploaded
    assert [n for n, _ in backend.log] == ["record", "instantiate", "upload", "synchronize"]
    assert [(e.kind, e.what) for e in events] == [("op", "record"), ("op", "instantiate"),
                                                  ("op", "upload"), ("op", "synchronize"),
                                                  ("reply", "Reply")]
    assert events[0].detail == "decode@2" and all(e.seq == 3 and e.rank == 0 for e in events)


def test_a_raising_op_poisons_the_worker_with_a_failed_reply():
    w, events = worker(), []
    reply = run_command(w, LoggingBackend(fail="instantiate"), Capture(0, GraphKey(1)), events.append)
    assert not reply.ok and "boom in instantiate" in reply.error and reply.error_kind == "error"
    assert [(e.what, e.ok) for e in events][-2:] == [("instantiate", False), ("Reply", False)]
    refused = run_command(w, LoggingBackend(), Warmup(1, (8,)))
    assert not refused.ok and "poisoned" in refused.error


def test_a_refused_command_carries_its_kind_and_invariant():
    w = worker()
    reply = run_command(w, LoggingBackend(), Launch(0, GraphKey(1)))
    assert not reply.ok and reply.error_kind == "eligibility"
    slot = SlotError("slot 3 holds nothing")
    assert slot.kind == "slot" and slot.invariant == "I8"
    failure = RankFailure("x", (1,), (), {1: "oops"}, kinds={1: "oom"}, invariants={1: "I9"}, step=4)
    assert (failure.kind, failure.invariant, failure.rank, failure.step) == ("oom", "I9", 1, 4)


def test_sync_after_inserts_a_synchronize_whose_result_is_not_a_worker_result():
    w = worker()
    w.uploaded.add(GraphKey(1))
    run = CommandRun(w, Launch(0, GraphKey(1)), sync_after=(LaunchGraph,))
    seen = []
    while run.op is not None:
        seen.append(run.op.name)
        run.done("r")
    assert seen == ["launch", "synchronize", "synchronize"] and run.results == ["r", "r"]


@dataclass(frozen=True)
class Odd(Command):
    """A command type the protocol does not know."""


@dataclass(frozen=True)
class Custom(Op):
    """An op type no backend knows."""


def test_unknown_command_and_op_types_are_refused_by_type():
    with pytest.raises(ProtocolError, match="no handler for Odd"):
        worker().ops_for(Odd(0))
    with pytest.raises(ProtocolError, match="has no op 'op' \\(Custom\\)"):
        perform(LoggingBackend(), Custom())
    assert perform(LoggingBackend(), Record(GraphKey(1))) is None
    assert str(Record(GraphKey(4))) == "record(decode@4)" and SYNC.args == ()


def test_trace_violations_are_records_with_rank_and_step():
    from protocol.trace import TraceEvent as E
    violations = check_trace([E("rank1", "op", "launch", 5, 1, "decode@8")])
    assert violations and violations[0].invariant == "I4"
    assert (violations[0].rank, violations[0].step) == (1, 5)
