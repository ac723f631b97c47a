"""Argument types shared by the engine's subcommands."""

from __future__ import annotations

import argparse
import re

from engine.seeds import SEED_LIMIT

SHOWN_CHARS = 32
"""Most characters of a bad value an error line repeats."""


def seed(text: str) -> int:
    """A 64-bit seed: an integer in [0, 2**64) (`SEED_LIMIT`); argparse type for ``--seed``."""
    shown = text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}..."
    digits = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]+", digits):
        raise argparse.ArgumentTypeError(f"{shown!r} is not an integer")
    # a number of more significant digits than 2**64's 20 is outside, whatever they are (and
    # int() of thousands of digits refuses)
    value = int(digits) if len(digits.lstrip("+-").lstrip("0")) <= 20 else SEED_LIMIT
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{shown.strip()} is outside [0, 2**64)")
    return value
