"""Non-finite values where they must not matter (issue 13, item 2): stale NaN in a slot's KV
pages past its length, and NaN in another rank's vocabulary rows of the embedding."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]


@pytest.mark.timeout(120)
def test_stale_nan_in_kv_pages_does_not_reach_live_rows(tiny_dir):
    with LLM(tiny_dir, max_batch=2, max_model_len=64) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        kv = llm.ranks.executor.kv
        kv.k.fill_(float("nan"))
        kv.v.fill_(float("nan"))
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want


@pytest.mark.timeout(180)
def test_nan_in_another_ranks_embedding_rows_stays_there(tmp_path):
    """TP 2: rank 1's embedding shard holds NaN in a row no prompt uses; rank 0's ids look up
    rank 1's local row 0 and must contribute zeros, not 0 x NaN."""
    from safetensors.torch import load_file, save_file

    from engine.model_dir import write_model_dir

    model = write_model_dir("tiny", tmp_path / "m", seed=0, dtype="float32")
    with LLM(model, max_batch=2, max_model_len=64) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        vocab = llm.cfg.vocab_size
    for shard in sorted(model.glob("*.safetensors")):
        tensors = load_file(shard)
        if "model.embed_tokens.weight" in tensors:
            tensors["model.embed_tokens.weight"][vocab // 2] = float("nan")
            save_file(tensors, shard, metadata={"format": "pt"})
    with LLM(model, tensor_parallel_size=2, max_batch=2, max_model_len=64) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
