"""The per-rank backend interface: the only way a worker touches its device.

A worker never calls these itself. It returns a list of `Op` for a command; the driver runs each
op against its backend (the simulator's modelled device, or the engine's CUDA/CPU executor) and
hands the results back. That keeps the worker sans-IO: the simulator can interleave ranks between
any two ops, and the engine runs them for real.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from protocol.commands import Admit, Step
from protocol.keys import GraphKey


@dataclass(frozen=True)
class Op:
    """One backend operation: the method ``name`` called with ``args``."""

    name: str
    args: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})"


class Backend(ABC):
    """Device operations of one rank. Every method may raise; the worker then fails the command.

    Host calls may return before their device work is complete (stream semantics); only
    `synchronize` waits for the device, and a worker replies only after it (I1).
    """

    @abstractmethod
    def warmup_collective(self, nbytes: int) -> None:
        """Run one eager all-reduce of ``nbytes`` bytes so the communicator connects that size (I5)."""

    @abstractmethod
    def profile_memory(self, rows: int) -> tuple[int, int]:
        """Eager forward at ``rows`` rows; returns (free bytes, peak activation bytes)."""

    @abstractmethod
    def record(self, key: GraphKey) -> None:
        """Stream-capture one decode step of ``key.bucket`` rows into the shared graph pool."""

    @abstractmethod
    def instantiate(self, key: GraphKey) -> None:
        """Instantiate the recorded graph of ``key`` into an executable graph."""

    @abstractmethod
    def upload(self, key: GraphKey) -> None:
        """Upload the executable graph of ``key`` to the device, so launch does no implicit upload."""

    @abstractmethod
    def launch(self, key: GraphKey) -> None:
        """Enqueue a replay of ``key``; returns before the device finishes."""

    @abstractmethod
    def graph_memory(self) -> int:
        """Bytes held by this rank's graph pool and executable graphs now."""

    @abstractmethod
    def free_graphs(self) -> None:
        """Free every graph this rank holds."""

    @abstractmethod
    def allocate_kv(self, pages: int) -> None:
        """Allocate the paged KV cache (``pages`` pages plus the reserved padding page)."""

    @abstractmethod
    def move_slot(self, src: int, dst: int) -> None:
        """Move per-slot state (page-table row, length) from slot ``src`` to slot ``dst``."""

    @abstractmethod
    def release_slot(self, slot: int) -> None:
        """Forget the KV pages of the request leaving ``slot`` (retired or preempted): its
        page-table row points at the padding page again; the pages return to the controller's
        pool (I14)."""

    @abstractmethod
    def assign_pages(self, slot: int, first_index: int, pages: tuple[int, ...]) -> None:
        """Write ``pages`` into ``slot``'s page-table row from ``first_index`` on (I14). The page
        ids come from the command; the backend never chooses one."""

    @abstractmethod
    def prefill(self, admits: tuple[Admit, ...]) -> None:
        """Enqueue eager prefill of newly admitted requests into their slots."""

    @abstractmethod
    def prepare_replay(self, step: Step) -> None:
        """Write the step's tokens, positions, lengths and tables into the fixed-address buffers (I12)."""

    @abstractmethod
    def run_eager(self, step: Step) -> None:
        """Enqueue the decode rows of ``step`` eagerly (no graph)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until this rank's device work, collectives included, is complete (I1, I11)."""

    @abstractmethod
    def sample(self, step: Step) -> dict[int, int]:
        """Rank 0 only: sample the next token of every admitted and decoded request."""

    @abstractmethod
    def destroy_communicator(self) -> None:
        """Destroy the TP communicator; only after `free_graphs` (I10)."""
