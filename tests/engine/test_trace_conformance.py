"""Issue #3 item 6: the eager engine's recorded protocol trace passes the simulator's invariant
checkers, with the same code they run on simulated traces, at TP 1 and TP 2 (gloo)."""

import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams
from protocol.trace import TraceEvent
from protocol.invariants import check_trace


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2])
def test_eager_engine_trace_passes_the_simulators_checks(tiny_dir, tp):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 2, 4)]
    with LLM(tiny_dir, tensor_parallel_size=tp, max_batch=4, max_model_len=64,
             record_trace=True) as llm:
        llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], params)
        size = llm.protocol_config.shape.allreduce_bytes
    trace = list(llm.trace)  # after shutdown: the teardown is in it too
    assert trace and all(isinstance(e, TraceEvent) for e in trace)
    assert {e.rank for e in trace if e.kind == "op"} == set(range(tp))
    assert any(e.kind == "send" and e.what == "Step" for e in trace)
    assert any(e.kind == "send" and e.what == "Teardown" for e in trace)
    assert check_trace(trace, size) == []
    # the same checker flags the trace once the step lock is broken in it
    first_reply = next(i for i, e in enumerate(trace) if e.kind == "reply")
    broken = trace[:first_reply] + [TraceEvent("controller", "send", "Step", 10**6)] + trace[first_reply:]
    assert "I1" in [v.invariant for v in check_trace(broken, size)]


def _replay_trace(tiny_dir, monkeypatch=None):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8] * 5]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 3, 5)]
    with LLM(tiny_dir, cuda_graph=True, _graph_standin=True, record_trace=True, max_batch=4,
             max_model_len=64) as llm:
        llm.generate(prompts, params)
        size = llm.protocol_config.shape.allreduce_bytes
        replays = llm.steps["replay"]
    return list(llm.trace), size, replays


@pytest.mark.timeout(180)
def test_graph_engine_trace_reports_what_each_replay_read(tiny_dir):
    """Issue 11 item 8: the engine's serving replays report the rows they read (the backend's
    launch result), and the protocol's own check (`protocol.invariants`, the simulator's too)
    finds them equal to each step's rows."""
    trace, size, replays = _replay_trace(tiny_dir)
    serving = [e for e in trace if e.kind == "op" and e.what == "launch" and e.data]
    assert replays > 0 and len(serving) == replays
    assert all(e.data[0] == e.data[1] and e.data[0] for e in serving)
    assert check_trace(trace, size) == []


@pytest.mark.timeout(180)
def test_trace_check_fails_when_prepare_replay_skips_writing(tiny_dir, monkeypatch):
    """A prepare_replay that skips writing the step's rows (the replay then reads the previous
    step's) is an I12 violation of the trace, not only a token difference from HF."""
    from engine.executor import RankExecutor

    def skip_writing(self, step):
        self._step = step  # the step is noted; its rows never reach the replay buffers

    monkeypatch.setattr(RankExecutor, "prepare_replay", skip_writing)
    trace, size, replays = _replay_trace(tiny_dir)
    assert replays > 0
    found = [v for v in check_trace(trace, size) if v.invariant == "I12"]
    assert found and "prepare_replay did not write them" in found[0].text
