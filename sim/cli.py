"""`lockstep check`: check the protocol and every known-bad variant, print the verdict table.

With no arguments it checks the correct protocol on the real configuration (Qwen3-4B shapes, TP
2, the 36 pegainfer buckets, max batch 256, startup sweep then serving) under both process
topologies -- clean without faults, loud global aborts with them -- and every shipped variant,
and exits 0 only if all verdicts are as expected. Bad arguments exit 2 with a one-line error,
an option that takes a value given twice among them (a script's second value is not an
override, as it is in `lockstep bench`; --variant, --variant-file and --hazard-off repeat).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

from lockstep.args import clipped, integer, number, option_integer, seed, within_digits
from lockstep.paths import nearest_existing, write_refused
from protocol.errors import ConfigError
from sim.check import (NOT_REACHABLE, TRACE_REDUCE_ATTEMPTS, CheckSpec, Row,
                       check_coverage_reachable, check_scenario_value, has_faulted_row,
                       replay_trace, scenario_spec, is_other_harm, unreachable_here,
                       variant_spec, verdict_label)
from sim.common import EVENT_NEEDS
from sim.guard import Stalled, describe, watchdog
from sim.hazards import H2_CALLS, H2_SCOPES, RULES, HazardModel
from sim.limits import MAX_JOBS, check_limits
from sim.progress import CheckProgress
from sim.report import narrative, write_trace
from sim.rows import check_rows, expects_clean, planned_schedules
from sim.run import freeze_imports
from sim.scenario import TOPOLOGIES
from sim.strategies import STRATEGIES
from sim.variants import REGISTRY, SHIPPED, get_variant, load_variant_file


def _int(text: str, minimum: int | None = None) -> int:
    value = option_integer(text)
    if minimum is not None and value < minimum:
        raise ValueError(f"{value} must be at least {minimum}")
    return value


def default_jobs() -> int:
    """--jobs when not given: the CPU count, at most MAX_JOBS (a machine of more CPUs was
    refused as if it had been given)."""
    return min(os.cpu_count() or 1, MAX_JOBS)


def _listed(text: str, known) -> list[str] | None:
    """The names of a comma list whose every non-empty part is one of ``known``, or None: a
    fresh user's ``--variant a,b`` or ``--hazard-off h2,h3``."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    return parts if "," in text and parts and all(part in known for part in parts) else None


def _hazard(text: str) -> str:
    """A hazard rule name, in either case (the docs write H2; the rules are h1..h9)."""
    if text.lower() not in RULES:
        raise ValueError(f"invalid choice: {text!r} (choose from {', '.join(RULES)})" + (
            "; give --hazard-off once per hazard" if _listed(text.lower(), RULES) else ""))
    return text.lower()


def _positive_int(text: str) -> int:
    return _int(text, 1)


def _positive_float(text: str) -> float:
    value = number(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{text} must be a finite, positive number of seconds")
    return value


def _buckets(text: str) -> tuple[int, ...]:
    items = [x.strip() for x in text.split(",")]
    if any(not x for x in items):
        raise ValueError(f"{text!r} has an empty item; give a comma-separated list of integers")
    for item in items:
        within_digits(item)
    try:
        values = tuple(integer(x) for x in items)
    except ValueError:
        raise ValueError(f"{clipped(text)!r} is not a comma-separated list of integers") from None
    return check_scenario_value("buckets", values)


def _bounded(fn, option: str):
    """``fn`` followed by the `sim.limits` bound of ``option`` (a keyword of `check_limits`)."""
    def parse(text):
        value = fn(text)
        check_limits(**{option: value})
        return value
    return parse


def _typed(fn, what):
    """An argparse type whose error message is the parser's reason alone (argparse adds the option)."""
    import argparse

    def parse(text):
        try:
            return fn(text)
        except (ValueError, ConfigError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = what
    return parse


class OnceOption(argparse.Action):
    """An option that takes one value and may be given once: a second use is refused (argparse
    would keep the last one and silently drop the first). The parser's error is one line
    naming the option and both values, each as parsed (``--buckets 1,2`` as '1,2').

    Every option of `lockstep check` that takes a value uses it (its default must be None, so
    that a first use can be told from none); the repeatable ones (``--variant``,
    ``--variant-file``, ``--hazard-off``) append instead, and a switch (``--json``) given twice
    is the same switch."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        if given is not None:
            raise argparse.ArgumentError(self, f"given twice ({_shown(given)!r}, then "
                                               f"{_shown(values)!r}); give it once")
        setattr(namespace, self.dest, values)


def _shown(value) -> str:
    """A parsed option value as text: buckets as ``1,2,4``, a path as given, else ``str``."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


DEFAULTS = {"ranks": 2, "topology": "both", "strategy": None, "schedules": 300,
            "fault_schedules": 18, "time_budget": 60.0, "seed": 0, "jobs": None}
"""Defaults of the options that `--replay` refuses; they are None in the parser so that an
option given on the command line can be told from one left at its default."""

CLEAN_SCHEDULES = 35
"""Fault-free schedules of a protocol expected clean (the correct protocol, under each of its
scenarios) when ``--schedules`` is not given; a bad variant's search, which stops at its first
failure, may take up to ``DEFAULTS["schedules"]``. Chosen so the default check stays under 10 s on
2 cores with every catch and non-vacuity check kept (docs/simulator-figures.md)."""

HAZARD_HELP = ", ".join(f"{f.name.split('_')[0]} {' '.join(f.name.split('_')[1:])}"
                        for f in fields(HazardModel) if f.type in (bool, "bool"))


def add_parser(subparsers, name: str) -> None:
    """Register `lockstep check`."""
    p = subparsers.add_parser(name, help="check the protocol and every known-bad variant",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[], metavar="NAME",
                   help="check only this variant (repeatable), shipped or from a --variant-file; "
                        "default: all shipped, or every variant of the given files")
    p.add_argument("--variant-file", action="append", default=[], metavar="PATH",
                   help="load variants from a Python file and check them instead of the shipped "
                        "ones: every variant it defines, or only those --variant names (which "
                        "may name shipped ones too)")
    p.add_argument("--ranks", action=OnceOption, default=None,
                   type=_typed(lambda t: check_scenario_value("ranks", _int(t)), "--ranks"),
                   help="world size, at least 2: every hazard is between ranks (default 2)")
    p.add_argument("--buckets", action=OnceOption, type=_typed(_buckets, "--buckets"), default=None,
                   help="comma-separated decode buckets (default: the 36 pegainfer buckets)")
    p.add_argument("--max-batch", action=OnceOption, default=None,
                   type=_typed(lambda t: check_scenario_value("max_batch", _int(t)),
                               "--max-batch"),
                   help="max batch (default: the largest bucket)")
    p.add_argument("--topology", action=OnceOption, choices=("both",) + TOPOLOGIES, default=None,
                   help="shared (all ranks in one process, one driver lock), per-rank (one "
                        "process per rank), or both (default both)")
    p.add_argument("--strategy", action=OnceOption, choices=STRATEGIES, default=None,
                   help="schedule search strategy (default random); a variant whose bug needs "
                        "a rare interleaving names its own, which this option replaces, so such "
                        "a variant may then go unfound (docs/search-stats.md)")
    p.add_argument("--schedules", action=OnceOption, default=None,
                   type=_typed(_bounded(_positive_int, "schedules"), "--schedules"),
                   help="schedules per variant and topology (default: up to 300 for a bad "
                        f"variant, stopping at its first failure; {CLEAN_SCHEDULES} fault-free "
                        "ones for the correct protocol); a Hypothesis search of several "
                        "scenarios in turn shares them among those, at least one each; a "
                        "variant may cap its own (correct-eager runs at most 20: each row's "
                        "detail counts what ran)")
    p.add_argument("--fault-schedules", action=OnceOption, default=None,
                   type=_typed(_bounded(lambda t: _int(t, 0), "fault_schedules"),
                               "--fault-schedules"),
                   help=f"faulted schedules for the correct protocol (default "
                        f"{DEFAULTS['fault_schedules']}; 0 skips)")
    p.add_argument("--time-budget", action=OnceOption, default=None,
                   type=_typed(_bounded(_positive_float, "time_budget"), "--time-budget"),
                   help="seconds per search, for each variant and topology (default 60)")
    p.add_argument("--seed", action=OnceOption, default=None,
                   type=_typed(seed, "--seed"),
                   help="search seed, an integer in [0, 2**64) (default 0)")
    p.add_argument("--jobs", action=OnceOption, default=None,
                   type=_typed(_bounded(_positive_int, "jobs"), "--jobs"),
                   help=f"worker processes for random and PCT search (default: the CPU count, "
                        f"at most {MAX_JOBS}: {default_jobs()} here)")
    p.add_argument("--hazard-off", action="append", default=[], metavar="HAZARD",
                   type=_typed(_hazard, "--hazard-off"),
                   help=f"switch a hazard rule off (repeatable): {HAZARD_HELP} (docs/hazards.md); "
                        "bad variants' verdicts are then reported, not compared")
    p.add_argument("--h2-scope", action=OnceOption, choices=H2_SCOPES, default=None,
                   help="which devices a quiescing driver call waits for (an assumption, "
                        "docs/hazards.md): its own device, every device of its process, or every "
                        "peer (default process)")
    p.add_argument("--h2-calls", action=OnceOption, choices=H2_CALLS, default=None,
                   help="which driver calls wait for quiescence (H2): those public reports name "
                        "(assumed: instantiate, upload, allocation), those the H200 probes "
                        "measured (measured: frees), or both (default both; docs/hazards.md); "
                        "with a value other than both, bad variants' verdicts are reported, not "
                        "compared")
    p.add_argument("--explain", action="store_true",
                   help="for each counterexample, the minimal set of hazards it needs (each "
                        "hazard switched off in turn) and its verdict under each H2 scope")
    p.add_argument("--stats", action="store_true",
                   help="instead of verdicts, the share of random and of PCT schedules that fail "
                        "for each bad variant (--schedules of each, no stop at the first failure; "
                        "docs/search-stats.md)")
    p.add_argument("--matrix", action="store_true",
                   help="check every variant at ranks 2, 3, 4 x four bucket sets x both topologies "
                        "(docs/matrix.md); chooses --ranks, --buckets, --max-batch, --topology; "
                        "verdicts only (refuses --explain and --trace-out)")
    p.add_argument("--replay", metavar="TRACE.json", action=OnceOption,
                   help="replay one recorded trace exactly (takes its scenario from the trace; "
                        "combines only with --json, --trace-out and --variant-file)")
    p.add_argument("--trace-out", action=OnceOption, metavar="DIR",
                   type=_typed(_trace_dir, "--trace-out"),
                   help="write each counterexample as .txt, .mmd, .json (created, with its "
                        "parents, when the traces are written); the counterexamples, and the "
                        "table's min trace with them, are reduced with the walkthroughs' "
                        f"{TRACE_REDUCE_ATTEMPTS} attempts rather than "
                        f"{CheckSpec.reduce_attempts}, so each walkthrough's Reproduce command "
                        "writes its story")
    p.add_argument("--list", action="store_true",
                   help="print the variants (shipped, or those of --variant-file / --variant) "
                        "with their expected verdicts (or 'not reachable here' where the check "
                        "reads that at the default configuration) and one-line summaries, and "
                        "check nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--no-progress", action="store_true",
                       help="no progress bar (default: a bar on stderr where it is a terminal)")
    shown.add_argument("--progress", action="store_true",
                       help="the progress bar on stderr even where it is not a terminal (a "
                            "log file, a pipe)")
    p.set_defaults(run=run)


def _bar_disabled(args) -> bool | None:
    """`CheckProgress`'s ``disable``: True with --no-progress, False with --progress, None
    (tqdm's choice: a bar only on a terminal) otherwise."""
    if args.no_progress:
        return True
    return False if args.progress else None


def _variant_list(variants, spec: CheckSpec, as_json: bool) -> str:
    """`--list`: one line per variant (name, expected verdict per topology, summary), or the
    same as a JSON list.

    A topology where the check of ``spec`` (the default configuration: `--list` takes no
    configuration option) reads "not reachable here" shows that instead of the expected
    verdict, as the check's table does, with the reason in a ``note:`` line below the table
    (JSON: ``not_reachable``, topology -> reason); the decision is the check's own
    (`sim.check.unreachable_here`). A variant whose code raises or stalls while that is decided
    shows ``error`` there, with the one-line account as its note (JSON: ``errors``).
    """
    rows, notes = [], []
    for v in variants:
        row = {"variant": v.name, **{t: v.expected.get(t, "-") for t in TOPOLOGIES},
               "summary": v.summary, "not_reachable": {}, "errors": {}}
        for t in TOPOLOGIES:
            try:
                with watchdog():  # a variant's hook is user code, as in a check
                    reason = unreachable_here(v, variant_spec(v, spec), t)
            except (Exception, Stalled, SystemExit) as exc:  # noqa: BLE001 - as check_variant
                row[t], row["errors"][t] = "error", describe(v.name, exc)
                notes.append(f"error: {v.name} / {t}: {row['errors'][t]}")
                continue
            if reason is not None:
                row[t], row["not_reachable"][t] = NOT_REACHABLE, reason
                notes.append(f"note: {v.name} / {t}: not reachable here: {reason}")
        rows.append(row)
    if as_json:
        return json.dumps(rows, indent=1)
    width = max(len(r["variant"]) for r in rows)
    verdicts = {t: max(len(t), *(len(str(r[t])) for r in rows)) for t in TOPOLOGIES}
    head = f"{'variant':<{width}}  " + "  ".join(f"{t:<{verdicts[t]}}" for t in TOPOLOGIES)
    lines = [head + "  summary"]
    for r in rows:
        lines.append(f"{r['variant']:<{width}}  "
                     + "  ".join(f"{str(r[t]):<{verdicts[t]}}" for t in TOPOLOGIES)
                     + f"  {r['summary']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def _trace_dir(text: str) -> Path:
    """The --trace-out directory, checked writable before any search but not created: a command
    refused after its arguments are parsed must leave nothing behind. A missing directory is
    created when the traces are written (`sim.report.write_trace`); until then the test write
    goes to its nearest existing ancestor.

    Raises:
        ValueError: the one-line reason, a path that cannot even be looked at included (a
            PermissionError from ``Path.exists`` for a directory the user may not enter).
    """
    try:
        return _checked_trace_dir(text)
    except OSError as exc:
        raise ValueError(f"cannot use {text!r}: {exc.strerror or exc}") from None


def _checked_trace_dir(text: str) -> Path:
    if not text:
        raise ValueError("the directory name is empty")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{text!r} exists and is not a directory")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"cannot create {text!r}: {str(existing)!r} is not a directory")
    refused = write_refused(existing)
    if refused:
        what = f"write to {text!r}" if existing == path.absolute() else (
            f"create {text!r} (in {str(existing)!r})")
        raise ValueError(f"cannot {what}: {refused}")
    return path


CONFIG_FLAGS = {"world_size": "--ranks", "buckets": "--buckets", "max_batch": "--max-batch"}
"""The option that sets each configuration field `lockstep check` passes to the protocol's
config and the simulator's scenario; `flag_names` spells a `ConfigError`'s fields with them."""


def flag_names(error: ConfigError, defaulted: dict[str, str] | None = None) -> str:
    """``error``'s message with each configuration field it names (``error.fields``) spelled as
    the option that sets it: ``max_batch=300 exceeds ...; lower max_batch`` reads
    ``--max-batch 300 exceeds ...; lower --max-batch``. A field no option sets is left as is.

    ``defaulted`` maps a field the command line did not set to where its value came from
    (`defaulted_fields`); its ``max_batch=2`` then reads ``--max-batch 2 (not given; it
    defaults to the largest of --buckets 1,2)``, so that the error does not blame an option
    nobody typed."""
    text = str(error)
    for name in error.fields:
        flag = CONFIG_FLAGS.get(name)
        if flag is not None:
            source = (defaulted or {}).get(name)
            note = f" (not given; it defaults to {source})" if source else ""
            text = re.sub(rf"\b{name}=([^\s:;,()]+)", lambda m: f"{flag} {m[1]}{note}", text)
            text = re.sub(rf"(?<!-)\b{name}\b", flag, text)
    return text


def defaulted_fields(args) -> dict[str, str]:
    """For `flag_names`: each configuration field whose option ``args`` (the parsed command
    line) leaves unset and whose value is derived from another, with what it is derived from.
    Only ``--max-batch`` is: `sim.scenario.default_scenario` takes the largest bucket, of
    ``--buckets`` where given (``--ranks`` has a fixed default that no configuration check
    refuses)."""
    if args.max_batch is not None:
        return {}
    if args.buckets is not None:
        return {"max_batch": f"the largest of --buckets {','.join(map(str, args.buckets))}"}
    return {"max_batch": "the largest default bucket"}


def _fail(message: str) -> int:
    sys.stderr.write(f"lockstep check: error: {message}\n")
    return 2


class _Terminated(BaseException):
    """SIGTERM, turned into an exception so that worker processes are reaped on the way out."""


def run(args) -> int:
    """Run `lockstep check`; returns the exit status (0 all as expected, 1 not, 2 bad input,
    130 interrupted by Ctrl-C, 143 by SIGTERM). An interrupted check prints the rows it had
    finished, then one line saying how many were interrupted."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        def terminated(signum, frame):
            raise _Terminated()
        previous = signal.signal(signal.SIGTERM, terminated)
    finished = _Finished()
    try:
        return _run(args, finished)
    except KeyboardInterrupt:
        return finished.report("interrupted", 130)
    except _Terminated:
        return finished.report("terminated", 143)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Finished:
    """The rows a check has finished so far, printed if Ctrl-C or SIGTERM ends it early.

    Its line counts table rows, the unit the final summary counts (``N/M verdicts as
    expected``): the rows of the checks that finished, of those plus the rows planned for the
    checks that did not (a protocol expected clean plans two, the fault-free one and the
    faulted one).

    Attributes:
        render: () -> the text (table or JSON) of the finished rows, or None before any finished.
        planned: rows planned for each check (a variant in one topology, a matrix
            configuration, a --stats line), in order.
        unit: what a row is, in the singular (``verdict``; ``row`` for --stats).
    """

    def __init__(self):
        self.render = None
        self.planned: list[int] = []
        self.unit = "verdict"
        self._rows: dict[int, int] = {}  # check index -> rows it gave

    def finish(self, check: int, rows: int) -> None:
        """Check ``check`` (an index into ``planned``) finished with ``rows`` rows."""
        self._rows[check] = rows

    @property
    def done(self) -> int:
        """Rows of the finished checks."""
        return sum(self._rows.values())

    @property
    def total(self) -> int:
        """Rows finished, plus those planned for the checks not finished."""
        return self.done + sum(n for i, n in enumerate(self.planned) if i not in self._rows)

    def _count(self, n: int) -> str:
        return f"{n} {self.unit}{'s' * (n != 1)}"

    def report(self, how: str, code: int) -> int:
        text = self.render() if self.render is not None and self.done else None
        if text and len(self._rows) == len(self.planned):  # stopped in what follows the rows
            print(text, flush=True)
            sys.stderr.write(f"lockstep check: {how}; all {self._count(self.total)} finished "
                             "(above), what follows them (--explain, traces) did not\n")
        elif text:
            print(text, flush=True)
            sys.stderr.write(f"lockstep check: {how}; {self.done} of {self._count(self.total)} "
                             f"finished (above), the other {self.total - self.done} did not\n")
        elif self.planned:  # stopped before any check finished (a fresh user's finding)
            sys.stderr.write(f"lockstep check: {how}; none of the {self._count(self.total)} "
                             "finished\n")
        else:
            sys.stderr.write(f"lockstep check: {how}\n")
        return code


def _run(args, finished: _Finished | None = None) -> int:
    finished = finished or _Finished()
    if args.hazard_off:  # one switch per hazard, however often it was named
        args.hazard_off = list(dict.fromkeys(args.hazard_off))
    if args.list:  # it reads only which variants: every other option would be ignored
        given = [f"--{k.replace('_', '-')}" for k in DEFAULTS if getattr(args, k) is not None]
        given += [opt for opt, value in (("--buckets", args.buckets),
                                         ("--max-batch", args.max_batch),
                                         ("--hazard-off", args.hazard_off),
                                         ("--h2-scope", args.h2_scope),
                                         ("--h2-calls", args.h2_calls),
                                         ("--replay", args.replay), ("--matrix", args.matrix),
                                         ("--stats", args.stats), ("--explain", args.explain),
                                         ("--trace-out", args.trace_out)) if value]
        if given:
            return _fail(f"--list checks nothing; drop {', '.join(given)}")
    if args.replay is not None:
        given = [f"--{k.replace('_', '-')}" for k in DEFAULTS if getattr(args, k) is not None]
        given += [opt for opt, value in (("--variant", args.variant), ("--buckets", args.buckets),
                                         ("--max-batch", args.max_batch),
                                         ("--hazard-off", args.hazard_off),
                                         ("--matrix", args.matrix),
                                         ("--stats", args.stats),
                                         ("--explain", args.explain),
                                         ("--h2-scope", args.h2_scope),
                                         ("--h2-calls", args.h2_calls)) if value]
        if given:
            return _fail(f"--replay takes its scenario and search from the trace; drop "
                         f"{', '.join(given)}")
        try:
            for path in args.variant_file:  # a trace of a user's variant needs its file
                load_variant_file(path)
        except ConfigError as exc:
            return _fail(str(exc))
        return _replay(args.replay, args.json, args.trace_out)
    if args.stats and (args.matrix or args.explain or args.strategy):
        both = "--matrix" if args.matrix else "--explain" if args.explain else "--strategy"
        return _fail(f"--stats measures random and PCT search by itself; drop {both}")
    if args.strategy == "exhaustive" and args.schedules is not None:
        return _fail(f"--schedules {args.schedules} sets the budget of random, PCT and "
                     "Hypothesis search; exhaustive search runs every distinct schedule: drop "
                     "--schedules")
    if "h2" in (args.hazard_off or ()):
        h2_options = [f"{opt} {value}" for opt, value in (("--h2-calls", args.h2_calls),
                                                           ("--h2-scope", args.h2_scope))
                      if value is not None]
        if h2_options:
            verb = "shapes" if len(h2_options) == 1 else "shape"
            return _fail(f"{' and '.join(h2_options)} {verb} H2, but --hazard-off h2 switches "
                         "H2 off: drop one")
    if args.stats and args.trace_out is not None:
        return _fail("--stats counts failing schedules and keeps no counterexample; drop "
                     "--trace-out")
    if args.matrix and (args.explain or args.trace_out is not None):
        given = ", ".join(opt for opt, value in (("--explain", args.explain),
                                                 ("--trace-out", args.trace_out is not None)) if value)
        return _fail(f"--matrix prints verdicts only (no attribution, no traces); drop {given}, "
                     "or check one configuration without --matrix")
    if args.matrix:
        given = [opt for opt, value in (("--ranks", args.ranks), ("--buckets", args.buckets),
                                        ("--max-batch", args.max_batch),
                                        ("--topology", args.topology)) if value is not None]
        if given:
            return _fail(f"--matrix chooses ranks, buckets and topologies; drop {', '.join(given)}")
    clean_schedules = CLEAN_SCHEDULES if args.schedules is None else args.schedules
    faults_given, jobs_given = args.fault_schedules is not None, args.jobs is not None
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value if key != "jobs" else default_jobs())
    try:
        loaded = list(dict.fromkeys(v.name for path in args.variant_file
                                    for v in load_variant_file(path)))  # a file given twice: once
        names = list(dict.fromkeys(args.variant)) or loaded or list(SHIPPED)
        for name in names:
            if name not in REGISTRY and (parts := _listed(name, REGISTRY)):
                given = "--variant " + " --variant ".join(parts)
                return _fail(f"--variant {name!r}: a variant's name has no comma; give {given}"
                             if len(parts) == 1 else f"--variant {name!r} names several "
                             f"variants; give --variant once per variant ({given})")
        variants = [get_variant(n) for n in names]
        spec = CheckSpec(ranks=args.ranks, buckets=args.buckets, max_batch=args.max_batch,
                         strategy=args.strategy, schedules=args.schedules,
                         clean_schedules=clean_schedules, fault_schedules=args.fault_schedules, time_budget=args.time_budget,
                         seed=args.seed, hazards_off=tuple(args.hazard_off), jobs=args.jobs,
                         h2_scope=args.h2_scope or "process", h2_calls=args.h2_calls or "both")
        if args.trace_out is not None:  # traces to read: reduced as far as the walkthroughs'
            spec = replace(spec, reduce_attempts=TRACE_REDUCE_ATTEMPTS)
        if args.list:
            print(_variant_list(variants, spec, args.json))
            return 0
        # options that only a '+faults' row uses (a fresh user's findings: taken and ignored)
        faulted = args.matrix or any(has_faulted_row(v, spec) for v in variants)
        if faults_given and spec.fault_schedules > 0 and not faulted:
            return _fail(f"--fault-schedules {spec.fault_schedules} sets the '+faults' row of a "
                         "design expected clean; no variant checked here has one ("
                         f"{clipped(', '.join(v.name for v in variants))}): drop "
                         "--fault-schedules")
        if (jobs_given and args.jobs > 1 and args.strategy in ("exhaustive", "hypothesis")
                and not faulted):  # under these, only a faulted row's random search uses workers
            return _fail(f"--jobs {args.jobs} spreads random and PCT search over worker "
                         f"processes; {args.strategy} search runs in this one: drop --jobs")
        # validates ranks / buckets / max batch before any search
        check_coverage_reachable(spec.scenario("shared"))
    except ConfigError as exc:
        return _fail(flag_names(exc, defaulted_fields(args)))
    freeze_imports()
    cpus = os.cpu_count() or 1
    if args.jobs > cpus and args.strategy in (None, "random", "pct"):
        sys.stderr.write(f"lockstep check: warning: --jobs {args.jobs} is more than the {cpus} "
                         f"CPUs here; the search will not run faster than with --jobs {cpus}\n")
    if args.matrix:
        return _run_matrix(variants, spec, args, finished)
    if args.stats:
        clean = [v.name for v in variants if expects_clean(v)]
        if len(clean) == len(variants):
            return _fail(f"--stats measures how often a bad variant's schedules fail; "
                         f"{', '.join(clean)} {'is' if len(clean) == 1 else 'are'} expected "
                         "clean everywhere: give a bad variant (or no --variant for all)")
        if clean and args.variant:
            sys.stderr.write(f"lockstep check: --stats skips {', '.join(clean)} (expected "
                             "clean: no failing share to measure)\n")
        return _run_stats(variants, spec, args, finished)
    topologies = TOPOLOGIES if args.topology == "both" else (args.topology,)
    budgets = default_budgets(variants)
    rows: list[Row] = []
    start = time.perf_counter()
    plan = [(f"{v.name} / {t}", planned_schedules(v, spec), _planned_rows(v, spec))
            for v in variants for t in topologies]
    order = {(v.name, t): i for i, (v, t) in enumerate((v, t) for v in variants for t in topologies)}
    done: dict[int, list[Row]] = {}

    def partial() -> str:
        rows_so_far = [r for i in sorted(done) for r in done[i]]
        if args.json:
            return json.dumps({"ok": None, "interrupted": True, "seconds": time.perf_counter() - start,
                               "rows": [_row_json(r) for r in rows_so_far]}, indent=1)
        return "\n".join([render_table(rows_so_far)] + _row_notes(rows_so_far, budgets))

    finished.render, finished.planned = partial, [n for _, _, n in plan]
    with CheckProgress(plan, spec.time_budget, disable=_bar_disabled(args)) as bar:
        def on_rows(new: list[Row], planned: int) -> None:
            bar.next_row()  # tops the row up to its planned schedules
            index = order[new[0].variant, new[0].topology]
            done[index] = new
            finished.finish(index, len(new))

        for variant, new in zip((v for v in variants for _ in topologies),
                                check_rows(variants, topologies, spec, on_rows, bar.step)):
            _report_only(variant, new, args)
            rows += new
    explained = _explain(rows, variants, spec) if args.explain else {}
    if args.explain and not explained:
        sys.stderr.write("lockstep check: --explain: no counterexample to explain (only a bad "
                         "variant's failing row has one)\n")
    elapsed = time.perf_counter() - start
    trace_error = None  # reported after the table: a failed write must not lose the verdicts
    if args.trace_out is not None:
        try:
            _write_traces(args.trace_out, rows, spec)
        except OSError as exc:
            # the file that failed, where the OS names one (a directory standing at a trace's
            # name), not only the folder given
            trace_error = (f"cannot write traces to {str(exc.filename or args.trace_out)!r}: "
                           f"{exc.strerror or exc}")
    ok = all(row.passed for row in rows)
    if args.json:
        out = []
        for r in rows:
            data = _row_json(r)
            if (r.variant, r.topology) in explained:
                a = explained[r.variant, r.topology]
                data["explain"] = {"needed": list(a.needed), "without": a.without,
                                   "sufficient": a.sufficient, "h2_scopes": a.scopes,
                                   "ablation_errors": a.errors,
                                   "still_caught": a.still_caught,
                                   "story_hazards_off": list(a.story_hazards_off),
                                   "story": a.story.outcome.detail if a.story else None}
            out.append(data)
        print(json.dumps({"ok": ok, "headline": _headline(rows), "seconds": elapsed,
                          "hazards_off": list(args.hazard_off), "h2_scope": spec.h2_scope,
                          "rows": out}, indent=1))
    else:
        _print_text(rows, ok, elapsed, args, len(variants), budgets)
        for (name, topology), a in explained.items():
            print(f"explain: {name} / {topology}: {a.line()}")
            if a.story_hazards_off:
                story = narrative(a.story)
                needed = ", ".join(h.upper() for h in a.needed) or "no hazard"
                print(f"  the counterexample above also goes through a hazard this verdict does "
                      f"not need; with only {needed} on the search finds:\n"
                      + story[story.index("==> "):])
    if trace_error is not None:
        return _fail(trace_error)
    return 0 if ok else 1


def _compares_bad(args) -> bool:
    """Whether bad variants' verdicts are held to their expected ones: only under the full
    model (no hazard off, the default H2 scope and calls); under another model they are
    reported, not compared."""
    return (not args.hazard_off and args.h2_calls in (None, "both")
            and args.h2_scope in (None, "process"))


def _report_only(variant, rows: list[Row], args) -> None:
    """Under another model than the full one (`_compares_bad`), mark a bad variant's rows as
    reported, not compared: each passes unless it is an error or its search was cut short."""
    if _compares_bad(args) or expects_clean(variant):
        return
    for row in rows:
        row.compared = False
        if row.got == NOT_REACHABLE:  # checked against no verdict, so none to report as
            continue                  # differing (a reviewer saw "differs" for such a row)
        # a verdict the full model's check would pass as one of the design's other harms
        # reads so, not "differs" (a reviewer saw split-eligibility's also_expected oom under
        # --hazard-off h3 read "differs")
        row.report = ("same" if row.got == row.expected
                      else "unproven" if row.got == "incomplete"
                      else "other harm" if (row.expected == variant.expected.get(row.topology)
                                            and is_other_harm(variant, row.topology, row.got))
                      else "differs")
        # a search the budget ended has no verdict to report: not a pass (a reviewer saw two
        # such rows under --hazard-off end "OK", exit 0, counted as verdicts that differ)
        row.passed = row.got not in ("error", "incomplete")


def _model_changes(args) -> list[tuple[str, str]]:
    """How the model a check runs under differs from the full one: per change, its phrase and
    what it does to the check table's verdicts. `--stats` names the phrases above its shares,
    the check table prints both above its rows (`_print_model`)."""
    reported = "bad variants' verdicts are reported, not compared"
    changes = []
    if args.hazard_off:
        changes.append((f"hazards switched off: {', '.join(args.hazard_off)}",
                        "bad variants' verdicts are reported, not held to their expected "
                        "verdicts; the status column compares them with the full model's"))
    if args.h2_scope not in (None, "process"):
        changes.append((f"H2 scope: {args.h2_scope}", reported))
    if args.h2_calls not in (None, "both"):
        changes.append((f"H2 calls: {args.h2_calls}", reported))
    return changes


def _print_model(args) -> None:
    """The header that says which model a check ran under, where it is not the full one."""
    for phrase, effect in _model_changes(args):
        print(f"{phrase} ({effect})")


def _run_matrix(variants, spec: CheckSpec, args, finished: _Finished) -> int:
    from sim.matrix import BUCKET_SETS, RANKS, render_markdown, run_matrix, unreachable_notes

    start = time.perf_counter()
    cells = []

    def partial() -> str:
        if args.json:
            return json.dumps({"ok": None, "interrupted": True, "seconds": time.perf_counter() - start,
                               "cells": [{"ranks": c.ranks, "bucket_set": c.bucket_set,
                                          **_row_json(c.row)} for c in cells]}, indent=1)
        return render_markdown(cells)

    plan = [(f"{v.name} / TP{r} {b} / {t}",
             spec.schedules + (spec.fault_schedules if expects_clean(v) else 0),
             _planned_rows(v, spec))
            for b in BUCKET_SETS for r in RANKS for v in variants for t in TOPOLOGIES]
    finished.render, finished.planned = partial, [n for _, _, n in plan]
    checked = 0
    with CheckProgress(plan, spec.time_budget, disable=_bar_disabled(args)) as bar:
        def progress(n):
            bar.step(n)
        for b in BUCKET_SETS:
            for r in RANKS:
                for v in variants:
                    for t in TOPOLOGIES:
                        new = run_matrix([v], spec, (r,), (b,), (t,), progress)
                        _report_only(v, [c.row for c in new], args)
                        cells += new
                        finished.finish(checked, len(new))
                        checked += 1
                        bar.next_row()
    elapsed = time.perf_counter() - start
    rows = [c.row for c in cells]
    ok = all(r.passed for r in rows)
    if args.json:
        print(json.dumps({"ok": ok, "headline": _headline(rows), "seconds": elapsed,
                          "cells": [{"ranks": c.ranks, "bucket_set": c.bucket_set, **_row_json(c.row)}
                                    for c in cells]}, indent=1))
        return 0 if ok else 1
    _print_model(args)
    print(render_markdown(cells))
    for line in unreachable_notes(cells):
        print(f"note: {line}")
    budgets = default_budgets(variants)
    for c in cells:  # a vacuous cell had no note (a fresh user's --matrix --schedules 5)
        if c.row.got != NOT_REACHABLE:
            for line in _row_notes([c.row], budgets, lambda row: c.config):
                print(line)
    print(f"\n{_headline(rows)}: {_summary(rows)} in {elapsed:.1f} s")
    return 0 if ok else 1


def _run_stats(variants, spec: CheckSpec, args, finished: _Finished) -> int:
    """`lockstep check --stats`: the failing share of each strategy per bad variant."""
    from sim.stats import STATS_STRATEGIES, failing_shares, render_table

    start = time.perf_counter()
    topologies = TOPOLOGIES if args.topology == "both" else (args.topology,)
    bad = [v for v in variants if not expects_clean(v)]
    shares = []

    def partial() -> str:
        if args.json:
            return json.dumps({"interrupted": True, "seconds": time.perf_counter() - start,
                               "schedules": spec.schedules, "seed": spec.seed,
                               "rows": [s.__dict__ for s in shares]}, indent=1)
        return render_table(shares)

    finished.render, finished.planned = partial, [1] * (len(bad) * len(topologies))
    finished.unit = "row"
    plan = [(f"{v.name} / {t}", spec.schedules * len(STATS_STRATEGIES), 1)
            for v in bad for t in topologies]
    with CheckProgress(plan, spec.time_budget, disable=_bar_disabled(args)) as bar:
        for variant in bad:
            for topology in topologies:
                shares.append(failing_shares(variant, spec, topology, bar.step))
                finished.finish(len(shares) - 1, 1)
                bar.next_row()
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps({"seconds": elapsed, "schedules": spec.schedules, "seed": spec.seed,
                          "rows": [s.__dict__ for s in shares]}, indent=1))
        return 1 if any(s.error for s in shares) else 0
    else:
        changed = _model_changes(args)
        if changed:  # a fresh user's finding: shares under another model read as the full one's
            print(f"model: {'; '.join(phrase for phrase, _ in changed)} (a share counts the "
                  "schedules that fail in any way under it)")
        print(render_table(shares))
        for line in shares:
            if line.error:
                print(f"error: {line.variant} / {line.topology}: {line.error}")
        print(f"\n{len(shares)} rows, {spec.schedules} schedules per strategy, seed {spec.seed}, "
              f"in {elapsed:.1f} s")
    return 1 if any(s.error for s in shares) else 0


def _explain(rows: list[Row], variants, spec: CheckSpec) -> dict:
    """(variant, topology) -> `sim.explain.Attribution` for each bad variant's counterexample."""
    from sim.explain import attribute
    from sim.guard import watchdog

    by_name = {v.name: v for v in variants}
    out = {}
    for row in rows:
        variant = by_name.get(row.variant)
        if variant is None or expects_clean(variant) or row.minimal is None:
            continue
        with watchdog():  # an ablation whose hook stalls is that ablation's error
            out[row.variant, row.topology] = attribute(variant, spec, row.topology, row.got,
                                                       story=row.minimal)
    return out


def _planned_rows(variant, spec: CheckSpec) -> int:
    """Table rows (and searches) a check of ``variant`` in one topology plans: one, and a
    ``+faults`` row where `sim.check.has_faulted_row` says the check gives one."""
    return 1 + has_faulted_row(variant, spec)


def _write_traces(directory: Path, rows: list[Row], spec: CheckSpec) -> None:
    if not any(row.minimal is not None for row in rows):
        sys.stderr.write(f"lockstep check: no counterexample found, nothing written to {directory}\n")
    written = 0
    for row in rows:
        if row.minimal is not None:
            write_trace(directory, f"{row.variant}.{row.topology}", row.minimal,
                        row.variant.split("+")[0],
                        scenario_spec(spec, row.topology, row.minimal.world.scenario,
                                      row.scenario))
            written += 1
    if written:
        sys.stderr.write(f"lockstep check: {written} minimal trace{'s' * (written > 1)} "
                         f"(.txt, .mmd, .json) written to {directory}\n")


def _print_text(rows: list[Row], ok: bool, elapsed: float, args, n_variants: int,
                budgets: dict[str, tuple[int, int]]) -> None:
    _print_model(args)
    print(render_table(rows))
    for line in _row_notes(rows, budgets):
        print(line)
    print(f"\n{_headline(rows)}: {_summary(rows)} in {elapsed:.1f} s")
    for row in rows:
        if row.minimal is not None and (not row.passed or n_variants == 1):
            print(f"\nMinimal counterexample, {row.variant} / {row.topology}:\n"
                  + narrative(row.minimal))


def _row_notes(rows: list[Row], budgets: dict[str, tuple[int, int]],
               where: Callable[[Row], str] = lambda row: row.topology) -> list[str]:
    """The ``error:`` and ``note:`` lines printed under the verdict table; ``budgets`` as
    `default_budgets` gives them for the variants checked; ``where`` names a row's place after
    its variant (the topology; the matrix's configuration)."""
    out = []
    for row in rows:
        place = where(row)
        if row.got == "error":
            out.append(f"error: {row.variant} / {place}: {row.detail}")
        elif row.got == "not reachable here":
            out.append(f"note: {row.variant} / {place}: not reachable here: {row.detail}")
        elif row.got == "vacuous":
            out.append(f"note: {row.variant} / {place}: vacuous: {row.detail}; a search "
                       f"that never does these cannot show the protocol handles them "
                       f"{_vacuous_causes(row, budgets)}")
        elif row.got == "incomplete":
            smaller = ("; or a smaller configuration: the states an exhaustive search visits "
                       "grow with the buckets and the max batch (the README's example: "
                       "--buckets 1,2,4,8 --max-batch 8)" if row.stats.hashed else "")
            out.append(f"note: {row.variant} / {place}: {row.detail}; a larger "
                       f"--time-budget (default {DEFAULTS['time_budget']:g} s) may finish "
                       f"it{smaller}")
        elif row.stats.budget_reached:
            out.append(f"note: {row.variant} / {place}: {_budget_note(row)}")
        elif row.got == "startup-refused" and row.expected in ("clean", "abort"):
            # a design expected clean refused a run whose memory holds a plan: say so, since
            # the story below ends in the refusal alone (`sim.check.VerdictIn`)
            out.append(f"note: {row.variant} / {place}: {row.detail}")
        elif row.compared and row.got == "clean" and row.expected != "clean":
            out.append(f"note: {row.variant} / {place}: not caught: "
                       f"{row.stats.schedules} schedule{'s' * (row.stats.schedules != 1)} "
                       "found no "
                       f"{row.expected}; a larger --schedules (default up to "
                       f"{DEFAULTS['schedules']}) or another --strategy may reach it"
                       + _own_strategy(row.variant))
    return out


def _own_strategy(name: str) -> str:
    """The clause a "not caught" note adds for a variant that names its own search strategy."""
    from sim.variants import REGISTRY

    own = getattr(REGISTRY.get(name), "strategy", None)
    return (f" ({name} names {own} as its own, which an explicit --strategy replaces)"
            if own else "")


def default_budgets(variants) -> dict[str, tuple[int, int]]:
    """Per variant name, the schedules its clean row and its '+faults' row run under the
    default options: CLEAN_SCHEDULES and the default --fault-schedules, each capped by the
    variant's own ``schedules`` / ``fault_schedules`` (`variant_spec`)."""
    defaults = CheckSpec(schedules=DEFAULTS["schedules"], clean_schedules=CLEAN_SCHEDULES,
                         fault_schedules=DEFAULTS["fault_schedules"])
    specs = {v.name: variant_spec(v, defaults) for v in variants}
    return {name: (spec.planned_clean, spec.fault_schedules) for name, spec in specs.items()}


def _vacuous_causes(row: Row, budgets: dict[str, tuple[int, int]]) -> str:
    """What may have kept a vacuous row's search from what it must reach: a configuration that
    never needs it, or, where the search ran fewer schedules than the row runs by default
    (`default_budgets`) and did not cover every state, those too few schedules (a fresh
    user's --schedules 5 read as a configuration too small)."""
    n = row.stats.schedules
    faulted = row.variant.endswith("+faults")
    clean, faults = budgets.get(row.variant.removesuffix("+faults"),
                                (CLEAN_SCHEDULES, DEFAULTS["fault_schedules"]))
    few = (f"only {n} schedule{'' if n == 1 else 's'} ran: a larger --schedules (default "
           f"{clean} for this row) may reach them"
           if not faulted and n < clean and not row.stats.complete else "")
    needs = _event_needs(row.missing)
    if needs:
        return f"({few}; {needs})" if few else f"({needs})"
    subject, small = "the max batch or the bucket set", "too small to need them"
    if few:
        return f"({few}, unless {subject} is {small})"
    return f"(is {subject} {small}?)" + (
        f"; only {n} faulted schedule{'' if n == 1 else 's'} ran: raise --fault-schedules "
        f"(default {faults} for this row)" if faulted and n < faults else "")


def _event_needs(missing: tuple[str, ...]) -> str:
    """What the configuration needs to reach every event of ``missing`` (`EVENT_NEEDS`), events
    of one need named together; "" unless each has an entry there (a replay or compaction
    never reached points at the max batch and the buckets instead)."""
    if not missing or not all(e in EVENT_NEEDS for e in missing):
        return ""
    grouped: dict[tuple[str, str], list[str]] = {}
    for event in missing:
        grouped.setdefault(EVENT_NEEDS[event], []).append(event)
    return "; ".join(f"{' and '.join(events)} need{'s' if len(events) == 1 else ''} {need}, as "
                     f"adjust={adjust} gives" for (need, adjust), events in grouped.items())


def _budget_note(row: Row) -> str:
    explored = (row.stats.hashed_states if row.stats.hashed
                else f"{row.stats.schedules} complete schedules")
    return (f"the time budget ended the search after {explored}; the verdict covers only what "
            "was explored")


def _summary(rows: list[Row]) -> str:
    unreachable = [r for r in rows if r.got == NOT_REACHABLE]
    compared = [r for r in rows if r.compared and r.got != NOT_REACHABLE]
    text = (f"{sum(r.passed for r in compared)}/{len(compared)} verdicts as expected"
            if any(r.compared for r in rows) else "no verdict compared with an expected one")
    if unreachable:
        text += f", {len(unreachable)} not reachable here"
    others = [r for r in rows if not r.compared and r.got != NOT_REACHABLE]
    if others:
        changed = sum(r.report == "differs" for r in others)
        harms = sum(r.report == "other harm" for r in others)
        text += (f"; {changed} of {len(others)} bad-variant verdicts differ from the full "
                 "model's" + (f" ({harms} more give one of their design's other harms, "
                              "which the full model's check also passes)" if harms else ""))
    return text


def _row_json(row: Row) -> dict:
    s = row.stats
    # a row whose bug this configuration cannot reach was checked against no verdict: its
    # expected verdict and whether it passed are null here, as the table reads "-" and "n/a"
    unchecked = row.got == NOT_REACHABLE
    return {"variant": row.variant, "topology": row.topology,
            "expected": None if unchecked else row.expected, "got": row.got,
            "passed": None if unchecked else row.passed, "schedules": s.schedules, "states": s.actions,
            "unique_states": s.unique_states if s.hashed else None, "complete": s.complete,
            "budget_reached": s.budget_reached, "seconds": round(s.seconds, 3),
            "failing_percent": round(s.failing_percent, 2), "minimal_trace_length": row.minimal_length,
            "compared": row.compared,
            "report": None if row.compared or unchecked else row.report,
            "detail": row.detail,
            "choices": row.minimal.choices if row.minimal else None}


def render_table(rows: list[Row]) -> str:
    """The verdict table: variant, topology, expected, got, schedules, states, time, minimal
    trace, and whether the row is as expected (status). A row whose bug this configuration
    cannot reach was checked against no verdict: its expected column reads ``-``, as its
    status reads ``n/a``."""
    header = ("variant", "topology", "expected", "got", "schedules", "states", "time", "min trace",
              "status")
    body = [(r.variant, r.topology, "-" if r.got == NOT_REACHABLE else r.expected, r.got,
             str(r.stats.schedules), str(r.stats.actions), f"{r.stats.seconds:.2f}s",
             str(r.minimal_length or "-"), _status(r))
            for r in rows]
    widths = [max(len(x[i]) for x in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


UNPROVEN = ("incomplete", "vacuous")
"""Verdicts of a search that found no failure but did not establish the expected verdict
either: ``incomplete`` (the time budget ended it first) and ``vacuous`` (it never did what the
row must exercise, as a --schedules 5 check of the short path did not). Their status reads
``unproven``, and a check whose only shortfalls they are ends NOT PROVEN."""


def _headline(rows: list[Row]) -> str:
    """The word before the summary line: NOTHING CHECKED when every row's bug is not reachable
    in this configuration (exit 0 still: nothing is contradicted); OK when every row is as
    expected; NOT PROVEN when the only rows that are not are `UNPROVEN` (nothing contradicts
    the expected verdicts, but the search did not establish them); REPORTED when no row was
    compared with an expected verdict (a model with a hazard off, `_model_changes`) and every
    search ran to a verdict; else FAILED. Fresh users read "OK: 0/0 verdicts" as a pass, "OK"
    over verdicts that differ from the full model's as a pass too, and "FAILED" and
    "MISMATCH" after a short --time-budget or --schedules as a bug found in the correct
    protocol."""
    if rows and all(r.got == NOT_REACHABLE for r in rows):
        return "NOTHING CHECKED"
    if all(r.passed for r in rows):
        return "OK" if any(r.compared for r in rows) or not rows else "REPORTED"
    if all(r.passed or r.got in UNPROVEN for r in rows):
        return "NOT PROVEN"
    return "FAILED"


def _status(row: Row) -> str:
    if row.got == "not reachable here":
        return "n/a"
    if row.got in UNPROVEN:
        return "unproven"
    if not row.compared:
        return "error" if row.got == "error" else row.report
    return "ok" if row.passed else "MISMATCH"


MAX_TRACE_BYTES = 1 << 30
"""Largest trace file `--replay` reads: a run is at most `Scenario.max_actions` (200,000)
actions, whose JSON is a few tens of MB; /dev/zero or a wrong multi-GB file would otherwise be
read into memory until the OOM killer stopped it (a fresh user's finding)."""


def _replay(path: str, as_json: bool, trace_out: Path | None = None) -> int:
    if not path:
        return _fail("--replay needs a trace file path")
    trace = Path(path)
    try:
        if trace.exists() and not trace.is_dir() and not trace.is_file():
            return _fail(f"trace file {path!r} is not a regular file (a device or a pipe: "
                         "--trace-out writes regular files)")
        if trace.is_file() and trace.stat().st_size > MAX_TRACE_BYTES:
            return _fail(f"trace file {path!r} holds {trace.stat().st_size} bytes, more than "
                         f"the {MAX_TRACE_BYTES} of any trace --trace-out writes")
        data = json.loads(trace.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _fail(f"trace file {path!r} does not exist")
    except IsADirectoryError:
        return _fail(f"trace file {path!r} is a directory")
    except UnicodeDecodeError:
        return _fail(f"trace file {path!r} is not UTF-8 text")
    except json.JSONDecodeError as exc:
        beside = trace.with_suffix(".json")
        hint = (f"; the trace to replay is the JSON beside it, {str(beside)!r} (--trace-out "
                "writes .json, .txt and .mmd)" if trace.suffix in (".txt", ".mmd")
                and beside.is_file() else "")
        return _fail(f"trace file {path!r} is not JSON: {exc}{hint}")
    except ValueError as exc:  # an integer of thousands of digits (Python's conversion limit)
        return _fail(f"trace file {path!r} is not a trace: a value in it cannot be read ({exc})")
    except RecursionError:  # json.loads of thousands of nested brackets
        return _fail(f"trace file {path!r} is not a trace: its JSON nests too deeply")
    except OSError as exc:  # a fresh user's finding: a PermissionError traceback
        return _fail(f"trace file {path!r} cannot be read: {exc.strerror or exc}")
    from sim.guard import Stalled, describe

    try:
        result, problem = replay_trace(data)  # the run under the stall watchdog
    except ConfigError as exc:
        return _fail(f"{path}: {exc}")
    except (Exception, Stalled, SystemExit) as exc:  # noqa: BLE001 - a variant's code can raise
        sys.stderr.write(f"lockstep check: error: replaying {path}: "  # anything, sys.exit too
                         f"{describe(str(data.get('variant')), exc)}\n")
        return 1
    if problem:
        if as_json:
            print(json.dumps({"nondeterminism": problem}))
        else:
            print(f"NONDETERMINISM: {problem}")
        return 1
    if trace_out is not None:
        try:
            written = write_trace(trace_out, Path(path).stem + ".replayed", result, data["variant"],
                                  data.get("scenario", {}))
        except OSError as exc:
            return _fail(f"cannot write the replayed trace to {str(trace_out)!r}: {exc.strerror or exc}")
        sys.stderr.write(f"lockstep check: replayed trace written to {written['json'].parent}\n")
    if as_json:
        print(json.dumps({"verdict": result.outcome.verdict, "invariant": result.outcome.invariant,
                          "step": result.outcome.step, "detail": result.outcome.detail,
                          "actions": result.actions}))
    else:
        print(f"replayed {result.actions} actions exactly: {verdict_label(result)}")
        print(narrative(result))
    return 0


__all__ = ["add_parser", "run", "render_table", "flag_names", "defaulted_fields", "CONFIG_FLAGS",
           "REGISTRY"]
