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

    def __str__(self) -> str:
        return f"{self.path}@{self.bucket}"
