"""tools/mutation.py generates the same mutant set every time, and every mutant changes code."""

import ast

import pytest

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


def test_the_simulators_checks_can_be_mutated_line_by_line(capsys):
    sim = mutation.enumerate_mutants(package="sim")
    assert sim and all(m.path.startswith("sim/") for m in sim)
    assert mutation.main(["--list", "--package", "sim",
                          "--within", "sim/checks.py:1-40"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if " sim/" in line]
    assert listed and all(line.split()[1].startswith("sim/checks.py:") for line in listed)
    assert all(1 <= int(line.split()[1].split(":")[1]) <= 40 for line in listed)
    names = [k[0] for k in mutation.killers("python", "sim")]
    assert names == ["lockstep check", "sim tests"]


def test_a_line_range_may_name_its_file_as_a_user_would(capsys):
    for within in ("./sim/checks.py:1-40", str(ROOT / "sim" / "checks.py") + ":1-40"):
        assert mutation.main(["--list", "--package", "sim", "--within", within]) == 0
        assert capsys.readouterr().out.splitlines()[-1] != "0 mutants"


@pytest.mark.parametrize("within", ["sim/checks.py", "sim/checks.py:9-3", "sim/nope.py:1-5",
                                    "protocol/slots.py:1-40", "sim/checks.py:1-2"])
def test_a_bad_line_range_is_one_line(within, capsys):
    with pytest.raises(SystemExit) as info:
        mutation.main(["--list", "--package", "sim", "--within", within])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert within in err
