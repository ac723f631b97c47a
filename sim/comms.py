"""Communicators: which ranks a collective runs among, and how its calls are numbered.

A world holds several communicators (`Scenario.communicators`): by default the TP group
``"tp"`` (every rank's device, NCCL) and the control group ``"cpu"`` (every rank's host, gloo:
its collectives block the host thread, not a stream). A variant adds more -- a second device
communicator over the same ranks for a second stream, a sub-group of some ranks.

Every device collective names its communicator in its `sim.common.Signature`. Each rank numbers
its calls per communicator (``order``: issue order on that rank) and per pairing channel
(``index``: the n-th collective of the communicator, or the n-th send/receive between one pair
of ranks), so matching and divergence are judged per communicator, and collectives of different
communicators overlap freely. What two collectives of one communicator in flight at once do is
hazard H9 (`sim.hazards.HazardModel.h9_one_in_flight`).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ConfigError


@dataclass(frozen=True)
class Communicator:
    """One communicator of the simulated world.

    Attributes:
        name: how collectives name it (``"tp"``).
        ranks: its member ranks, ascending; None for every rank of the world.
        device: True for a device communicator (NCCL, custom all-reduce: collectives are
            kernels on a stream, H3); False for a host group (gloo: a collective blocks the
            calling host thread until every member's host is in it).
        one_in_flight: its protocol allows one collective in flight at a time even eagerly
            (custom/one-shot all-reduce: sgl-project/sglang #31117). A plain NCCL communicator
            serializes its eager collectives across streams in issue order (NVIDIA/nccl #574)
            and wedges only inside CUDA graphs (ROCm/rccl #2179).
    """

    name: str
    ranks: tuple[int, ...] | None = None
    device: bool = True
    one_in_flight: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"communicator name {self.name!r} must be a non-empty string")
        if self.ranks is not None:
            if len(set(self.ranks)) != len(self.ranks) or len(self.ranks) < 1:
                raise ConfigError(f"communicator {self.name!r}: ranks {self.ranks!r} must be "
                                  "distinct and not empty")
            if tuple(sorted(self.ranks)) != tuple(self.ranks):
                raise ConfigError(f"communicator {self.name!r}: ranks {self.ranks!r} must be "
                                  "ascending")

    def members(self, world_size: int) -> tuple[int, ...]:
        """Its member ranks in a world of ``world_size`` ranks."""
        return tuple(range(world_size)) if self.ranks is None else self.ranks


TP = Communicator("tp")
"""The tensor-parallel device communicator every shipped collective uses."""

CPU = Communicator("cpu", device=False)
"""The control group on the hosts (gloo), for host-side agreement (e.g. data-parallel batch sizes)."""

DEFAULT_COMMUNICATORS = (TP, CPU)


def check_communicators(comms: tuple[Communicator, ...], world_size: int) -> None:
    """Raise ConfigError for a duplicate name or a member rank outside the world."""
    names = [c.name for c in comms]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"communicator {name!r} is defined twice")
    for comm in comms:
        bad = [r for r in comm.members(world_size) if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"communicator {comm.name!r} names rank {bad[0]}, outside world "
                              f"size {world_size}")


def pairing_key(comm: str, op: str, rank: int, peer: int | None) -> tuple:
    """The channel a call is numbered in for matching: the communicator for a collective, the
    (communicator, lower rank, higher rank) pair for a send or receive."""
    if peer is None:
        return (comm,)
    return (comm, min(rank, peer), max(rank, peer))


__all__ = ["Communicator", "TP", "CPU", "DEFAULT_COMMUNICATORS", "check_communicators",
           "pairing_key"]
