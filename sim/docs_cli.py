"""`lockstep docs`: render docs/walkthroughs/ from real simulator counterexamples.

Every page is generated -- never edited by hand -- from a deterministic search (fixed seed, a
fixed number of reducer attempts), so `tests/sim/test_docs.py` can regenerate the pages and fail
if the committed ones are stale. The README's inline diagram is the fused-sweep walkthrough's: it
goes between the README's two walkthrough markers (`README_BEGIN`, `README_END`), and a README
that lacks either is refused, since the diagram there would never be regenerated or checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lockstep.paths import nearest_existing, write_refused
from sim.check import TRACE_REDUCE_ATTEMPTS, CheckSpec, check_bad, unreachable_here
from sim.checks import attribute_divergence
from sim.limits import MAX_TIME_BUDGET
from sim.report import mermaid, narrative
from sim.variants import REGISTRY, SHIPPED

SPEC = CheckSpec(schedules=100, fault_schedules=0, time_budget=MAX_TIME_BUDGET, seed=0)
EXPLAIN_SPEC = CheckSpec(schedules=40, fault_schedules=0, time_budget=MAX_TIME_BUDGET, seed=0)
"""Search settings of each walkthrough's hazard attribution (fixed, so pages are reproducible)."""
README_BEGIN = "<!-- walkthrough:fused-sweep:begin -->"
README_END = "<!-- walkthrough:fused-sweep:end -->"
"""The lines between which the README holds the generated fused-sweep diagram, each once."""


def readme_marker_problem(readme: str, where: str) -> str | None:
    """Why the README text ``readme`` (at ``where``, for the message) cannot take the generated
    diagram, or None: a marker missing or given twice, or the end marker before the begin.
    Without this a deleted marker left the README's diagram unchecked: `docs --check` said
    "up to date" (a fresh user's finding)."""
    for marker in (README_BEGIN, README_END):
        count = readme.count(marker)
        if count != 1:
            what = "lacks" if count == 0 else f"has {count} of"
            return (f"{where} {what} the marker {marker!r}; the generated fused-sweep diagram "
                    f"goes between one {README_BEGIN!r} line and one {README_END!r} line")
    if readme.index(README_END) < readme.index(README_BEGIN):
        return (f"{where} has the marker {README_END!r} before {README_BEGIN!r}; the generated "
                "fused-sweep diagram goes between them, begin first")
    return None


def _topology_for(variant) -> str:
    """The topology whose verdict shows the hazard (a non-invariant verdict if there is one)."""
    for topology in ("shared", "per-rank"):
        if not variant.expected[topology].startswith("invariant:"):
            return topology
    return "shared"


def _other_verdict(variant, topology: str) -> str:
    """"expected `<verdict>`", or "not reachable (<reason>)" where that topology cannot hold
    the bug (the check's own decision, `sim.check.unreachable_here`)."""
    reason = unreachable_here(variant, SPEC, topology)
    return f"not reachable ({reason})" if reason else f"expected `{variant.expected[topology]}`"


def walkthrough(name: str) -> tuple[str, str, str]:
    """(markdown page, mermaid diagram, verdict lines of the narrative) for one bad variant.

    The story shown names only mechanisms of the hazards the verdict needs
    (`sim.explain.attribute`): when the full model's counterexample goes through another, the
    page shows the one found with only the needed hazards on, and says so.
    """
    from sim.explain import attribute, story_hazards

    variant = REGISTRY[name]
    topology = _topology_for(variant)
    # the reduction `lockstep check --trace-out` makes, so that the page's Reproduce command
    # writes the story shown (a second reduction here once gave shorter stories than it)
    row = check_bad(variant, SPEC, topology, reduce_attempts=TRACE_REDUCE_ATTEMPTS)
    minimal = row.minimal
    found = attribute(variant, EXPLAIN_SPEC, topology, row.got, story=minimal,
                      reduce_attempts=TRACE_REDUCE_ATTEMPTS)
    reproduce = f"lockstep check --variant {name} --topology {topology} --trace-out traces/"
    note = ""
    if found.story_hazards_off:
        extra = sorted(story_hazards(minimal) - set(found.needed))
        minimal = found.story
        reproduce += "".join(f" --hazard-off {h}" for h in found.story_hazards_off)
        note = (f" The full model's first counterexample also goes through "
                f"{', '.join(h.upper() for h in extra)}, which this verdict does not need; the "
                "counterexample below is the one the search finds with only the needed hazards "
                "on.")
    # the needed-only story is reduced afresh, and a fresh run has no step attributed yet: as
    # `check_bad` does after its reduction, so the page shows what --trace-out writes
    minimal = attribute_divergence(minimal.world.scenario, variant, minimal)
    diagram = mermaid(minimal)
    story = narrative(minimal)
    other = "per-rank" if topology == "shared" else "shared"
    lines = [
        f"# {name}",
        "",
        "<!-- generated by `lockstep docs`; do not edit -->",
        "",
        f"**What the design does.** {variant.summary[0].upper() + variant.summary[1:]}.",
        "",
        f"**Source.** {variant.source}.",
        "",
        f"**Verdict.** `{row.got}` with {topology} processes "
        f"({'one process for all ranks' if topology == 'shared' else 'one process per rank'}); "
        f"{_other_verdict(variant, other)} with {other} processes.",
        "",
        f"**Hazards it needs** (`lockstep check --explain`: each hazard switched off in turn). "
        f"{found.line()}.{note}",
        "",
        "## Minimal counterexample",
        "",
        "```mermaid",
        diagram.rstrip(),
        "```",
        "",
        "```",
        story,
        "```",
        "",
        "## Why the correct protocol avoids it",
        "",
        variant.remedy,
        "",
        "## Reproduce",
        "",
        "```bash",
        reproduce,
        "```",
        "",
    ]
    ending = story[story.index("==> "):]
    return "\n".join(lines), diagram, ending


CHECKOUT_MARKS = ("README.md", "sim/__init__.py", "protocol/__init__.py")
"""Files that make a directory a lockstep checkout: the README (whose diagram block is
regenerated) and the simulator's and protocol's packages. A README.md alone is in nearly every
project, and the README's wording may change; these packages are what the pages come from."""


def _walkthrough_names() -> list[str]:
    """The shipped variants that get a page: every one not expected clean everywhere."""
    return [name for name in SHIPPED
            if not REGISTRY[name].clean_everywhere]


def output_paths(root: Path) -> list[Path]:
    """Every file `render` may write under ``root``, known before anything is rendered."""
    pages = root / "docs" / "walkthroughs"
    return ([pages / f"{name}.md" for name in _walkthrough_names()]
            + [pages / "README.md", root / "README.md"])


def check_root(text: str, write: bool = True) -> str | None:
    """The one-line reason ``--root text`` cannot take the generated docs, or None; checked
    before the ~20 s of rendering. Reads the README (it must be UTF-8) and, when ``write``,
    test-writes where the pages go (creating nothing that is not there). A path that cannot
    even be looked at (a PermissionError from ``Path.is_dir``) is one more reason."""
    try:
        return _root_problem(text, write)
    except OSError as exc:
        return f"--root {text!r} cannot be used: {exc.strerror or exc}"


def _root_problem(text: str, write: bool) -> str | None:
    if not text.strip():
        return "--root is empty; name the checkout (e.g. --root .)"
    root = Path(text)
    if not root.is_dir():
        return f"--root {text!r} is not a directory"
    missing = [m for m in CHECKOUT_MARKS if not (root / m).is_file()]
    if missing:
        return (f"--root {text!r} is not a lockstep checkout: it lacks {', '.join(missing)} (a "
                "checkout holds README.md and the sim/ and protocol/ packages)")
    try:
        readme = (root / "README.md").read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return f"--root {text!r}: README.md is not UTF-8 text"
    except OSError as exc:
        return f"--root {text!r}: cannot read README.md: {exc.strerror or exc}"
    marker_problem = readme_marker_problem(readme, repr(str(root / "README.md")))
    if marker_problem:
        return f"--root {text!r}: {marker_problem}"
    for d in (root / "docs", root / "docs" / "walkthroughs"):
        if d.exists() and not d.is_dir():
            return f"--root {text!r}: {str(d)!r} exists and is not a directory"
    for path in output_paths(root):
        if path.is_dir():
            return f"--root {text!r}: {str(path)!r} is a directory, not a generated page"
    if write:
        refused = write_refused(nearest_existing(root / "docs" / "walkthroughs"))
        try:
            with open(root / "README.md", "a"):
                pass
        except OSError as exc:
            refused = refused or exc.strerror or str(exc)
        if refused:
            return f"--root {text!r}: cannot write the docs: {refused}"
    return None


def render(root: Path) -> dict[Path, str]:
    """Every generated file under ``root`` (a checkout) -> its content.

    Raises:
        ValueError: the README's walkthrough markers are missing (`readme_marker_problem`),
            found before the ~20 s of rendering.
    """
    readme = (root / "README.md").read_text(encoding="utf-8")
    problem = readme_marker_problem(readme, repr(str(root / "README.md")))
    if problem:  # `run` refuses it before this (`check_root`)
        raise ValueError(problem)
    files: dict[Path, str] = {}
    index = ["# Walkthroughs", "", "<!-- generated by `lockstep docs`; do not edit -->", "",
             "One page per known-bad variant: what it does, the minimal counterexample the "
             "simulator finds, and why the correct protocol avoids it.", ""]
    readme_block = ""
    for name in _walkthrough_names():  # not the correct protocol, under any scenario
        page, diagram, ending = walkthrough(name)
        files[root / "docs" / "walkthroughs" / f"{name}.md"] = page
        index.append(f"- [{name}]({name}.md): {REGISTRY[name].summary}")
        if name == "fused-sweep":
            readme_block = f"```\n{ending}\n```\n\n```mermaid\n{diagram.rstrip()}\n```"
    files[root / "docs" / "walkthroughs" / "README.md"] = "\n".join(index) + "\n"
    head, rest = readme.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    block = f"{README_BEGIN}\n{readme_block}\n{README_END}"
    files[root / "README.md"] = head + block + tail
    return files


def add_parser(subparsers, name: str) -> None:
    """Register `lockstep docs`."""
    p = subparsers.add_parser(name, help="regenerate docs/walkthroughs from simulator traces",
                              description=__doc__)
    from sim.cli import OnceOption  # refused when given twice, as every option of `lockstep check`

    p.add_argument("--root", action=OnceOption, default=None,
                   help="lockstep checkout to write into: a directory holding README.md and the "
                        "sim/ and protocol/ packages (default: .)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if any generated file is stale")
    p.set_defaults(run=run)


def run(args) -> int:
    """Write (or with --check, compare) the generated files; 2 with one line for a --root
    that cannot take them, found before rendering."""
    if args.root is None:
        args.root = "."
    problem = check_root(args.root, write=not args.check)
    if problem:
        sys.stderr.write(f"lockstep docs: error: {problem}\n")
        return 2
    root = Path(args.root)
    stale = []
    try:
        for path, content in render(root).items():
            current = path.read_bytes() if path.exists() else None
            if current != content.encode("utf-8"):
                stale.append(path)
                if not args.check:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(content, encoding="utf-8")
    except OSError as exc:  # changed under us since check_root (a full disk, a removed dir)
        sys.stderr.write(f"lockstep docs: error: cannot write {str(exc.filename)!r}: "
                         f"{exc.strerror or exc}\n")
        return 2
    if args.check:
        for path in stale:
            print(f"stale: {path}")
        if not stale:
            print("the generated docs are up to date")
        return 1 if stale else 0
    print(f"wrote {len(stale)} file(s)")
    return 0
