"""The batched sampler against the one-request reference sampler (same tokens for the same
(seed, index)), its random stream (torch Philox vs the Triton kernel in interpreter mode), its
distribution, and batch invariance through `LLM.generate` (alone vs in a batch of 40)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import (
    BatchParams,
    SamplingParams,
    PHILOX_GROUP,
    philox_uniform,
    sample_batch,
    sample_reference,
)
from engine.testing import run_in_triton_interpreter

PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
          SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.6, top_p=0.9),
          SamplingParams(temperature=1.3, top_k=50, top_p=0.5),
          SamplingParams(temperature=0.8, min_p=0.1),
          SamplingParams(temperature=2.0, top_p=0.95, min_p=0.05, top_k=300),
          SamplingParams(temperature=0.5, top_k=1)]


def _logits(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


@pytest.mark.parametrize("trial", range(6))
def test_batched_sampler_matches_reference_row_by_row(trial):
    logits = _logits(len(PARAMS), 1000, trial)
    seeds = [trial * 1_000_003 + 17 * i for i in range(len(PARAMS))]
    index = [trial * 5 + i for i in range(len(PARAMS))]
    tokens, logprobs = sample_batch(logits, BatchParams.from_params(PARAMS, seeds, index), True)
    assert tokens.dtype == torch.int32
    for i, p in enumerate(PARAMS):
        ref, ref_lp = sample_reference(logits[i], SamplingParams(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            logprobs=True), seeds[i], index[i])
        assert int(tokens[i]) == ref, (i, p)
        assert abs(float(logprobs[i]) - ref_lp) < 1e-5


@settings(max_examples=40, deadline=None)
@given(temperature=st.floats(0.05, 3), top_k=st.integers(0, 40), top_p=st.floats(0.01, 1),
       min_p=st.floats(0, 0.5), seed=st.integers(0, 2**64 + 5), index=st.integers(0, 4000))
def test_any_parameters_same_token_as_reference_and_kept(temperature, top_k, top_p, min_p,
                                                           seed, index):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = _logits(1, 300, seed % 1000)
    token, = sample_batch(logits, BatchParams.from_params([p], [seed], [index]))[0].tolist()
    assert token == sample_reference(logits[0], p, seed, index)[0]
    x = logits[0] / temperature
    if top_k:
        assert x[token] >= torch.topk(x, top_k).values[-1]
    if min_p:
        assert x[token] >= x.max() + math.log(min_p) - 1e-5


def test_row_does_not_depend_on_its_batch_or_row():
    logits = _logits(40, 500, 3)
    params = [SamplingParams(temperature=0.9, top_p=0.8)] * 40
    seeds, index = list(range(40)), [7] * 40
    together = sample_batch(logits, BatchParams.from_params(params, seeds, index))[0].tolist()
    alone = [sample_batch(logits[i:i + 1], BatchParams.from_params(params[:1], [i], [7]))[0]
             .item() for i in range(40)]
    assert together == alone
    assert len(set(together)) > 10  # the seeds matter (not one token for every row)


def test_frequencies_follow_softmax_of_scaled_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    n = 20_000
    counts = torch.zeros(5)
    bp = BatchParams.from_params([SamplingParams(temperature=0.8)] * n, [11] * n, list(range(n)))
    tokens = sample_batch(logits.expand(n, -1).contiguous(), bp)[0]
    counts += torch.bincount(tokens.long(), minlength=5)
    expected = torch.softmax(logits[0] / 0.8, 0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, chi2  # 4 degrees of freedom: p = 0.0004


@pytest.mark.parametrize("top_p, nucleus", [(0.79, {0, 1}), (0.81, {0, 1, 2}), (0.5, {0}),
                                             (0.51, {0, 1})])
def test_top_p_keeps_exactly_the_nucleus(top_p, nucleus):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 2000
    bp = BatchParams.from_params([SamplingParams(temperature=1.0, top_p=top_p)] * n, [1] * n,
                                 list(range(n)))
    seen = set(sample_batch(logits.expand(n, -1).contiguous(), bp)[0].tolist())
    assert seen == nucleus  # 0.5 + 0.3 reaches 0.8 < 0.81: token 3 is never drawn


def test_philox_stream_is_a_function_of_seed_index_and_token():
    lo, hi = torch.tensor([1, 1, 2]), torch.tensor([0, 0, 0])
    u = philox_uniform(lo, hi, torch.tensor([0, 1, 0]), 64)
    assert u.min() > 0 and u.max() < 1
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = philox_uniform(lo[:1], hi[:1], torch.tensor([0]), 64)
    assert torch.equal(u[0], again[0])


def _philox4x32_10(counter, key):
    """Philox4x32-10 on Python ints (Salmon et al. 2011), for the stream's oracle."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = c0 * 0xD2511F53, c2 * 0xCD9E8D57
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> 32) ^ c3 ^ k1) & mask, p0 & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def test_philox_stream_takes_all_four_words_of_each_call():
    # Random123's known answers for Philox4x32-10
    assert _philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert _philox4x32_10((2**32 - 1,) * 4, (2**32 - 1,) * 2) == (
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    seed_lo, seed_hi, index, vocab = 12345, 7, 3, 9000
    u = philox_uniform(torch.tensor([seed_lo]), torch.tensor([seed_hi]), torch.tensor([index]),
                       vocab)[0]
    g = PHILOX_GROUP
    for v in (0, 1, g - 1, g, 2 * g + 5, 4 * g - 1, 4 * g, 4 * g + g + 3, vocab - 1):
        counter, word = (v // (4 * g)) * g + v % g, (v % (4 * g)) // g
        bits = _philox4x32_10((counter, index, 0, 0), (seed_lo, seed_hi))[word]
        want = (torch.tensor(bits >> 8, dtype=torch.float32) + 0.5) * (1.0 / 16777216.0)
        assert u[v].item() == want.item(), v  # the same float32 arithmetic as the kernels


_TRITON_CHECK = r"""
import torch
from engine.sampling import (BatchParams, SamplingParams, _noisy_argmax_torch,
                             _noisy_argmax_triton, _race_triton, _sample_batch_torch,
                             _sample_batch_triton, _cuts, thresholds)
g = torch.Generator().manual_seed(0)
params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
          SamplingParams(temperature=1.5, top_k=20), SamplingParams(temperature=0.9, top_p=0.6),
          SamplingParams(temperature=0.6, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.3),
          SamplingParams(temperature=0.8, min_p=0.05, top_p=0.9),
          SamplingParams(temperature=2.0, top_p=0.5, top_k=30)]
redone = 0
for trial in range(3):
    logits = torch.randn(len(params), 5000, generator=g) * (0.1 if trial == 1 else 2)
    if trial == 2:
        logits[1, 7] = float("nan")
        logits[4, 100] = float("inf")
    seeds = [trial, 2**40 + trial, 7, 2**63 + 1, 5 + trial, 6, 9, 11]
    bp = BatchParams.from_params(params, seeds, [0, 3, 99, 4, 5, 6, 7, 8])
    cut = torch.full((len(params),), float("-inf"))
    cut[2] = torch.topk(logits[2] / 1.5, 20).values[-1]
    a = _noisy_argmax_triton(logits, bp, cut)
    b = _noisy_argmax_torch(logits, bp, cut)
    ok = torch.isfinite(logits).all(dim=-1)
    assert a.tolist() == torch.where(ok, b, -1).tolist(), (a, b)
    # the whole sampled path: race + exact mass + pick, the redraw of rows outside the nucleus
    x, cut_k, cut = _cuts(logits, bp)
    won = x.gather(1, _noisy_argmax_torch(logits, bp, cut).long()[:, None])[:, 0]
    _, redo = _race_triton(logits, bp, cut, cut_k)
    inside = (won >= thresholds(x, bp)) | (bp.noise == 0) | ~ok
    assert redo.tolist() == (~inside).tolist(), (redo, inside)
    redone += int(redo.sum())
    a = _sample_batch_triton(logits, bp)
    b = _sample_batch_torch(logits, bp)
    assert a.tolist() == b.tolist(), (trial, a, b)
    assert (a == -1).tolist() == (~ok).tolist()
assert redone >= 2, redone  # the redraw path ran
print("ok")
"""


_CUT_CHECK = r"""
import torch
import engine.sampling as S
from engine.sampling import (BatchParams, SamplingParams, _cuts, _launch_race,
                             _noisy_argmax_torch, _redraw_triton, thresholds)
g = torch.Generator().manual_seed(0)
params = [SamplingParams(temperature=0.6, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.3),
          SamplingParams(temperature=0.8, min_p=0.01, top_p=0.2),
          SamplingParams(temperature=2.0, top_p=0.5, top_k=300),
          SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=0.7, top_p=0.01),
          SamplingParams(temperature=0.9, top_p=0.6), SamplingParams(temperature=1.0, top_p=0.05)]
n, flagged_rows = len(params), 0
for trial in range(5):
    S.REDRAW_CAP = 16384 if trial < 4 else 8  # the last trial searches rows in place
    logits = torch.randn(n, 3000, generator=g) * (0.05 if trial in (1, 4) else 1.5)
    if trial == 2:  # many ties, a negative-only row
        logits = torch.randint(-3, 3, (n, 3000), generator=g).float()
        logits[6] = -logits[6].abs() - 1
    if trial == 3:  # a few huge values above a flat floor
        logits[:, ::500] += 30
    bp = BatchParams.from_params(params, [trial * n + i for i in range(n)], [trial] * n)
    _, cut_k, cut = _cuts(logits, bp)
    race = _launch_race(logits, bp, cut, cut_k)
    first = race.tokens.clone()
    flagged = race.redo.bool()
    got = _redraw_triton(logits, bp, cut, cut_k, race)
    want = thresholds(logits * bp.inv_temp[:, None], bp)
    assert torch.equal(got[flagged], want[flagged]), (trial, got, want, flagged)
    assert torch.equal(race.tokens[~flagged], first[~flagged])  # unflagged rows untouched
    redrawn = _noisy_argmax_torch(logits, bp, torch.where(flagged, want, cut))
    assert torch.equal(race.tokens[flagged], redrawn[flagged]), (race.tokens, redrawn)
    flagged_rows += int(flagged.sum())
assert flagged_rows >= 15, flagged_rows
# finite logits that overflow to -inf when scaled (temperature 1e-5): every score is -inf, and
# the redraw takes the first index, as the race and torch.argmax do (found by a review)
S.REDRAW_CAP = 16384
logits = torch.tensor([[-1e35, -2e34, -3e34]])
bp = BatchParams.from_params([SamplingParams(temperature=1e-5, top_p=0.9)], [0], [0])
from engine.sampling import _sample_batch_torch, _sample_batch_triton
assert _sample_batch_triton(logits, bp).tolist() == _sample_batch_torch(logits, bp).tolist() == [0]
print("ok")
"""


@pytest.mark.timeout(240)
def test_device_top_p_cut_search_equals_the_sorted_cut_with_ties_and_infinities():
    """The CUDA path's redraw (a search for the row's top-p cut over float32 keys, no sort,
    no host sync, then the race again) gives `thresholds`' sorted cut bit for bit, with
    top-k and min-p, and the race's token under that cut; unflagged rows are left alone."""
    pytest.importorskip("triton")
    res = run_in_triton_interpreter(_CUT_CHECK)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.timeout(240)
def test_triton_kernels_in_interpreter_draw_the_torch_stream_and_the_same_tokens():
    pytest.importorskip("triton")
    res = run_in_triton_interpreter(_TRITON_CHECK)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.8, 1.0), (0.6, 0.95)])
def test_a_row_with_a_non_finite_logit_gets_minus_one_and_the_others_are_sampled(temperature,
                                                                                  top_p):
    logits = _logits(6, 400, 9)
    logits[1, 3], logits[4, 0], logits[5, 399] = float("nan"), float("inf"), float("-inf")
    p = SamplingParams(temperature=temperature, top_p=top_p, logprobs=True)
    bp = BatchParams.from_params([p] * 6, list(range(6)), [2] * 6)
    tokens, logprobs = sample_batch(logits, bp, want_logprobs=True)
    assert tokens[[1, 4, 5]].tolist() == [-1, -1, -1]
    for i in (0, 2, 3):
        assert int(tokens[i]) == sample_reference(logits[i], p, i, 2)[0]


def test_bad_min_p_is_a_request_error():
    from engine.errors import RequestError

    with pytest.raises(RequestError, match="min_p = 1.5"):
        SamplingParams(min_p=1.5).validate(100)
    with pytest.raises(RequestError, match="temperature = inf"):
        SamplingParams(temperature=float("inf")).validate(100)


@pytest.fixture(scope="module")
def llm40(tiny_dir):
    from engine.llm import LLM

    llm = LLM(tiny_dir, max_batch=40, max_model_len=64)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_request_alone_and_in_a_batch_of_40_gets_the_same_tokens(llm40, temperature):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 500, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 20, (40,), generator=g)]
    params = [SamplingParams(max_tokens=6 + i % 5, temperature=temperature, top_p=0.9,
                             seed=100 + i, ignore_eos=True) for i in range(40)]
    together = llm40.generate(prompts, params)
    for i in (0, 17, 39):
        alone, = llm40.generate([prompts[i]], params[i])
        assert together[i].token_ids == alone.token_ids
    if temperature:
        assert len({tuple(o.token_ids) for o in together}) > 30


def _rows(kind, rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    match kind:
        case "normal":
            return torch.randn(rows, vocab, generator=g) * 3
        case "ties":  # few distinct values: whole tie groups straddle the cut
            return torch.randint(-3, 3, (rows, vocab), generator=g).float()
        case "peaked":  # one token holds almost all the mass
            x = torch.randn(rows, vocab, generator=g)
            x[:, 0] = 40.0
            return x
        case "flat":  # equal up to a few ulps
            return 1.0 + torch.randint(0, 4, (rows, vocab), generator=g).float() * 1e-7
        case "wide":  # far below the maximum: zero weight
            return torch.randn(rows, vocab, generator=g) * 60


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["normal", "ties", "peaked", "flat", "wide"]),
       top_p=st.one_of(st.floats(0.001, 1), st.sampled_from([1 - 2**-24, 0.999999, 2**-20])),
       top_k=st.integers(0, 70), min_p=st.sampled_from([0.0, 0.0, 1e-4, 0.3]),
       temperature=st.floats(0.05, 3), seed=st.integers(0, 10**6))
def test_nucleus_test_without_sort_agrees_with_the_sorted_cut_for_every_token(
        kind, top_p, top_k, min_p, temperature, seed):
    from engine.sampling import base_cut, nucleus_holds, nucleus_weights, thresholds

    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = _rows(kind, 3, 64, seed)
    bp = BatchParams.from_params([p] * 3, [seed] * 3, [0] * 3)
    x = logits * bp.inv_temp[:, None]
    cut = thresholds(x, bp)  # sorts
    cut_k, base = base_cut(x, bp)
    q, z = nucleus_weights(x, cut_k)
    V = x.shape[1]  # every token of every row: row r's token v is row r * V + v below
    value = x.reshape(-1)
    rep = lambda t: t.repeat_interleave(V, 0)  # noqa: E731
    fast = nucleus_holds(rep(x), rep(q), rep(z), rep(bp.top_p), value) & (value >= rep(base))
    assert torch.equal(fast, value >= rep(cut)), (x, cut)
    assert bool((x >= cut[:, None]).any(dim=-1).all())  # the maximum is always kept


@pytest.mark.parametrize("kind", ["normal", "ties", "peaked", "flat", "wide"])
def test_batched_sampler_matches_reference_on_adversarial_rows(kind):
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k, min_p=mp)
              for t, tp, k, mp in [(0.6, 0.95, 0, 0.0), (1.0, 0.3, 0, 0.0), (0.6, 0.05, 0, 0.0),
                                   (2.0, 0.5, 30, 0.0), (0.8, 0.9, 0, 0.2), (0, 0.5, 0, 0.0),
                                   (1.0, 1 - 2**-24, 0, 0.0), (1.0, 0.7, 10, 0.01)]] * 4
    logits = _rows(kind, len(params), 700, 11)
    seeds, index = [3 * i + 1 for i in range(len(params))], list(range(len(params)))
    tokens = sample_batch(logits, BatchParams.from_params(params, seeds, index))[0].tolist()
    ref = [sample_reference(logits[i], p, seeds[i], index[i])[0] for i, p in enumerate(params)]
    assert tokens == ref


def test_rows_whose_winner_leaves_the_nucleus_are_redrawn_under_the_sorted_cut():
    from engine.sampling import thresholds

    n = 64  # flat rows, top_p 0.3: the unconstrained winner is outside the nucleus ~70% of rows
    params = [SamplingParams(temperature=1.0, top_p=0.3)] * n
    logits = torch.randn(n, 500, generator=torch.Generator().manual_seed(2)) * 0.1
    bp = BatchParams.from_params(params, list(range(n)), [5] * n)
    tokens = sample_batch(logits, bp)[0].long()
    cut = thresholds(logits, bp)
    assert bool((logits.gather(1, tokens[:, None])[:, 0] >= cut).all())
    free = sample_batch(logits, BatchParams.from_params([SamplingParams(temperature=1.0)] * n,
                                                        list(range(n)), [5] * n))[0].long()
    outside = logits.gather(1, free[:, None])[:, 0] < cut
    assert int(outside.sum()) > n // 3  # the redraw path ran for many rows
    assert torch.equal(tokens[~outside], free[~outside])  # winners inside stand as drawn


_PASSES_CHECK = r"""
from engine.bench.sampler_passes import count_passes
greedy = count_passes(4, 5000, 0.0, 1.0)
assert [p[0] for p in greedy["full"]] == ["_race_kernel"], greedy
top_p = count_passes(4, 5000, 0.6, 0.95)
assert [p[0] for p in top_p["full"]] == ["_race_kernel", "_mass_kernel"], top_p
top_k = count_passes(4, 5000, 0.6, 1.0, top_k=20)  # top-k needs its own passes (torch.topk)
assert "topk" in [p[0] for p in top_k["full"]], top_k
lp = count_passes(4, 5000, 0.6, 0.95, logprobs=True)
assert len(lp["full"]) > len(top_p["full"]), lp
print("ok")
"""


@pytest.mark.timeout(240)
def test_the_cuda_path_reads_the_logits_once_greedy_and_twice_with_top_p():
    """The pass counter (`engine.bench.sampler_passes`) over the Triton path in the interpreter:
    greedy and plain temperature are one kernel pass (finiteness included), top-p two, with no
    torch op over the whole logits; top-k and logprobs add their own."""
    pytest.importorskip("triton")
    res = run_in_triton_interpreter(_PASSES_CHECK)
    assert res.returncode == 0, res.stdout + res.stderr


def test_greedy_accepts_and_ignores_top_k_top_p_min_p_and_seed():
    """What SamplingParams' docstring says (`lockstep generate` refuses the flags instead): a
    greedy row's cuts and seed reach neither the batch's tensors nor its token."""
    cut = SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.9, seed=7)
    cut.validate(100)
    plain = SamplingParams(temperature=0)
    a, b = BatchParams.from_params([cut], [7], [0]), BatchParams.from_params([plain], [11], [0])
    for name in ("inv_temp", "noise", "top_k", "top_p", "min_p"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not (a.any_top_k or a.any_top_p or a.any_min_p)
    logits = _logits(1, 100, 3)
    assert int(sample_batch(logits, a)[0][0]) == int(torch.argmax(logits[0]))
    assert sample_reference(logits[0], cut, 7, 0)[0] == int(torch.argmax(logits[0]))
