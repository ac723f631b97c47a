"""Argument types shared by the engine's subcommands."""

from __future__ import annotations

import argparse
import re

from lockstep.args import SEED_LIMIT, clipped, too_many_digits


def seed(text: str) -> int:
    """A 64-bit seed: an integer in [0, 2**64) (`SEED_LIMIT`); argparse type for ``--seed``."""
    shown = clipped(text)
    digits = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", digits):
        raise argparse.ArgumentTypeError(f"{shown!r} is not an integer")
    # more significant digits than 2**64's 20 is outside, whatever they are
    value = SEED_LIMIT if too_many_digits(digits) else int(digits)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{shown.strip()} is outside [0, 2**64)")
    return value
