"""Argument types shared by the engine's subcommands: the spelling of every integer, number and
seed is `lockstep.args`', as in `lockstep check` (ASCII digits, no underscores)."""

from __future__ import annotations

import argparse
import re

from lockstep import args

_NAN = re.compile(r"[+-]?nan", re.IGNORECASE | re.ASCII)
"""NaN as float() spells it; taken here so that each option's range check names it ("--top-p
nan must be a number in (0, 1]")."""


def _typed(parse, text: str):
    """``parse(text)``, its ValueError as argparse's error (argparse words a plain ValueError as
    "invalid <type> value", repeating the whole text)."""
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def integer(text: str) -> int:
    """An integer option's value (`lockstep.args.option_integer`): int() alone also took "1_0"
    and other scripts' digits ("\u0662" for 2), and echoed a value of thousands of digits whole.

    Raises:
        argparse.ArgumentTypeError: "'<text>' is not an integer" or "... has more than 20
            digits, above any value this option takes" (clipped).
    """
    return _typed(args.option_integer, text)


def number(text: str) -> float:
    """A decimal option's value (`lockstep.args.number`: ASCII, no underscores), or NaN, which
    the option's own range check then names.

    Raises:
        argparse.ArgumentTypeError: "'<text>' is not a number" (clipped).
    """
    if _NAN.fullmatch(text.strip()):
        return float("nan")
    return _typed(args.number, text)


def seed(text: str) -> int:
    """A 64-bit seed: an integer in [0, 2**64) (`lockstep.args.seed`); argparse type for
    ``--seed``."""
    return _typed(args.seed, text)
