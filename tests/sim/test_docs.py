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

    _checkout(tmp_path)
    fresh = tmp_path / "fresh.md"
    fresh.write_text("same")
    monkeypatch.setattr(docs_cli, "render", lambda root: {fresh: "same"})
    assert docs_cli.run(argparse.Namespace(root=str(tmp_path), check=True)) == 0
    assert capsys.readouterr().out.strip() == "the generated docs are up to date"
    monkeypatch.setattr(docs_cli, "render", lambda root: {fresh: "changed"})
    assert docs_cli.run(argparse.Namespace(root=str(tmp_path), check=True)) == 1
    assert capsys.readouterr().out.strip() == f"stale: {fresh}"


MARKED_README = ("# lockstep\n\n<!-- walkthrough:fused-sweep:begin -->\n"
                 "<!-- walkthrough:fused-sweep:end -->\n")
"""The least README `lockstep docs` takes: the two markers of the generated diagram."""


def _checkout(root: Path) -> Path:
    """The least `lockstep docs` takes for a checkout: README.md (with the diagram's markers),
    sim/ and protocol/."""
    (root / "README.md").write_text(MARKED_README)
    for package in ("sim", "protocol"):
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").write_text("")
    return root


def _not_a_checkout(root):
    (root / "README.md").write_text("# some other project\n")


def _non_utf8_readme(root):
    _checkout(root)
    (root / "README.md").write_bytes(b"# lockstep \xff\xfe\n")


def _docs_a_file(root):
    _checkout(root)
    (root / "docs").write_text("")


def _walkthroughs_a_file(root):
    _checkout(root)
    (root / "docs").mkdir()
    (root / "docs" / "walkthroughs").write_text("")


def _page_a_directory(root):
    _checkout(root)
    (root / "docs" / "walkthroughs" / "fused-sweep.md").mkdir(parents=True)


@pytest.mark.parametrize("make, words", [
    (_not_a_checkout, "is not a lockstep checkout: it lacks sim/__init__.py, "
                      "protocol/__init__.py (a checkout holds README.md and the sim/ and "
                      "protocol/ packages)"),
    (_non_utf8_readme, "README.md is not UTF-8 text"),
    (_docs_a_file, "docs' exists and is not a directory"),
    (_walkthroughs_a_file, "walkthroughs' exists and is not a directory"),
    (_page_a_directory, "fused-sweep.md' is a directory, not a generated page"),
])
@pytest.mark.parametrize("check", [False, True])
def test_a_root_that_cannot_take_the_docs_is_one_line_before_rendering(
        make, words, check, tmp_path, monkeypatch, capsys):
    """A fresh user's finding: these were a UnicodeDecodeError, NotADirectoryError or
    FileExistsError traceback after ~20 s of rendering, and any directory with a README.md
    was taken for a checkout (docs/walkthroughs written into it)."""
    import sim.docs_cli as docs_cli
    from lockstep.cli import main

    def rendered(root):
        raise AssertionError("rendered before the --root checks")

    monkeypatch.setattr(docs_cli, "render", rendered)
    make(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["docs", "--root", str(tmp_path), *(["--check"] if check else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep docs: error: --root {str(tmp_path)!r}") and words in err, err
    assert "\n" not in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


BEGIN, END = "<!-- walkthrough:fused-sweep:begin -->", "<!-- walkthrough:fused-sweep:end -->"


@pytest.mark.parametrize("readme, words", [
    (MARKED_README.replace(END + "\n", ""), f"lacks the marker {END!r}"),
    (MARKED_README.replace(BEGIN + "\n", ""), f"lacks the marker {BEGIN!r}"),
    ("# lockstep\n", f"lacks the marker {BEGIN!r}"),
    (MARKED_README + END + "\n", f"has 2 of the marker {END!r}"),
    (f"# lockstep\n{END}\n{BEGIN}\n", f"has the marker {END!r} before {BEGIN!r}"),
])
@pytest.mark.parametrize("check", [False, True])
def test_a_readme_without_the_diagram_markers_is_refused_naming_marker_and_file(
        readme, words, check, tmp_path, monkeypatch, capsys):
    """A fresh user's finding: with a marker deleted, `lockstep docs` left the README as it was
    and `docs --check` said "the generated docs are up to date", so the diagram was never
    checked again; the end marker before the begin was a ValueError traceback. Now one line
    naming the marker and the README, exit 2, before rendering, nothing written."""
    import sim.docs_cli as docs_cli
    from lockstep.cli import main

    monkeypatch.setattr(docs_cli, "walkthrough", lambda name: pytest.fail("rendered"))
    _checkout(tmp_path)
    (tmp_path / "README.md").write_text(readme)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["docs", "--root", str(tmp_path), *(["--check"] if check else [])]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    readme_path = repr(str(tmp_path / "README.md"))
    assert err.startswith(f"lockstep docs: error: --root {str(tmp_path)!r}: {readme_path} "), err
    assert words in err and "\n" not in err and captured.out == "", err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "README.md").read_text() == readme
    with pytest.raises(ValueError, match="marker"):  # render itself, called directly
        docs_cli.render(tmp_path)


def test_an_empty_root_is_refused_not_read_as_the_current_directory(monkeypatch, capsys):
    import sim.docs_cli as docs_cli
    from lockstep.cli import main

    monkeypatch.setattr(docs_cli, "render", lambda root: pytest.fail("rendered"))
    assert main(["docs", "--root", ""]) == 2
    assert capsys.readouterr().err.strip() == ("lockstep docs: error: --root is empty; name the "
                                               "checkout (e.g. --root .)")


def test_a_repeated_root_is_refused_as_lockstep_check_refuses_one(monkeypatch, capsys):
    """A fresh user's finding: `docs --root . --root /x` kept the last value, silently."""
    import sim.docs_cli as docs_cli
    from lockstep.cli import main

    monkeypatch.setattr(docs_cli, "render", lambda root: pytest.fail("rendered"))
    with pytest.raises(SystemExit) as info:
        main(["docs", "--root", ".", "--root", "/nonexistent"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("argument --root: given twice ('.', then '/nonexistent'); give it once")
    assert len(err.splitlines()) == 1


def test_an_unwritable_root_is_refused_before_rendering(monkeypatch, capsys):
    """os.access is true for root; the test write is not (here: /proc cannot hold files)."""
    import sim.docs_cli as docs_cli

    monkeypatch.setattr(docs_cli, "CHECKOUT_MARKS", ())
    monkeypatch.setattr(docs_cli, "render", lambda root: pytest.fail("rendered"))
    monkeypatch.setattr(Path, "read_bytes", lambda self: MARKED_README.encode())
    problem = docs_cli.check_root("/proc")
    assert problem.startswith("--root '/proc': cannot write the docs: "), problem


def test_a_write_that_fails_after_rendering_is_one_line(tmp_path, monkeypatch, capsys):
    import argparse

    import sim.docs_cli as docs_cli

    _checkout(tmp_path)
    page = tmp_path / "docs" / "walkthroughs" / "x.md"

    def full(self, *a, **k):
        raise OSError(28, "No space left on device", str(self))

    monkeypatch.setattr(docs_cli, "render", lambda root: {page: "new"})
    monkeypatch.setattr(Path, "write_text", full)
    assert docs_cli.run(argparse.Namespace(root=str(tmp_path), check=False)) == 2
    assert capsys.readouterr().err.strip() == (f"lockstep docs: error: cannot write {str(page)!r}: "
                                               "No space left on device")


def _story_block(text: str) -> str:
    """The walkthrough's numbered story: the fenced block without a language that holds the
    verdict line (``==> ...``)."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = [line]
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return next("\n".join(b[1:]) for b in blocks
                if b[0] == "```" and any(line.startswith("==> ") for line in b))


REPRODUCED = ["host-frozen-metadata", "unfenced-preempt-store", "kv-zero-unordered",
              "short-path-first-row", "death-drops-requests", "uncoordinated-profile"]
"""Pages whose Reproduce command once wrote another story than theirs (a fresh user's finding:
the page reduced its counterexample twice, the command once and with fewer attempts), and the
page whose command switches hazards off."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", REPRODUCED)
def test_a_walkthrough_s_reproduce_command_writes_the_story_on_its_page(name, tmp_path, capsys):
    import shlex

    from lockstep.cli import main

    text = (ROOT / "docs" / "walkthroughs" / f"{name}.md").read_text()
    command = text.split("## Reproduce\n\n```bash\n", 1)[1].split("\n", 1)[0]
    argv = shlex.split(command.replace("traces/", f"{tmp_path}/"))
    assert argv[:2] == ["lockstep", "check"]
    assert main(argv[1:] + ["--no-progress"]) == 0
    capsys.readouterr()
    [written] = tmp_path.glob("*.txt")
    assert written.read_text().strip() == _story_block(text).strip()


@pytest.mark.timeout(300)
def test_the_python_api_page_s_property_tests_pass():
    """docs/python-api.md's example file runs as its page says (pytest from the root), and
    its tests ran examples rather than rejecting them all."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    example = root / "docs" / "examples" / "property" / "test_property.py"
    assert str(example.relative_to(root)) in (root / "docs" / "python-api.md").read_text()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(example), "--hypothesis-show-statistics"], cwd=root,
                          capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
    assert done.stdout.count("15 passing") == 2, done.stdout[-2000:]


def test_python_api_md_lists_signatures_in_their_order():
    """A reader's finding: docs/python-api.md listed CheckSpec's clean_schedules before
    fault_schedules, the other way round from the dataclass (wrong for a positional call).
    Every `name(args)` it lists for a function or class of sim/ names its parameters in order."""
    import importlib
    import inspect
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text()
    checked = 0
    for dotted, args in re.findall(r"`(sim(?:\.\w+)+)\(([^()`]*)\)`", text):
        module, _, name = dotted.rpartition(".")
        obj = getattr(importlib.import_module(module), name)  # a name gone is a stale page
        listed = [a.split("=")[0].strip() for a in args.split(",") if a.strip()]
        listed = [a for a in listed if a not in ("...", "")]
        params = [p for p in inspect.signature(obj).parameters if p != "self"]
        assert listed == params[:len(listed)], (dotted, listed, params)
        checked += 1
    assert checked >= 5, checked


@pytest.mark.timeout(300)
def test_the_protocol_api_page_s_engine_example_and_its_property_test_run():
    """docs/protocol-api.md's example engine runs as its page says and its property test
    passes (pytest from the root), having run examples rather than rejecting them all."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    folder = root / "docs" / "examples" / "protocol"
    page = (root / "docs" / "protocol-api.md").read_text()
    for name in ("echo_engine.py", "test_echo_engine.py"):
        assert f"docs/examples/protocol/{name}" in page
    env = {**os.environ, "PYTHONPATH": str(root)}
    shown = subprocess.run([sys.executable, str(folder / "echo_engine.py")], cwd=root,
                           capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0, shown.stderr[-2000:]
    first, second = shown.stdout.splitlines()[:2]
    assert first == "1 [8, 9, 10, 11] [8, 9, 10, 11]" and second == "2 [999, 0, 1] [999, 0, 1]"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(folder / "test_echo_engine.py"), "--hypothesis-show-statistics"],
                          cwd=root, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stdout[-3000:]
    import re

    phases = re.findall(r"(\d+) passing, (\d+) failing, and (\d+) invalid", done.stdout)
    assert "1 passed" in done.stdout and phases, done.stdout[-2000:]
    passing, invalid = (sum(int(p[i]) for p in phases) for i in (0, 2))
    assert passing >= 30 and invalid <= passing, phases


def test_the_protocol_api_page_s_loop_runs_as_written():
    """A reader's finding: the page's loop, copied, crashed at the first `Wait` (its pattern
    rebound the name of the ranks' list) and spun for ever on `Abort`. The fragment runs here
    with the example's backend, its Idle branch filled in; a rank that fails ends it."""
    import re
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "docs" / "examples" / "protocol"))
    from echo_engine import EchoBackend

    from protocol import ProtocolConfig

    text = (root / "docs" / "protocol-api.md").read_text()
    code = re.search(r"## The loop\n\n```python\n(.*?)```", text, re.S).group(1)
    idle = ("            controller.submit(Request(request_id, prompt, max_tokens, stop_token_ids))\n"
            "            # or: controller.shutdown()")
    assert idle in code
    code = code.replace(idle, "            if todo:\n"
                              "                controller.submit(Request(*todo.pop()))\n"
                              "            else:\n"
                              "                outputs.append(controller.take_finished(7))\n"
                              "                controller.shutdown()")
    config = ProtocolConfig(world_size=2, buckets=(1, 2), max_batch=2)
    scope = dict(config=config, pages_per_seq=4, MyBackend=lambda rank: EchoBackend(),
                 todo=[(7, (1, 2, 3), 3, frozenset())], outputs=[])
    exec(code, scope)
    assert scope["outputs"] == [[4, 5, 6]] and scope["controller"].phase == "done"

    class Failing(EchoBackend):
        def launch(self, key):
            raise RuntimeError("device lost")

    scope.update(MyBackend=lambda rank: Failing() if rank == 1 else EchoBackend(),
                 todo=[(7, (1, 2, 3), 3, frozenset())], outputs=[])
    with pytest.raises(RuntimeError, match="device lost"):
        exec(code, scope)


@pytest.mark.timeout(300)
def test_python_api_md_s_trace_file_fragment_replays():
    """docs/python-api.md's "A counterexample kept in a file": a row's minimal run through
    `to_json` and `scenario_spec`, then `replay_trace`, replays exactly; JSON round-trip
    included, as a file would carry it."""
    import json

    from sim.check import CheckSpec, check_variant, replay_trace, scenario_spec
    from sim.report import to_json
    from sim.variants import NeedsTwoBuckets, get_variant

    variant = get_variant("local-bucket")
    assert isinstance(variant.unreachable, NeedsTwoBuckets)
    spec = CheckSpec(ranks=2, buckets=(1, 2, 4, 8), max_batch=8, schedules=20, jobs=1)
    [row] = check_variant(variant, spec, "shared")
    assert row.passed and row.got == "divergence"
    result = row.minimal
    data = json.loads(json.dumps(to_json(result, variant.name,
                                         scenario_spec(spec, "shared", result.world.scenario))))
    replayed, departed = replay_trace(data)
    assert departed is None
    assert replayed.choices == result.choices
    assert replayed.outcome.verdict == "divergence"
