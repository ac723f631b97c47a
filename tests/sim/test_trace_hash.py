"""tools/trace_hash.py, the golden hash of speed work, is a pure function of the code: the same
digest every time, and a different one when a run changes."""

from sim.check import CheckSpec
from tests.tools import load_tool

trace_hash = load_tool("trace_hash")


def test_the_hash_is_stable_and_tells_variants_apart():
    first = trace_hash.variant_hash("local-bucket", 1, CheckSpec())
    assert first == trace_hash.variant_hash("local-bucket", 1, CheckSpec())
    assert len(first) == 64 and int(first, 16) >= 0
    assert first != trace_hash.variant_hash("single-warmup", 1, CheckSpec())
