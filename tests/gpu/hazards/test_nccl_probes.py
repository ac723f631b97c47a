"""Run each case of hazard_probe_nccl.py (both ranks in one process, two GPUs, CuPy NCCL) in
its own process under a timeout. A hang or a crash of the fused sweep or of a destroyed
communicator is a finding, written to the result file and recorded in docs/hazard-probes.md;
the two-phase barrier sweep must complete with outputs that agree across ranks.

Set HAZARD_PROBES_OUT to a directory to keep each case's JSON and output there.
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

from hazard_probe_nccl import CASES, HUNG_EXIT
from hazard_verdicts import VERDICTS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, found {GPUS}")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
def test_nccl_case(tmp_path, case):
    out = tmp_path / f"{case}.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(HERE),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(HERE / "hazard_probe_nccl.py"), "--case", case,
                           "--out", str(out), "--hang-s", "20"],
                          capture_output=True, text=True, timeout=200, env=env, cwd=ROOT)
    keep = os.environ.get("HAZARD_PROBES_OUT")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        log = f"exit {done.returncode}\n{done.stdout}\n--- stderr ---\n{done.stderr[-20000:]}"
        (Path(keep) / f"nccl-{case}.log").write_text(log)
        for f in (out, Path(str(out) + ".stacks")):
            if f.exists():
                shutil.copy(f, Path(keep) / f"nccl-{f.name}")
    assert out.exists(), f"no result written (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    if case.startswith("barrier"):  # the protocol's claim: the two-phase barrier completes
        assert done.returncode == 0, done.stderr[-3000:]
        assert result["outcome"] == "completed", result
        assert result["outputs_agree"], "the ranks' all-reduced outputs differ"
    elif case.startswith("fused"):  # completed or hung is the finding; an error is not
        assert done.returncode in (0, HUNG_EXIT), done.stderr[-3000:]
        assert result["outcome"] in ("completed", "hung"), result
    elif case.startswith("h5"):  # error, hang or crash after destroy: all findings
        assert any(s.get("op") == "first replay done" for s in result["steps"]), result
    else:
        assert done.returncode == 0, done.stderr[-3000:]
        hz = "H3" if case == "h3-spin" else "H4"
        assert result["verdicts"][hz]["verdict"] in VERDICTS, result
