"""A max_batch that is not a bucket, through the engine on CPU with the graph stand-in: the
bucket a full batch pads to is measured, captured and replayed (issue 13, item 1: max_batch=3
with buckets 1, 2, 4 replayed 0 of 3 full decode steps)."""

import pytest

from engine.graphs import StandInGraphs
from engine.llm import LLM
from engine.sampling import SamplingParams
from protocol.keys import GraphKey
from sim.invariants import check_trace


@pytest.mark.parametrize("max_batch, bucket", [(3, 4), (5, 8)])
def test_full_batch_replays_the_bucket_that_holds_it(tiny_dir, max_batch, bucket):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(tiny_dir, max_batch=max_batch, max_model_len=64, cuda_graph=True,
             _graph_standin=True, record_trace=True) as llm:
        llm.generate([[1 + i, 2, 3] for i in range(max_batch)], params)
        launches = list(llm.ranks.executor.graphs.launches)
        memory = llm.controller.memory
        captured = llm.ranks.executor.graphs.keys
    assert llm.steps["eager"] == 0 and llm.steps["replay"] == 3
    assert GraphKey(bucket) in captured
    assert launches.count(GraphKey(bucket)) == 1 + 3  # the sweep's launch and three replays
    kept = [b for b in (1, 2, 4, 8) if b <= bucket]
    assert memory.graph_reserve_bytes == StandInGraphs.bytes_per_row * sum(kept)
    assert check_trace(llm.trace, llm.protocol_config.shape.allreduce_bytes) == []
