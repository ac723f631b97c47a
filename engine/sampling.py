"""Sampling parameters and the sampler (rank 0 only).

Each token's randomness comes from a generator seeded with (request seed, output index), so a
request's tokens do not depend on which other requests share its batch, on its slot, or on the
tensor-parallel size: continuous batching gives each request the tokens it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request.

    Attributes:
        max_tokens: new tokens to generate, >= 1 (the first comes from the prefill).
        temperature: 0 for greedy (argmax); otherwise logits are divided by it, > 0.
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        seed: seed of this request's sampling; None picks one per request (recorded in the
            output). Ignored when greedy.
        stop_token_ids: extra tokens that end the request (kept in the output).
        ignore_eos: do not stop at the model's end-of-sequence tokens.
        logprobs: return the log-probability (natural log, of the unmodified model
            distribution) of every generated token.
        return_logits: return the float32 logits [n, vocab] the model produced for every
            generated token (for tests and debugging: large).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    return_logits: bool = False

    def validate(self, vocab_size: int) -> None:
        """Raises RequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise RequestError(f"max_tokens = {self.max_tokens!r}, expected an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 \
                or self.temperature != self.temperature:
            raise RequestError(f"temperature = {self.temperature!r}, expected a number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k = {self.top_k!r}, expected -1, 0 (all) or a positive int")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p = {self.top_p!r}, expected a number in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise RequestError(f"seed = {self.seed!r}, expected None or an integer >= 0")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise RequestError(f"stop token id {t!r} outside the vocabulary [0, {vocab_size})")


def sample(logits, params: SamplingParams, seed: int, index: int):
    """Pick one token from `logits` (float32 [vocab], any device).

    Args:
        seed: the request's seed. index: the output position (0 for the token after the
            prompt); together they seed this token's generator.
    Returns:
        (token id: int, logprob: float | None) -- logprob when params.logprobs.
    """
    import torch

    logits = logits.float()
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        x = logits / params.temperature
        if params.top_k > 0 and params.top_k < x.numel():
            kth = torch.topk(x, params.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # drop a token when the mass before it already reaches top_p (keep at least one)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(0, order, sorted_x)
        probs = torch.softmax(x, dim=-1).cpu()
        g = torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))
        token = int(torch.multinomial(probs, 1, generator=g))
    logprob = None
    if params.logprobs:
        logprob = float(torch.log_softmax(logits, dim=-1)[token])
    return token, logprob
