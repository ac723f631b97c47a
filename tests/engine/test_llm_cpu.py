"""`LLM` at tensor-parallel size 1 on CPU: logits and greedy tokens against HF transformers at
the same weights, continuous batching, sampling, and per-request errors."""

from __future__ import annotations

import pytest
import torch

from engine.errors import RequestError
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.testing import hf_greedy, hf_logits

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, return_logits=True)
PROMPT = [5, 6, 7, 8, 100, 200, 300, 17, 42]


@pytest.fixture(scope="module", params=["tiny_dir", "tiny_tied_dir"])
def model(request):
    d = request.getfixturevalue(request.param)
    llm = LLM(d, max_batch=4, max_model_len=96)
    yield d, llm
    llm.shutdown()


def test_logits_and_greedy_tokens_match_hf(model, hf_model):
    d, llm = model
    hf = hf_model(d)
    out, = llm.generate([PROMPT], GREEDY)
    assert out.token_ids == hf_greedy(hf, PROMPT, 32)
    ref = hf_logits(hf, PROMPT + out.token_ids[:-1])[len(PROMPT) - 1:]
    rel = float((out.logits - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, rel


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1, 12)]


def test_continuous_batching_gives_each_request_its_solo_tokens(model, monkeypatch):
    _, llm = model
    executor = llm.ranks.executor
    moves = []
    real_move = executor.move_slot
    monkeypatch.setattr(executor, "move_slot",
                        lambda src, dst: (moves.append((src, dst)), real_move(src, dst)))
    prompts = _prompts()
    params = [SamplingParams(max_tokens=m, temperature=t, top_k=k, seed=i, ignore_eos=True)
              for i, (m, t, k) in enumerate([(5, 0, 0), (12, 0.8, 50), (3, 0, 0), (9, 1.0, 0),
                                             (14, 0.7, 10), (7, 0, 0)])]
    together = llm.generate(prompts, params)  # 6 requests over 4 slots: queueing + compaction
    assert moves, "vacuous: no retirement compacted a live slot"
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    for t, a, q in zip(together, alone, params):
        assert t.error is None and len(t.token_ids) == q.max_tokens
        assert t.token_ids == a.token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    _, llm = model
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    a, b = llm.generate([PROMPT, PROMPT], [p, p])
    c, = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=124,
                                                ignore_eos=True))
    assert a.token_ids == b.token_ids and a.seed == 123
    assert a.token_ids != c.token_ids
    top1, = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, top_k=1,
                                                   seed=5, ignore_eos=True))
    greedy, = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True))
    assert top1.token_ids == greedy.token_ids
    nucleus, = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0,
                                                      top_p=1e-6, seed=9, ignore_eos=True))
    assert nucleus.token_ids == greedy.token_ids


def test_logprobs_are_log_softmax_of_the_logits(model):
    _, llm = model
    out, = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.9, seed=3,
                                                  ignore_eos=True, logprobs=True,
                                                  return_logits=True))
    want = torch.log_softmax(out.logits, -1)[torch.arange(6), torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs), want)


def test_stop_tokens_end_a_request(model):
    _, llm = model
    free, = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True))
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    out, = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0,
                                                  ignore_eos=True, stop_token_ids=(stop,)))
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    assert free.finish_reason == "length"


@pytest.mark.parametrize("prompt, params, fragment", [
    (list(range(90)), SamplingParams(max_tokens=10), "exceeds max_model_len 96"),
    ([1], SamplingParams(max_tokens=96), "prompt of 1 token + max_tokens 96 = 97 exceeds"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature = -1.0"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens = 0"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p = 0.0"),
    ([1, 2], SamplingParams(top_k=-5), "top_k = -5"),
    ([1, 2], SamplingParams(seed=-3), "seed = -3"),
    ([1, 2], SamplingParams(seed=2**64), f"seed = {2**64}, expected None or an integer in"),
    ([1, 2], SamplingParams(stop_token_ids=(512,)), "stop token id 512"),
    ([1, 512], SamplingParams(), "prompt token id 512"),
    ([], SamplingParams(), "prompt is empty"),
    ("hi \udcff", SamplingParams(), "text prompt is not valid UTF-8 text: '\\udcff' at character 3"),
])
def test_a_bad_request_gets_its_own_error_while_others_finish(model, prompt, params, fragment):
    _, llm = model
    good = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.generate([[3, 4, 5], prompt, [6, 7]], [good, params, good])
    assert isinstance(outs[1].error, RequestError) and fragment in str(outs[1].error)
    assert outs[1].token_ids == []
    assert [o.error for o in (outs[0], outs[2])] == [None, None]
    assert outs[0].token_ids == llm.generate([[3, 4, 5]], good)[0].token_ids
    assert len(outs[2].token_ids) == 5


def test_text_prompt_without_a_tokenizer_is_a_request_error(no_tokenizer_dir):
    with LLM(no_tokenizer_dir, max_batch=2, max_model_len=32) as llm:
        outs = llm.generate(["hello", [1, 2]], SamplingParams(max_tokens=2))
    assert isinstance(outs[0].error, RequestError) and "has no tokenizer" in str(outs[0].error)
    assert outs[1].error is None and len(outs[1].token_ids) == 2


def test_a_text_prompt_encoded_past_the_vocabulary_is_that_request_error(mismatched_tokenizer_dir):
    """A tokenizer whose ids run past the model's vocabulary: the text prompt is refused alone
    (it indexed the embedding out of range at TP 1, and was silently masked at TP 2)."""
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with LLM(mismatched_tokenizer_dir, max_batch=2, max_model_len=32) as llm:
        outs = llm.generate([[1, 2], "hi", [3, 4]], greedy)
        assert llm.generate(["i"], greedy)[0].error is None  # ids in range: served
    assert isinstance(outs[1].error, RequestError) and outs[1].token_ids == []
    assert ("text prompt 'hi' encodes to token id 700, outside the model's vocabulary [0, 512)"
            in str(outs[1].error))
    assert [o.error for o in (outs[0], outs[2])] == [None, None]
    assert len(outs[0].token_ids) == len(outs[2].token_ids) == 2


def test_eos_from_generation_config_stops_unless_ignored(tiny_dir, tmp_path):
    import json
    import shutil

    with LLM(tiny_dir, max_batch=1, max_model_len=64) as llm:
        free, = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0,
                                                       ignore_eos=True))
    d = tmp_path / "eos"
    shutil.copytree(tiny_dir, d)
    eos = free.token_ids[5]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 0]}))
    with LLM(d, max_batch=1, max_model_len=64) as llm:
        stopped, = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0))
        ignored, = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0,
                                                          ignore_eos=True))
    cut = free.token_ids.index(eos) + 1
    assert stopped.token_ids == free.token_ids[:cut] and stopped.finish_reason == "stop"
    assert ignored.token_ids == free.token_ids


def test_sampling_fields_of_generation_config_are_ignored_not_checked(tiny_dir, tmp_path,
                                                                      capsys):
    """What load_model_config's docstring and the README say: only eos_token_id is read, so
    values that no request could carry (temperature -3, top_p 7) neither fail nor change the
    tokens; a request samples as its SamplingParams say."""
    import json
    import shutil

    from lockstep.cli import main

    d = tmp_path / "gen"
    shutil.copytree(tiny_dir, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=-3, top_p=7, top_k="many", min_p=None)
    (d / "generation_config.json").write_text(json.dumps(gen))
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, seed=3, ignore_eos=True)]
    outs = {}
    for model in (tiny_dir, d):
        with LLM(model, max_batch=2, max_model_len=32) as llm:
            outs[model] = [o.token_ids for o in llm.generate([PROMPT, PROMPT], params)]
    assert outs[d] == outs[tiny_dir]
    assert main(["generate", "--model", str(d), "--prompt-ids", "1,2", "--max-tokens",
                 "2"]) == 0
    capsys.readouterr()


def test_closed_llm_refuses_work(tiny_dir):
    llm = LLM(tiny_dir, max_batch=1, max_model_len=32)
    llm.shutdown()
    with pytest.raises(RuntimeError) as info:
        llm.generate([[1, 2]])
    assert str(info.value) == "this LLM is closed (shut down); build a new LLM"


def test_an_in_process_rank_failure_closes_the_llm(tiny_dir):
    from engine.errors import RankError

    llm = LLM(tiny_dir, max_batch=1, max_model_len=32, _fault=(0, 6, "raise"))
    with pytest.raises(RankError) as info:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert info.value.rank == 0 and "injected fault at command 6" in str(info.value)
    with pytest.raises(RuntimeError) as info:
        llm.generate([[1, 2]])
    assert str(info.value).startswith("this LLM is closed (stopped by ")
    assert "injected fault at command 6" in str(info.value)


def test_an_llm_closed_by_ctrl_c_says_so(tiny_dir, monkeypatch):
    """A fresh user caught KeyboardInterrupt around generate and called it again: "this LLM is
    closed (after shutdown or a rank failure)" named neither."""
    llm = LLM(tiny_dir, max_batch=1, max_model_len=32)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.ranks, "collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(RuntimeError) as info:
        llm.generate([[1, 2]])
    assert str(info.value) == "this LLM is closed (interrupted by Ctrl-C); build a new LLM"


@pytest.mark.timeout(300)
def test_a_config_naming_10_to_the_12_positions_runs_with_a_table_of_max_model_len(
        tiny_dir, tmp_path):
    """Found by a fresh user: max_position_embeddings = 10**12 in config.json gave a 30-line
    traceback (the RoPE table was sized from the config: 32 GB for 10**9 positions), even with
    --max-model-len 64. The table now has max_model_len rows, and the tokens are those of the
    same weights under the shipped config."""
    import json
    import shutil

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    big = tmp_path / "m"
    shutil.copytree(tiny_dir, big)
    cfg = json.loads((big / "config.json").read_text())
    cfg["max_position_embeddings"] = 10**12
    (big / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for path in (tiny_dir, big):
        with LLM(str(path), device="cpu", max_model_len=64) as llm:
            assert llm.ranks.executor.model.rotary.cos.shape[0] == 64
            outs.append(llm.generate([[5, 6, 7]], params)[0].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_a_startup_the_memory_fit_refuses_names_the_settings_to_change(tiny_dir, monkeypatch):
    """Old behaviour (an H100, gpu_memory_utilization 0.01): "rank 0 failed: startup refused:
    rank 0 has -33569792 bytes ..." as a rank failure, exit 1, naming no setting."""
    from engine.errors import ParallelConfigError
    from engine.executor import RankExecutor

    monkeypatch.setattr(RankExecutor, "profile_memory", lambda self, rows: (0, 4096))
    with pytest.raises(ParallelConfigError) as info:
        LLM(tiny_dir, max_batch=2, max_model_len=32)
    line = str(info.value)
    assert line.startswith("startup refused: rank 0 has no bytes (0 free, 4096 of activations, ")
    assert line.endswith("; lower max_batch (now 2) or max_model_len (now 32)")
    assert "\n" not in line
