"""Graph keys: what one captured CUDA graph is for."""

from __future__ import annotations

from dataclasses import dataclass

DECODE = "decode"
"""The attention path of a decode-only step (one new token per row)."""


@dataclass(frozen=True, order=True)
class GraphKey:
    """Identity of one captured graph: (bucket, attention path).

    Attributes:
        bucket: padded batch size in rows (int, one of the configured decode buckets).
        path: attention path name; only ``"decode"`` is captured today.
    """

    bucket: int
    path: str = DECODE

    def __post_init__(self) -> None:
        # a key is hashed at every graph lookup and printed in every trace event of its ops
        # (about 1,300 and 560 times in one simulated run of the default sweep), and the plan
        # hands out the same few keys throughout: both are computed once per key
        object.__setattr__(self, "_hash", hash((self.bucket, self.path)))
        object.__setattr__(self, "_text", f"{self.path}@{self.bucket}")

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return self._text

    def __reduce__(self):
        # rebuilt from its fields: another process hashes the path string differently
        return (self.__class__, (self.bucket, self.path))
