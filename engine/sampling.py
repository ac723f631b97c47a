"""Sampling parameters and the batched on-device sampler (rank 0 only).

Every sampled token is an exponential race (the Gumbel-max trick): the token is
argmax over the kept vocabulary of logits / temperature + Gumbel noise, which draws from
softmax(logits / temperature) restricted to the kept set. The noise of vocabulary entry v for
output index i of a request with seed s is a pure function of (s, i, v): Philox4x32-10
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) keyed by the seed's
two 32-bit halves, counter (k, i, 0, 0), where each call's four output words serve four
entries (`philox_counter_word`: block b of 4,096 entries takes counters b * 1024 + k, word w
for entry b * 4096 + w * 1024 + k). So a request's tokens do not depend on which other
requests share its batch, on its row or slot, or on the tensor-parallel size: continuous
batching gives each request the tokens it gets alone, on CPU and GPU alike.

Three implementations with one meaning:
    `sample_reference`: one request at a time in plain torch; the oracle.
    `sample_batch`: the whole batch at once (per-row parameters as tensors). The kept set
        is cut by one threshold per row (top-k, top-p, min-p, each a value on the scaled
        logits). Top-p needs no sort: the race is run under the top-k / min-p cut, and the
        winner is kept when the mass above it is below top_p (`nucleus_holds`); only the rows
        whose winner falls outside the nucleus (about 1 - top_p of them) get their top-p cut
        and run the race again. On CPU these are torch ops (the cut by a sort,
        `thresholds`); on CUDA five Triton kernels and no device-to-host sync: `_race_kernel`
        (per row and 4096-entry chunk: the noisy argmax, the chunk's maximum and whether a
        logit is not finite; one read of the logits), `_mass_kernel` (only when a row asks
        for top-p: the chunk's integer weights Z and the weight above the race's winner,
        int64 partial sums; a second read), `_pick_kernel` (per row: the winner, -1 for a
        non-finite row, and whether top-p must redraw it), then for the redrawn rows alone
        (the programs of other rows return at once) `_bracket_kernel` (per chunk: the
        weight above 32 values between the winner and the row maximum) and `_redraw_kernel`
        (per row: the values of the part where that weight crosses top_p * Z are copied
        out and searched over their order-keyed float32 bits for the smallest value whose
        weight above is < top_p * Z -- `thresholds`' cut exactly -- then the race again
        under it). So greedy and plain temperature read the logits once, top-p twice plus
        the redrawn rows, finiteness included (`python -m engine.bench.sampler_passes`
        counts them).

Top-p mass is exact integer arithmetic, so the kept set does not depend on summation order
(sort or no sort, CPU or GPU, batch size): each token weighs
q = trunc(exp(x - max x) * 2**34) (int64; x the scaled logit, exp elementwise float32), Z is
the sum of q over the tokens top-k keeps, and a token of value v is in the nucleus when the
weight of the tokens strictly above v is < top_p * Z (float64 product of the float32 top_p and
Z, both exact). This is "keep the most likely tokens until their probability reaches top_p,
ties with the last kept token kept", with the float32 cumsum's order-dependent rounding
removed.
    `philox_uniform`: the random stream in torch (int64 arithmetic); the Triton kernel
        computes the same bits.
Only the sampled token ids (int32, one per row) need to cross to the host.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.errors import RequestError
from engine.seeds import SEED_LIMIT
from lockstep.args import one_line_repr

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


MIN_TEMPERATURE = 1e-5
"""The smallest sampled temperature; below it, use 0 (greedy)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request. The defaults are these fields' own: a model
    directory's generation_config.json is not read for them (its sampling fields are ignored,
    `engine.config.load_model_config`).

    Attributes:
        max_tokens: new tokens to generate, >= 1 (the first comes from the prefill).
        temperature: 0 for greedy (argmax); otherwise logits are multiplied by 1/temperature,
            > 0.
        top_k: keep the k most likely tokens (ties with the k-th kept); 0 or -1 keeps all.
            Ignored when greedy.
        top_p: keep the most likely tokens until their probability reaches top_p (ties with the
            last kept token kept), in (0, 1]. Ignored when greedy.
        min_p: keep tokens whose probability is at least min_p times the most likely one's,
            in [0, 1]; 0 keeps all. Ignored when greedy.
        seed: seed of this request's sampling, an integer in [0, 2**64) (its 64 bits key the
            random stream; a larger one would alias a smaller one, so it is refused); None
            picks one per request (recorded in the output). Ignored when greedy.
        stop_token_ids: extra tokens that end the request (kept in the output): a list, tuple,
            set or 1-D array of integer ids (numpy and torch integers taken as their value); an
            iterator, read once by the check, is refused.
        ignore_eos: do not stop at the model's end-of-sequence tokens.
        logprobs: return the log-probability (natural log, of the unmodified model
            distribution) of every generated token.
        return_logits: return the float32 logits [n, vocab] the model produced for every
            generated token (for tests and debugging: large).

    With temperature 0 (greedy) the most likely token is taken, and top_k, top_p, min_p and
    seed are not used (no cut drops the most likely token, and nothing is drawn); they are
    still range-checked by `validate`, and accepted. `lockstep generate` instead refuses
    --top-k, --top-p or --seed with --temperature 0, where a flag that does nothing had been
    taken without a word.
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
        """Raises RequestError naming the first bad field (a wrong type included: a numpy or
        torch scalar is named by its type, to be passed as a Python int or float)."""
        for name in ("max_tokens", "top_k") + (("seed",) if self.seed is not None else ()):
            v = getattr(self, name)
            if as_token_id(v) is None:
                raise RequestError(f"{name} = {v!r}, expected an integer")
            if not isinstance(v, int):  # np.int64(3) read "expected an integer >= 1"
                raise RequestError(f"{name} = {v!r} is a {type(v).__name__}, expected a "
                                   f"Python int: pass int(...)")
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
                raise RequestError(f"{name} = {v!r}, expected a number")
            if not isinstance(v, (int, float)):  # np.float32(0.7) read "expected a number >= 0"
                raise RequestError(f"{name} = {v!r} is a {type(v).__name__}, expected a "
                                   f"Python float: pass float(...)")
        for name in ("ignore_eos", "logprobs", "return_logits"):
            if not isinstance(getattr(self, name), bool):  # logprobs=5 is not vLLM's top-5
                raise RequestError(f"{name} = {getattr(self, name)!r}, expected True or False")
        stop = self.stop_token_ids
        if (isinstance(stop, (str, bytes, Mapping)) or not hasattr(stop, "__iter__")
                or getattr(stop, "ndim", 1) != 1 or iter(stop) is stop):
            # an iterator (a generator) would be used up by this check and leave no stop token
            raise RequestError(f"stop_token_ids = {one_line_repr(stop)}, expected a list of "
                               "token ids")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise RequestError(f"max_tokens = {one_line_repr(self.max_tokens)}, expected an "
                               "integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 \
                or self.temperature > sys.float_info.max or not math.isfinite(self.temperature):
            # an int past the largest float (10**400) raised OverflowError from isfinite
            raise RequestError(f"temperature = {one_line_repr(self.temperature)}, expected a "
                               "finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # logits / a subnormal temperature overflow to inf and the race returns junk
            raise RequestError(f"temperature = {one_line_repr(self.temperature)}, expected 0 "
                               f"(greedy) or at least {MIN_TEMPERATURE:g}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise RequestError(f"top_k = {one_line_repr(self.top_k)}, expected -1, 0 (all) or a "
                               "positive int")
        if self.top_k > vocab_size:
            raise RequestError(f"top_k = {one_line_repr(self.top_k)}, expected at most the "
                               f"vocabulary size {vocab_size}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p = {one_line_repr(self.top_p)}, expected a number in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p = {one_line_repr(self.min_p)}, expected a number in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise RequestError(f"seed = {one_line_repr(self.seed)}, expected None or an integer in "
                               "[0, 2**64)")
        for t in self.stop_token_ids:
            i = as_token_id(t)
            if i is None:
                raise RequestError(f"stop token id {t!r} is a {type(t).__name__}, expected an integer")
            if not 0 <= i < vocab_size:
                raise RequestError(f"stop token id {t!r} outside the vocabulary [0, {vocab_size})")

    def stop_ids(self) -> frozenset[int]:
        """The stop token ids as Python ints (a numpy or torch integer hashes otherwise, and a
        0-d array not at all). Call after `validate`."""
        return frozenset(as_token_id(t) for t in self.stop_token_ids)


def as_token_id(value) -> int | None:
    """``value`` as a Python int if it is integer-like (int, numpy or torch integer, a 0-d
    integer tensor), else None (bool, float, str, None, a meta tensor, which holds no value,
    and other types)."""
    if isinstance(value, bool) or getattr(value, "is_meta", False) or getattr(
            value, "dtype", None) is not None and (
            getattr(value, "is_floating_point", lambda: False)() or getattr(value, "ndim", 0) != 0
            or str(value.dtype) in ("bool", "torch.bool")):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, OverflowError):
        return None


def inverse_temperature(temperature: float) -> float:
    """The multiplier of the logits: 1 / temperature, and 1 for greedy (temperature 0)."""
    return 1.0 / temperature if temperature > 0 else 1.0


# -- the random stream ---------------------------------------------------------------------------


# Vocabulary entries per Philox block: one Philox4x32 call gives four 32-bit words, and block
# b's 4 * PHILOX_GROUP entries take them all: entry b * 4G + w * G + k is word w of counter
# b * G + k (G = PHILOX_GROUP). A race chunk (`ARGMAX_BLOCK`) is one block, so each call's four
# words serve four entries instead of one.
PHILOX_GROUP = 1024


def philox_counter_word(v):
    """(counter, word) of vocabulary entries ``v`` (int64 tensor) in the random stream."""
    g = PHILOX_GROUP
    return (v // (4 * g)) * g + v % g, (v % (4 * g)) // g


def philox_uniform(seed_lo, seed_hi, index, vocab: int):
    """Uniform floats in (0, 1) for every vocabulary entry of each row.

    Entry v reads word w of Philox4x32-10 at counter (k, index, 0, 0), key (seed_lo,
    seed_hi), with (k, w) = `philox_counter_word(v)`.

    Args:
        seed_lo, seed_hi: int64 [B], the low and high 32 bits of each row's seed.
        index: int64 [B], each row's output index (0 for the token after the prompt).
        vocab: vocabulary size V.
    Returns:
        float32 [B, V]: ((the entry's philox word >> 8) + 0.5) / 2**24 in float32 arithmetic
        (the Triton kernels compute the same roundings).
    """
    import torch

    dev = seed_lo.device
    g = PHILOX_GROUP
    blocks = -(-vocab // (4 * g))
    c0 = torch.arange(blocks * g, dtype=torch.int64, device=dev)[None, :].expand(len(seed_lo), -1)
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
    words = torch.stack([c0, c1, c2, c3], dim=1)            # [B, 4, blocks * G]
    words = words.view(len(seed_lo), 4, blocks, g).transpose(1, 2)  # [B, blocks, 4, G]
    bits = words.reshape(len(seed_lo), blocks * 4 * g)[:, :vocab]
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def gumbel(u):
    """Gumbel(0, 1) noise from uniforms u in (0, 1): -log(-log(u)), float32."""
    import torch

    return -torch.log(-torch.log(u))


def split_seed(seed: int) -> tuple[int, int]:
    """(low 32 bits, high 32 bits) of seed modulo 2**64."""
    seed %= 1 << 64
    return seed & MASK32, seed >> 32


# Fixed-point bits of the top-p token weights: exp(x - max) * 2**34 summed over 151,936 tokens
# stays below 2**52, so the sums (int64) and their float64 images are exact.
MASS_BITS = 34


def mass_weights(x, row_max):
    """Top-p weight of every token: trunc(exp(x - row_max) * 2**MASS_BITS).

    Args:
        x: float32 [B, V] scaled logits (-inf allowed: weight 0).
        row_max: float32 [B], the maximum of each row.
    Returns:
        int64 [B, V], each in [0, 2**MASS_BITS]; sums of up to 2**18 of them are exact in
        float64.
    """
    import torch

    e = torch.exp(x - row_max[:, None])
    return e.mul_(float(1 << MASS_BITS)).to(torch.int64)


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
            order = torch.argsort(x, descending=True, stable=True)
            q = mass_weights(x[None], x.max()[None])[0].masked_fill(~keep, 0)[order]
            before = torch.cumsum(q, dim=-1) - q  # exact: int64
            top_p = torch.tensor(params.top_p, dtype=torch.float32, device=x.device).double()
            m = int((before.double() < top_p * q.sum().double()).sum().clamp(min=1))
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
        max_top_k: a host-known bound >= every row's top_k, or None (then read from the
            tensor: a device-to-host sync).
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
    max_top_k: int | None = None

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

    def select(self, rows) -> "BatchParams":
        """The parameters of `rows` (int64 [R], on this device), in that order."""
        pick = {name: getattr(self, name).index_select(0, rows)
                for name in ("inv_temp", "noise", "top_k", "top_p", "min_p", "seed_lo",
                             "seed_hi", "index")}
        return BatchParams(**pick, any_top_k=self.any_top_k, any_top_p=self.any_top_p,
                           any_min_p=self.any_min_p, max_top_k=self.max_top_k)


def base_cut(x, bp: BatchParams):
    """The top-k and min-p cuts of the scaled logits x (float32 [B, V]), without a sort.

    Returns:
        (cut_k, cut) float32 [B] each: cut_k keeps x >= the k-th largest value (top-k alone,
        -inf where no top-k); cut is max(cut_k, max + log(min_p)) (-inf where nothing is cut).
    """
    import torch

    B, V = x.shape
    cut_k = torch.full((B,), float("-inf"), dtype=torch.float32, device=x.device)
    k = bp.top_k.clamp(max=V)
    if bp.any_top_k:
        # the flags may outlive the rows that asked (a subset): at least 1
        kmax = min(max(bp.max_top_k if bp.max_top_k is not None else int(k.max()), 1), V)
        kth = torch.topk(x, kmax, dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
        cut_k = torch.where((k > 0) & (k < V), kth, cut_k)
    cut = cut_k
    if bp.any_min_p:
        mth = x.max(dim=-1).values + torch.log(bp.min_p)
        cut = torch.where(bp.min_p > 0, torch.maximum(cut, mth), cut)
    return cut_k, cut


def nucleus_weights(x, cut_k):
    """Top-p weights of x (float32 [B, V]) restricted to the top-k set x >= cut_k (float32
    [B]): (q int64 [B, V], zero outside; Z int64 [B], their sum)."""
    q = mass_weights(x, x.max(dim=-1).values).masked_fill_(x < cut_k[:, None], 0)
    return q, q.sum(dim=-1)


def nucleus_holds(x, q, z, top_p, value):
    """Whether a token of value `value` (float32 [B]) is in each row's top-p nucleus: the
    weight of the tokens strictly above it is < top_p * Z, or top_p >= 1 (no top-p). One
    masked sum per row, no sort.

    Args:
        x: float32 [B, V] scaled logits. q, z: `nucleus_weights(x, cut_k)`.
        top_p: float32 [B]. value: float32 [B], a value of its row (e.g. a drawn token's).
    Returns:
        bool [B].
    """
    above = q.masked_fill(x <= value[:, None], 0).sum(dim=-1)
    return (above.double() < top_p.double() * z.double()) | (top_p >= 1)


def thresholds(x, bp: BatchParams):
    """Per-row cut on the scaled logits x (float32 [B, V]): a token is kept when x >= the cut.

    top-k keeps x >= the k-th largest value; top-p (after top-k) keeps x >= the value of the
    last token, in descending order, whose preceding weight is < top_p * Z (module
    docstring: exact integer weights); min-p keeps x >= max + log(min_p). Returns float32 [B]
    (-inf where nothing is cut). Sorts the rows when any asks for top-p: `sample_batch` calls
    it only for the rows whose drawn token left the nucleus; tests use it as the oracle of
    `nucleus_holds`.
    """
    import torch

    cut_k, cut = base_cut(x, bp)
    if bp.any_top_p:
        ordered, order = torch.sort(x, dim=-1, descending=True, stable=True)
        q, z = nucleus_weights(x, cut_k)
        q = q.gather(1, order)
        before = torch.cumsum(q, dim=-1) - q  # exact: int64
        m = (before.double() < (bp.top_p.double() * z.double())[:, None]).sum(dim=-1)
        pth = ordered.gather(1, (m.clamp(min=1) - 1)[:, None])[:, 0]
        cut = torch.where(bp.top_p < 1, torch.maximum(cut, pth), cut)
    return cut


def sample_batch(logits, bp: BatchParams, want_logprobs: bool = False):
    """Sample one token per row of `logits` (float32 [B, V], on the device of `bp`).

    A row holding a non-finite logit (NaN or +-inf) gets token -1: the finiteness test runs
    inside the sampler's own pass (on CUDA, the race kernel), not as a separate pass.

    On CUDA a batch costs one pass over the logits (the race kernel: row maximum, finiteness,
    noisy argmax) plus, when a row asks for top-p, a second (the mass kernel: the exact integer
    weights Z and the weight above the winner), and the rows whose winner left the nucleus are
    drawn again under their top-p cut, searched on the device (no host sync). Top-k and min-p cuts, when asked for, add their own
    passes (`base_cut`); logprobs add a logsumexp pass.

    Returns:
        (tokens int32 [B], logprobs float32 [B] or None): logprobs of the chosen tokens under
        the unmodified distribution (log_softmax of logits), when want_logprobs (undefined for
        a -1 row).
    """
    import torch

    logits = logits.float()
    if logits.is_cuda and triton is not None:
        tokens = _sample_batch_triton(logits, bp)
    else:
        tokens = _sample_batch_torch(logits, bp)
    logprobs = None
    if want_logprobs:
        chosen = logits.gather(1, tokens.long().clamp(min=0)[:, None])[:, 0]
        logprobs = chosen - torch.logsumexp(logits, dim=-1)
    return tokens, logprobs


def _cuts(logits, bp: BatchParams):
    """(x, cut_k, cut) for the race: x the scaled logits (None when no row cuts by top-k or
    min-p: the kernels scale on the fly), cut_k the top-k cut and cut the race's cut (float32
    [B], -inf where none; greedy rows never cut)."""
    import torch

    B = logits.shape[0]
    if not (bp.any_top_k or bp.any_min_p):
        none = torch.full((B,), float("-inf"), dtype=torch.float32, device=logits.device)
        return None, none, none
    x = logits * bp.inv_temp[:, None]
    cut_k, cut = base_cut(x, bp)
    return x, cut_k, torch.where(bp.noise > 0, cut, float("-inf"))


def _sample_batch_torch(logits, bp: BatchParams):
    """`sample_batch`'s tokens in torch ops (the CPU path)."""
    import torch

    x, cut_k, cut = _cuts(logits, bp)
    tokens = _noisy_argmax_torch(logits, bp, cut)
    if bp.any_top_p:  # the winner stands when it is in the nucleus; else the sorted cut
        if x is None:
            x = logits * bp.inv_temp[:, None]
        q, z = nucleus_weights(x, cut_k)
        value = x.gather(1, tokens.long()[:, None])[:, 0]
        held = nucleus_holds(x, q, z, bp.top_p, value) | (bp.noise == 0)
        redo = torch.nonzero(~held)[:, 0]
        if len(redo):
            sub = bp.select(redo)
            sub_cut = thresholds(x.index_select(0, redo), sub)
            tokens[redo] = _noisy_argmax_torch(logits.index_select(0, redo), sub, sub_cut)
    return torch.where(torch.isfinite(logits).all(dim=-1), tokens, -1)


def _sample_batch_triton(logits, bp: BatchParams, stats: dict | None = None):
    """`sample_batch`'s tokens with the Triton kernels (module docstring; same meaning as the
    torch path): race (+ mass when top-p) + pick, and when top-p the redraw of the rows whose
    winner left the nucleus, with no device-to-host sync. With `stats` (a dict, for the pass
    counter) the number of redrawn rows is stored in stats["redrawn"] (that one syncs)."""
    _, cut_k, cut = _cuts(logits, bp)
    if not bp.any_top_p:
        return _launch_race(logits, bp, cut).tokens
    race = _launch_race(logits, bp, cut, cut_k)
    _redraw_triton(logits, bp, cut, cut_k, race)
    if stats is not None:
        stats["redrawn"] = int(race.redo.sum())
    return race.tokens


def _noisy_argmax_torch(logits, bp: BatchParams, cut):
    """int32 [B]: per row, the first argmax of scaled logits + Gumbel noise over x >= cut."""
    import torch

    x = logits * bp.inv_temp[:, None]
    if bool((bp.noise > 0).any()):
        g = gumbel(philox_uniform(bp.seed_lo, bp.seed_hi, bp.index, logits.shape[1]))
        score = torch.where(bp.noise[:, None] > 0, x + g, x)
    else:  # an all-greedy batch draws no random stream (as the Triton kernel skips it per row)
        score = x
    score = score.masked_fill(x < cut[:, None], float("-inf"))
    return torch.argmax(score, dim=-1).to(torch.int32)


# Vocabulary entries per program of the race and mass kernels: 151,936 / 4096 = 38 programs
# per row, enough to fill the GPU at batch 1 while keeping the cross-chunk reduction small.
ARGMAX_BLOCK = 4 * PHILOX_GROUP  # 4096: one Philox block per program (`_gumbel_block`)

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _gumbel_block(x, start, seed_lo, seed_hi, index, GROUP: tl.constexpr,
                      ROUNDS: tl.constexpr, LIBDEVICE: tl.constexpr):
        """x + Gumbel noise of the 4 * GROUP vocabulary entries start.. (x: [4 * GROUP],
        start a multiple of 4 * GROUP: one Philox block) for output `index` of a request with
        seed halves (seed_lo, seed_hi): `philox_uniform`'s bits, one Philox4x32 call per
        four entries (word w of counter k is entry w * GROUP + k of the block)."""
        c0 = ((start // (4 * GROUP)) * GROUP + tl.arange(0, GROUP)).to(tl.uint32)
        k0 = (seed_lo & 0xFFFFFFFF).to(tl.uint32)
        k1 = (seed_hi & 0xFFFFFFFF).to(tl.uint32)
        c1 = (index & 0xFFFFFFFF).to(tl.uint32) + tl.zeros_like(c0)
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
        # [GROUP, 2, 2] with [k, j, i] = word 2i + j, then [i, j, k]: entry (2i + j) * GROUP + k
        words = tl.join(tl.join(c0, c1), tl.join(c2, c3))
        bits = tl.reshape(tl.permute(words, (2, 1, 0)), (4 * GROUP,))
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        if LIBDEVICE:  # logf, as torch.log on CUDA
            g = libdevice.log(-libdevice.log(u))
        else:  # the interpreter: numpy's log
            g = tl.log(-tl.log(u))
        return x - g

    @triton.jit
    def _race_kernel(x_ptr, inv_t_ptr, noise_ptr, cut_ptr, lo_ptr, hi_ptr, idx_ptr,
                     best_ptr, arg_ptr, max_ptr, bad_ptr, stride_x, V, n_chunks,
                     BLOCK: tl.constexpr, ROUNDS: tl.constexpr, LIBDEVICE: tl.constexpr):
        """One chunk of one row: the noisy argmax over x >= cut (best score, its first
        index), the chunk's maximum of x and whether a logit is not finite."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        v = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = v < V
        raw = tl.load(x_ptr + row.to(tl.int64) * stride_x + v, mask=mask, other=0.0)
        bad = tl.max(tl.where(mask & ~(tl.abs(raw) < float("inf")), 1, 0), 0)
        x = raw * tl.load(inv_t_ptr + row)
        noise = tl.load(noise_ptr + row)
        cut = tl.load(cut_ptr + row)
        if noise > 0:  # greedy rows skip the random stream
            score = _gumbel_block(x, chunk * BLOCK, tl.load(lo_ptr + row),
                                  tl.load(hi_ptr + row), tl.load(idx_ptr + row), BLOCK // 4,
                                  ROUNDS, LIBDEVICE)
        else:
            score = x
        score = tl.where(mask & (x >= cut), score, float("-inf"))
        best = tl.max(score, 0)
        arg = tl.min(tl.where(score == best, v, V), 0)  # first index of the maximum
        out = row * n_chunks + chunk
        tl.store(best_ptr + out, best)
        tl.store(arg_ptr + out, arg)
        tl.store(max_ptr + out, tl.max(tl.where(mask, x, float("-inf")), 0))
        tl.store(bad_ptr + out, bad)

    @triton.jit
    def _winner(best_ptr, arg_ptr, row, n_chunks, V, NCH: tl.constexpr):
        """The race's winner of a row from its chunks: the first chunk holding the best score,
        that chunk's first index (clamped into the row, for rows whose scores are NaN)."""
        c = tl.arange(0, NCH)
        cm = c < n_chunks
        bests = tl.load(best_ptr + row * n_chunks + c, mask=cm, other=float("-inf"))
        top = tl.max(bests, 0)
        first = tl.minimum(tl.min(tl.where(cm & (bests == top), c, NCH), 0), n_chunks - 1)
        return tl.minimum(tl.load(arg_ptr + row * n_chunks + first), V - 1)

    @triton.jit
    def _mass_kernel(x_ptr, inv_t_ptr, noise_ptr, top_p_ptr, cut_k_ptr, best_ptr, arg_ptr,
                     max_ptr, z_ptr, above_ptr, stride_x, V, n_chunks,
                     BLOCK: tl.constexpr, NCH: tl.constexpr, MASS_SCALE: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
        """One chunk of one row: its part of the exact top-p mass Z (integer weights
        trunc(exp(x - max) * 2**MASS_BITS) over x >= cut_k) and of the weight strictly above
        the race's winner (int64 partial sums: exact, so their order does not matter)."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        # greedy and top_p = 1 rows load nothing (masked) and store zeros
        active = (tl.load(noise_ptr + row) > 0) & (tl.load(top_p_ptr + row) < 1)
        c = tl.arange(0, NCH)
        top = tl.max(tl.load(max_ptr + row * n_chunks + c, mask=c < n_chunks,
                             other=float("-inf")), 0)
        inv_t = tl.load(inv_t_ptr + row)
        base = x_ptr + row.to(tl.int64) * stride_x
        won = tl.load(base + _winner(best_ptr, arg_ptr, row, n_chunks, V, NCH)) * inv_t
        v = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = v < tl.where(active, V, 0)
        x = tl.load(base + v, mask=mask, other=0.0) * inv_t
        if LIBDEVICE:  # expf, as torch.exp on CUDA (tl.exp is ex2.approx)
            e = libdevice.exp(x - top)
        else:  # the interpreter (no libdevice there): numpy's exp
            e = tl.exp(x - top)
        q = (e * MASS_SCALE).to(tl.int64)
        q = tl.where(mask & (x >= tl.load(cut_k_ptr + row)), q, 0)
        out = row * n_chunks + chunk
        tl.store(z_ptr + out, tl.sum(q, 0))
        tl.store(above_ptr + out, tl.sum(tl.where(x > won, q, 0), 0))

    @triton.jit
    def _pick_kernel(best_ptr, arg_ptr, bad_ptr, noise_ptr, top_p_ptr, z_ptr, above_ptr,
                     token_ptr, redo_ptr, V, n_chunks, NCH: tl.constexpr, TOP_P: tl.constexpr):
        """One row: the winner (-1 when a logit is not finite) and, with TOP_P, whether it
        must be drawn again (a sampled row whose winner is outside the nucleus:
        weight above >= top_p * Z in float64, both sides exact)."""
        row = tl.program_id(0)
        c = tl.arange(0, NCH)
        cm = c < n_chunks
        bad = tl.max(tl.load(bad_ptr + row * n_chunks + c, mask=cm, other=0), 0)
        token = tl.where(bad > 0, -1, _winner(best_ptr, arg_ptr, row, n_chunks, V, NCH))
        tl.store(token_ptr + row, token)
        if TOP_P:
            z = tl.sum(tl.load(z_ptr + row * n_chunks + c, mask=cm, other=0), 0)
            above = tl.sum(tl.load(above_ptr + row * n_chunks + c, mask=cm, other=0), 0)
            top_p = tl.load(top_p_ptr + row)
            held = above.to(tl.float64) < top_p.to(tl.float64) * z.to(tl.float64)
            held = held | (top_p >= 1) | (tl.load(noise_ptr + row) == 0) | (bad > 0)
            tl.store(redo_ptr + row, tl.where(held, 0, 1).to(tl.int8))


    @triton.jit
    def _float_key(x):
        """float32 -> int64 key in the order of the floats (NaN excluded; -0.0 one below
        +0.0): the bits, with the magnitude bits of negative floats flipped."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)

    @triton.jit
    def _key_float(k):
        """The float32 of a `_float_key` key."""
        b = k.to(tl.int32)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _bracket_kernel(x_ptr, inv_t_ptr, cut_k_ptr, token_ptr, redo_ptr, max_ptr, part_ptr,
                        stride_x, V, n_chunks, BLOCK: tl.constexpr, SUB: tl.constexpr,
                        NCH: tl.constexpr, S: tl.constexpr, MASS_SCALE: tl.constexpr,
                        LIBDEVICE: tl.constexpr):
        """One chunk of one redrawn row (the others return at once): the weight strictly above
        each of S values that split (the winner's value, the row maximum) into S + 1 equal
        parts, into part [B, n_chunks, S] (int64, `_mass_kernel`'s weights bit for bit), so
        that `_redraw_kernel` can start its search from one part."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        if tl.load(redo_ptr + row) == 0:
            return
        c = tl.arange(0, NCH)
        top = tl.max(tl.load(max_ptr + row * n_chunks + c, mask=c < n_chunks,
                             other=float("-inf")), 0)
        inv_t = tl.load(inv_t_ptr + row)
        cut_k = tl.load(cut_k_ptr + row)
        base = x_ptr + row.to(tl.int64) * stride_x
        won = tl.load(base + tl.load(token_ptr + row)) * inv_t
        t = _part_values(won, top, S)
        acc = tl.zeros((S,), dtype=tl.int64)
        for i in tl.static_range(BLOCK // SUB):
            v = chunk * BLOCK + i * SUB + tl.arange(0, SUB)
            mask = v < V
            x = tl.load(base + v, mask=mask, other=0.0) * inv_t
            if LIBDEVICE:  # expf, as torch.exp on CUDA
                e = libdevice.exp(x - top)
            else:
                e = tl.exp(x - top)
            q = tl.where(mask & (x >= cut_k), (e * MASS_SCALE).to(tl.int64), 0)
            acc += tl.sum(tl.where(x[:, None] > t[None, :], q[:, None], 0), 0)
        tl.store(part_ptr + (row * n_chunks + chunk) * S + tl.arange(0, S), acc)

    @triton.jit
    def _part_values(won, top, S: tl.constexpr):
        """S increasing values strictly inside (won, top): won + (top - won) * j / (S + 1)."""
        j = (tl.arange(0, S) + 1).to(tl.float32)
        return won + (top - won) * (j / (S + 1))

    @triton.jit
    def _redraw_kernel(x_ptr, inv_t_ptr, cut_k_ptr, cut_ptr, top_p_ptr, lo_ptr, hi_ptr,
                       idx_ptr, redo_ptr, max_ptr, z_ptr, part_ptr, scratch_ptr, token_ptr,
                       cut_out_ptr, stride_x, V, n_chunks, CAP, BLOCK: tl.constexpr,
                       NCH: tl.constexpr, S: tl.constexpr, ROUNDS: tl.constexpr,
                       MASS_SCALE: tl.constexpr, LIBDEVICE: tl.constexpr):
        """One row whose race winner left the top-p nucleus (the others return at once): its
        top-p cut, then the race again over x >= max(cut, top-p cut).

        The top-p cut is the smallest value t of the row whose weight strictly above, W(t),
        is < top_p * Z (`thresholds`' cut, without a sort). W falls as t grows, so it is found
        by narrowing an interval (lo, hi] with W(lo) >= top_p * Z > W(hi). The winner left
        the nucleus, so W(winner) >= top_p * Z, and `_bracket_kernel`'s weights at S values
        of (winner, max) give the part where W crosses. The values of the row inside that
        part are copied to scratch (at most CAP of them; a row with more is searched in
        place), and a search over their order-keyed float32 values keeps, each step, the
        quarter of the key interval where W crosses (three candidates, W(candidate) = W(hi)
        + the weight of the copied values above it; int64 weights, `_mass_kernel`'s bit for
        bit) until one key is left. The cut is stored in cut_out, the new winner in token."""
        row = tl.program_id(0)
        if tl.load(redo_ptr + row) == 0:
            return
        c = tl.arange(0, NCH)
        cm = c < n_chunks
        z = tl.sum(tl.load(z_ptr + row * n_chunks + c, mask=cm, other=0), 0)
        pz = tl.load(top_p_ptr + row).to(tl.float64) * z.to(tl.float64)
        top = tl.max(tl.load(max_ptr + row * n_chunks + c, mask=cm, other=float("-inf")), 0)
        inv_t = tl.load(inv_t_ptr + row)
        cut_k = tl.load(cut_k_ptr + row)
        base = x_ptr + row.to(tl.int64) * stride_x
        won = tl.load(base + tl.load(token_ptr + row)) * inv_t
        # the part of (winner, max] where W crosses top_p * Z
        j = tl.arange(0, S)
        w_part = tl.sum(tl.load(part_ptr + (row * n_chunks + c[:, None]) * S + j[None, :],
                                mask=cm[:, None], other=0), 0)
        t = _part_values(won, top, S)
        holds = w_part.to(tl.float64) < pz
        first = tl.min(tl.where(holds, j, S), 0)  # the first value whose weight above holds
        f_hi = tl.where(first < S, tl.max(tl.where(j == first, t, float("-inf")), 0), top)
        w_hi = tl.where(first < S, tl.sum(tl.where(j == first, w_part, 0), 0), 0)
        f_lo = tl.where(first > 0, tl.max(tl.where(j == first - 1, t, float("-inf")), 0), won)
        # copy the values inside (f_lo, f_hi] (and kept by top-k) to scratch
        dst = scratch_ptr + row.to(tl.int64) * CAP
        n = tl.zeros((), dtype=tl.int32)
        for start in range(0, V, BLOCK):
            v = start + tl.arange(0, BLOCK)
            x = tl.load(base + v, mask=v < V, other=float("-inf")) * inv_t
            live = (x > f_lo) & (x <= f_hi) & (x >= cut_k)
            at = n + tl.cumsum(live.to(tl.int32), 0) - 1
            tl.store(dst + at, x, mask=live & (at < CAP))
            n += tl.sum(live.to(tl.int32), 0)
        copied = n <= CAP
        src = tl.where(copied, dst, base)
        count = tl.where(copied, n, V)
        lo = _float_key(f_lo)
        hi = _float_key(f_hi)
        while hi - lo > 1:
            c1 = lo + (hi - lo + 3) // 4
            c2 = lo + (2 * (hi - lo) + 3) // 4
            c3 = lo + (3 * (hi - lo) + 3) // 4
            t1, t2, t3 = _key_float(c1), _key_float(c2), _key_float(c3)
            g_lo, g_hi = _key_float(lo), _key_float(hi)
            a1 = tl.zeros((BLOCK,), dtype=tl.int64)
            a2 = tl.zeros((BLOCK,), dtype=tl.int64)
            a3 = tl.zeros((BLOCK,), dtype=tl.int64)
            for start in range(0, count, BLOCK):
                v = start + tl.arange(0, BLOCK)
                x = tl.load(src + v, mask=v < count, other=float("-inf"))
                x = tl.where(copied, x, x * inv_t)  # scratch holds scaled values
                live = (x > g_lo) & (x <= g_hi) & (x >= cut_k)
                if LIBDEVICE:
                    e = libdevice.exp(x - top)
                else:
                    e = tl.exp(x - top)
                q = tl.where(live, (e * MASS_SCALE).to(tl.int64), 0)
                a1 += tl.where(x > t1, q, 0)
                a2 += tl.where(x > t2, q, 0)
                a3 += tl.where(x > t3, q, 0)
            w1 = w_hi + tl.sum(a1, 0)
            w2 = w_hi + tl.sum(a2, 0)
            w3 = w_hi + tl.sum(a3, 0)
            h1 = w1.to(tl.float64) < pz
            h2 = w2.to(tl.float64) < pz
            h3 = w3.to(tl.float64) < pz
            new_hi = tl.where(h1, c1, tl.where(h2, c2, tl.where(h3, c3, hi)))
            w_hi = tl.where(h1, w1, tl.where(h2, w2, tl.where(h3, w3, w_hi)))
            lo = tl.where(~h3, c3, tl.where(~h2, c2, tl.where(~h1, c1, lo)))
            hi = new_hi
        cut = tl.maximum(tl.load(cut_ptr + row), _key_float(hi))
        tl.store(cut_out_ptr + row, cut)
        seed_lo = tl.load(lo_ptr + row)
        seed_hi = tl.load(hi_ptr + row)
        index = tl.load(idx_ptr + row)
        best = tl.full((), float("-inf"), tl.float32)
        arg = V
        for start in range(0, V, BLOCK):  # chunk by chunk, the first index of the maximum
            v = start + tl.arange(0, BLOCK)
            mask = v < V
            x = tl.load(base + v, mask=mask, other=0.0) * inv_t
            score = _gumbel_block(x, start, seed_lo, seed_hi, index, BLOCK // 4, ROUNDS,
                                  LIBDEVICE)
            score = tl.where(mask & (x >= cut), score, float("-inf"))
            m = tl.max(score, 0)
            first_v = tl.min(tl.where(score == m, v, V), 0)
            # the first chunk holding the best score, as `_winner`: a row whose scores are all
            # -inf (logits that overflow when scaled) gets index 0, as torch.argmax gives
            arg = tl.where((m > best) | (arg == V), first_v, arg)
            best = tl.maximum(best, m)
        tl.store(token_ptr + row, tl.minimum(arg, V - 1).to(tl.int32))


# `_redraw_kernel`: vocabulary entries per block (one program per row, 16 warps), and the most
# values of a row it copies out of the part where the top-p weight crosses (scratch [B, CAP]
# float32: 16 MB at 256 rows; a row with more is searched in place).
REDRAW_BLOCK = 4 * PHILOX_GROUP  # one Philox block per iteration (`_gumbel_block`)
REDRAW_CAP = 16384
# `_bracket_kernel`: values that split (winner, max) into parts, and entries per inner tile
# ([BRACKET_SUB, BRACKET_VALUES] comparisons).
BRACKET_VALUES = 32
BRACKET_SUB = 128
ROW_SUBSET_KERNELS = frozenset({"_bracket_kernel", "_redraw_kernel"})
"""Kernels that load only the rows drawn again (for `engine.bench.sampler_passes`)."""


@dataclass
class _Race:
    """What one race launch leaves on the device."""

    tokens: object          # int32 [B]
    redo: object | None     # int8 [B]: 1 where top-p must redraw the winner
    top: object             # float32 [B, chunks]: each chunk's maximum of the scaled logits
    z: object | None        # int64 [B, chunks]: each chunk's part of the top-p mass Z


def _launch_race(logits, bp: BatchParams, cut, cut_k=None) -> _Race:
    """Launch the race kernel, and with cut_k (float32 [B], the top-k cut) the mass kernel and
    the nucleus check; then the pick kernel."""
    import torch

    B, V = logits.shape
    assert logits.stride(-1) == 1
    dev = logits.device
    n_chunks = triton.cdiv(V, ARGMAX_BLOCK)
    nch = triton.next_power_of_2(n_chunks)
    best = torch.empty(B, n_chunks, dtype=torch.float32, device=dev)
    top = torch.empty(B, n_chunks, dtype=torch.float32, device=dev)
    arg = torch.empty(B, n_chunks, dtype=torch.int32, device=dev)
    bad = torch.empty(B, n_chunks, dtype=torch.int32, device=dev)
    tokens = torch.empty(B, dtype=torch.int32, device=dev)
    exact = dict(enable_fp_fusion=False)  # no fused multiply-add: torch's roundings
    _race_kernel[(B, n_chunks)](
        logits, bp.inv_temp, bp.noise, cut, bp.seed_lo, bp.seed_hi, bp.index, best, arg, top,
        bad, logits.stride(0), V, n_chunks, BLOCK=ARGMAX_BLOCK, ROUNDS=PHILOX_ROUNDS,
        LIBDEVICE=logits.is_cuda, num_warps=8, **exact)
    z = above = redo = None
    if cut_k is not None:
        z = torch.empty(B, n_chunks, dtype=torch.int64, device=dev)
        above = torch.empty(B, n_chunks, dtype=torch.int64, device=dev)
        redo = torch.empty(B, dtype=torch.int8, device=dev)
        _mass_kernel[(B, n_chunks)](
            logits, bp.inv_temp, bp.noise, bp.top_p, cut_k, best, arg, top, z, above,
            logits.stride(0), V, n_chunks, BLOCK=ARGMAX_BLOCK, NCH=nch,
            MASS_SCALE=float(1 << MASS_BITS), LIBDEVICE=logits.is_cuda, num_warps=8, **exact)
    _pick_kernel[(B,)](best, arg, bad, bp.noise, bp.top_p, z if z is not None else best,
                       above if above is not None else best, tokens,
                       redo if redo is not None else tokens, V, n_chunks, NCH=nch,
                       TOP_P=cut_k is not None, num_warps=1, **exact)
    return _Race(tokens, redo, top, z)


def _race_triton(logits, bp: BatchParams, cut, cut_k=None):
    """The race on CUDA (or in the Triton interpreter): per row the first argmax of scaled
    logits + Gumbel noise over x >= cut (float32 [B]), -1 for a row with a non-finite logit.

    With cut_k (float32 [B], the top-k cut), also the nucleus check of each winner.
    Returns:
        (tokens int32 [B], redo bool [B] or None): redo marks the sampled top-p rows whose
        winner is outside the nucleus (they must be drawn again under the top-p cut).
    """
    race = _launch_race(logits, bp, cut, cut_k)
    return race.tokens, (race.redo.bool() if race.redo is not None else None)


def _redraw_triton(logits, bp: BatchParams, cut, cut_k, race: _Race):
    """Draw again, in place in race.tokens, every row flagged in race.redo, under max(cut,
    its top-p cut): `_bracket_kernel` (every chunk of the flagged rows: the part of (winner,
    max) where the top-p weight crosses), then `_redraw_kernel` (one program per flagged row:
    the search inside that part and the race again); no sort, no host sync. A flagged row's
    token must be a race winner outside its nucleus (the pick kernel's redo flag).

    Args:
        logits: float32 [B, V]. cut, cut_k: float32 [B] (`_cuts`). race: `_launch_race`'s
            record with its mass outputs.
    Returns:
        float32 [B]: the redraw's cut of each flagged row (other rows: unwritten).
    """
    import torch

    B, V = logits.shape
    dev = logits.device
    n_chunks = triton.cdiv(V, ARGMAX_BLOCK)
    nch = triton.next_power_of_2(n_chunks)
    part = torch.empty(B, n_chunks, BRACKET_VALUES, dtype=torch.int64, device=dev)
    scratch = torch.empty(B, REDRAW_CAP, dtype=torch.float32, device=dev)
    cut_out = torch.empty(B, dtype=torch.float32, device=dev)
    exact = dict(enable_fp_fusion=False, LIBDEVICE=logits.is_cuda,
                 MASS_SCALE=float(1 << MASS_BITS))
    _bracket_kernel[(B, n_chunks)](
        logits, bp.inv_temp, cut_k, race.tokens, race.redo, race.top, part, logits.stride(0), V,
        n_chunks, BLOCK=ARGMAX_BLOCK, SUB=BRACKET_SUB, NCH=nch, S=BRACKET_VALUES, num_warps=8,
        **exact)
    _redraw_kernel[(B,)](
        logits, bp.inv_temp, cut_k, cut, bp.top_p, bp.seed_lo, bp.seed_hi, bp.index, race.redo,
        race.top, race.z, part, scratch, race.tokens, cut_out, logits.stride(0), V, n_chunks,
        REDRAW_CAP, BLOCK=REDRAW_BLOCK, NCH=nch, S=BRACKET_VALUES, ROUNDS=PHILOX_ROUNDS,
        num_warps=16, **exact)
    return cut_out


def _noisy_argmax_triton(logits, bp: BatchParams, cut):
    """int32 [B]: `_noisy_argmax_torch`'s tokens from the race kernel (-1 for a row with a
    non-finite logit)."""
    return _race_triton(logits, bp, cut)[0]
