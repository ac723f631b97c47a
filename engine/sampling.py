"""Sampling parameters and the batched on-device sampler (rank 0 only).

Every sampled token is an exponential race (the Gumbel-max trick): the token is
argmax over the kept vocabulary of logits / temperature + Gumbel noise, which draws from
softmax(logits / temperature) restricted to the kept set. The noise of vocabulary entry v for
output index i of a request with seed s is a pure function of (s, i, v): Philox4x32-10
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) keyed by the seed's
two 32-bit halves, counter (v, i, 0, 0). So a request's tokens do not depend on which other
requests share its batch, on its row or slot, or on the tensor-parallel size: continuous
batching gives each request the tokens it gets alone, on CPU and GPU alike.

Three implementations with one meaning:
    `sample_reference`: one request at a time in plain torch; the oracle.
    `sample_batch`: the whole batch in one pass (per-row parameters as tensors). The kept set
        is cut by one threshold per row (top-k, top-p, min-p, each a value on the scaled
        logits); the noisy argmax runs as one Triton kernel on CUDA and as torch ops on CPU.
    `philox_uniform`: the random stream in torch (int64 arithmetic); the Triton kernel
        computes the same bits.
Only the sampled token ids (int32, one per row) need to cross to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import RequestError

try:  # Triton is optional on CPU-only machines.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Philox4x32 constants (Salmon et al. 2011, Random123): multipliers and Weyl key increments.
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request.

    Attributes:
        max_tokens: new tokens to generate, >= 1 (the first comes from the prefill).
        temperature: 0 for greedy (argmax); otherwise logits are multiplied by 1/temperature,
            > 0.
        top_k: keep the k most likely tokens (ties with the k-th kept); 0 or -1 keeps all.
        top_p: keep the most likely tokens until their probability reaches top_p (ties with the
            last kept token kept), in (0, 1].
        min_p: keep tokens whose probability is at least min_p times the most likely one's,
            in [0, 1]; 0 keeps all.
        seed: seed of this request's sampling (any integer >= 0; its value modulo 2**64 keys
            the random stream); None picks one per request (recorded in the output). Ignored
            when greedy.
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
    min_p: float = 0.0
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
                or not math.isfinite(self.temperature):
            raise RequestError(f"temperature = {self.temperature!r}, expected a finite "
                               "number >= 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise RequestError(f"top_k = {self.top_k!r}, expected -1, 0 (all) or a positive int")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p = {self.top_p!r}, expected a number in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p = {self.min_p!r}, expected a number in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or isinstance(self.seed, bool) or self.seed < 0):
            raise RequestError(f"seed = {self.seed!r}, expected None or an integer >= 0")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise RequestError(f"stop token id {t!r} outside the vocabulary [0, {vocab_size})")


def inverse_temperature(temperature: float) -> float:
    """The multiplier of the logits: 1 / temperature, and 1 for greedy (temperature 0)."""
    return 1.0 / temperature if temperature > 0 else 1.0


# -- the random stream ---------------------------------------------------------------------------


def philox_uniform(seed_lo, seed_hi, index, vocab: int):
    """Uniform floats in (0, 1) for every vocabulary entry of each row.

    Args:
        seed_lo, seed_hi: int64 [B], the low and high 32 bits of each row's seed.
        index: int64 [B], each row's output index (0 for the token after the prompt).
        vocab: vocabulary size V.
    Returns:
        float32 [B, V]: ((philox word 0 >> 8) + 0.5) / 2**24, exactly representable.
    """
    import torch

    dev = seed_lo.device
    c0 = torch.arange(vocab, dtype=torch.int64, device=dev)[None, :].expand(len(seed_lo), -1)
    c1 = (index.to(torch.int64) & MASK32)[:, None].expand_as(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = (seed_lo.to(torch.int64) & MASK32)[:, None]
    k1 = (seed_hi.to(torch.int64) & MASK32)[:, None]
    for _ in range(PHILOX_ROUNDS):
        p0 = c0 * PHILOX_M0  # wraps modulo 2**64: the low 64 bits of the 32x32 product
        p1 = c2 * PHILOX_M1
        hi0, lo0 = (p0 >> 32) & MASK32, p0 & MASK32
        hi1, lo1 = (p1 >> 32) & MASK32, p1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return ((c0 >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def gumbel(u):
    """Gumbel(0, 1) noise from uniforms u in (0, 1): -log(-log(u)), float32."""
    import torch

    return -torch.log(-torch.log(u))


def split_seed(seed: int) -> tuple[int, int]:
    """(low 32 bits, high 32 bits) of seed modulo 2**64."""
    seed %= 1 << 64
    return seed & MASK32, seed >> 32


# -- reference: one request at a time -------------------------------------------------------------


def sample_reference(logits, params: SamplingParams, seed: int, index: int):
    """Pick one token from `logits` (float32 [vocab], any device), the oracle of `sample_batch`.

    Args:
        seed: the request's seed. index: the output position (0 for the token after the
            prompt); together they key this token's random stream.
    Returns:
        (token id: int, logprob: float | None) -- logprob when params.logprobs.
    """
    import torch

    logits = logits.float()
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        x = logits * torch.tensor(inverse_temperature(params.temperature), dtype=torch.float32,
                                  device=logits.device)
        keep = torch.ones_like(x, dtype=torch.bool)
        ordered = torch.sort(x, descending=True).values
        if 0 < params.top_k < x.numel():
            keep &= x >= ordered[params.top_k - 1]
        if params.top_p < 1.0:
            kept = ordered.masked_fill(ordered < x[keep].min(), float("-inf"))
            probs = torch.softmax(kept, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs
            m = int((before < params.top_p).sum().clamp(min=1))
            keep &= x >= ordered[m - 1]
        if params.min_p > 0:
            log_min_p = torch.log(torch.tensor(params.min_p, dtype=torch.float32))
            keep &= x >= ordered[0] + log_min_p.to(x.device)
        lo, hi = split_seed(seed)
        dev = logits.device
        u = philox_uniform(torch.tensor([lo], device=dev), torch.tensor([hi], device=dev),
                           torch.tensor([index], device=dev), x.numel())[0]
        score = torch.where(keep, x + gumbel(u), torch.tensor(float("-inf"), device=dev))
        token = int(torch.argmax(score))
    logprob = None
    if params.logprobs:
        logprob = float(torch.log_softmax(logits, dim=-1)[token])
    return token, logprob


# -- batched ------------------------------------------------------------------------------------


@dataclass
class BatchParams:
    """Per-row sampling parameters as tensors on one device (rows in batch order).

    Attributes:
        inv_temp: float32 [B], 1 / temperature (1 for greedy rows).
        noise: float32 [B], 1 for sampled rows, 0 for greedy rows (no noise, no cut).
        top_k: int64 [B], 0 keeps all. top_p: float32 [B]. min_p: float32 [B].
        seed_lo, seed_hi: int64 [B], the seed's 32-bit halves. index: int64 [B] output index.
        any_top_k / any_top_p / any_min_p: host flags (skip the passes nobody needs).
    """

    inv_temp: object
    noise: object
    top_k: object
    top_p: object
    min_p: object
    seed_lo: object
    seed_hi: object
    index: object
    any_top_k: bool = True
    any_top_p: bool = True
    any_min_p: bool = True

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], indices: list[int],
                    device="cpu") -> "BatchParams":
        """Build the tensors of a batch from one SamplingParams, seed and output index per row
        (a host loop over rows: for tests and admission, not for every step)."""
        import torch

        sampled = [p.temperature > 0 for p in params]
        halves = [split_seed(s) for s in seeds]
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            inv_temp=torch.tensor([inverse_temperature(p.temperature) for p in params], **f32),
            noise=torch.tensor([1.0 if s else 0.0 for s in sampled], **f32),
            top_k=torch.tensor([max(p.top_k, 0) if s else 0 for p, s in zip(params, sampled)],
                               **i64),
            top_p=torch.tensor([p.top_p if s else 1.0 for p, s in zip(params, sampled)], **f32),
            min_p=torch.tensor([p.min_p if s else 0.0 for p, s in zip(params, sampled)], **f32),
            seed_lo=torch.tensor([h[0] for h in halves], **i64),
            seed_hi=torch.tensor([h[1] for h in halves], **i64),
            index=torch.tensor(indices, **i64),
            any_top_k=any(s and p.top_k > 0 for p, s in zip(params, sampled)),
            any_top_p=any(s and p.top_p < 1 for p, s in zip(params, sampled)),
            any_min_p=any(s and p.min_p > 0 for p, s in zip(params, sampled)))


def thresholds(x, bp: BatchParams):
    """Per-row cut on the scaled logits x (float32 [B, V]): a token is kept when x >= the cut.

    top-k keeps x >= the k-th largest value; top-p (after top-k) keeps x >= the value of the
    last token needed to reach top_p; min-p keeps x >= max + log(min_p). Returns float32 [B]
    (-inf where nothing is cut). One sort over the rows that ask for top-p, else one topk.
    """
    import torch

    B, V = x.shape
    cut = torch.full((B,), float("-inf"), dtype=torch.float32, device=x.device)
    k = bp.top_k.clamp(max=V)
    if bp.any_top_p:
        ordered = torch.sort(x, dim=-1, descending=True).values
        if bp.any_top_k:
            kth = ordered.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
            cut = torch.where((k > 0) & (k < V), kth, cut)
            ordered = ordered.masked_fill(ordered < cut[:, None], float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        m = (before < bp.top_p[:, None]).sum(dim=-1).clamp(min=1)
        pth = ordered.gather(1, (m - 1)[:, None])[:, 0]
        cut = torch.where(bp.top_p < 1, torch.maximum(cut, pth), cut)
    elif bp.any_top_k:
        kmax = int(k.max())
        kth = torch.topk(x, kmax, dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
        cut = torch.where((k > 0) & (k < V), kth, cut)
    if bp.any_min_p:
        mth = x.max(dim=-1).values + torch.log(bp.min_p)
        cut = torch.where(bp.min_p > 0, torch.maximum(cut, mth), cut)
    return cut


def sample_batch(logits, bp: BatchParams, want_logprobs: bool = False):
    """Sample one token per row of `logits` (float32 [B, V], on the device of `bp`).

    Returns:
        (tokens int32 [B], logprobs float32 [B] or None): logprobs of the chosen tokens under
        the unmodified distribution (log_softmax of logits), when want_logprobs.
    """
    import torch

    B, V = logits.shape
    logits = logits.float()
    if bp.any_top_k or bp.any_top_p or bp.any_min_p:
        cut = thresholds(logits * bp.inv_temp[:, None], bp)
        cut = torch.where(bp.noise > 0, cut, float("-inf"))
    else:
        cut = torch.full((B,), float("-inf"), dtype=torch.float32, device=logits.device)
    if logits.is_cuda and triton is not None:
        tokens = _noisy_argmax_triton(logits, bp, cut)
    else:
        tokens = _noisy_argmax_torch(logits, bp, cut)
    logprobs = None
    if want_logprobs:
        chosen = logits.gather(1, tokens.long()[:, None])[:, 0]
        logprobs = chosen - torch.logsumexp(logits, dim=-1)
    return tokens, logprobs


def _noisy_argmax_torch(logits, bp: BatchParams, cut):
    import torch

    x = logits * bp.inv_temp[:, None]
    g = gumbel(philox_uniform(bp.seed_lo, bp.seed_hi, bp.index, logits.shape[1]))
    score = torch.where(bp.noise[:, None] > 0, x + g, x)
    score = score.masked_fill(x < cut[:, None], float("-inf"))
    return torch.argmax(score, dim=-1).to(torch.int32)


# Vocabulary entries per program of the noisy-argmax kernel: 151,936 / 4096 = 38 programs per
# row, enough to fill the GPU at batch 1 while keeping the cross-chunk reduction small.
ARGMAX_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _noisy_argmax_kernel(x_ptr, inv_t_ptr, noise_ptr, cut_ptr, lo_ptr, hi_ptr, idx_ptr,
                             best_ptr, arg_ptr, stride_x, V, n_chunks,
                             BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        v = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = v < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + v, mask=mask, other=0.0)
        x = x * tl.load(inv_t_ptr + row)
        noise = tl.load(noise_ptr + row)
        cut = tl.load(cut_ptr + row)
        if noise > 0:  # greedy rows skip the random stream
            k0 = (tl.load(lo_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
            k1 = (tl.load(hi_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
            c0 = v.to(tl.uint32)
            c1 = (tl.load(idx_ptr + row) & 0xFFFFFFFF).to(tl.uint32) + tl.zeros_like(c0)
            c2 = tl.zeros_like(c0)
            c3 = tl.zeros_like(c0)
            for _ in tl.static_range(ROUNDS):
                hi0 = tl.umulhi(c0, 0xD2511F53)
                lo0 = c0 * 0xD2511F53
                hi1 = tl.umulhi(c2, 0xCD9E8D57)
                lo1 = c2 * 0xCD9E8D57
                c0 = hi1 ^ c1 ^ k0
                c2 = hi0 ^ c3 ^ k1
                c1 = lo1
                c3 = lo0
                k0 = k0 + 0x9E3779B9
                k1 = k1 + 0xBB67AE85
            u = ((c0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = x - tl.log(-tl.log(u))
        else:
            score = x
        score = tl.where(mask & (x >= cut), score, float("-inf"))
        best = tl.max(score, 0)
        arg = tl.min(tl.where(score == best, v, V), 0)  # first index of the maximum
        tl.store(best_ptr + row * n_chunks + chunk, best)
        tl.store(arg_ptr + row * n_chunks + chunk, arg)


def _noisy_argmax_triton(logits, bp: BatchParams, cut):
    import torch

    B, V = logits.shape
    n_chunks = triton.cdiv(V, ARGMAX_BLOCK)
    best = torch.empty(B, n_chunks, dtype=torch.float32, device=logits.device)
    arg = torch.empty(B, n_chunks, dtype=torch.int32, device=logits.device)
    assert logits.stride(-1) == 1
    _noisy_argmax_kernel[(B, n_chunks)](
        logits, bp.inv_temp, bp.noise, cut, bp.seed_lo, bp.seed_hi, bp.index, best, arg,
        logits.stride(0), V, n_chunks, BLOCK=ARGMAX_BLOCK, ROUNDS=PHILOX_ROUNDS, num_warps=8)
    chunk = torch.argmax(best, dim=-1, keepdim=True)  # first chunk holding the maximum
    return arg.gather(1, chunk)[:, 0]
