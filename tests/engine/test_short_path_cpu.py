"""The engine on the short-context decode path (`protocol.keys.SHORT`), on CPU with the
stand-in graph runner: the graphs captured for it, the replays the controller picks as a
sequence grows past `SHORT_DECODE_TOKENS`, the same tokens and logits as without the path (on
the CPU it runs the ordinary attention), and the engine settings that turn it off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine_config import SHORT_DECODE_MAX_BUCKET, SHORT_DECODE_TOKENS, EngineConfig
from engine.errors import ParallelConfigError
from engine.llm import LLM
from engine.sampling import SamplingParams


def _config(d, short: bool, **kw) -> EngineConfig:
    kw.setdefault("max_batch", 4)
    config = EngineConfig.create(d, cuda_graph=True, graph_standin=True, record_trace=True,
                                 max_model_len=256, dtype="bfloat16", **kw)
    return dataclasses.replace(config, short_decode=short)


def _launches(llm) -> list[str]:
    return [e.detail for e in llm.trace if e.kind == "op" and e.what == "launch"]


@pytest.mark.timeout(300)
def test_a_growing_sequence_replays_the_short_path_until_its_context_passes_the_tile(tiny_dir):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (SHORT_DECODE_TOKENS - 4,), generator=g).tolist()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, return_logits=True)
    out = {}
    for short in (True, False):
        with LLM(_config(tiny_dir, short)) as llm:
            uploads = [e.detail for e in llm.trace if e.kind == "op" and e.what == "upload"]
            before = len(_launches(llm))
            out[short] = llm.generate([prompt], params)[0]
            served = _launches(llm)[before:]
            pair = llm.generate([prompt[:20], prompt[:30]],
                                SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            pair_served = _launches(llm)[before + len(served):]
        if short:
            assert uploads == ["decode@4", "decode@2", "decode@1", "decode-short@1"]
            # decode steps write positions len(prompt) .. len(prompt) + 8: contexts
            # SHORT_DECODE_TOKENS - 3 .. + 5; the first four fit the tile
            assert served == ["decode-short@1"] * 4 + ["decode@1"] * 5, served
            assert set(pair_served) == {"decode@2"}, pair_served  # above SHORT_DECODE_MAX_BUCKET
        else:
            assert uploads == ["decode@4", "decode@2", "decode@1"]
            assert set(served) == {"decode@1"}
        assert len(pair) == 2
    assert out[True].token_ids == out[False].token_ids
    assert torch.equal(out[True].logits, out[False].logits)


def test_the_short_path_is_off_where_it_cannot_run(tiny_dir):
    base = _config(tiny_dir, True)
    assert base.short_context == SHORT_DECODE_TOKENS
    assert base.protocol_config().short_context == SHORT_DECODE_TOKENS
    assert base.protocol_config().short_max_bucket == SHORT_DECODE_MAX_BUCKET
    for change in (dict(short_decode=False), dict(cuda_graph=False, graph_standin=False),
                   dict(decode_gemm="cublas"), dict(buckets=(2, 4)), dict(dtype="float32"),
                   dict(page_size=2 * SHORT_DECODE_TOKENS)):
        config = dataclasses.replace(base, **change)
        assert config.short_context is None, change
        assert config.protocol_config().short_context is None, change
    # create: on only with CUDA graphs at TP 1, never on the CPU
    assert not EngineConfig.create(tiny_dir).short_decode


def test_create_turns_the_short_path_on_for_cuda_graphs_at_tp_1_unless_the_environment_says_no(
        monkeypatch):
    from engine.engine_config import short_decode_default

    assert short_decode_default("cuda", True, 1)
    assert not short_decode_default("cuda", False, 1)
    assert not short_decode_default("cuda", True, 2)
    assert not short_decode_default("cpu", True, 1)
    for name in ("LOCKSTEP_SHORT_DECODE", "LOCKSTEP_FUSED_NORM"):
        monkeypatch.setenv(name, "0")
        assert not short_decode_default("cuda", True, 1), name
        monkeypatch.delenv(name)


def test_short_decode_must_be_a_bool(tiny_dir):
    with pytest.raises(ParallelConfigError, match="short_decode = 'yes', expected True or False"):
        dataclasses.replace(_config(tiny_dir, True), short_decode="yes").validate()
