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
