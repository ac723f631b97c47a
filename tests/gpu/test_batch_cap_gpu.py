"""max_batch between two buckets on one GPU (issue 13, item 1): `LLM(max_batch=100,
cuda_graph=True)` failed at startup with "I9 violated: rank 0 holds 2310144 graph bytes, above
the reserve of 2097152"; now bucket 104 is measured, reserved, captured and replayed."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.timeout(600)
def test_max_batch_100_captures_and_replays_bucket_104(tmp_path):
    from engine.llm import LLM
    from engine.model_dir import write_model_dir
    from engine.sampling import SamplingParams
    from protocol.keys import GraphKey

    model = write_model_dir("tiny", tmp_path / "m", seed=0)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with LLM(model, device="cuda", max_batch=100, max_model_len=64, cuda_graph=True) as llm:
        outs = llm.generate([[1 + i % 400, 2, 3] for i in range(100)], params)
        assert GraphKey(104) in llm.ranks.executor.graphs.keys
        memory = llm.controller.memory
    assert [len(o.token_ids) for o in outs] == [3] * 100
    assert memory.batch_cap == 100
    assert llm.steps["replay"] >= 1  # full 100-row steps replay decode@104
    assert max(llm._startup.graph_bytes.values()) <= memory.graph_reserve_bytes
