"""Argument text shared by the simulator's and the engine's commands: how much of a bad value
an error line repeats, the most digits an integer option takes, and the one seed range and its
parser."""

from __future__ import annotations

import re

from protocol.errors import shown

SHOWN_CHARS = 32
"""Most characters of a bad value an error line repeats."""

MAX_DIGITS = 20
"""Most significant digits of an integer option: 2**64 has 20, and no option takes more. A
value of thousands of digits was echoed whole, and past 4,300 digits int() refuses it as "not an
integer" (fresh users' findings)."""

SEED_LIMIT = 2**64
"""Every seed a command takes is in [0, SEED_LIMIT): 64 bits, what `torch.Generator.manual_seed`
and a 64-bit Philox key take."""


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text``, or its first ``limit`` - 3 characters and "..." when it is longer than
    ``limit`` (SHOWN_CHARS unless a message wants more of its value)."""
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def one_line_repr(value, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` on one line (the rows of an array's repr joined by single spaces),
    `clipped` to ``limit`` characters: for an error line that repeats a value of any type.

    Spelt so, not as a format spec such as ``{value!r:.60}``, which cut without a mark (a reader
    could not tell the value was cut) and kept the line breaks of a numpy array's or a tensor's
    repr, so a bad-input error ran over several lines. ``limit`` is SHOWN_CHARS unless a
    message wants more of its value (a fault's fields, a list of pairs); it must be at least 4,
    room for one character and the "...". An integer too long for `repr` (past
    ``sys.get_int_max_str_digits()``, 4,300 digits by default, where repr raises ValueError)
    is described by its length. The same as the protocol's `protocol.errors.shown`, which it is.
    """
    return shown(value, limit)


_SEED = re.compile(r"[+-]?[0-9]+", re.ASCII)
"""A seed as the engine has always spelt one: a sign and ASCII digits, no underscores; every
integer option of `lockstep check` is spelt so too (`integer`)."""

_NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?))",
                     re.ASCII)
"""A decimal number in ASCII: digits with an optional point and exponent, no underscores; or
``inf``, which a caller's range check then names (``nan`` is not a number)."""


def too_many_digits(text: str) -> bool:
    """Whether ``text`` (stripped) is an integer spelt as every integer option spells one
    (`_SEED`: no underscores) of more than MAX_DIGITS significant digits: above every bound of
    every option, so refused unparsed. Anything else is left to the parser, which names it
    "not an integer"."""
    digits = text.strip()
    return (_SEED.fullmatch(digits) is not None
            and len(digits.lstrip("+-").lstrip("0")) > MAX_DIGITS)


def integer(text: str) -> int:
    """An integer option's value spelt as a seed is (`_SEED`): int() alone also took "1_0" and
    other scripts' digits ("\u0662" for 2), which the seeds refused (a fresh user's finding).

    Raises:
        ValueError: "'<text>' is not an integer" (clipped).
    """
    return int(_spelt(text, _SEED, "an integer"))


def option_integer(text: str) -> int:
    """An integer option's value: `integer`, with a value of more than MAX_DIGITS significant
    digits refused unparsed (int() of thousands of digits refuses as "not an integer" and an
    error line would repeat them all).

    Raises:
        ValueError: "'<text>' is not an integer", or "<text> has more than 20 digits, above any
            value this option takes" (clipped).
    """
    digits = _spelt(text, _SEED, "an integer")
    within_digits(digits)
    return int(digits)


def within_digits(text: str) -> None:
    """Refuses ``text`` if it is an integer of more than MAX_DIGITS significant digits
    (`too_many_digits`).

    Raises:
        ValueError: "<text> has more than 20 digits, above any value this option takes"
            (clipped).
    """
    if too_many_digits(text):
        raise ValueError(f"{clipped(text.strip())} has more than {MAX_DIGITS} digits, above any "
                         "value this option takes")


def number(text: str) -> float:
    """A decimal option's value spelt in ASCII (`_NUMBER`), as float() of it.

    Raises:
        ValueError: "'<text>' is not a number" (clipped).
    """
    return float(_spelt(text, _NUMBER, "a number"))


def _spelt(text: str, pattern: re.Pattern, what: str) -> str:
    """``text`` stripped, if ``pattern`` spells all of it; else ValueError naming it."""
    digits = text.strip()
    if pattern.fullmatch(digits) is None:
        raise ValueError(f"{clipped(text)!r} is not {what}")
    return digits


def seed(text: str) -> int:
    """A seed option's value: an integer spelt as `_SEED`, in [0, SEED_LIMIT).

    Raises:
        ValueError: one line naming the value (clipped): not an integer, or outside the range.
    """
    digits = _spelt(text, _SEED, "an integer")
    value = SEED_LIMIT if too_many_digits(digits) else int(digits)
    if not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{clipped(digits)} is outside [0, 2**64)")
    return value
