"""Every module of `protocol/`, `sim/` and `lockstep/` can be a script's first import."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("protocol", "sim", "lockstep")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
"""


@pytest.mark.timeout(300)
def test_every_module_imports_first():
    """A reader's first line `from sim.variants_paging import page_pressure` (the adjust that
    docs/variants.md names) failed: sim.variants_paging imports sim.variants, which imports
    sim.variants_chunked, which took page_pressure from the half-run sim.variants_paging."""
    names = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                   for package in ("protocol", "sim", "lockstep")
                   for p in (ROOT / package).glob("*.py") if p.name != "__main__.py")
    assert "sim.variants_paging" in names and len(names) > 40
    run = subprocess.run([sys.executable, "-c", SCRIPT, *names], cwd=ROOT, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "", run.stdout
