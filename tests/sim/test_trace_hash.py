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


def _hashed_verdicts(monkeypatch, name):
    verdicts = []
    run = trace_hash.run_schedule

    def spy(scenario, variant, chooser):
        result = run(scenario, variant, chooser)
        verdicts.append(result.outcome.verdict)
        return result

    monkeypatch.setattr(trace_hash, "run_schedule", spy)
    trace_hash.variant_hash(name, 3, CheckSpec())
    return verdicts


def test_a_bad_variant_is_hashed_on_to_the_run_that_catches_it(monkeypatch):
    """short-path-first-row's runs 0-2 take the correct protocol's every decision (no step has
    slot 0 on the short path with a longer row behind it), so over three runs its digest held
    nothing of its bug and equalled correct-short-path's. Its own search (random, its draw) is
    now hashed on to run 3, the one that diverges and catches it in `lockstep check`; the other
    scenario families, and a protocol expected clean, keep three runs each."""
    bad = _hashed_verdicts(monkeypatch, "short-path-first-row")
    # per topology: base and random-fault families, random and PCT, 3 runs; run 3 of base/random
    assert len(bad) == 2 * (2 * 2 * 3 + 1)
    assert bad[:4] == ["clean", "clean", "clean", "divergence"]
    assert len(_hashed_verdicts(monkeypatch, "correct-short-path")) == 2 * 2 * 2 * 3
