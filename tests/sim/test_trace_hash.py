"""tools/trace_hash.py, the golden hash of speed work, is a pure function of the code: the same
digest every time, and a different one when a run changes."""

import importlib.util
import sys
from pathlib import Path

from sim.check import CheckSpec

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("trace_hash_tool", ROOT / "tools" / "trace_hash.py")
trace_hash = importlib.util.module_from_spec(spec)
sys.modules.setdefault("trace_hash_tool", trace_hash)
spec.loader.exec_module(trace_hash)


def test_the_hash_is_stable_and_tells_variants_apart():
    first = trace_hash.variant_hash("local-bucket", 1, CheckSpec())
    assert first == trace_hash.variant_hash("local-bucket", 1, CheckSpec())
    assert len(first) == 64 and int(first, 16) >= 0
    assert first != trace_hash.variant_hash("single-warmup", 1, CheckSpec())
