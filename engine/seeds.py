"""The one seed range of the engine's tools, and seeds derived from a user's seed.

Every seed is 64 bits wide: `torch.Generator.manual_seed` takes [0, 2**64) (make-model's
weights, bench's weights and inputs) and a request's sampling seed keys a 64-bit Philox key
(`engine.sampling`). One range everywhere, so a seed one subcommand accepts the others accept.
"""

from __future__ import annotations

from lockstep.args import SEED_LIMIT

__all__ = ["SEED_LIMIT", "derived_seed"]


def derived_seed(seed: int, offset: int) -> int:
    """The seed ``seed + offset`` wrapped into [0, SEED_LIMIT): a stream of its own (bench's
    inputs, a workload's n-th request, make-model's k-th tensor) for every seed in range, the
    largest included. Unchanged wherever the sum is already in range."""
    return (seed + offset) % SEED_LIMIT
