"""Run each hazard probe on the GPU (in its own process, under a timeout) and check that it
measured what it set out to and reached a verdict. Which verdict is the finding, not a test
result: docs/hazard-probes.md records what the H200 showed.

Set HAZARD_PROBES_OUT to a directory to keep each probe's JSON and output there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hazard_verdicts import VERDICTS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# NVLink multicast stays off on shared hosts (device README), in every child too.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}

# (id, program, extra arguments, GPUs needed, hazards whose verdicts it must give)
PROBES = [
    ("block-own-device", "hazard_probe_block.py", [], 1, ("H1", "H2")),
    ("block-other-device", "hazard_probe_block.py", ["--spin-device", "1", "--call-device", "0"],
     2, ("H1", "H2")),
    ("block-peer-device", "hazard_probe_block.py",
     ["--spin-device", "1", "--call-device", "0", "--peer-access"], 2, ("H1", "H2")),
    ("async", "hazard_probe_async.py", [], 1, ("H6",)),
    ("memory", "hazard_probe_memory.py", [], 1, ("H7",)),
    ("exit", "hazard_probe_exit.py", [], 1, ("H8",)),
]


@pytest.mark.gpu
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name,program,extra,gpus,hazards", PROBES, ids=[p[0] for p in PROBES])
def test_probe_reaches_a_verdict(tmp_path, name, program, extra, gpus, hazards):
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s), found {GPUS}")
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(HERE),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(HERE / program), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    keep = os.environ.get("HAZARD_PROBES_OUT")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{name}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
        if out.exists():
            shutil.copy(out, Path(keep) / f"{name}.json")
    assert done.returncode == 0, f"{program} exited {done.returncode}:\n{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    for hz in hazards:
        assert result["verdicts"][hz]["verdict"] in VERDICTS, (hz, result["verdicts"][hz])
    if name.startswith("block"):  # every call was measured: a baseline and a spin outcome
        assert result["calls"], "no call was measured"
        for call, rec in result["calls"].items():
            assert rec["outcome"] in ("blocks", "does not block", "inconclusive", "error"), call
    if name == "async":
        assert set(result["calls"]) | set(result["errors"]) == {
            "kernel_launch", "graph_launch", "torch_op", "torch_graph_replay"}
    if name == "exit":
        assert {r["case"] for r in result["runs"]} == {
            "exit_idle", "exit_spinning", "exit_lock_held", "os_exit_lock_held"}
