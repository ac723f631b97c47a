"""Every configuration error names the bad value, before anything starts."""

import pytest

from protocol.buckets import DEFAULT_DECODE_BUCKETS, select_bucket, validate_buckets
from protocol.config import ModelShape, ProtocolConfig
from protocol.errors import ConfigError
from protocol.requests import Request


def test_default_buckets_are_pegainfer_36():
    assert len(DEFAULT_DECODE_BUCKETS) == 36
    assert DEFAULT_DECODE_BUCKETS[:8] == (1, 2, 4, 8, 16, 20, 24, 32)
    assert DEFAULT_DECODE_BUCKETS[-1] == 256


@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 20), (33, 40), (256, 256)])
def test_select_bucket_pads_up(batch, bucket):
    assert select_bucket(batch, DEFAULT_DECODE_BUCKETS) == bucket


@pytest.mark.parametrize("batch,match", [(0, "batch 0"), (257, "batch 257 exceeds")])
def test_select_bucket_rejects(batch, match):
    with pytest.raises(ConfigError, match=match):
        select_bucket(batch, DEFAULT_DECODE_BUCKETS)


@pytest.mark.parametrize("buckets,match", [((), "empty"), ((1, 0), "bucket 0"), ((4, 2), "ascending"),
                                           ((1, "x"), "'x'"), ((2, 2), "ascending")])
def test_bad_buckets(buckets, match):
    with pytest.raises(ConfigError, match=match):
        validate_buckets(buckets)


@pytest.mark.parametrize("kwargs,match", [
    ({"world_size": 0}, "world_size=0"),
    ({"max_batch": 300}, "max_batch=300 exceeds"),
    ({"max_batch": -1}, "max_batch=-1"),
    ({"graph_batch_cap": 0}, "graph_batch_cap=0"),
    ({"watchdog_timeout_s": 0}, "watchdog_timeout_s=0"),
    ({"step_timeout_s": -1}, "step_timeout_s=-1"),
    ({"step_timeout_s": 0}, "step_timeout_s=0"),  # zero is no timeout either
    ({"max_prefill_tokens": 0}, "max_prefill_tokens=0"),  # no step could prefill a token
    ({"max_kv_pages": 0}, "max_kv_pages=0"),  # None is "every page memory allows"
    ({"kv_watermark": 1}, "kv_watermark=1"),  # admission would leave every page free
    ({"memory_headroom_bytes": -5}, "memory_headroom_bytes=-5"),
    ({"kv_page_bytes": 0}, "kv_page_bytes=0"),
    ({"page_size": 0}, "page_size=0 must be a positive integer"),  # a mutation-run survivor
    ({"page_size": 2.5}, "page_size=2.5 must be a positive integer"),
    ({"decode_overlap": "yes"}, "decode_overlap='yes' must be True or False"),
    ({"buckets": (8, 4)}, "ascending"),
])
def test_bad_protocol_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ProtocolConfig(**kwargs)


def test_the_smallest_valid_settings_are_accepted():
    # the bounds are exclusive of zero and of 1.0 for the watermark, and nothing stricter
    config = ProtocolConfig(step_timeout_s=1, watchdog_timeout_s=1, max_kv_pages=1,
                            kv_watermark=0.99, max_prefill_tokens=1)
    assert (config.step_timeout_s, config.max_kv_pages, config.kv_watermark) == (1, 1, 0.99)
    assert ProtocolConfig(step_timeout_s=0.5, watchdog_timeout_s=0.5).step_timeout_s == 0.5


def test_decode_overlap_is_accepted_with_graphs_under_tp():
    # overlapped scheduling is modelled at every world size (every rank samples)
    assert ProtocolConfig(decode_overlap=True, cuda_graphs=True, world_size=2).decode_overlap
    assert ProtocolConfig(decode_overlap=True, world_size=1).decode_overlap


@pytest.mark.parametrize("kwargs,match", [({"hidden_size": 0}, "hidden_size=0"),
                                          ({"num_layers": True}, "num_layers=True")])
def test_bad_model_shape(kwargs, match):
    base = {"hidden_size": 8, "num_layers": 2}
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        ModelShape(**base)


@pytest.mark.parametrize("kwargs,match", [({"request_id": -1}, "request_id=-1"),
                                          ({"prompt": ()}, "prompt is empty"),
                                          ({"max_tokens": 0}, "max_tokens=0")])
def test_bad_request(kwargs, match):
    base = {"request_id": 1, "prompt": (1, 2)}
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        Request(**base)


def test_shape_collective_sizes():
    shape = ModelShape(hidden_size=2560, num_layers=36)
    assert shape.allreduces_per_step == 73
    assert shape.allreduce_bytes(8) == 8 * 2560 * 2


def test_a_long_bad_bucket_is_named_clipped():
    """A bucket of 500 characters was repeated whole (found replaying an edited trace)."""
    with pytest.raises(ConfigError) as info:
        validate_buckets((1, "x" * 500))
    assert str(info.value) == f"bucket '{'x' * 28}... at position 1 is not a positive integer"
