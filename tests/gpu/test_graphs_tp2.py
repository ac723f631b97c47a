"""CUDA graphs at TP 2 over NCCL, one process per rank (marker `gpu`; skipped with fewer
than 2 GPUs): the startup sweep (warm-up per size, Capture/Launch barrier per key), graph vs
eager token-exact and vs HF, bucket straddles, replay after compaction, 16 concurrent requests
to completion, clean teardown."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("tiny-tied", tmp_path_factory.mktemp("tp2"), seed=6, dtype="float32")


def _work():
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (5 + 3 * i,), generator=g).tolist() for i in range(16)]
    params = [SamplingParams(max_tokens=3 + (5 * i) % 11, temperature=0, ignore_eos=True,
                             return_logits=True) for i in range(16)]
    return {"five": (prompts[:5], params[:5]), "nine": (prompts[5:14], params[5:14]),
            "sixteen": (prompts, params)}


@pytest.fixture(scope="module")
def runs(model_dir):
    from engine.llm import LLM

    out = {}
    for graphs in (True, False):
        with LLM(model_dir, tensor_parallel_size=2, device="cuda", max_batch=16,
                 max_model_len=128, cuda_graph=graphs, record_trace=True,
                 step_timeout_s=120) as llm:
            out[graphs] = ({k: llm.generate(p, ps) for k, (p, ps) in _work().items()}, llm)
        assert multiprocessing.active_children() == []  # clean teardown, no rank left
    return out


@pytest.mark.timeout(400)
def test_tp2_startup_sweep_warmup_and_barrier(runs):
    from protocol.invariants import check_trace

    llm = runs[True][1]
    keys = llm.controller.plan.keys()
    assert [k.bucket for k in keys] == [16, 8, 4, 2, 1]
    sends = [e for e in llm.trace if e.kind == "send"]
    names = [e.what for e in sends]
    assert names[:4] == ["Warmup", "ProfileMemory", "MeasureGraphs", "AllocateKV"]
    assert names[4:4 + 2 * len(keys)] == ["Capture", "Launch"] * len(keys)
    warm = {(e.rank, int(e.detail)) for e in llm.trace
            if e.kind == "op" and e.what == "warmup_collective"}
    size = llm.protocol_config.shape.allreduce_bytes
    assert warm == {(r, size(k.bucket)) for r in (0, 1) for k in keys}
    # every rank uploaded key k (Capture replies collected) before any rank launched it
    assert check_trace(llm.trace, size) == []
    print(f"\nTP2 tiny-tied: {llm._startup.captured} graphs captured in "
          f"{llm._startup.capture_s:.3f} s, graph bytes per rank "
          f"{ {r: b // 2**20 for r, b in llm._startup.graph_bytes.items()} } MiB")


@pytest.mark.timeout(400)
def test_tp2_graph_vs_eager_straddles_compaction_and_16_concurrent(runs):
    graph, eager = runs[True][0], runs[False][0]
    llm = runs[True][1]
    for name in graph:
        assert [o.token_ids for o in graph[name]] == [o.token_ids for o in eager[name]], name
        assert all(o.finish_reason == "length" for o in graph[name])
        for g, e in zip(graph[name], eager[name]):
            assert float((g.logits - e.logits).abs().max()) < 1e-4
    launched = {e.detail for e in llm.trace if e.kind == "op" and e.what == "launch"
                and e.seq > min(x.seq for x in llm.trace if x.what == "Step")}
    assert {"decode@8", "decode@16"} <= launched  # 5 -> 8, 9 -> 16, 16 concurrent
    moves = [e.seq for e in llm.trace if e.kind == "op" and e.what == "move_slot"]
    assert moves and any(e.seq > moves[0] for e in llm.trace
                         if e.kind == "op" and e.what == "launch")


@pytest.mark.timeout(400)
def test_tp2_graphs_vs_hf(model_dir):
    from transformers import AutoModelForCausalLM

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    prompt = list(range(10, 60))
    with LLM(model_dir, tensor_parallel_size=2, device="cuda", max_batch=2,
             max_model_len=128) as llm:
        out, = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0,
                                                      ignore_eos=True, return_logits=True))
        assert llm.steps["replay"] == 19
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    rel = float((out.logits - ref).abs().max() / ref.abs().max())
    print(f"\nTP2 graph replay float32 vs HF: max relative logit error {rel:.3g}")
    assert rel < 1e-4
    assert multiprocessing.active_children() == []
