"""Decode buckets and bucket selection by the controller.

A bucket is a padded batch size for which one CUDA graph is captured. The controller -- never
a rank -- maps a batch to its bucket (I2): a rank that picks its bucket from its own batch count
can replay a different graph than its peers (vLLM PR #25906; SGLang #30242 / PR #30450).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from protocol.errors import ConfigError, is_int

DEFAULT_DECODE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 20, 24) + tuple(range(32, 257, 8))
"""pegainfer's 36 Qwen3 decode buckets: 1, 2, 4, 8, 16, 20, 24, then every 8 from 32 to 256."""


def validate_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """Return ``buckets`` as a tuple after checking it is non-empty, positive and strictly ascending.

    Raises:
        ConfigError: naming the first bad entry.
    """
    result = tuple(buckets)
    if not result:
        raise ConfigError("bucket list is empty; give at least one decode bucket")
    for i, b in enumerate(result):
        if not is_int(b) or b <= 0:
            shown = repr(b) if len(repr(b)) <= 32 else f"{repr(b)[:29]}..."  # one line
            raise ConfigError(f"bucket {shown} at position {i} is not a positive integer")
        if i and b <= result[i - 1]:
            raise ConfigError(
                f"buckets must be strictly ascending: {result[i - 1]} then {b} at position {i}")
    return result


def select_bucket(batch: int, buckets: Sequence[int]) -> int:
    """Smallest bucket that holds ``batch`` rows; the rows above ``batch`` are padding.

    Args:
        batch: number of live decode rows (int >= 1).
        buckets: strictly ascending bucket sizes.

    Raises:
        ConfigError: if ``batch`` < 1 or larger than the largest bucket.
    """
    if batch < 1:
        raise ConfigError(f"batch {batch} has no bucket: a decode step needs at least one row")
    i = bisect_left(buckets, batch)
    if i == len(buckets):
        raise ConfigError(f"batch {batch} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
