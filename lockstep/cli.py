"""lockstep: CUDA-graph decode under tensor parallelism, safe by construction, and checked.

`lockstep check` checks the TP step protocol and the known-bad variants in the simulator;
`lockstep docs` renders the walkthroughs; `lockstep make-model`, `generate` and `bench` drive
the engine. `lockstep COMMAND --help` shows each command's options and their defaults.

Each subcommand lives with the package that implements it (`sim.cli` for `check` and
`docs`, `engine.cli` for `make-model`, `generate` and `bench`); this module only wires them
up, importing the engine lazily so that `lockstep check` never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import signal
import sys
import threading

# subcommand -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "check": "sim.cli",
    "docs": "sim.docs_cli",
    "make-model": "engine.cli_make_model",
    "generate": "engine.cli_generate",
    "bench": "engine.cli_bench",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors and exit status 2: "NAME: error: MESSAGE" on stderr, no
    usage block (`--help` still prints the usage and exits 0). NAME is ``error_name`` where
    given, else the prog: the `engine.bench` tools keep "python -m engine.bench.step_tune" in
    their usage and their errors' "step_tune: error: " prefix."""

    def __init__(self, *args, error_name: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.error_name = error_name

    def error(self, message: str) -> None:  # noqa: D401 - argparse override
        name = self.error_name or self.prog  # "lockstep check: error: ..."
        sys.stderr.write(f"{name}: error: {message}\n")
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's parse, except that in a parser with required options and no positional
        arguments an argument no option takes is named before a required option is missed:
        `bench --presets tiny` (a typo of --preset) said only "one of the arguments --preset
        --model is required". A first pass with nothing required finds such arguments, and
        they are an error there, as every lockstep command makes them (so such a parser
        returns no extras); an error in that pass is the one the real pass would give, and
        `type` functions run in both passes. A parser with positional arguments is left as
        argparse has it (Python 3.11's `parse_intermixed_args` reads positionals as extras);
        `main` names a stray before the subcommand (`lockstep --bogus bench`) itself."""
        args = sys.argv[1:] if args is None else list(args)
        needed = [a for a in self._actions if a.required] + [
            g for g in self._mutually_exclusive_groups if g.required]
        if needed and all(a.option_strings for a in self._actions):
            for item in needed:
                item.required = False
            self._relaxed = needed
            try:
                _, stray = super().parse_known_args(args, argparse.Namespace())
            finally:
                self._relaxed = []
                for item in needed:
                    item.required = True
            if stray:
                self.error(f"unrecognized arguments: {' '.join(stray)}")
        return super().parse_known_args(args, namespace)

    _relaxed: list = []  # the required options the first pass made optional, while it runs

    def format_usage(self) -> str:
        with self._required_shown():
            return super().format_usage()

    def format_help(self) -> str:
        """argparse's help, showing required options as required during the first pass too
        (a fresh user's finding: `make-model --help` put --preset and --out in brackets)."""
        with self._required_shown():
            return super().format_help()

    @contextlib.contextmanager
    def _required_shown(self):
        relaxed = self._relaxed
        for item in relaxed:
            item.required = True
        try:
            yield
        finally:
            for item in relaxed:
                item.required = False

    def _parse_optional(self, arg_string: str):
        """argparse's reading of one argument as an option or not, except that a negative
        value (`NEGATIVE_VALUE`) that names no option of this parser is a value: argparse
        itself takes only "-5" and "-.5" so, and read "-inf", "-1e9" or "-1,2" after
        `--temperature` as an unknown option, saying only "expected one argument"."""
        if (NEGATIVE_VALUE.match(arg_string) and arg_string not in self._option_string_actions
                and not self._has_negative_number_optionals):
            return None
        return super()._parse_optional(arg_string)


NEGATIVE_VALUE = re.compile(r"-(?:\.?[0-9]|(?i:inf|infinity|nan)$)", re.ASCII)
"""An argument that is a negative value, never an option: "-" then a digit or a point and a digit
("-5", "-1e9", "-1_0", "-1,2", "-.5"), or -inf, -infinity or -nan in any case. No option of any
lockstep parser is spelt so; one that is (argparse's "_has_negative_number_optionals") keeps
argparse's reading. `-nan` is not `-n an` (bench's -n), an integer option given 'an'."""


def _version() -> str:
    """The installed distribution's version; "unknown" when run from a checkout not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lockstep")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser; subcommands whose module is missing are skipped."""
    parser = OneLineParser(prog="lockstep", description="\n\n".join(__doc__.split("\n\n")[:2]),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lockstep {_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith(module_name.split(".")[0]):
                continue
            raise
        module.add_parser(sub, name)
    parser.subcommands = sub.choices  # name -> its parser, for errors in that parser's name
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lockstep` console script; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check"] and (os.cpu_count() or 1) > 1:
        from sim.workers import start_server

        start_server()  # its workers' imports overlap this process's (see start_server)
    parser = build_parser()
    command = next((i for i, arg in enumerate(argv) if arg in parser.subcommands), None)
    if command:  # a stray before the subcommand, named before the subcommand's own errors
        _, stray = parser.parse_known_args(argv[:command])
        if stray:
            parser.subcommands[argv[command]].error(
                f"unrecognized arguments: {' '.join(stray)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand's parser, so the error has its prefix
        parser.subcommands.get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        sys.stderr.write(f"lockstep {args.command}: interrupted\n")
        return 130
    except Terminated:
        sys.stderr.write(f"lockstep {args.command}: terminated\n")
        return 143
    except BrokenPipeError:
        # The reader went away (`lockstep check | head -1`): say nothing more, exit as a
        # process killed by SIGPIPE would, and keep Python's exit-time flush quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that each command stops what it started (rank
    processes, worker processes) on the way out, as after Ctrl-C."""


def _terminated(signum, frame) -> None:
    raise Terminated()


if __name__ == "__main__":
    raise SystemExit(main())
