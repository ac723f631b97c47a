"""I8: scheduler-owned dense slots with swap-remove compaction, applied with assertions."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.commands import Admit, Retire, SlotMove
from protocol.errors import SlotError
from protocol.slots import SlotMap, SlotTable


def test_single_retire_is_swap_remove():
    table = SlotTable(8)
    for r in (10, 11, 12, 13):
        table.admit(r)
    retires, moves = table.retire([11])
    assert retires == (Retire(11, 1),)
    assert moves == (SlotMove(13, 3, 1),)
    assert table.requests() == (10, 13, 12)


def test_retiring_the_tail_moves_nothing():
    table = SlotTable(4)
    for r in (1, 2, 3):
        table.admit(r)
    _, moves = table.retire([3])
    assert moves == ()
    assert table.requests() == (1, 2)


def test_admit_errors():
    table = SlotTable(1)
    table.admit(5)
    with pytest.raises(SlotError, match="request 5 already holds slot 0"):
        table.admit(5)
    with pytest.raises(SlotError, match="no free slot for request 6"):
        table.admit(6)
    with pytest.raises(SlotError, match="request 7 holds no slot"):
        table.retire([7])
    with pytest.raises(SlotError, match="capacity 0"):
        SlotTable(0)


def test_slot_map_assertions_poison_on_mismatch():
    slots = SlotMap(4)
    slots.admit(Admit(1, 0, (1,)))
    slots.admit(Admit(2, 1, (1,)))
    with pytest.raises(SlotError, match="retire of request 9 from slot 0, but the slot holds 1"):
        slots.retire(Retire(9, 0))
    with pytest.raises(SlotError, match="move of request 2 into slot 0, which still holds request 1"):
        slots.move(SlotMove(2, 1, 0))
    with pytest.raises(SlotError, match="next dense slot is 2"):
        slots.admit(Admit(3, 3, (1,)))
    with pytest.raises(SlotError, match="move of request 5 from slot 1, but the slot holds 2"):
        slots.move(SlotMove(5, 1, 0))


def test_padding_slot_is_reserved_past_capacity():
    assert SlotTable(16).padding_slot == 16


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=80))
def test_any_admit_retire_sequence_keeps_rank_maps_identical_and_dense(ops):
    """Property (c): every rank's slot map equals the scheduler's and stays dense; each live
    request's per-slot state follows it through every move."""
    table = SlotTable(8)
    ranks = [SlotMap(8), SlotMap(8)]
    state = [dict(), dict()]  # per rank: slot -> request whose state the slot holds
    next_id = 0
    for admit, pick in ops:
        live = table.requests()
        if admit and len(live) < 8:
            a = table.admit(next_id)
            for m, s in zip(ranks, state):
                m.admit(a)
                s[a.slot] = next_id
            next_id += 1
        elif live:
            retires, moves = table.retire([live[pick % len(live)]])
            for m, s in zip(ranks, state):
                for r in retires:
                    m.retire(r)
                    del s[r.slot]
                for mv in moves:
                    m.move(mv)
                    s[mv.dst] = s.pop(mv.src)
        want = dict(enumerate(table.requests()))
        for m, s in zip(ranks, state):
            assert m.slots == want
            m.check_dense()
            assert s == want


def test_multi_retire_compaction_fills_holes_below_new_length():
    table = SlotTable(8)
    for r in range(6):
        table.admit(r)
    retires, moves = table.retire([0, 2, 5])
    assert {m.dst for m in moves} <= {0, 2}
    assert all(m.src >= 3 for m in moves)
    assert sorted(table.requests()) == [1, 3, 4]


def test_a_worker_refuses_an_admission_past_its_capacity():
    # two decode slots, both held: the next dense slot would be 2, the padding slot
    slots = SlotMap(2)
    slots.admit(Admit(1, 0, (1,)))
    slots.admit(Admit(2, 1, (1,)))
    with pytest.raises(SlotError, match="admit of request 3 into slot 2 past capacity 2"):
        slots.admit(Admit(3, 2, (1,)))
    assert slots.fingerprint() == ((0, 1), (1, 2))


@pytest.mark.parametrize("held", [{1: 7}, {0: 7, 2: 8}, {0: 7, 1: 8, 3: 9}])
def test_check_dense_names_a_hole_in_the_occupied_slots(held):
    slots = SlotMap(4)
    slots.slots.update(held)
    with pytest.raises(SlotError, match=re.escape(f"not dense: occupied {sorted(held)}")):
        slots.check_dense()


def test_check_dense_accepts_dense_slots_beside_the_chunk_slot():
    slots = SlotMap(4)
    slots.slots.update({0: 7, 1: 8, slots.chunk_slot: 9})
    slots.check_dense()
    slots.slots.update({2: 10})
    slots.check_dense()
