"""tools/mutation.py generates the same mutant set every time, and every mutant changes code."""

import ast
import os
import subprocess
import sys

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


@pytest.mark.timeout(120)
def test_a_mutants_private_copy_collects_the_simulator_tests(tmp_path):
    """The killers run in a private copy of the checkout (`_copy_tree`), so it must hold what
    the tests import: the simulator tests load tools/ scripts (this file, trace_hash,
    schedule_cost), and a copy without tools/ failed collection. With ``-x`` that failure was
    reported as "killed by sim tests" for every mutant that survived ``lockstep check``."""
    mutation._copy_tree(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    for name, killer, _ in mutation.killers(sys.executable, "sim"):
        if name == "sim tests":
            command += killer[killer.index("no:cacheprovider") + 1:]  # paths, --ignore
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_a_killer_that_fails_on_unmutated_code_stops_the_run(monkeypatch, tmp_path, capsys):
    """A killer red without a mutant would read every mutant as killed: the run refuses to
    start and names the killer, instead of reporting a run with no survivors."""
    monkeypatch.setattr(mutation, "_copy_tree", lambda dest: None)
    monkeypatch.setattr(mutation, "killers", lambda python, package="protocol": [
        ("always red", [sys.executable, "-c", "raise SystemExit(3)"], 10)])
    code = mutation.main(["--package", "sim", "--within", "sim/checks.py:1-40", "--only", "0",
                          "--out", str(tmp_path / "out")])
    assert code == 1
    err = capsys.readouterr().err
    assert "'always red' failed on the unmutated code" in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_mutant_is_made_from_the_private_copy_not_the_live_checkout(monkeypatch, tmp_path):
    """A run takes minutes per mutant; a module edited in the checkout meanwhile (a fix for an
    earlier survivor) received the later mutants at sites numbered in its old text, and the
    copy was put back as the new text, so the rest of the run mutated other code."""
    mutation._copy_tree(tmp_path)
    mutant = next(m for m in mutation.enumerate_mutants(package="sim") if m.path == "sim/guard.py")
    copy = tmp_path / mutant.path
    as_copied = copy.read_text().replace('"""Keeping a variant', '"""KEEPING a variant', 1)
    copy.write_text(as_copied)  # the copy and the checkout now differ, as after such an edit
    seen = []
    monkeypatch.setattr(mutation, "_run_killers", lambda workdir, python, package: seen.append(
        (workdir / mutant.path).read_text()) or {"killed_by": None, "timeout": False})
    mutation.run_mutant(mutant, tmp_path, sys.executable, "sim")
    assert seen == [mutation.mutated_source(mutant, tmp_path)] and "KEEPING" in seen[0]
    assert copy.read_text() == as_copied
