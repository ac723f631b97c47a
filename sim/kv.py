"""Modelled device memory: buffers with identity and generation, and the per-slot KV cache.

A `Buffer` is one allocation on one rank: a name (``"kv"``, ``"replay-inputs"``, ``"logits"``),
a generation that every free-and-allocate bumps, and its contents. A graph records the buffers
it captured by (name, generation), as a real graph bakes their addresses in; a replay reads and
writes those captured buffers, live or not, so a replay over a re-allocated buffer computes from
stale memory (and is flagged, I15).

The KV cache holds, per slot and position, the token written there (a token-derived value is
enough). The modelled model's next token is a function of everything the row reads -- its
slot's KV at positions 0..p, or on the short-context path only the first ``short_context`` of
them (`sim.devices.DeviceModel.decode`) -- so a write to the wrong slot, a stale read, a wrong
slot move or a row replayed past the short path's tile changes a token. Slots map to storage through `ModelledKV.rows`, the one place a paged model
would put its page table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PAD_REQUEST = -1
"""Request id of a padding row."""

_MOD = (1 << 61) - 1


def next_token(history: tuple[int, ...] | list[int], vocab: int) -> int:
    """The modelled model: the next token after reading ``history`` (tokens at positions 0..p).

    A polynomial hash, so any change of any position read (wrong slot, stale page, missing
    write) changes the token with probability about 1 - 1/vocab.
    """
    h = 17
    for token in history:
        h = (h * 1000003 + token + 1) % _MOD
    return h % vocab


class ModelledKV:
    """One KV-cache allocation of one rank: slot -> the tokens written at positions 0, 1, ...

    Args:
        slots: number of slots including the scratch slot (the padding rows' slot).
    """

    def __init__(self, slots: int):
        self.slots = slots
        self.rows: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # slot -> tokens its sequence caches (seq_lens)

    def write(self, slot: int, position: int, token: int) -> None:
        """Write ``token`` at ``position`` of ``slot``; positions past the slot's length are
        filled with -1 (never written)."""
        row = self.rows.setdefault(slot, [])
        if position < len(row):
            row[position] = token
        else:
            row.extend([-1] * (position - len(row)))
            row.append(token)

    def read(self, slot: int, upto: int) -> tuple[int, ...]:
        """What an attention read of ``slot`` sees at positions 0..upto (-1: never written)."""
        row = self.rows.get(slot, [])
        return tuple(row[:upto + 1]) + (-1,) * max(0, upto + 1 - len(row))

    def copy(self, src: int, dst: int) -> None:
        """Compaction: ``dst`` gets ``src``'s contents and length."""
        self.rows[dst] = list(self.rows.get(src, []))
        self.lengths[dst] = self.lengths.get(src, 0)

    def fingerprint(self) -> tuple:
        """Hashable contents."""
        return tuple(sorted((s, tuple(row)) for s, row in self.rows.items()))

    def empty_like(self) -> "ModelledKV":
        """A fresh, never-written cache of the same shape."""
        return ModelledKV(self.slots)


@dataclass
class Buffer:
    """One allocation: ``name``, ``generation`` (bumped by every re-allocation), ``data``, and
    ``by``: the command that allocated it, or None for the world's own allocations before
    any command; ``nbytes``: the device memory it takes, where the memory model counts it (the
    KV cache), else 0."""

    name: str
    generation: int
    data: Any = field(default=None, compare=False)
    by: Any = field(default=None, compare=False)
    nbytes: int = field(default=0, compare=False)

    @property
    def ref(self) -> tuple[str, int]:
        """(name, generation): what a graph records when it captures this buffer."""
        return (self.name, self.generation)
