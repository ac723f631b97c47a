"""Mutation testing of `protocol/`: a generated mutant set, killed by the project's own checks.

Every mutant changes one site of one module of ``protocol/`` by one operator -- a comparison
flipped (``<`` to ``<=``, ``==`` to ``!=``, ``in`` to ``not in`` ...), ``and``/``or`` swapped,
a ``not`` dropped, an integer constant moved by one, ``True``/``False`` swapped, ``+``/``-``
swapped, a returned value replaced by ``None``, a call statement or an augmented assignment
deleted. The sites are enumerated from the syntax tree in a fixed order (module, then
breadth-first), so mutant N is the same mutant on every machine; nothing is hand-picked.

Each mutant is written into a private copy of the checkout and put to the killers in order,
stopping at the first that fails: the protocol tests (``tests/protocol``), the default
``lockstep check`` (every shipped variant must get its verdict, the correct protocol must stay
clean), then the fast simulator tests. A killer that runs past its timeout kills the mutant too
(a mutant that loops). A mutant no killer notices survives; docs/mutation.md lists every
survivor with the reason it is equivalent or the test added to kill it.

Usage: ``python tools/mutation.py [--jobs 2] [--sample N] [--only 12,40] [--out DIR]``; ``make
mutation`` runs it with ``nice -n 19``. ``--sample N`` takes N mutants evenly spread over the
whole set (every k-th), ``--list`` prints the set without running anything. Before any mutant
the killers run once on the unmutated copy and must pass there (``--no-baseline`` skips
this): a killer that fails without a mutant would read every mutant as killed.

``--package sim --within sim/devices.py:405-490`` mutates the simulator's own checks instead
(only the mutants on those lines; ``--within`` may be repeated): a check of the model checker
that no test can make fire is a defect too. Its killers are the default ``lockstep check``
(every shipped variant must still get its verdict), then the simulator tests.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "sim")
COPIED = ("protocol", "sim", "lockstep", "engine", "tests", "tools", "pyproject.toml",
          "README.md", "docs")
"""What a mutant's private checkout holds: everything a killer imports or reads (the
simulator tests load ``tools/`` scripts through ``tests/tools.py``)."""

WALL_LIMIT_S = 1200
"""Wall-clock backstop per killer, for a mutant that blocks without using CPU."""

FAST_SIM_TESTS = ("tests/sim/test_invariants.py", "tests/sim/test_state.py",
                  "tests/sim/test_transport.py", "tests/sim/test_paging.py",
                  "tests/sim/test_admission_variants.py")
"""Simulator tests that run in seconds and exercise the protocol through the simulator."""

COMPARE_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
                ast.Is: ast.IsNot, ast.IsNot: ast.Is}
BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult,
              ast.Mod: ast.FloorDiv}


@dataclass(frozen=True)
class Mutant:
    """One generated mutant.

    Attributes:
        index: position in the whole set (stable across runs).
        path: module path relative to the checkout.
        site: position of the mutated node in the module's breadth-first walk.
        line: source line of the node.
        operator: what was changed (``"< -> <="``, ``"delete call"`` ...).
        original: the source line, stripped.
    """

    index: int
    path: str
    site: int
    line: int
    operator: str
    original: str


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0]))
    return ids


def _skipped(tree: ast.AST) -> set[int]:
    """Nodes not mutated: docstrings, annotations, ``__all__`` and whatever is inside raise
    statements' messages and f-strings (text only)."""
    skip = _docstring_nodes(tree)
    for node in ast.walk(tree):
        inside = []
        if isinstance(node, ast.JoinedStr):
            inside.append(node)
        if isinstance(node, (ast.arg, ast.AnnAssign)) and getattr(node, "annotation", None):
            inside.append(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            inside.append(node.returns)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            inside.append(node)
        for root in inside:
            skip.update(id(n) for n in ast.walk(root))
    return skip


def _operators(node: ast.AST) -> list[str]:
    """Names of the mutations that apply to ``node``."""
    ops = []
    match node:
        case ast.Compare(ops=cmp) if len(cmp) == 1 and type(cmp[0]) in COMPARE_SWAP:
            ops.append(f"{type(cmp[0]).__name__} -> {COMPARE_SWAP[type(cmp[0])].__name__}")
        case ast.BoolOp(op=ast.And()):
            ops.append("and -> or")
        case ast.BoolOp(op=ast.Or()):
            ops.append("or -> and")
        case ast.UnaryOp(op=ast.Not()):
            ops.append("drop not")
        case ast.Constant(value=bool() as v):
            ops.append(f"{v} -> {not v}")
        case ast.Constant(value=int() as v):
            ops.append(f"{v} -> {v + 1}")
        case ast.BinOp(op=op) if type(op) in BINOP_SWAP:
            ops.append(f"{type(op).__name__} -> {BINOP_SWAP[type(op)].__name__}")
        case ast.Return(value=value) if value is not None and not (
                isinstance(value, ast.Constant) and value.value is None):
            ops.append("return None")
        case ast.Expr(value=ast.Call()):
            ops.append("delete call")
        case ast.AugAssign():
            ops.append("delete augmented assignment")
    return ops


def _sites(tree: ast.AST):
    """(site number, node, operator) for every mutation of ``tree``, breadth-first."""
    skip = _skipped(tree)
    out = []
    for site, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        for operator in _operators(node):
            out.append((site, node, operator))
    return out


def enumerate_mutants(root: Path = ROOT, package: str = "protocol") -> list[Mutant]:
    """Every mutant of every module of ``package`` (``protocol`` or ``sim``), in a fixed
    order."""
    mutants = []
    for path in sorted((root / package).glob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        for site, node, operator in _sites(tree):
            line = getattr(node, "lineno", 0)
            mutants.append(Mutant(len(mutants), str(path.relative_to(root)), site, line, operator,
                                  lines[line - 1].strip() if line else ""))
    return mutants


class _Apply(ast.NodeTransformer):
    def __init__(self, site: int, operator: str):
        self.site, self.operator = site, operator
        self.order = None

    def visit(self, node):
        if self.order is None:
            self.order = {id(n): i for i, n in enumerate(ast.walk(node))}
        if self.order.get(id(node)) == self.site:
            return self._mutate(node)
        return self.generic_visit(node)

    def _mutate(self, node):
        op = self.operator
        if isinstance(node, ast.Compare):
            node.ops = [COMPARE_SWAP[type(node.ops[0])]()]
        elif isinstance(node, ast.BoolOp):
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        elif isinstance(node, ast.UnaryOp):
            return node.operand
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            node.value = not node.value
        elif isinstance(node, ast.Constant):
            node.value = node.value + 1
        elif isinstance(node, ast.BinOp):
            node.op = BINOP_SWAP[type(node.op)]()
        elif op == "return None":
            node.value = ast.Constant(None)
        elif op in ("delete call", "delete augmented assignment"):
            return ast.Pass()
        return node


def mutated_source(mutant: Mutant, root: Path = ROOT) -> str:
    """The module's source with ``mutant`` applied (re-generated from the syntax tree)."""
    tree = ast.parse((root / mutant.path).read_text())
    tree = _Apply(mutant.site, mutant.operator).visit(tree)
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n"


SLOW_SIM_TESTS = ("tests/sim/test_docs.py", "tests/sim/test_cli.py",
                  "tests/sim/test_check_robustness.py", "tests/sim/test_search.py",
                  "tests/sim/test_matrix.py")
"""Left out of the simulator killer: walkthrough regeneration, CLI plumbing, the search's own
reductions and hook robustness, whose minutes test no check of the model."""


def killers(python: str, package: str = "protocol") -> list[tuple[str, list[str], int]]:
    """(name, command, CPU-second limit), fastest and most likely to kill first.

    The limits are CPU time (``RLIMIT_CPU``), not wall time, so a loaded machine does not turn a
    slow but correct run into a kill; each is several times what the unmutated run takes
    (about 3 s, 16 s and 10 s; the simulator tests of a ``sim`` run about 70 s)."""
    pytest = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    check = ("lockstep check", [python, "-m", "lockstep", "check", "--no-progress", "--jobs", "1"],
             120)
    if package == "sim":
        return [check, ("sim tests", pytest + ["tests/sim"]
                        + [f"--ignore={t}" for t in SLOW_SIM_TESTS], 400)]
    return [("tests/protocol", pytest + ["tests/protocol"], 40),
            ("lockstep check", [python, "-m", "lockstep", "check", "--no-progress", "--jobs", "1"],
             120),
            ("fast sim tests", pytest + list(FAST_SIM_TESTS), 90)]


def _limit_cpu(seconds: int):
    def apply() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 5))
    return apply


def _copy_tree(dest: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dest / name)


def _run_killers(workdir: Path, python: str, package: str) -> dict:
    """Run the killers in ``workdir`` in order, stopping at the first that fails: ``killed_by``
    (its name, or None), ``timeout``, and ``output`` (the tail of the failing killer's)."""
    env = dict(os.environ, PYTHONPATH=str(workdir), PYTHONDONTWRITEBYTECODE="1")
    result = {"killed_by": None, "timeout": False}
    for name, command, cpu_s in killers(python, package):
        try:
            proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True,
                                  text=True, timeout=WALL_LIMIT_S,
                                  preexec_fn=_limit_cpu(cpu_s))
        except subprocess.TimeoutExpired:  # blocked without using CPU
            result.update(killed_by=name, timeout=True)
            break
        if proc.returncode != 0:
            result["killed_by"] = name
            result["timeout"] = proc.returncode in (-24, -9)  # SIGXCPU / past the hard limit
            result["output"] = (proc.stdout + proc.stderr)[-2000:]
            break
    return result


def run_mutant(mutant: Mutant, workdir: Path, python: str, package: str = "protocol") -> dict:
    """Put ``mutant`` to the killers in ``workdir`` (a copy of the checkout); restores the file.

    The mutant is made from the copy's own module, as it was when the run started, not from
    the checkout: a module edited there during a run (a fix for what an earlier mutant showed)
    would otherwise receive each later mutant at a site numbered in the old text, and be put
    back as the new text."""
    target = workdir / mutant.path
    original = target.read_text()
    target.write_text(mutated_source(mutant, workdir))
    start = time.perf_counter()
    try:
        result = _run_killers(workdir, python, package)
    finally:
        target.write_text(original)
    result.pop("output", None)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def baseline_failure(workdir: Path, python: str, package: str) -> str | None:
    """Why the killers fail on the unmutated copy in ``workdir``, or None when they pass.

    A killer that fails without a mutant (a test that cannot run in the private copy, a
    check that is red on the checkout) would read every mutant as killed, so a run starts
    with this and refuses to go on."""
    result = _run_killers(workdir, python, package)
    if result["killed_by"] is None:
        return None
    how = "ran past its limit" if result["timeout"] else "failed"
    return (f"the killer {result['killed_by']!r} {how} on the unmutated code, so every mutant "
            f"would read as killed; its output ends:\n{result.get('output', '')}")


def _line_range(text: str) -> tuple[str, int, int]:
    """"sim/devices.py:405-490" -> ("sim/devices.py", 405, 490).

    Raises:
        ValueError: not FILE:FIRST-LAST with FIRST <= LAST, or no such file."""
    path, _, lines = text.rpartition(":")
    first, _, last = lines.partition("-")
    if not path or not first.isdigit() or not last.isdigit() or int(first) > int(last):
        raise ValueError(f"--within {text!r}: expected FILE:FIRST-LAST, e.g. sim/devices.py:1-80")
    full = (ROOT / path).resolve()  # ./sim/x.py and an absolute path name the same module
    if not full.is_file() or not full.is_relative_to(ROOT):
        raise ValueError(f"--within {text!r}: no file {path} in the checkout")
    return full.relative_to(ROOT).as_posix(), int(first), int(last)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    p.add_argument("--sample", type=int, default=None,
                   help="run N mutants evenly spread over the set (default: all)")
    p.add_argument("--only", default=None, help="comma-separated mutant indices to run")
    p.add_argument("--out", default="mutation-results", help="directory for results.json")
    p.add_argument("--list", action="store_true", help="print the mutant set and exit")
    p.add_argument("--package", choices=PACKAGES, default="protocol",
                   help="what to mutate (default protocol)")
    p.add_argument("--within", action="append", default=[], metavar="FILE:FIRST-LAST",
                   help="only mutants on these lines of this module (repeatable)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip running the killers on the unmutated code first (they must pass "
                        "there, or every mutant reads as killed)")
    args = p.parse_args(argv)
    try:
        ranges = [_line_range(w) for w in args.within]
    except ValueError as exc:
        p.error(str(exc))
    outside = [w for w, (f, _, _) in zip(args.within, ranges)
               if not f.startswith(args.package + "/")]
    if outside:
        p.error(f"--within {outside[0]!r}: the file is not in --package {args.package}")
    every = enumerate_mutants(package=args.package)
    mutants = [m for m in every
               if not ranges or any(m.path == f and a <= m.line <= b for f, a, b in ranges)]
    if not mutants:
        p.error(f"--within {' '.join(map(repr, args.within))}: no mutant on those lines")
    if args.list:
        for m in mutants:
            print(f"{m.index:5d} {m.path}:{m.line} {m.operator}: {m.original}")
        print(f"{len(mutants)} mutants")
        return 0
    chosen = mutants
    if args.only:
        wanted = {int(x) for x in args.only.split(",")}
        chosen = [m for m in mutants if m.index in wanted]
    elif args.sample is not None and args.sample < len(mutants):
        stride = len(mutants) / args.sample
        chosen = [mutants[math.floor(i * stride)] for i in range(args.sample)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    results: dict[int, dict] = {}
    lock = threading.Lock()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lockstep-mutation-") as tmp:
        slots = []
        for w in range(max(1, args.jobs)):
            workdir = Path(tmp) / f"w{w}"
            workdir.mkdir()
            _copy_tree(workdir)
            slots.append(workdir)
        if not args.no_baseline:
            failure = baseline_failure(slots[0], python, args.package)
            if failure is not None:
                print(f"mutation.py: {failure}", file=sys.stderr)
                return 1
        free = list(slots)

        def one(mutant: Mutant) -> None:
            with lock:
                workdir = free.pop()
            try:
                res = run_mutant(mutant, workdir, python, args.package)
            finally:
                with lock:
                    free.append(workdir)
            with lock:
                results[mutant.index] = {**asdict(mutant), **res}
                done = len(results)
                status = f"killed by {res['killed_by']}" if res["killed_by"] else "SURVIVED"
                print(f"[{done}/{len(chosen)}] #{mutant.index} {mutant.path}:{mutant.line} "
                      f"{mutant.operator}: {status} ({res['seconds']} s)", flush=True)
                (out / "results.json").write_text(json.dumps(
                    {"package": args.package, "total_mutants": len(every),
                     "chosen": len(chosen),
                     "results": [results[k] for k in sorted(results)]}, indent=1))

        with ThreadPoolExecutor(max_workers=len(slots)) as pool:
            list(pool.map(one, chosen))
    survived = [r for r in results.values() if not r["killed_by"]]
    print(f"\n{len(chosen)} of {len(mutants)} mutants run in {time.perf_counter() - start:.0f} s: "
          f"{len(chosen) - len(survived)} killed, {len(survived)} survived")
    for r in sorted(survived, key=lambda r: r["index"]):
        print(f"  survived #{r['index']} {r['path']}:{r['line']} {r['operator']}: {r['original']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
