"""Overlapped scheduling on one GPU (marker `gpu`, decode_overlap, I20): with graphs on, each
step is built and launched while the previous one runs, its rows reading their input tokens from
the previous step's sampled ids on the device. Tokens and logprobs equal the step-locked
engine's, greedy and sampled, with stop tokens (leftover rows) and a preempting KV pool; a
decode step makes no host synchronization besides the wait for the previous step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("qwen3-0.6b", tmp_path_factory.mktemp("overlap"), seed=2,
                           dtype="bfloat16")


def _prompts(n=48):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 150000, (int(k),), generator=g).tolist()
            for k in torch.randint(4, 200, (n,), generator=g)]


def _run(model_dir, params, overlap, **kw):
    from engine.llm import LLM

    with LLM(model_dir, device="cuda", max_batch=32, max_model_len=512, decode_overlap=overlap,
             **kw) as llm:
        outs = llm.generate(_prompts(), params)
        return outs, llm.steps["replay"], llm.controller.preemptions, llm.controller.leftover_rows


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_overlapped_graph_serving_gives_the_step_locked_tokens(model_dir, temperature):
    """Requests that end by length: the overlapped run has the step-locked run's batches, so
    its tokens and logprobs are the same, bit for bit (bf16 logits are not batch-invariant, so
    a schedule that differs could flip a near-tie: see the stop-token test)."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=48, temperature=temperature, top_p=0.95, seed=9,
                            ignore_eos=True, logprobs=True)
    locked, _, _, _ = _run(model_dir, params, False)
    overlapped, replays, _, _ = _run(model_dir, params, True)
    assert replays > 0
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in locked]
    for a, b in zip(overlapped, locked):
        assert a.logprobs == b.logprobs


def test_overlapped_stops_and_preemptions_end_every_request_on_its_rule(model_dir):
    """Stop tokens (leftover rows dropped) and a preempting KV pool: each request ends on its
    first stop token or at its length, with no token (and no logprob) after the stop."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=48, temperature=0.7, seed=9, ignore_eos=True)
    locked, _, _, _ = _run(model_dir, params, False)
    stops = frozenset(o.token_ids[7] for o in locked[::3])
    params = dataclasses.replace(params, stop_token_ids=tuple(sorted(stops)), logprobs=True)
    outs, replays, preempted, leftover = _run(model_dir, params, True, kv_cache_pages=40)
    assert replays > 0 and preempted > 0 and leftover > 0
    for o in outs:
        assert len(o.logprobs) == len(o.token_ids)  # a leftover row's logprob is dropped too
        first = next((i for i, t in enumerate(o.token_ids) if t in stops), None)
        if first is None:
            assert o.finish_reason == "length" and len(o.token_ids) == 48
        else:
            assert o.finish_reason == "stop" and len(o.token_ids) == first + 1


def test_an_overlapped_decode_step_makes_no_host_sync(model_dir):
    """Under torch's sync debug mode, decode steps of an overlapped run raise on any
    synchronizing call (the wait for the previous step is a CUDA event, which it allows), from
    the step's first op on: retirements and slot moves included (storing a Python scalar into
    a slot's length through indexing once blocked the host until the stream drained)."""
    from protocol.commands import Step
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    with LLM(model_dir, device="cuda", max_batch=8, max_model_len=256) as llm:
        assert llm.controller.config.decode_overlap
        params = [SamplingParams(max_tokens=24 + 3 * i, temperature=0.7, ignore_eos=True,
                                 seed=i) for i in range(8)]  # they end at different steps
        llm.generate(_prompts(8), params)  # warm: every shape met once
        strict = []
        from engine import ranks

        run = ranks.execute

        def execute(worker, ex, command, extras):
            decode_only = (isinstance(command, Step) and command.rows and not command.admits
                           and command.chunk is None)
            if decode_only:  # from its first op to its reply, no sync
                strict.append(command)
                torch.cuda.set_sync_debug_mode("error")
            try:
                return run(worker, ex, command, extras)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        ranks.execute = execute
        try:
            outs = llm.generate(_prompts(8), params)
        finally:
            ranks.execute = run
            torch.cuda.set_sync_debug_mode(0)
        assert len(strict) > 20
        assert any(s.retires for s in strict) and any(s.moves for s in strict)
        assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_overlap_under_tp2_gives_the_step_locked_tokens(model_dir):
    """Two GPUs: every rank samples from the all-gathered logits and feeds its own rows (I20);
    tokens and logprobs equal TP 2 step-locked (graphs on, requests ending by length)."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0.7, seed=3, ignore_eos=True,
                            logprobs=True)
    locked, _, _, _ = _run(model_dir, params, False, tensor_parallel_size=2)
    overlapped, replays, _, _ = _run(model_dir, params, True, tensor_parallel_size=2)
    assert replays > 0
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in locked]
    assert [o.logprobs for o in overlapped] == [o.logprobs for o in locked]
