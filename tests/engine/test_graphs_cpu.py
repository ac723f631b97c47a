"""The engine's graph path through the protocol, on CPU: the stand-in graph runner
(`engine.graphs.StandInGraphs`, eager replays) takes every op the CUDA runner takes, so the
startup sweep's command and op sequence, replay serving, the engine trace, eligibility, errors,
flags and the startup watchdog are checked in CI without a GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.errors import ParallelConfigError, RankError
from engine.graphs import GraphError, GraphTable, StandInGraphs
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from protocol.keys import GraphKey
from protocol.invariants import check_trace

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)


def _graph_llm(d, **kw):
    kw.setdefault("max_batch", 8)
    kw.setdefault("max_model_len", 64)
    return LLM(d, cuda_graph=True, _graph_standin=True, record_trace=True, **kw)


def test_sweep_command_and_op_sequence(tiny_dir):
    llm = _graph_llm(tiny_dir)
    try:
        sends = [e.what for e in llm.trace if e.kind == "send"]
        assert sends[:4] == ["Warmup", "ProfileMemory", "MeasureGraphs", "AllocateKV"]
        assert sends[4:12] == ["Capture", "Launch"] * 4 and sends[12] == "Finalize"
        ops = [(e.what, e.detail) for e in llm.trace if e.kind == "op"]
        # warm-up: one all-reduce per bucket's message size (hidden 64 x 4 bytes per row)
        assert [d for w, d in ops if w == "warmup_collective"] == ["256", "512", "1024", "2048"]
        captures = [d for w, d in ops if w == "upload"]
        assert captures == ["decode@8", "decode@4", "decode@2", "decode@1"]  # largest first
        i = ops.index(("allocate_kv", ops[[w for w, _ in ops].index("allocate_kv")][1]))
        measured = [d for w, d in ops[:i] if w == "record"]
        assert measured == captures  # the whole retained set measured before KV sizing (I9)
        assert ("free_graphs", "") in ops[:i]
        assert llm.ranks.executor.graphs.keys == tuple(GraphKey(b) for b in (1, 2, 4, 8))
        reserve = llm.controller.memory.graph_reserve_bytes
        assert reserve == StandInGraphs.bytes_per_row * (1 + 2 + 4 + 8)
    finally:
        llm.shutdown()
    tail = [e.what for e in llm.trace if e.kind == "op"][-3:]
    assert tail == ["synchronize", "free_graphs", "destroy_communicator"]  # I10
    assert check_trace(llm.trace, llm.protocol_config.shape.allreduce_bytes) == []


def test_replay_serving_matches_eager_and_trace_is_clean(tiny_dir):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8] * 5, [9, 10], [11] * 9]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, return_logits=True)
              for n in (6, 2, 5, 3, 7)]  # different lengths: retirements and compactions
    with _graph_llm(tiny_dir, max_batch=4) as llm:
        llm.step_log = []
        got = llm.generate(prompts, params)
        launches = list(llm.ranks.executor.graphs.launches)
        kinds = [s[0] for s in llm.step_log]
    with LLM(tiny_dir, max_batch=4, max_model_len=64) as eager:
        want = eager.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert (g.logits - w.logits).abs().max() < 1e-5
    steps = [e for e in llm.trace if e.kind == "send" and e.what == "Step"]
    # the fifth prompt is admitted beside decode rows: that mixed step replays too
    assert "mixed" in kinds and llm.steps["eager"] == 0 and llm.steps["replay"] > 0
    assert len(launches) == 3 + llm.steps["replay"]  # 3 sweep launches (buckets 4, 2, 1)
    assert steps
    assert check_trace(llm.trace, llm.protocol_config.shape.allreduce_bytes) == []


def test_tp2_gloo_sweep_and_replay(tiny_dir):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8] * 5]
    with _graph_llm(tiny_dir, tensor_parallel_size=2, max_batch=4) as llm:
        got = llm.generate(prompts, GREEDY)
    with LLM(tiny_dir, max_batch=4, max_model_len=64) as tp1:
        want = tp1.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.steps["replay"] > 0
    ranks = {e.rank for e in llm.trace if e.kind == "op"}
    assert ranks == {0, 1}
    assert check_trace(llm.trace, llm.protocol_config.shape.allreduce_bytes) == []


def test_uncaptured_key_is_refused_by_worker_and_executor(tiny_dir):
    from protocol.commands import Admit, DecodeRow, PageAssign, Step

    llm = _graph_llm(tiny_dir, max_batch=2)
    try:
        ex = llm.ranks.executor
        with pytest.raises(GraphError, match=r"launch\(decode@4\) refused: no graph was "
                                              r"captured for this key"):
            ex.launch(GraphKey(4))
        seq = llm.controller.seq + 1
        llm.ranks.send(Step(seq, admits=(Admit(99, 0, (1, 2, 3)),),
                            pages=(PageAssign(99, 0, 0, (0,)),)),
                       {99: (SamplingParams(), 0)})
        (reply, _, _), = llm.ranks.collect()
        assert reply.ok
        # a step that asks to replay a key the sweep never captured (bucket 4 > batch cap 2)
        step = Step(seq + 1, rows=(DecodeRow(0, 99, 1, 3),), key=GraphKey(4), bucket=4)
        llm.ranks.send(step, None)
        (reply, _, _), = llm.ranks.collect()
        assert not reply.ok and "decode@4, which was not captured at startup (I3)" in reply.error
    finally:
        llm._abort()


def test_graph_ops_out_of_order_are_refused():
    table = GraphTable()
    key = GraphKey(8)
    with pytest.raises(GraphError, match=r"instantiate\(decode@8\) refused: the graph is not "
                                         "recorded"):
        table.instantiate(key)
    table.record(key)
    with pytest.raises(GraphError, match="upload.*is recorded, expected instantiated"):
        table.upload(key)
    with pytest.raises(GraphError, match="launch.*is recorded, expected instantiated"):
        table.launch(key)
    with pytest.raises(GraphError, match="already recorded"):
        table.record(key)
    table.instantiate(key)
    table.launch(key)  # MeasureGraphs-style (never uploaded) is the caller's choice
    table.free()
    assert table.keys == ()


def test_executor_without_graphs_refuses_graph_ops(tiny_dir):
    with LLM(tiny_dir, max_batch=2, max_model_len=32) as llm:
        ex = llm.ranks.executor
        with pytest.raises(GraphError, match="cuda_graph=False"):
            ex.record(GraphKey(1))
        assert ex.graph_memory() == 0
        ex.free_graphs()  # no graphs: a no-op


def test_graphs_default_off_on_cpu_and_plan_eligibility(tiny_dir):
    settings = EngineConfig.create(tiny_dir, max_batch=8)
    pconfig = settings.protocol_config()
    assert settings.cuda_graph is False and pconfig.cuda_graphs is False
    settings = EngineConfig.create(tiny_dir, max_batch=5, graph_standin=True, cuda_graph=True)
    pconfig = settings.protocol_config()
    assert pconfig.cuda_graphs and settings.buckets == (1, 2, 4, 8)
    with LLM(tiny_dir, max_batch=3, max_model_len=32) as llm:
        assert [e for e in llm.trace] == [] and llm.controller.plan.keys() == ()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(cuda_graph=True), "cuda_graph = True needs device = 'cuda'"),
    (dict(cuda_graph="yes"), "cuda_graph = 'yes'"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization = 0.0"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization = 1.5"),
    (dict(startup_timeout_s=0), "startup_timeout_s = 0"),
])
def test_bad_graph_settings_rejected_before_load(tiny_dir, kwargs, fragment, monkeypatch):
    import engine.executor

    def no_load(*a, **k):
        raise AssertionError("model construction must not start")

    monkeypatch.setattr(engine.executor.RankExecutor, "load_model", no_load)
    with pytest.raises(ParallelConfigError, match=fragment.replace("(", r"\(")):
        LLM(tiny_dir, **kwargs)


def test_cli_cuda_graph_flags(tiny_dir, capsys):
    from lockstep.cli import main

    base = ["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2,3", "--max-tokens", "3"]
    assert main(base + ["--cuda-graph"]) == 2
    assert ("--cuda-graph needs --device cuda (--device cpu, the default, runs eager only)"
            in capsys.readouterr().err)
    assert main(base + ["--no-cuda-graph", "--max-batch", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("token_ids: ") and "CUDA graphs off" in out.err
    assert main(base + ["--gpu-memory-utilization", "2"]) == 2
    assert "--gpu-memory-utilization 2 must be a fraction in (0, 1]" in capsys.readouterr().err


def test_startup_watchdog_aborts_a_wedged_sweep(tiny_dir):
    script = textwrap.dedent(f"""
        from engine.llm import LLM
        LLM({str(tiny_dir)!r}, max_batch=2, max_model_len=32, cuda_graph=True,
            _graph_standin=True, startup_timeout_s=6.0, _fault=(0, 4, "hang"))
        print("survived")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGABRT, proc.stderr[-2000:]
    assert "survived" not in proc.stdout
    assert "startup watchdog expired after 6 s during command 4 (Capture)" in proc.stderr


def test_watchdog_is_disarmed_after_a_sweep_error(tiny_dir):
    """The watchdog's timer thread ends with the failed startup. (Its timeout is long, so a
    loaded machine cannot make it fire and abort the test run, as a 1 s timeout once did: a
    still-armed watchdog shows as its timer thread still waiting.)"""
    import threading
    import time

    with pytest.raises(RankError, match="injected fault at command 4"):
        LLM(tiny_dir, max_batch=2, max_model_len=32, cuda_graph=True, _graph_standin=True,
            startup_timeout_s=300.0, _fault=(0, 4, "raise"))
    deadline = time.monotonic() + 5
    while (time.monotonic() < deadline
           and [t for t in threading.enumerate() if isinstance(t, threading.Timer)]):
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer)]


def test_gpu_memory_utilization_given_on_cpu_is_refused_and_its_default_holds_on_cuda(tiny_dir):
    """From Python, as `lockstep generate` refuses it (a fresh user's finding: on CPU it was
    taken and did nothing); left out, the default reaches the config. A value out of range is
    named as such first (the test above)."""
    from engine.engine_config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig

    with pytest.raises(ParallelConfigError, match=r"gpu_memory_utilization = 0\.5 applies to "
                                                  r"device = 'cuda' only"):
        EngineConfig.create(tiny_dir, gpu_memory_utilization=0.5)
    assert EngineConfig.create(tiny_dir).gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
