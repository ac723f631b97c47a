"""The eager decode step is ready for CUDA graphs (I12): captured once, a replay after the
static buffers are refreshed with new tokens, positions and slots gives the eager logits."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_decode_step_capture_and_replay_with_new_metadata(tmp_path):
    from engine.executor import RankExecutor
    from engine.model_dir import write_model_dir
    from engine.parallel import SINGLE
    from engine.engine_config import EngineConfig
    from engine.sampling import SamplingParams
    from protocol.commands import Admit, DecodeRow, Step

    d = write_model_dir("tiny-tied", tmp_path / "m", seed=2, dtype="float32")
    torch.cuda.set_device(0)
    ex = RankExecutor(EngineConfig(str(d), device="cuda", dtype="float32", max_batch=4,
                                     max_model_len=128, buckets=(1, 2, 4)), SINGLE)
    ex.load_model()
    ex.allocate_kv(ex.pages_needed())
    ex.assign_pages_per_slot()
    ex.register({rid: (SamplingParams(), 0) for rid in range(3)})  # what the rank loop does
    ex.prefill((Admit(0, 0, tuple(range(3, 40))), Admit(1, 1, (7, 8, 9)),
                Admit(2, 2, tuple(range(100, 117)))))

    def step(tokens, positions):
        rows = tuple(DecodeRow(slot=i, request_id=i, token=t, position=p)
                     for i, (t, p) in enumerate(zip(tokens, positions)))
        return Step(seq=0, rows=rows, bucket=4)

    first = step([5, 6, 7], [37, 3, 17])
    ex.prepare_replay(first)
    eager = ex.decode_forward(4).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ex.decode_forward(4)  # warm-up (Triton compile) outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = ex.decode_forward(4)
    ex.prepare_replay(first)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_logits, eager, rtol=1e-5, atol=1e-5)

    second = step([11, 12, 13], [38, 4, 18])
    ex.prepare_replay(second)
    graph.replay()
    torch.cuda.synchronize()
    replayed = static_logits.clone()
    ex.prepare_replay(second)
    torch.testing.assert_close(replayed, ex.decode_forward(4), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(replayed[:3], eager[:3])
