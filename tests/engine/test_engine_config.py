"""`EngineConfig`: defaults resolved from the checkpoint, derived values computed once, the
protocol's config produced from it with the same (one) step timeout, bad values refused with
one line naming them before any rank starts."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from engine.engine_config import EngineConfig
from engine.errors import ParallelConfigError


def test_defaults_derived_values_and_protocol_config(tiny_dir):
    c = EngineConfig.create(tiny_dir, max_batch=5, step_timeout_s=42.0)
    m = c.model_config
    assert c.dtype == "float32" and c.dtype_bytes == 4 and c.cuda_graph is False
    assert c.max_model_len == min(m.max_position, 2048) and c.buckets == (1, 2, 4, 8)
    assert c.startup_timeout_s == 42.0  # defaults to the step timeout
    assert c.kv_heads_per_rank == m.num_kv_heads and c.q_heads_per_rank == m.num_q_heads
    assert c.kv_page_bytes == 2 * m.num_layers * 16 * m.num_kv_heads * m.head_dim * 4
    p = c.protocol_config()
    assert p.step_timeout_s == 42.0 and p.watchdog_timeout_s == 42.0  # one value each
    assert p.kv_page_bytes == c.kv_page_bytes and p.max_batch == 5
    assert p.max_kv_pages == 5 * c.pages_per_seq
    assert p.max_prefill_tokens == 8192 and p.page_size == 16


def test_llm_takes_a_config_and_uses_its_values(tiny_dir):
    from engine.llm import LLM

    c = EngineConfig.create(tiny_dir, max_batch=2, max_model_len=40, step_timeout_s=77.0,
                            max_prefill_tokens=64)
    with LLM(c) as llm:
        assert llm.config is c and llm.controller.config.step_timeout_s == 77.0
        assert llm.controller.config.max_prefill_tokens == 64
        # default max_tokens (16); ignore_eos: an unseeded draw may sample EOS early (4.5% of
        # runs did, on the tiny model)
        out, = llm.generate([[1, 2, 3]], SamplingParams(ignore_eos=True))
        assert len(out.token_ids) == SamplingParams().max_tokens == 16
    with pytest.raises(TypeError, match="max_batch"):
        LLM(c, max_batch=3)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(step_timeout_s=float("nan")), "step_timeout_s = nan"),
    (dict(step_timeout_s=0), "step_timeout_s = 0"),
    (dict(startup_timeout_s=-1), "startup_timeout_s = -1"),
    (dict(max_prefill_tokens=0), "max_prefill_tokens = 0"),
    (dict(max_batch=0), "max_batch = 0"),
    (dict(max_model_len=10**9), "max_model_len = 1000000000"),
    (dict(page_size=24), "page_size = 24"),
    (dict(dtype="int8"), "dtype = 'int8'"),
])
def test_bad_setting_is_named(tiny_dir, kwargs, needle):
    with pytest.raises(ParallelConfigError) as info:
        EngineConfig.create(tiny_dir, **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)
