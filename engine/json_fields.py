"""A JSON value that one of the project's tools wrote, read back with each field's type checked.

The bench tools read their own --json back (a GEMM sweep's measurements, the step tuner's
records). A file edited by hand or written by something else is refused in one line that names
the field by its path and says what was expected (`results[0].swiglu = 'garbage': expected
true or false`), not in Python's words about the value ("'str' object has no attribute
'items'"), and never accepted with a value that `bool()` or `int()` would bend into shape.
Own code, not jsonschema: these tools run on the GPU machines, whose image names no schema
library among its packages and cannot fetch one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from lockstep.args import one_line_repr

T = TypeVar("T")

SHOWN_CHARS = 60
"""Most characters of a refused value shown in its message: one line, even for a long list
(`lockstep.args.one_line_repr`, whose own default is 32)."""


class FieldError(ValueError):
    """A field that is missing or of the wrong kind; the message is one line naming its path."""


def _shown(value) -> str:
    """``value`` as a refusal repeats it: `lockstep.args.one_line_repr` at SHOWN_CHARS."""
    return one_line_repr(value, SHOWN_CHARS)


@dataclass(frozen=True)
class Field:
    """One value of a JSON document and the path that reaches it ("" for the whole document);
    each accessor returns the value or a child `Field`, or raises `FieldError` naming the path.
    """

    value: object
    path: str = ""

    def refuse(self, expected: str) -> FieldError:
        """The error for this value: "PATH = VALUE: expected EXPECTED"."""
        return FieldError(f"{self.path or 'the top level'} = {_shown(self.value)}: "
                          f"expected {expected}")

    def child_path(self, key: str | int) -> str:
        """The path of the value at `key` (an object's key or a list's index): ".key" where
        the key is a name, "['key']" where it is not ("rows['8']"), "[i]" for an index."""
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        if key.isidentifier():
            return f"{self.path}.{key}" if self.path else key
        return f"{self.path}[{key!r}]"

    def object(self) -> dict:
        if not isinstance(self.value, dict):
            raise self.refuse("an object")
        return self.value

    def __getitem__(self, key: str) -> "Field":
        """The object's field `key`, which must be there."""
        fields = self.object()
        if key not in fields:
            raise FieldError(f"{self.path}: no {key!r} field" if self.path
                             else f"no {key!r} field")
        return Field(fields[key], self.child_path(key))

    def optional(self, key: str) -> "Field | None":
        """The object's field `key`, None where it is absent."""
        return self[key] if key in self.object() else None

    def if_present(self, key: str, check: Callable[["Field"], object],
                   nullable: bool = False) -> None:
        """`check(field)` of the object's field `key` where it is there (and, with
        `nullable`, not null): a field the reader does not need, of its kind where given."""
        field = self.optional(key)
        if field is not None and not (nullable and field.value is None):
            check(field)

    def items(self) -> Iterator[tuple[str, "Field"]]:
        """(key, field) of each of the object's fields, in order."""
        for key, value in self.object().items():
            yield key, Field(value, self.child_path(key))

    def list(self) -> list["Field"]:
        if not isinstance(self.value, list):
            raise self.refuse("a list")
        return [Field(v, self.child_path(i)) for i, v in enumerate(self.value)]

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.refuse("true or false")
        return self.value

    def integer(self, least: int = 1) -> int:
        """An integer >= least (true and 1.0 are not integers here)."""
        if type(self.value) is not int or self.value < least:
            raise self.refuse(f"an integer >= {least}")
        return self.value

    def positive(self) -> float:
        """A positive finite number (a time, a bandwidth): true and "2.5" are not numbers."""
        v = self.value
        # an int past float's range (JSON's 400-digit integer) compares below inf, and float()
        # of it raises OverflowError
        if type(v) not in (int, float) or not 0 < v <= sys.float_info.max:
            raise self.refuse("a positive finite number")
        return float(v)

    def string(self, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(self.value, str) or (choices and self.value not in choices):
            raise self.refuse(f"one of {', '.join(map(repr, choices))}" if choices
                              else "a string")
        return self.value

    def parse(self, read: Callable[[object], T]) -> T:
        """`read(value)`, its ValueError prefixed with this path ("PATH: ...")."""
        try:
            return read(self.value)
        except ValueError as exc:
            raise FieldError(f"{self.path or 'the top level'}: {exc}") from None
