"""Argument types shared by the engine's subcommands."""

from __future__ import annotations

import argparse

# Every seed is 64 bits wide: `torch.Generator.manual_seed` takes [0, 2**64) (make-model's
# weights, bench's weights and inputs) and a request's sampling seed keys a 64-bit Philox key
# (generate). One range for all three subcommands, so a seed one accepts the others accept.
SEED_LIMIT = 2**64


def seed(text: str) -> int:
    """A 64-bit seed: an integer in [0, 2**64) (`SEED_LIMIT`); argparse type for ``--seed``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 2**64)")
    return value
