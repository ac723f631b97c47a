"""Property-based tests of the protocol driven as an engine drives it (docs/protocol-api.md):
Hypothesis draws the configuration and the requests, `echo_engine.serve` runs them.

    .venv/bin/python -m pytest docs/examples/protocol/test_echo_engine.py   # from the root
"""

import sys
from pathlib import Path

from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from echo_engine import VOCAB, expected_tokens, serve  # noqa: E402
from protocol import ProtocolConfig  # noqa: E402
from protocol.pages import pages_for  # noqa: E402
from protocol.requests import Request  # noqa: E402

MAX_MODEL_LEN = 48


@st.composite
def scenarios(draw):
    """A configuration (ranks, buckets, page size, a KV pool from one sequence up, a prefill
    budget small enough to chunk) and waves of requests that fit max_model_len."""
    buckets = draw(st.sampled_from([(1,), (1, 2), (1, 2, 4), (2, 4, 8), (1, 2, 4, 8)]))
    page_size = draw(st.sampled_from([4, 16]))
    per_seq = pages_for(MAX_MODEL_LEN, page_size)
    config = ProtocolConfig(
        world_size=draw(st.integers(1, 4)), buckets=buckets,
        max_batch=draw(st.integers(1, buckets[-1])), page_size=page_size,
        # a pool of one sequence or little more: requests that grow outgrow it (preemption)
        max_kv_pages=draw(st.sampled_from([None, per_seq, per_seq + 1, 2 * per_seq])),
        max_prefill_tokens=draw(st.sampled_from([7, 16, 8192])),
        cuda_graphs=draw(st.booleans()))
    ids = iter(range(10**6))
    request = st.builds(
        lambda prompt, new, stops: Request(next(ids), tuple(prompt),
                                           max(1, min(new, MAX_MODEL_LEN - len(prompt))),
                                           frozenset(stops)),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_MODEL_LEN // 2),
        st.integers(1, MAX_MODEL_LEN), st.sets(st.integers(0, VOCAB - 1), max_size=3))
    waves = draw(st.lists(st.lists(request, min_size=1, max_size=6), min_size=1, max_size=3))
    return config, per_seq, waves


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_every_request_gets_its_tokens_and_every_rank_the_same_commands(scenario):
    config, per_seq, waves = scenario
    outputs, received = serve(config, per_seq, waves)
    for wave in waves:
        for request in wave:
            assert outputs[request.request_id] == expected_tokens(request)
    assert all(log == received[0] for log in received[1:])  # one command stream (the step lock)
