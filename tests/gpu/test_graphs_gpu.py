"""CUDA graphs on one GPU (marker `gpu`; skipped only where CUDA is unavailable): replay vs
eager (same tokens, bit-identical logits at the same bucket), vs HF, bucket straddles,
changing lengths, compaction, requests joining and leaving, memory reservation, refusals,
the engine trace, and the startup watchdog aborting a wedged sweep. Figures are printed
(-s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("tiny-tied", tmp_path_factory.mktemp("g"), seed=5, dtype="float32")


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(torch.randint(3, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _params(n):
    from engine.sampling import SamplingParams

    # different lengths: requests retire at different steps, so slots compact and the
    # bucket changes between replays
    return [SamplingParams(max_tokens=4 + (7 * i) % 13, temperature=0, ignore_eos=True,
                           return_logits=True) for i in range(n)]


@pytest.fixture(scope="module")
def runs(model_dir):
    """The same workloads through a graph engine and an eager engine (max_batch 16)."""
    from engine.llm import LLM

    work = {"straddle5": (_prompts(5, 1), _params(5)), "straddle9": (_prompts(9, 2), _params(9)),
            "join_leave": (_prompts(23, 3), _params(23))}
    out = {}
    for graphs in (True, False):
        with LLM(model_dir, device="cuda", max_batch=16, max_model_len=128, cuda_graph=graphs,
                 record_trace=True) as llm:
            res = {k: llm.generate(p, ps) for k, (p, ps) in work.items()}
            out[graphs] = (res, llm)
    return out


@pytest.mark.timeout(300)
def test_replay_same_tokens_and_bit_identical_logits(runs):
    graph, eager = runs[True][0], runs[False][0]
    llm = runs[True][1]
    assert llm.steps["replay"] > 0
    for name in graph:
        for g, e in zip(graph[name], eager[name]):
            assert g.token_ids == e.token_ids, name
            diff = float((g.logits - e.logits).abs().max())
            assert torch.equal(g.logits, e.logits), f"{name}: max |graph - eager| {diff}"


@pytest.mark.timeout(300)
def test_bf16_replay_of_ordered_buckets_is_bit_identical_to_eager(tmp_path):
    """bf16 (the LM head writes float32 from its GEMM) and buckets of at least ORDER_MIN_ROWS
    rows (decode attention takes its rows longest first): replay and eager agree bit for bit."""
    from engine.kernels.decode_attention import ORDER_MIN_ROWS
    from engine.llm import LLM
    from engine.model_dir import write_model_dir
    from engine.sampling import SamplingParams

    model = write_model_dir("tiny", tmp_path / "bf16", seed=2, dtype="bfloat16")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 90, (100,), generator=g)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    out = {}
    for graphs in (True, False):
        with LLM(model, device="cuda", dtype="bfloat16", max_batch=100, max_model_len=128,
                 cuda_graph=graphs) as llm:
            llm.step_log = []
            out[graphs] = llm.generate(prompts, params)
            if graphs:
                assert llm.steps["replay"] > 0
                assert max(s[1] for s in llm.step_log if s[0] == "decode") >= ORDER_MIN_ROWS
    for a, b in zip(out[True], out[False]):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)


@pytest.mark.timeout(300)
def test_straddles_compaction_and_trace(runs):
    from protocol.invariants import check_trace

    llm = runs[True][1]
    steps = [e for e in llm.trace if e.kind == "op" and e.what == "launch"
             and e.detail in ("decode@8", "decode@16")]
    assert {e.detail for e in steps} == {"decode@8", "decode@16"}  # 5 -> 8 and 9 -> 16
    moves = [e for e in llm.trace if e.kind == "op" and e.what == "move_slot"]
    assert moves, "no slot compaction happened"
    later = [e for e in llm.trace if e.kind == "op" and e.what == "launch"
             and e.seq > moves[0].seq]
    assert later, "no replay after a compaction"
    assert check_trace(llm.trace, llm.protocol_config.shape.allreduce_bytes) == []


@pytest.mark.timeout(300)
def test_graph_memory_within_reserve_before_kv(runs):
    llm = runs[True][1]
    graphs = max(llm._startup.graph_bytes.values())
    reserve = llm.controller.memory.graph_reserve_bytes
    print(f"\ntiny-tied graphs: {llm._startup.captured} captured in "
          f"{llm._startup.capture_s:.3f} s; held {graphs / 2**20:.1f} MiB, "
          f"reserved {reserve / 2**20:.1f} MiB")
    assert 0 < graphs <= reserve
    ops = [e.what for e in llm.trace if e.kind == "op"]
    assert ops.index("record") < ops.index("allocate_kv") < ops.index("upload")


@pytest.mark.timeout(300)
def test_vs_hf_within_eager_tolerance(model_dir):
    from transformers import AutoModelForCausalLM

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    prompt = list(range(10, 60))
    with LLM(model_dir, device="cuda", max_batch=4, max_model_len=128) as llm:
        out, = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                      ignore_eos=True, return_logits=True))
        assert llm.steps["replay"] == 23
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    rel = float((out.logits - ref).abs().max() / ref.abs().max())
    print(f"\ngraph replay float32 vs HF: max relative logit error {rel:.3g}")
    assert rel < 1e-4


@pytest.mark.timeout(300)
def test_uncaptured_and_ineligible_keys_raise(model_dir):
    from engine.executor import RankExecutor
    from engine.graphs import GraphError
    from engine.parallel import SINGLE
    from engine.engine_config import EngineConfig
    from protocol.keys import GraphKey

    torch.cuda.set_device(0)
    ex = RankExecutor(EngineConfig(str(model_dir), device="cuda", max_batch=4,
                                     max_model_len=64, buckets=(1, 2, 4), cuda_graph=True),
                      SINGLE)
    ex.load_model()
    ex.allocate_kv(ex.pages_needed())
    ex.assign_pages_per_slot()
    ex.record(GraphKey(2))
    with pytest.raises(GraphError, match="upload.*expected instantiated"):
        ex.upload(GraphKey(2))
    ex.instantiate(GraphKey(2))
    ex.upload(GraphKey(2))
    ex.launch(GraphKey(2))
    with pytest.raises(GraphError, match=r"launch\(decode@4\) refused: no graph was captured"):
        ex.launch(GraphKey(4))
    assert ex.graph_memory() > 0
    ex.free_graphs()
    assert ex.graph_memory() == 0


@pytest.mark.timeout(300)
def test_wedged_sweep_watchdog_aborts_the_process(model_dir):
    script = textwrap.dedent(f"""
        from engine.llm import LLM
        LLM({str(model_dir)!r}, device="cuda", max_batch=2, max_model_len=32,
            startup_timeout_s=60.0, _fault=(0, 4, "hang"))
        print("survived")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=250)
    assert proc.returncode == -signal.SIGABRT, proc.stderr[-2000:]
    assert "startup watchdog expired after 60 s during command 4 (Capture)" in proc.stderr
