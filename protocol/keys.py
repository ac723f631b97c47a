"""Graph keys: what one captured CUDA graph is for."""

from __future__ import annotations

from dataclasses import dataclass

DECODE = "decode"
"""The attention path of a decode-only step (one new token per row): split-KV attention over
every cached token of each row, however long its context."""

SHORT = "decode-short"
"""The short-context decode path: decode rows whose every context -- the tokens a row attends
over, the one this step writes included (position + 1) -- fits ``ProtocolConfig.short_context``
tokens. Its attention is fused into the o_proj GEMM and reads at most ``short_context`` cached
tokens per row (one tile, no loop), so a row with a longer context replayed on it silently loses
tokens; the controller chooses it for a whole step from its own count (`GraphPlan.key_for`)."""


@dataclass(frozen=True, order=True)
class GraphKey:
    """Identity of one captured graph: (bucket, attention path).

    Attributes:
        bucket: padded batch size in rows (int, one of the configured decode buckets).
        path: attention path name: `DECODE` (``"decode"``), or `SHORT` (``"decode-short"``)
            where the configuration turns the short-context path on.
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
