"""Requests as the scheduler sees them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ConfigError


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
        if not isinstance(self.request_id, int) or self.request_id < 0:
            raise ConfigError(f"request_id={self.request_id!r} must be a non-negative integer")
        if len(self.prompt) == 0:
            raise ConfigError(f"request {self.request_id}: prompt is empty")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"request {self.request_id}: max_tokens={self.max_tokens!r} must be >= 1")
