"""Scheduler-owned dense decode slots with compaction (I8).

The scheduler (in the controller) owns the slot table: live requests occupy slots 0..n-1, a new
request takes slot n, and a retirement is filled by moving a request from the tail into the hole
(swap-remove). The moves travel inside the step command; workers apply them with occupancy
assertions and never decide a move themselves -- workers that infer moves from their own view end
with slot maps that differ across ranks (pegainfer qwen35 TP design: the scheduler owns slots).
Padding rows of a bucket use the reserved slot ``capacity`` (one past the last real slot).
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.commands import Admit, DecodeRows, Retire, SlotMove
from protocol.errors import SlotError


class SlotTable:
    """The scheduler's slot table: request ids in dense slots 0..n-1.

    Args:
        capacity: number of real slots (the maximum batch); slot ``capacity`` is the reserved
            padding slot.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise SlotError(f"slot capacity {capacity} must be at least 1")
        self.capacity = capacity
        self._slots: list[int] = []

    @property
    def padding_slot(self) -> int:
        """The reserved scratch slot that padding rows of a bucket read and write."""
        return self.capacity

    @property
    def chunk_slot(self) -> int:
        """The reserved slot through which a chunked prefill writes its non-final chunks
        (`protocol.commands.Chunk`): one past the padding slot, outside the dense decode slots,
        so compaction never moves it; its last chunk moves it into a decode slot."""
        return self.capacity + 1

    def __len__(self) -> int:
        return len(self._slots)

    def requests(self) -> tuple[int, ...]:
        """Request ids in slot order."""
        return tuple(self._slots)

    def slot_of(self, request_id: int) -> int:
        """Slot of a live request; raises SlotError if it holds none."""
        try:
            return self._slots.index(request_id)
        except ValueError:
            raise SlotError(f"request {request_id} holds no slot") from None

    def admit(self, request_id: int) -> Admit:
        """Give ``request_id`` slot n; raises SlotError when full or already live."""
        if request_id in self._slots:
            raise SlotError(f"request {request_id} already holds slot {self.slot_of(request_id)}")
        if len(self._slots) >= self.capacity:
            raise SlotError(f"no free slot for request {request_id}: all {self.capacity} are taken")
        self._slots.append(request_id)
        return Admit(request_id=request_id, slot=len(self._slots) - 1, prompt=())

    def retire(self, request_ids: Iterable[int]) -> tuple[tuple[Retire, ...], tuple[SlotMove, ...]]:
        """Retire requests and compact; returns the retirements and the moves that fill holes.

        Survivors beyond the new length move, in ascending slot order, into the holes below it,
        in ascending order; for one retirement this is the classic swap-remove (last into hole).
        Apply retirements first, then moves.
        """
        leaving = list(dict.fromkeys(request_ids))
        retires = tuple(Retire(request_id=r, slot=self.slot_of(r)) for r in leaving)
        gone = {r.slot for r in retires}
        new_len = len(self._slots) - len(gone)
        holes = sorted(s for s in gone if s < new_len)
        movers = [s for s in range(new_len, len(self._slots)) if s not in gone]
        moves = tuple(SlotMove(request_id=self._slots[src], src=src, dst=dst)
                      for src, dst in zip(movers, holes))
        table = list(self._slots)
        for move in moves:
            table[move.dst] = table[move.src]
        self._slots = table[:new_len]
        return retires, moves

    def rows(self, tokens: list[int], positions: list[int]) -> DecodeRows:
        """Decode rows in slot order from slot-aligned columns: ``tokens[i]`` and
        ``positions[i]`` are the next input token and position of the request in slot i."""
        return DecodeRows(tuple(self._slots), tuple(tokens), tuple(positions))


class SlotMap:
    """A worker's copy of the slot occupancy, changed only by the moves a command carries.

    Every change is asserted against the current occupancy; a mismatch raises SlotError, which
    poisons the worker (its slot map no longer matches the scheduler's).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots: dict[int, int] = {}

    @property
    def chunk_slot(self) -> int:
        """The reserved chunk slot (see `SlotTable.chunk_slot`)."""
        return self.capacity + 1

    def decode_slots(self) -> int:
        """Occupied slots other than the chunk slot."""
        return len(self.slots) - (self.chunk_slot in self.slots)

    def chunk(self, chunk) -> None:
        """A non-final chunk of request ``chunk.request_id``: its first (``start`` 0) takes the
        free chunk slot, a later one must find the request there."""
        held = self.slots.get(chunk.slot)
        if chunk.slot != self.chunk_slot:
            raise SlotError(f"chunk of request {chunk.request_id} through slot {chunk.slot}, "
                            f"but the chunk slot is {self.chunk_slot}")
        if chunk.start == 0 and held is None:
            self.slots[chunk.slot] = chunk.request_id
        elif held != chunk.request_id:
            raise SlotError(f"chunk of request {chunk.request_id} at {chunk.start}, but the "
                            f"chunk slot holds {held}")

    def fingerprint(self) -> tuple[tuple[int, int], ...]:
        """Hashable view: sorted (slot, request_id) pairs."""
        return tuple(sorted(self.slots.items()))

    def retire(self, retire: Retire) -> None:
        """Free ``retire.slot``; it must hold ``retire.request_id``."""
        held = self.slots.get(retire.slot)
        if held != retire.request_id:
            raise SlotError(f"retire of request {retire.request_id} from slot {retire.slot}, "
                            f"but the slot holds {held}")
        del self.slots[retire.slot]

    def move(self, move: SlotMove) -> None:
        """Move the request in ``move.src`` to the free slot ``move.dst``."""
        held = self.slots.get(move.src)
        if held != move.request_id:
            raise SlotError(f"move of request {move.request_id} from slot {move.src}, "
                            f"but the slot holds {held}")
        if move.dst in self.slots:
            raise SlotError(f"move of request {move.request_id} into slot {move.dst}, "
                            f"which still holds request {self.slots[move.dst]}")
        self.slots[move.dst] = self.slots.pop(move.src)

    def admit(self, admit: Admit) -> None:
        """Place a new request in ``admit.slot``, which must be the next dense slot. The last
        chunk of a chunked prefill (``start`` > 0) moves the request out of the chunk slot,
        which must hold it."""
        dense = self.decode_slots()
        if admit.slot != dense or admit.slot in self.slots:
            raise SlotError(f"admit of request {admit.request_id} into slot {admit.slot}, "
                            f"but the next dense slot is {dense}")
        if admit.slot >= self.capacity:
            raise SlotError(f"admit of request {admit.request_id} into slot {admit.slot} "
                            f"past capacity {self.capacity}")
        if admit.start:
            held = self.slots.get(self.chunk_slot)
            if held != admit.request_id:
                raise SlotError(f"last chunk of request {admit.request_id} (from {admit.start}) "
                                f"but the chunk slot holds {held}")
            del self.slots[self.chunk_slot]
        self.slots[admit.slot] = admit.request_id

    def check_dense(self) -> None:
        """Occupied slots, the chunk slot aside, must be exactly 0..n-1: n distinct slots
        that hold every one of 0..n-1 are those (a C-level pass, no Python work per slot)."""
        if not all(map(self.slots.__contains__, range(self.decode_slots()))):
            occupied = sorted(s for s in self.slots if s != self.chunk_slot)
            raise SlotError(f"slots are not dense: occupied {occupied}")

    def check_rows(self, rows: DecodeRows, admitted: int = 0) -> None:
        """Row i must be slot i and hold the request the scheduler says; the ``admitted``
        requests of this step take the slots after the rows. One comparison of the step's
        request-id column with this rank's occupancy; the first mismatching row is named."""
        if len(rows) + admitted != self.decode_slots():
            raise SlotError(f"{len(rows)} decode rows and {admitted} admissions for "
                            f"{self.decode_slots()} live slots")
        held = tuple(map(self.slots.get, range(len(rows))))
        if held == rows.request_ids:
            return
        i = next(i for i, (r, h) in enumerate(zip(rows.request_ids, held)) if r != h)
        raise SlotError(f"row {i} names slot {i} request {rows.request_ids[i]}, "
                        f"but slot {i} holds {held[i]}")
