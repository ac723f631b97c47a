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
