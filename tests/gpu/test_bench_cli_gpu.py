"""`lockstep bench` end to end on one GPU (marker `gpu`), both workloads on the tiny preset:
the commands the benchmark docs print must run (the decode workload once crashed on an
interface change that no CPU test could reach, since the bench needs CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from lockstep.cli import main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.timeout(600)
def test_decode_workload_times_graph_and_eager_steps(tmp_path):
    out = tmp_path / "decode.json"
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1,3", "--steps", "4",
                 "--warmup", "1", "--no-capture-sweep", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["rows"]] == [1, 3]
    for row in doc["rows"]:
        assert row["graphs"]["n"] == 4 and row["graphs"]["median_ms"] > 0
        assert row["eager"]["n"] == 4 and row["eager"]["median_ms"] > 0
        assert row["logits_finite"] and row["graph_vs_eager_max_abs"] == 0.0
        assert row["profile"]["launches"] > 0
        assert all(g["TFLOPps"] > 0 for g in row["profile"]["gemms"])
        # the tiny preset is bound by bytes at these rows: the roofline is the HBM floor
        assert row["roofline_ms"] == pytest.approx(row["floor_ms"])
    assert doc["matmul_TFLOPps"] > 1


@pytest.mark.timeout(600)
def test_throughput_workload_serves_every_request(tmp_path):
    out = tmp_path / "w.json"
    assert main(["bench", "--preset", "tiny", "--workload", "throughput", "-n", "6", "--max-batch", "8",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["n"] == 6
    for row in doc["rows"]:
        assert row["output_tok_s"] > 0
