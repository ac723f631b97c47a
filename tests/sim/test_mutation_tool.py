"""tools/mutation.py generates the same mutant set every time, and every mutant changes code."""

import ast

from tests.tools import ROOT, load_tool

mutation = load_tool("mutation")


def test_mutant_set_is_stable_and_every_mutant_changes_the_module():
    first, second = mutation.enumerate_mutants(), mutation.enumerate_mutants()
    assert first == second and len(first) > 500
    assert [m.index for m in first] == list(range(len(first)))
    for m in first[::25]:
        original = ast.unparse(ast.parse((ROOT / m.path).read_text())) + "\n"
        changed = mutation.mutated_source(m)
        ast.parse(changed)
        assert changed != original, m


def test_docstrings_and_messages_are_not_mutated():
    mutants = mutation.enumerate_mutants()
    assert not any(m.original.startswith('"""') for m in mutants)
    watchdog = [m for m in mutants if m.original == "self.watchdog.disarm()"]
    assert watchdog and all(m.operator == "delete call" for m in watchdog)
