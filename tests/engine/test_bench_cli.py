"""`lockstep bench`: bad arguments give one line naming the value and exit 2 before any GPU
work; the report (table, JSON) is built correctly from measured numbers."""

from __future__ import annotations

import json

import pytest

from engine.bench.options import BenchArgError, BenchOptions, validate
from lockstep.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "tiny", "--batch-sizes", "1,x"], "'x' is not an integer"),
    (["--preset", "tiny", "--batch-sizes", "0"], "batch size 0"),
    (["--preset", "tiny", "--batch-sizes", "1,300"], "batch size 300"),
    (["--preset", "tiny", "--context-lens", "0"], "context length 0"),
    (["--preset", "tiny", "--context-lens", "5000"], "context length 5000"),
    (["--preset", "tiny", "-tp", "3"], "--tensor-parallel-size 3"),
    (["--preset", "tiny", "-tp", "0"], "--tensor-parallel-size 0"),
    (["--preset", "tiny", "--steps", "0"], "--steps 0"),
    (["--preset", "tiny", "--warmup", "-1"], "--warmup -1"),
    (["--preset", "tiny", "--no-graphs", "--no-eager"], "nothing to measure"),
    (["--preset", "tiny", "--compare", "hf", "--hf-batch-sizes", "9999"], "batch size 9999"),
    (["--preset", "tiny", "--json", "/nonexistent-dir/x.json"], "--json"),
    (["--preset", "tiny", "--json", "/tmp"], "is a directory"),
    (["--preset", "tiny", "--seed", "-1"], "outside [0, 2**63)"),
    (["--model", "/nonexistent-model-dir"], "/nonexistent-model-dir"),
    (["--preset", "nope"], "nope"),
    (["--preset", "tiny", "--model", "x"], "not allowed with"),
])
def test_bad_argument_is_one_line_naming_it_and_exit_2(argv, needle, capsys, monkeypatch):
    import torch

    def boom(*a, **k):  # any GPU probe before validation would be a bug
        raise AssertionError("touched CUDA before the argument checks")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    with pytest.raises(SystemExit) if needle in ("nope", "not allowed with", "outside [0, 2**63)") else _nullctx():
        rc = main(["bench", *argv])
        assert rc == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_no_cuda_is_a_one_line_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU" in err and len(err.splitlines()) == 1


def test_model_dir_checks_read_its_config(tiny_dir):
    cfg = validate(BenchOptions(model=str(tiny_dir), batch_sizes=[1, 2]))
    assert cfg["num_attention_heads"] == 4
    with pytest.raises(BenchArgError, match="--tensor-parallel-size 4: num_key_value_heads"):
        validate(BenchOptions(model=str(tiny_dir), tensor_parallel_size=4))


def _fake_rank(rank=0):
    return {"rank": rank, "read_bandwidth_Bps": 4e12, "weight_bytes": 8_000_000_000,
            "capture": {"buckets": 36, "seconds": 0.5, "graph_memory_bytes": 100 * 2**20,
                        "device_free_drop_bytes": 120 * 2**20},
            "graph_source": "engine.graphs",
            "points": [{"batch": 1, "bucket": 1, "context": 128, "kv_bytes": 4_000_000_000,
                        "graphs": {"median_ms": 4.0, "p90_ms": 4.2, "min_ms": 3.9, "n": 10},
                        "eager": {"median_ms": 20.0, "p90_ms": 21.0, "min_ms": 19.0, "n": 10},
                        "graph_vs_eager_max_abs": 0.0, "logits_finite": True}]}


def test_report_floor_ratios_and_json(tmp_path):
    from engine.bench.report import build_document, format_table, write_json

    hf = [{"batch": 1, "context": 128, "compile_s": 40.0, "median_ms": 8.0, "p90_ms": 8.1,
           "min_ms": 7.9, "n": 10}]
    doc = build_document(BenchOptions(preset="qwen3-4b"), [_fake_rank()], hf, "lockstep bench")
    row = doc["rows"][0]
    assert row["floor_ms"] == pytest.approx(3.0)          # 12e9 bytes / 4e12 B/s
    assert row["graphs_x_floor"] == pytest.approx(4.0 / 3.0)
    assert row["graphs_over_eager"] == pytest.approx(0.2)
    assert row["hf_over_engine"] == pytest.approx(2.0)
    assert row["graphs_tokens_per_s"] == pytest.approx(250.0)
    table = format_table(doc)
    assert "captured 36 buckets in 0.500 s" in table and "100 MiB" in table
    assert "WARNING" not in table
    path = tmp_path / "b.json"
    write_json(doc, str(path))
    assert json.loads(path.read_text())["rows"][0]["batch"] == 1


def test_report_warns_when_graph_logits_differ():
    from engine.bench.report import build_document, format_table

    rank = _fake_rank()
    rank["points"][0]["graph_vs_eager_max_abs"] = 3.0
    doc = build_document(BenchOptions(preset="qwen3-4b"), [rank], [], "lockstep bench")
    assert "WARNING: batch 1" in format_table(doc)
