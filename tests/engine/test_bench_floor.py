"""The bench's floors: bytes and FLOPs counted from the engine's real model (tied and untied LM
heads), and the roofline floor's max-of-two per part."""

from __future__ import annotations

import json

import pytest
import torch

from engine.bench.floor import (attention_flops, gemm_flops, roofline_seconds,
                                weight_bytes)
from engine.bench.options import BenchOptions


def _model(model_dir):
    from engine.config import load_model_config
    from engine.model import Qwen3ForCausalLM
    from engine.parallel import TPGroup

    cfg = load_model_config(str(model_dir))
    return cfg, Qwen3ForCausalLM(cfg, TPGroup(), torch.float32, "cpu")


def _expected(cfg, tied: bool, batch: int):
    """Elements of the model counted by hand from its config: every layer's projections and
    norms, the embedding, the LM head unless tied, the final norm."""
    h, d = cfg.hidden_size, cfg.head_dim
    proj = (h * (cfg.num_q_heads + 2 * cfg.num_kv_heads) * d + cfg.num_q_heads * d * h
            + 3 * h * cfg.intermediate_size)
    norms = 2 * h + 2 * d                      # input, post-attention, q and k norm
    table = cfg.vocab_size * h
    matmul = cfg.num_layers * proj + table     # the LM head multiplies, tied or not
    read = cfg.num_layers * (proj + norms) + h + table + (0 if tied else min(batch, cfg.vocab_size) * h)
    return matmul, read


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("batch", [1, 7])
def test_weight_bytes_and_gemm_flops_count_the_model_from_its_config(
        tiny_dir, tiny_tied_dir, tied, batch):
    cfg, model = _model(tiny_tied_dir if tied else tiny_dir)
    assert cfg.tie_word_embeddings is tied
    matmul, read = _expected(cfg, tied, batch)
    assert gemm_flops(model, batch) == 2 * batch * matmul
    assert weight_bytes(model, batch) == 4 * read
    # without a batch, every distinct parameter once: the whole untied table
    whole = read - (0 if tied else batch * cfg.hidden_size) + (0 if tied else cfg.vocab_size
                                                                 * cfg.hidden_size)
    assert weight_bytes(model) == 4 * whole


def test_an_untied_table_counts_only_the_rows_a_step_looks_up(tiny_dir):
    cfg, model = _model(tiny_dir)
    row = cfg.hidden_size * 4
    assert weight_bytes(model, 2) - weight_bytes(model, 1) == row
    assert weight_bytes(model, 10**9) == weight_bytes(model)   # never more than the table


def test_attention_flops():
    # Qwen3-4B's 36 layers x 32 query heads x 128 dims, 8 rows at 128 tokens
    assert attention_flops(36, 32, 128, 8, 128) == 4 * 36 * 8 * 128 * 32 * 128


def test_roofline_takes_the_larger_bound_of_each_part():
    bw, rate = 4e12, 800e12
    # bytes bind both parts: the roofline is the HBM floor
    assert roofline_seconds(8e9, 1e9, 1.6e10, 1e8, bw, rate) == pytest.approx(9e9 / bw)
    # the GEMMs' FLOPs bind (2 TFLOP at 800 TFLOP/s = 2.5 ms > 2 ms of bytes), the KV's bytes
    assert roofline_seconds(8e9, 4e9, 2e12, 1e9, bw, rate) == pytest.approx(2.5e-3 + 1e-3)
    # the attention's FLOPs bind
    assert roofline_seconds(8e9, 4e6, 1e9, 8e11, bw, rate) == pytest.approx(2e-3 + 1e-3)
    with pytest.raises(ValueError, match="matmul rate 0"):
        roofline_seconds(1, 1, 1, 1, bw, 0)


def test_report_gives_the_roofline_where_the_rank_measured_its_matmul_rate(tmp_path):
    from engine.bench.report import build_document, format_table, write_json

    point = {"batch": 256, "bucket": 256, "context": 128, "kv_bytes": 4_000_000_000,
             "weight_bytes": 8_000_000_000, "gemm_flops": 2_000_000_000_000,
             "attention_flops": 1_000_000_000,
             "graphs": {"median_ms": 5.25, "p90_ms": 5.3, "min_ms": 5.2, "n": 10}}
    rank = {"rank": 0, "read_bandwidth_Bps": 4e12, "matmul_Fps": 800e12,
            "weight_bytes": 8_100_000_000, "points": [point]}
    doc = build_document(BenchOptions(preset="qwen3-4b"), [rank], [], "lockstep bench")
    row = doc["rows"][0]
    assert row["floor_ms"] == pytest.approx(3.0)           # the point's 8e9 + 4e9 bytes
    assert row["roofline_ms"] == pytest.approx(3.5)        # 2.5 ms of FLOPs + 1 ms of KV
    assert row["graphs_x_roofline"] == pytest.approx(1.5)
    assert doc["matmul_TFLOPps"] == pytest.approx(800)
    table = format_table(doc)
    assert "matmul 800 TFLOP/s" in table and "   3.500    1.50" in table
    write_json(doc, str(tmp_path / "d.json"))
    assert json.loads((tmp_path / "d.json").read_text())["rows"][0]["roofline_ms"] == 3.5
    # a rank without the probe (an older document): no roofline, no crash
    del rank["matmul_Fps"]
    doc = build_document(BenchOptions(preset="qwen3-4b"), [rank], [], "lockstep bench")
    assert "roofline_ms" not in doc["rows"][0] and "matmul" not in format_table(doc).split("\n")[1]
