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


class _Typed:
    """A number with the text it was given as (``text``, stripped), which an error line
    repeats (`shown`). Pickled or copied it is the plain number (``_plain``), so nothing of
    this class reaches a rank; computed with, it is one already."""

    _plain: type

    def __new__(cls, value, text: str):
        self = super().__new__(cls, value)
        self.text = text.strip()
        return self

    def __reduce__(self):
        return self._plain, (self._plain(self),)


class Integer(_Typed, int):
    """An integer option's value as typed: "+007" is not "7" in an error line."""

    _plain = int


class Number(_Typed, float):
    """A number option's value as typed: float() reads "1e308" back as 1e+308, "1e400" as inf
    and "-nan" as nan."""

    _plain = float


def shown(value) -> str:
    """``value`` as an error line repeats it: an option's value as it was typed (clipped), a
    float default as ``:g`` spells it, anything else as str()."""
    if isinstance(value, (Integer, Number)):
        return args.clipped(value.text)
    return f"{value:g}" if isinstance(value, float) else str(value)


def integer(text: str) -> Integer:
    """An integer option's value (`lockstep.args.option_integer`): int() alone also took "1_0"
    and other scripts' digits ("\u0662" for 2), and echoed a value of thousands of digits whole.

    Raises:
        argparse.ArgumentTypeError: "'<text>' is not an integer" or "... has more than 20
            digits, above any value this option takes" (clipped).
    """
    return Integer(_typed(args.option_integer, text), text)


def number(text: str) -> Number:
    """A decimal option's value (`lockstep.args.number`: ASCII, no underscores), or NaN, which
    the option's own range check then names.

    Raises:
        argparse.ArgumentTypeError: "'<text>' is not a number" (clipped).
    """
    if _NAN.fullmatch(text.strip()):
        return Number(float("nan"), text)
    return Number(_typed(args.number, text), text)


def seed(text: str) -> Integer:
    """A 64-bit seed: an integer in [0, 2**64) (`lockstep.args.seed`); argparse type for
    ``--seed``."""
    return Integer(_typed(args.seed, text), text)
