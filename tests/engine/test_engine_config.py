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


@pytest.mark.parametrize("kwargs, needle", [
    (dict(progress="yes"), "progress = 'yes', expected True or False"),
    (dict(progress=1), "progress = 1, expected True or False"),
    (dict(record_trace=None), "record_trace = None, expected True or False"),
    (dict(graph_standin="no"), "graph_standin = 'no', expected True or False"),
    (dict(fault="kill"), "fault = 'kill', expected None or a tuple (rank, command seq, kind)"),
    (dict(fault=[0, 4, "raise"]), "fault = [0, 4, 'raise'], expected None or a tuple"),
    (dict(fault=(0, 4)), "fault = (0, 4), expected None or a tuple"),
    (dict(fault=(1, 4, "raise")), "fault = (1, 4, 'raise'): rank 1, expected an integer in "
                                  "0..0 (tensor_parallel_size 1)"),
    (dict(tensor_parallel_size=2, fault=(2, 4, "kill")), "rank 2, expected an integer in 0..1"),
    (dict(fault=(-1, 4, "raise")), "rank -1, expected an integer in 0..0"),
    (dict(fault=(True, 4, "raise")), "rank True, expected an integer"),
    (dict(fault=(0, -1, "raise")), "command seq -1, expected an integer >= 0"),
    (dict(fault=(0, 4.0, "raise")), "command seq 4.0, expected an integer >= 0"),
    (dict(fault=(0, 4, "crash")), "kind 'crash', expected one of ('raise', 'exit', 'kill', "
                                  "'stop', 'hang')"),
])
def test_bad_test_hook_is_named(tiny_dir, kwargs, needle):
    """Old behaviour: any value was taken; a fault naming no rank or kind injected nothing and
    the test that set it passed for the wrong reason."""
    with pytest.raises(ParallelConfigError) as info:
        EngineConfig.create(tiny_dir, **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_good_test_hooks_are_taken(tiny_dir):
    c = EngineConfig.create(tiny_dir, tensor_parallel_size=2, progress=True, record_trace=True,
                            fault=(1, 0, "hang"))
    assert c.progress and c.trace and c.fault == (1, 0, "hang") and not c.graph_standin


@pytest.mark.parametrize("fields, line", [
    (dict(progress="x"), "progress = 'x', expected True or False"),
    (dict(trace=1), "trace = 1, expected True or False"),
    (dict(graph_standin="yes"), "graph_standin = 'yes', expected True or False"),
    (dict(cuda_graph=None), "cuda_graph = None, expected True or False"),
    (dict(decode_overlap=0), "decode_overlap = 0, expected True or False"),
    (dict(world_size=2, dist_init_method="tcp://256.0.0.1:99999"),
     "dist_init_method = 'tcp://256.0.0.1:99999', expected tcp://HOST:PORT with a host and a "
     "port in 1..65535"),
    (dict(world_size=2, dist_init_method="tcp://:29500"), "with a host and a port"),
    (dict(world_size=2, dist_init_method="tcp://localhost"), "with a host and a port"),
    (dict(world_size=2, dist_init_method="garbage"),
     "dist_init_method = 'garbage', expected '', 'env://', 'file://PATH' or 'tcp://HOST:PORT'"),
    (dict(world_size=2, dist_init_method=5), "dist_init_method = 5, expected a str"),
])
def test_a_config_built_directly_is_checked_like_create(tiny_dir, fields, line):
    """`LLM(EngineConfig(...))` skips `create`'s argument checks: validate refuses what create
    would, before any rank is spawned (old behaviour: a bad port failed inside rank 1)."""
    config = EngineConfig(model_dir=str(tiny_dir), **fields)
    with pytest.raises(ParallelConfigError) as info:
        config.validate()
    assert line in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("method", ["", "env://", "tcp://127.0.0.1:29500", "file:///tmp/rdv"])
def test_the_init_methods_torch_distributed_takes_pass(tiny_dir, method):
    EngineConfig(model_dir=str(tiny_dir), world_size=2, dist_init_method=method).validate()


def test_max_model_len_past_float32_positions_is_refused_before_any_table_is_built(tiny_dir,
                                                                                  tmp_path):
    """A config.json whose max_position_embeddings is 10**9 let max_model_len 10**9 through, and
    the RoPE table's allocation failed with a traceback (TP 1)."""
    import json
    import shutil

    d = tmp_path / "long"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 10**9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ParallelConfigError, match=r"max_model_len = 1000000000 exceeds 16777216 "
                       r"\(2\*\*24\): RoPE positions are float32"):
        EngineConfig.create(d, max_model_len=10**9)
    assert EngineConfig.create(d, max_model_len=2**24).max_model_len == 2**24
