"""Argument types shared by the engine's subcommands."""

from __future__ import annotations

import argparse

from lockstep import args


def seed(text: str) -> int:
    """A 64-bit seed: an integer in [0, 2**64) (`lockstep.args.seed`); argparse type for
    ``--seed``."""
    try:
        return args.seed(text)
    except ValueError as exc:  # argparse words a plain ValueError as "invalid seed value"
        raise argparse.ArgumentTypeError(str(exc)) from None
