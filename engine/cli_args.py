"""Argument types shared by the engine's subcommands."""

from __future__ import annotations

import argparse


def seed(text: str) -> int:
    """A seed torch accepts: an integer in [0, 2**63); argparse type for ``--seed``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 2**63)")
    return value
