"""The walkthroughs and the README diagram are generated; committed copies must not be stale."""

import shutil
from pathlib import Path

import pytest

from sim.docs_cli import render

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_generated_docs_are_fresh(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    stale = []
    for path, content in render(tmp_path).items():
        committed = ROOT / path.relative_to(tmp_path)
        if not committed.exists() or committed.read_text() != content:
            stale.append(str(committed.relative_to(ROOT)))
    assert not stale, f"run `lockstep docs` and commit: stale {stale}"


def test_every_walkthrough_has_a_valid_looking_diagram():
    pages = sorted((ROOT / "docs" / "walkthroughs").glob("*.md"))
    from sim.variants import REGISTRY, SHIPPED
    bad = [n for n in SHIPPED if any(v != "clean" for v in REGISTRY[n].expected.values())]
    assert sorted(p.stem for p in pages) == sorted(bad + ["README"])
    for page in pages:
        if page.name == "README.md":
            continue
        text = page.read_text()
        block = text.split("```mermaid\n", 1)[1].split("```", 1)[0]
        lines = block.splitlines()
        assert lines[0] == "sequenceDiagram"
        for line in lines[1:]:
            assert line.startswith("    ") and ";" not in line and "#" not in line, (page.name, line)
        assert "## Why the correct protocol avoids it" in text and "lockstep check --variant" in text
        # the hazard attribution ran: no ablation rerun failed (it once hit a time-budget limit)
        assert "**Hazards it needs**" in text and "error (" not in text, page.name


def test_the_readme_counts_the_shipped_known_bad_variants():
    import re

    from sim.variants import REGISTRY, SHIPPED

    bad = [n for n in SHIPPED if any(v != "clean" for v in REGISTRY[n].expected.values())]
    said = re.search(r"It ships (\d+) known-bad variants", (ROOT / "README.md").read_text())
    assert said is not None and int(said.group(1)) == len(bad), (said and said.group(1), len(bad))


def test_every_file_a_readme_command_names_is_shipped():
    """A path argument of a README command (`--variant-file`, `--replay` of a trace that an
    earlier line writes with `--trace-out`) names a file that exists or is written first."""
    import re

    text = (ROOT / "README.md").read_text()
    written = set(re.findall(r"--trace-out (\S+?)/?\s", text))
    for flag, path in re.findall(r"(--variant-file|--replay) (\S+)", text):
        if path.upper() == path or path.startswith("PATH"):
            continue  # a placeholder in the options list
        if flag == "--replay" and any(path.startswith(d.rstrip("/") + "/") for d in written):
            continue
        assert (ROOT / path).is_file(), f"README: {flag} {path} names no shipped file"


def test_docs_check_says_so_when_nothing_is_stale(tmp_path, monkeypatch, capsys):
    """It printed nothing on success (a fresh user's finding), and names each stale file."""
    import argparse

    import sim.docs_cli as docs_cli

    (tmp_path / "README.md").write_text("x")
    fresh = tmp_path / "fresh.md"
    fresh.write_text("same")
    monkeypatch.setattr(docs_cli, "render", lambda root: {fresh: "same"})
    assert docs_cli.run(argparse.Namespace(root=str(tmp_path), check=True)) == 0
    assert capsys.readouterr().out.strip() == "the generated docs are up to date"
    monkeypatch.setattr(docs_cli, "render", lambda root: {fresh: "changed"})
    assert docs_cli.run(argparse.Namespace(root=str(tmp_path), check=True)) == 1
    assert capsys.readouterr().out.strip() == f"stale: {fresh}"
