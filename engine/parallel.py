"""The tensor-parallel group as seen from one rank: rank, world size and the two collectives
the model uses.

Collectives are synchronous from the caller's point of view (I11): `all_reduce` returns only
a tensor whose reduction is complete on the current stream (gloo: complete on return; NCCL:
enqueued on the current stream, so every later kernel on that stream runs after it). Nothing
here returns an async work handle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank: this rank, 0 <= rank < world_size.
        world_size: number of ranks; 1 means no collective is ever issued.
        group: the process group the model's collectives use (None: the default group).
    """

    rank: int = 0
    world_size: int = 1
    group: object = None  # torch.distributed group of the model's collectives; None: default

    def shard(self, size: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of `size` (size % world_size == 0)."""
        assert size % self.world_size == 0, (size, self.world_size)
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x):
        """Sum `x` in place over the group; returns `x` with the sum (complete, see module doc)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)  # async_op=False: the result is ready (or stream-ordered)
        return x

    def all_gather_last_dim(self, x):
        """Concatenate every rank's `x` [..., n] along the last dim -> [..., n * world_size]."""
        if self.world_size == 1:
            return x
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup(0, 1)
