"""Every failure names the check that found it (`sim.common.Outcome.check`), and the reducer
keeps it: one rule of an invariant is never traded for another while a counterexample shrinks.

I11 alone is reported by four checks (an early token read and an early reply in the protocol's
trace checker, the simulator's direct token-copy check, the KV-memset variant's check); before
each carried a name, a reduction could start from one and end on another and still count as
"the same failure"."""

import ast
import pathlib

import pytest

from protocol.invariants import check_trace
from protocol.trace import TraceEvent as E
from sim.common import Outcome
from sim.reduce import same_failure

ROOT = pathlib.Path(__file__).resolve().parents[2]


def op(rank, what, seq, detail=""):
    return E(f"rank{rank}", "op", what, seq, rank, detail, True)


def reply(rank, seq):
    return E(f"rank{rank}", "reply", "Reply", seq, rank, "", True)


class _Result:
    def __init__(self, outcome):
        self.outcome = outcome


def test_the_two_i11_rules_of_the_trace_checker_have_their_own_clauses():
    early_read = check_trace([op(0, "enqueue_sample", 0), op(0, "read_tokens", 0)])
    early_reply = check_trace([op(0, "enqueue_sample", 0), reply(0, 0)])
    assert [(v.invariant, v.clause) for v in early_read] == [("I11", "tokens-read-early")]
    assert [(v.invariant, v.clause) for v in early_reply] == [("I11", "replied-in-flight")]


def test_same_failure_needs_the_same_check_not_only_the_same_invariant():
    a = _Result(Outcome("invariant", "x", "I11", check="tokens-read-early"))
    b = _Result(Outcome("invariant", "y", "I11", check="replied-in-flight"))
    c = _Result(Outcome("invariant", "z", "I11", check="tokens-read-early", rank=1, step=9))
    assert not same_failure(a, b)
    assert same_failure(a, c)  # the rank, step and words may change while reducing


def _calls(path: pathlib.Path, name: str):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
            yield node


def _keyword(call: ast.Call, name: str, position: int):
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_every_outcome_the_simulator_sets_names_its_check_and_no_two_places_share_one():
    """A new failure site without a check name, or with another site's, fails here."""
    named: dict[str, str] = {}
    for path in sorted((ROOT / "sim").glob("*.py")):
        for call in _calls(path, "Outcome"):
            verdict = _keyword(call, "verdict", 0)
            if isinstance(verdict, ast.Constant) and verdict.value == "clean":
                continue
            where = f"{path.name}:{call.lineno}"
            check = _keyword(call, "check", 99)
            assert check is not None, f"{where}: Outcome without check="
            if isinstance(check, ast.Constant):
                assert check.value and check.value not in named, (
                    f"{where}: check {check.value!r} empty or also set at {named.get(check.value)}")
                named[check.value] = where
    # the literal names (computed ones come from a Violation's clause or a reported error's kind)
    assert {"tokens", "unfinished", "token-copy-not-done", "memset-outlived-reply"} <= set(named)


def test_every_trace_violation_names_its_clause_and_no_two_share_one():
    clauses = []
    for call in _calls(ROOT / "protocol" / "invariants.py", "Violation"):
        clause = _keyword(call, "clause", 4)
        assert isinstance(clause, ast.Constant) and clause.value, (
            f"invariants.py:{call.lineno}: Violation without a clause")
        clauses.append(clause.value)
    assert len(clauses) == len(set(clauses)) >= 12


def test_a_verdict_no_run_ends_with_is_refused_and_every_literal_one_is_known():
    """OUTCOME_VERDICTS is what a trace's ``verdict`` is checked against on replay, so an
    Outcome outside it would write a trace that its own replay refuses."""
    from sim.common import OUTCOME_VERDICTS

    with pytest.raises(ValueError, match="'deadlocked' is not one of clean, abort"):
        Outcome("deadlocked")
    literal = {v.value for path in sorted((ROOT / "sim").glob("*.py"))
               for call in _calls(path, "Outcome")
               if isinstance(v := _keyword(call, "verdict", 0), ast.Constant)}
    assert literal and literal <= set(OUTCOME_VERDICTS), literal - set(OUTCOME_VERDICTS)


@pytest.mark.timeout(120)
def test_a_collective_a_peer_never_issues_is_an_i2_divergence_as_a_mismatched_one_is():
    """Both checks of "collective sequences differ across ranks" name I2 (every rank issues the
    broadcast collective sequence): the orphan check named I3 (uniform captured-ness), so a
    variant author's rank that warmed up once more, alone, read as a captured-set bug."""
    from sim.check import CheckSpec, check_bad
    from sim.variants import REGISTRY

    orphan = check_bad(REGISTRY["dp-idle-rank-skips-forward"], CheckSpec(schedules=20, jobs=1),
                       "shared").minimal
    assert orphan.outcome.check == "orphan-collective"
    assert (orphan.outcome.verdict, orphan.outcome.invariant) == ("divergence", "I2")
    # autotune-cache-shared needs a rare interleaving: PCT
    met = check_bad(REGISTRY["autotune-cache-shared"],
                    CheckSpec(schedules=20, jobs=1, strategy="pct"), "shared").minimal
    assert met.outcome.check == "device-collectives-differ"
    assert met.outcome.invariant == orphan.outcome.invariant
