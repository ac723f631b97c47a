"""Overlapped scheduling in the engine (decode_overlap, I20), on CPU: each step is built while the
previous one runs and its rows read their input tokens from the previous step's sampled ids on
the device. Tokens, logprobs, logits and finish reasons equal the step-locked engine's, under
stop tokens (leftover rows), preemption, chunked prefill and graph replays."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.errors import ParallelConfigError
from engine.llm import LLM
from engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, ignore_eos=True, seed=5,
                         logprobs=True, return_logits=True)


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (k,), generator=g).tolist() for k in (20, 9, 33, 14, 26, 5)]


def _run(model_dir, params, overlap, **kw):
    llm = LLM(model_dir, max_batch=4, max_model_len=64, decode_overlap=overlap, **kw)
    try:
        assert llm.controller.config.decode_overlap is overlap
        return llm.generate(_prompts(), params), llm
    finally:
        llm.shutdown()


def _same(a, b, exact=True):
    """Equal outputs; ``exact=False`` where the schedules differ (a leftover row changes a
    step's batch, and float32 matmuls are not batch-invariant to the last bit on CPU)."""
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        if x.logprobs is not None:
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        if x.logits is not None:
            assert (torch.equal(x.logits, y.logits) if exact
                    else torch.allclose(x.logits, y.logits, atol=1e-5, rtol=0))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kw", [{}, {"kv_cache_pages": 4}, {"max_prefill_tokens": 12},
                                {"cuda_graph": True, "_graph_standin": True}],
                         ids=["roomy", "preempting", "chunked", "graphs"])
def test_overlapped_scheduling_gives_the_step_locked_outputs(tiny_dir, params, kw):
    locked, _ = _run(tiny_dir, params, False, **kw)
    overlapped, llm = _run(tiny_dir, params, True, **kw)
    _same(overlapped, locked)
    if "kv_cache_pages" in kw:
        assert llm.controller.preemptions > 0
    if "cuda_graph" in kw:
        assert llm.steps["replay"] > 0


@pytest.mark.parametrize("kw", [{}, {"kv_cache_pages": 4}], ids=["roomy", "preempting"])
def test_a_stop_token_ends_the_request_with_its_leftover_row_dropped(tiny_dir, kw):
    """The leftover row's token is dropped, and so are its logprob and logits row: one side
    output per token, as step-locked (a reviewer's finding: they were kept)."""
    first, _ = _run(tiny_dir, GREEDY, False)
    # stop each request on the token its step-locked run produced fifth (kept in the output)
    stops = tuple(sorted({o.token_ids[4] for o in first}))
    params = dataclasses.replace(GREEDY, stop_token_ids=stops, logprobs=True,
                                 return_logits=True)
    locked, _ = _run(tiny_dir, params, False, **kw)
    overlapped, llm = _run(tiny_dir, params, True, **kw)
    _same(overlapped, locked, exact=False)
    assert all(o.finish_reason == "stop" and len(o.token_ids) <= 5 for o in overlapped)
    for o in overlapped:
        assert len(o.logprobs) == len(o.token_ids) == o.logits.shape[0]
    assert llm.controller.leftover_rows > 0


def test_decode_overlap_defaults_to_on_at_tp1_and_off_under_tp(tiny_dir):
    llm = LLM(tiny_dir, max_batch=2, max_model_len=32)
    try:
        assert llm.controller.config.decode_overlap is True
    finally:
        llm.shutdown()
    llm = LLM(tiny_dir, max_batch=2, max_model_len=32, tensor_parallel_size=2)
    try:
        assert llm.controller.config.decode_overlap is False
    finally:
        llm.shutdown()


def test_bad_decode_overlap_is_refused_before_any_rank_starts(tiny_dir):
    with pytest.raises(ParallelConfigError,
                       match="decode_overlap = 'yes', expected True, False or None"):
        LLM(tiny_dir, max_batch=2, max_model_len=32, decode_overlap="yes")


def test_overlap_under_tp2_every_rank_samples_and_gives_the_step_locked_outputs(tiny_dir):
    """Two gloo ranks: each samples the same ids from the same all-gathered logits and feeds
    its own rows from them (I20); outputs equal TP 2 step-locked, with a preempting pool."""
    tp2 = dict(kv_cache_pages=4, tensor_parallel_size=2)
    locked, _ = _run(tiny_dir, SAMPLED, False, **tp2)
    overlapped, llm = _run(tiny_dir, SAMPLED, True, **tp2)
    assert llm.controller.preemptions > 0
    _same(overlapped, locked)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_rank_failing_in_an_overlapped_step_is_named_and_no_rank_is_left(tiny_dir, fault):
    """Under overlap a rank's reply to step n comes before step n's device work is done; a
    rank that fails (raises, or is killed) in an overlapped decode step (command 8: startup is
    commands 0-4 on CPU) still ends the run with an error naming it, and no rank process is
    left."""
    import multiprocessing

    from engine.errors import RankError

    with pytest.raises(RankError) as info:
        with LLM(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32,
                 decode_overlap=True, _fault=(1, 8, fault)) as llm:
            llm.generate([[1, 2, 3], [4, 5]], dataclasses.replace(GREEDY, max_tokens=20))
    assert info.value.rank == 1, str(info.value)
    assert multiprocessing.active_children() == []
