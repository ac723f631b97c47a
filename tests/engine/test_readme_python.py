"""The README's Python example runs as written (on a `make-model` directory) and prints the
token ids (issue 13, item 5: it shows the main guard that spawned ranks need)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_readme_python_example_runs(tiny_dir, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    example = next(b for b in blocks if "LLM(" in b)
    assert 'if __name__ == "__main__":' in example
    script = tmp_path / "example.py"
    script.write_text(example.replace('"/tmp/m"', repr(str(tiny_dir))))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens = eval(proc.stdout.strip().splitlines()[-1])  # a list of ints
    assert isinstance(tokens, list) and len(tokens) == 8 and all(isinstance(t, int) for t in tokens)


@pytest.mark.timeout(300)
def test_readme_cpu_engine_commands_run(tmp_path):
    """The README's CPU engine commands (make-model, generate with ids and with text) succeed
    and print token ids (issue 13, items 13 and 15)."""
    import shlex

    block = (ROOT / "README.md").read_text().split("## Engine", 1)[1].split("```bash\n", 1)[1]
    lines = [ln.split("#", 1)[0].strip() for ln in block.split("```", 1)[0].splitlines()]
    cpu = [ln for ln in lines if ln and "/tmp/m" in ln]
    assert [ln.split()[1] for ln in cpu] == ["make-model", "generate", "generate"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for line in cpu:
        argv = [a.replace("/tmp/m", str(tmp_path / "m")) for a in shlex.split(line)[1:]]
        proc = subprocess.run([sys.executable, "-m", "lockstep", *argv], capture_output=True,
                              text=True, env=env, timeout=240, cwd=tmp_path)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        if argv[0] == "generate":
            assert proc.stdout.startswith("token_ids: ")


def test_readme_states_the_torch_version_the_makefile_installs():
    import re

    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"torch==([\d.]+)", makefile).group(1)
    readme = (ROOT / "README.md").read_text()
    assert f"torch {pinned}" in readme
    assert "source .venv/bin/activate" in readme and ".venv/bin/lockstep" in readme


needs_make = pytest.mark.skipif(
    subprocess.run(["which", "make"], capture_output=True).returncode != 0, reason="needs make")


def _make_gpu_test(tmp_path, python_flags: str, timeout: float) -> subprocess.CompletedProcess:
    """`make -s gpu-test` with `python3` on PATH this interpreter run with `python_flags`."""
    shim = tmp_path / "python3"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {python_flags} "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["make", "-s", "gpu-test"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


@pytest.mark.timeout(60)
@needs_make
def test_make_gpu_test_without_torch_says_so_in_one_line(tmp_path):
    """`make gpu-test` under a python3 that cannot import torch (here: this interpreter with
    site-packages off) stops with one line naming what it needs, not 47 collection tracebacks
    (a fresh user's finding on a CPU machine)."""
    proc = _make_gpu_test(tmp_path, "-S", 50)
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make gpu-test: python3 lacks"), proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr and "test session" not in proc.stdout


@pytest.mark.timeout(120)
@needs_make
def test_make_gpu_test_without_a_gpu_says_so_in_one_line(tmp_path):
    """`make gpu-test` under a python3 with every package but no CUDA GPU (here: this
    interpreter, as after `source .venv/bin/activate` on a CPU machine) stops with one line,
    instead of reporting every GPU test skipped and exiting 0 (a fresh user's finding)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this python sees a GPU: the target would run the GPU suite")
    proc = _make_gpu_test(tmp_path, "", 100)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make gpu-test: python3's torch sees no CUDA"), \
        proc.stdout
    assert "skipped" not in proc.stdout + proc.stderr
