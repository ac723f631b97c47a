"""Requests as the scheduler sees them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ConfigError, is_int, shown


@dataclass(frozen=True)
class Request:
    """A generation request.

    Attributes:
        request_id: unique non-negative id.
        prompt: prompt token ids (at least one).
        max_tokens: new tokens to generate (>= 1), the first from prefill.
        stop_token_ids: tokens that end the request (the stop token is kept in the output).
        params: opaque engine payload (sampling parameters, seed) carried in the request's
            `Admit`; the protocol never reads it.
    """

    request_id: int
    prompt: tuple[int, ...]
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    params: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        """Raises ConfigError, one line naming the field and its value: a request the
        controller accepted with a list or str prompt, a float or negative token id, or an
        int as its stop tokens failed later inside a step, with the controller's tables half
        updated (a fresh engine author's finding)."""
        if not _token_id(self.request_id):
            raise ConfigError(f"request_id={shown(self.request_id)} must be a non-negative "
                              "integer")
        where = f"request {self.request_id}"
        if not isinstance(self.prompt, tuple):
            raise ConfigError(f"{where}: prompt={shown(self.prompt)} must be a tuple of token ids")
        if len(self.prompt) == 0:
            raise ConfigError(f"{where}: prompt is empty")
        _check_ids(where, "prompt token id", self.prompt)
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"{where}: max_tokens={shown(self.max_tokens)} must be an integer "
                              ">= 1")
        if not isinstance(self.stop_token_ids, frozenset):
            raise ConfigError(f"{where}: stop_token_ids={shown(self.stop_token_ids)} must be a "
                              "frozenset of token ids")
        _check_ids(where, "stop token id", self.stop_token_ids)


def _check_ids(where: str, what: str, ids) -> None:
    """Raises ConfigError naming the first of ``ids`` that is no non-negative int; the common
    case, all good, in C-level passes (a 512-token prompt in about 20 us)."""
    if ids and (set(map(type, ids)) != {int} or min(ids) < 0):
        bad = next(t for t in ids if not _token_id(t))
        raise ConfigError(f"{where}: {what} {shown(bad)} must be a non-negative integer")


def _token_id(value) -> bool:
    """Whether ``value`` is a non-negative int (not a bool)."""
    return is_int(value) and value >= 0
