"""Argument text shared by the simulator's and the engine's commands: how much of a bad value
an error line repeats, the most digits an integer option takes, and the one seed range."""

from __future__ import annotations

SHOWN_CHARS = 32
"""Most characters of a bad value an error line repeats."""

MAX_DIGITS = 20
"""Most significant digits of an integer option: 2**64 has 20, and no option takes more. A
value of thousands of digits was echoed whole, and past 4,300 digits int() refuses it as "not an
integer" (fresh users' findings)."""

SEED_LIMIT = 2**64
"""Every seed a command takes is in [0, SEED_LIMIT): 64 bits, what `torch.Generator.manual_seed`
and a 64-bit Philox key take."""


def clipped(text: str) -> str:
    """``text``, or its first SHOWN_CHARS - 3 characters and "..." when it is longer."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}..."


def too_many_digits(text: str) -> bool:
    """Whether ``text`` is an integer (sign, digits, underscores; int()'s spelling) of more than
    MAX_DIGITS significant digits: above every bound of every option, so refused unparsed."""
    digits = text.strip().lstrip("+-")
    return digits.replace("_", "").isdigit() and len(digits.lstrip("0_")) > MAX_DIGITS
