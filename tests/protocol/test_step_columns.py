"""A step's rows as columns (issue 12 item 4): the controller's slot-aligned columns and
calendars must give the commands and outputs the per-row rules define."""

import pickle

import pytest
from hypothesis import given, settings, strategies as st

from protocol.commands import DecodeRow, DecodeRows, Step
from protocol.config import ProtocolConfig
from protocol.controller import Done
from protocol.pages import pages_for
from protocol.requests import Request
from tests.protocol.driver import PAGE_BYTES, PagedBackend, drive

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8, kv_page_bytes=PAGE_BYTES, page_size=4)


def test_rows_are_columns_that_iterate_as_records_and_survive_pickling():
    rows = DecodeRows((7, 9), (3, 4), (10, 11))
    assert len(rows) == 2 and bool(rows) and not DecodeRows()
    assert list(rows) == [DecodeRow(0, 7, 3, 10), DecodeRow(1, 9, 4, 11)]
    assert rows[1] == DecodeRow(1, 9, 4, 11) and rows[-1] == rows[1]
    step = Step(3, rows=(DecodeRow(0, 7, 3, 10), DecodeRow(1, 9, 4, 11)), bucket=2)
    assert step.rows == rows  # records given to a step become columns
    assert pickle.loads(pickle.dumps(step)) == step and hash(step) == hash(Step(3, rows=rows,
                                                                                bucket=2))


class RecordingBackend(PagedBackend):
    """A paged fake rank that records, at each step's sampling, how many pages each slot's
    page-table row holds (what the device would read)."""

    def __init__(self, rank, pages):
        super().__init__(rank, pages)
        self.held: list[dict[int, int]] = []

    def run(self, op):
        if op.name == "read_tokens":
            self.held.append({slot: len(row) for slot, row in self.table.items()})
        return super().run(op)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=8),
       stops=st.lists(st.frozensets(st.integers(0, 96), max_size=30), min_size=8, max_size=8),
       pages=st.integers(6, 24))
def test_outputs_end_by_length_or_first_stop_and_pages_grow_exactly_on_crossing(shapes, stops,
                                                                               pages):
    requests = [Request(i, tuple(range(10 + i, 10 + i + p)), max_tokens=m,
                        stop_token_ids=stops[i])
                for i, (p, m) in enumerate(shapes)]
    backend = RecordingBackend(0, pages)
    ctrl, _, _, sent, action = drive(ProtocolConfig(world_size=1, **SMALL), requests,
                                     backends=[backend], pages_per_seq=5)
    assert isinstance(action, Done), action
    for request in requests:
        out = ctrl.outputs[request.request_id]
        hits = [i for i, t in enumerate(out) if t in request.stop_token_ids]
        if hits:
            assert hits == [len(out) - 1], (request, out)  # ends at its first stop token
        else:
            assert len(out) == request.max_tokens, (request, out)
    steps = [s for s in sent if isinstance(s, Step) and (s.rows or s.admits)]
    assert len(steps) == len(backend.held)
    for step, held in zip(steps, backend.held):
        live = len(step.rows) + len(step.admits)
        assert sorted(s for s, n in held.items() if n) == list(range(live)), (step, held)
        for row in step.rows:  # a row holds exactly the pages of the tokens written so far
            assert held[row.slot] == pages_for(row.position + 1, 4), (step, held)
        for admit in step.admits:
            assert held[admit.slot] == pages_for(len(admit.prompt), 4), (step, held)


def test_a_stop_token_ends_only_the_request_that_stops_on_it():
    requests = [Request(0, (1, 2), max_tokens=5, stop_token_ids=frozenset({7})),
                Request(1, (3, 4), max_tokens=5)]
    ctrl, _, _, _, action = drive(ProtocolConfig(world_size=1, **SMALL), requests,
                                  pages_per_seq=4)
    assert isinstance(action, Done)
    assert ctrl.outputs == {0: [7], 1: [7, 7, 7, 7, 7]}  # the fake rank samples 7 every time


def test_a_stop_token_sampled_by_neighbouring_slots_ends_each_request_that_stops_on_it():
    # the fake rank samples 7 in every slot: requests 0, 1, 2 and 4 stop on it, 3 does not
    requests = [Request(i, (1, 2 + i), max_tokens=4,
                        stop_token_ids=frozenset() if i == 3 else frozenset({7}))
                for i in range(5)]
    ctrl, _, _, _, action = drive(ProtocolConfig(world_size=1, **SMALL), requests,
                                  pages_per_seq=4)
    assert isinstance(action, Done)
    assert ctrl.outputs == {0: [7], 1: [7], 2: [7], 3: [7, 7, 7, 7], 4: [7]}


def test_calendars_are_empty_once_every_request_retired():
    # some requests stop on 7 (the fake rank samples 7: they end on it), some on tokens that
    # never come (they end by length), some on none: no stop-token count outlives its request
    stops = (frozenset(), frozenset({7}), frozenset({3, 5}), frozenset({5, 7}))
    requests = [Request(i, tuple(range(1, 2 + i)), max_tokens=1 + i % 4,
                        stop_token_ids=stops[i % 3 + i // 6]) for i in range(12)]
    ctrl, _, _, _, action = drive(ProtocolConfig(world_size=1, **SMALL), requests,
                                  pages_per_seq=4)
    assert isinstance(action, Done)
    assert not any(ctrl._grow_at.values()) and not any(ctrl._finish_at.values())
    assert ctrl._due == {} and ctrl._live == {} and ctrl._stops == {}
    assert ctrl._tokens == ctrl._positions == ctrl._outs == []


@pytest.mark.parametrize("n", [1, 5])
def test_rows_are_built_from_the_columns_in_slot_order(n):
    requests = [Request(i, (1 + i,) * (3 + i), max_tokens=3) for i in range(n)]
    _, _, _, sent, _ = drive(ProtocolConfig(world_size=1, **SMALL), requests, pages_per_seq=4)
    decode = [s for s in sent if isinstance(s, Step) and s.rows]
    assert decode and all(s.rows.request_ids == tuple(range(n)) for s in decode)
    assert decode[0].rows.positions == tuple(3 + i for i in range(n))
    assert decode[1].rows.positions == tuple(4 + i for i in range(n))
    assert decode[0].rows.tokens == (7,) * n  # each request's last sampled token
