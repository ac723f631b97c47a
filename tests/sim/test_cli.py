"""`lockstep check` from the command line: bad input exits 2 with one line; outputs are real."""

import json
import re
from pathlib import Path
import subprocess
import sys

import pytest

from lockstep.cli import main
import sim.cli as cli
from sim.check import Row
from sim.common import EVENT_NEEDS
from sim.search import SearchStats


@pytest.fixture
def fused_trace(tmp_path, capsys):
    """Path of a fused-sweep counterexample written by `lockstep check --trace-out`."""
    out = tmp_path / "t"
    assert main(["check", "--variant", "fused-sweep", "--topology", "shared", "--schedules", "20",
                 "--no-progress", "--jobs", "1", "--trace-out", str(out)]) == 0
    capsys.readouterr()
    return out / "fused-sweep.shared.json"


def _rewrite(trace, edit):
    data = json.loads(trace.read_text())
    edit(data)
    trace.write_text(json.dumps(data))


def _restamped(edit):
    """``edit``, then the trace's ``record_digest`` written afresh: a recording that other
    code, or a nondeterministic simulator, made as edited, so its replay departs from it."""
    from sim.report import record_digest

    def both(data):
        edit(data)
        data.pop("record_digest", None)
        data["record_digest"] = record_digest(data)
    return both


@pytest.mark.parametrize("argv,needle", [
    (["check", "--ranks", "0"], "--ranks: 0 must be at least 2"),
    (["check", "--ranks", "1"], "--ranks: 1 must be at least 2"),
    (["check", "--buckets", "1,,2"], "empty item"),
    (["check", "--fault-schedules", "-1"], "-1 must be at least 0"),
    (["check", "--seed", "1.5"], "--seed: '1.5' is not an integer"),
    # a fresh user's finding: a negative seed was accepted (generate and make-model refuse one)
    (["check", "--seed", "-1"], "--seed: -1 is outside [0, 2**64)"),
    # a fresh user's finding: 5,000 digits were echoed whole as "not an integer", and up to
    # 4,300 any seed was taken, where every engine subcommand takes [0, 2**64)
    (["check", "--seed", "7" * 5000], "--seed: 77777777777777777777777777777... is outside"),
    (["check", "--seed", str(2**64)], f"--seed: {2**64} is outside [0, 2**64)"),
    (["check", "--ranks", "7" * 5000], "--ranks: 77777777777777777777777777777... has more"),
    (["check", "--buckets", "1," + "7" * 5000], "--buckets: 77777777777777777777777777777..."),
    (["check", "--buckets", "1,x" + "7" * 5000],
     "--buckets: '1,x77777777777777777777777777...' is not a comma-separated list"),
    (["check", "--schedules", "x" * 5000], "--schedules: 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' is not"),
    (["check", "--trace-out", ""], "--trace-out: the directory name is empty"),
    (["check", "--buckets", "8,4"], "ascending"),
    # a fresh user's finding: read "must be strictly ascending: 1048577 then 2"
    (["check", "--buckets", "1048577,2"], "--buckets: bucket 1048577 is above 1048576"),
    (["check", "--buckets", "a,b"], "'a,b' is not a comma-separated"),
    (["check", "--schedules", "x"], "--schedules: 'x' is not an integer"),
    (["check", "--time-budget", "-1"], "--time-budget: -1 must be a finite, positive number"),
    # a fresh user's finding: inf was said not to be positive
    (["check", "--time-budget", "inf"], "--time-budget: inf must be a finite, positive number"),
    # a fresh user's finding: int() and float() took "1_0" and other scripts' digits ("\u0662"
    # is Arabic-Indic 2) where the seeds refused them; every number is now spelt in ASCII
    (["check", "--ranks", "\u0662"], "--ranks: '\u0662' is not an integer"),
    (["check", "--schedules", "1_0"], "--schedules: '1_0' is not an integer"),
    (["check", "--buckets", "1,\u0662"], "--buckets: '1,\u0662' is not a comma-separated list"),
    (["check", "--time-budget", "1_0"], "--time-budget: '1_0' is not a number"),
    (["check", "--time-budget", "nan"], "--time-budget: 'nan' is not a number"),
    (["check", "--strategy", "magic"], "invalid choice: 'magic'"),
    (["check", "--topology", "ring"], "invalid choice: 'ring'"),
    (["check", "--hazard-off", "h2,H3"], "(choose from h1, h2, h3, h4, h5, h6, h7, h8, h9); give "
     "--hazard-off once per hazard"),
    (["check", "--hazard-off", "h2,"], "; give --hazard-off once per hazard"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and len(err) < 200
    assert "--ranks: --ranks" not in err


def test_the_seed_range_is_the_engine_s_and_leading_zeros_are_not_digits():
    from lockstep.args import seed, too_many_digits

    assert seed(str(2**64 - 1)) == 2**64 - 1 and seed(" 0007 ") == 7
    assert cli._int("0" * 40 + "7") == 7 and cli._int(" +7 ") == 7
    # only an integer's spelling counts its digits (a reviewer: "+-1...", "_1" and
    # superscript digits read "more than 20 digits" instead of "not an integer")
    for text in ("+-" + "1" * 25, "_" + "1" * 25, "1__" + "1" * 25, "\u00b2" * 25, "1_000"):
        assert not too_many_digits(text)
        with pytest.raises(ValueError, match="is not an integer"):
            seed(text)
        with pytest.raises(ValueError, match="is not an integer"):
            cli._int(text)
    assert too_many_digits("-" + "0" * 30 + "1" * 21) and not too_many_digits("1" * 20)
    # underscores are refused by every parser, so a long underscored integer is not an integer
    # rather than one of too many digits
    long_underscored = "1_" * 25 + "1"
    assert not too_many_digits(long_underscored)
    with pytest.raises(ValueError, match="is not an integer"):
        cli._int(long_underscored)


@pytest.mark.parametrize("argv,needle", [
    (["check", "--variant", "nope"], "unknown variant 'nope'; "),
    (["check", "--list", "--matrix"], "--list checks nothing; drop --matrix"),
    (["check", "--list", "--max-batch", "300", "--schedules", "5"],
     "--list checks nothing; drop --schedules, --max-batch"),
    (["check", "--replay", "/nonexistent.json", "--list"], "--list checks nothing; drop --replay"),
    # "prints them", or with variant files registered earlier in this process "prints the N
    # shipped" (test_unknown_variant_with_a_variant_file_says_how_to_list_them_all)
    (["check", "--list", "--variant", "nope"], "`lockstep check --list` prints"),
    (["check", "--variant", "early-token-reed"], "did you mean early-token-read"),
    (["check", "--variant", "FUSED-SWEEP"], "did you mean fused-sweep"),
    # a fresh user's comma lists: an unknown variant, an invalid hazard, and no word on why
    (["check", "--variant", "fused-sweep,split-eligibility"],
     "--variant 'fused-sweep,split-eligibility' names several variants; give --variant once per "
     "variant (--variant fused-sweep --variant split-eligibility)"),
    (["check", "--variant", "correct,,fused-sweep"], "give --variant once per variant (--variant "
     "correct --variant fused-sweep)"),
    (["check", "--variant", "correct,"], "--variant 'correct,': a variant's name has no comma; "
     "give --variant correct"),
    (["check", "--variant-file", "/nonexistent.py"], "does not exist"),
    (["check", "--max-batch", "300"], "--max-batch 300 exceeds the largest default bucket 256"),
    (["check", "--replay", "/nonexistent.json"], "does not exist"),
    (["check", "--replay", ""], "needs a trace file path"),
    (["check", "--replay", "/tmp", "--variant", "correct"], "drop --variant"),
    (["check", "--variant-file", "/tmp"], "is not a file"),
    (["check", "--variant-file", str(Path(__file__).parents[2] / "sim" / "variants.py")],
     "is one of lockstep's own modules; the shipped variants are registered already"),
    (["check", "--buckets", "100000"], "more than its 141 GiB"),
    (["check", "--strategy", "exhaustive", "--schedules", "2"],
     "--schedules 2 sets the budget of random, PCT and Hypothesis search"),
    # a fresh user's findings: taken and ignored where no row is faulted
    (["check", "--strategy", "exhaustive", "--variant", "fused-sweep", "--jobs", "4"],
     "--jobs 4 spreads random and PCT search over worker processes; exhaustive search runs in "
     "this one: drop --jobs"),
    (["check", "--strategy", "hypothesis", "--variant", "fused-sweep", "--jobs", "2"],
     "hypothesis search runs in this one: drop --jobs"),
    (["check", "--variant", "fused-sweep", "--fault-schedules", "5"],
     "--fault-schedules 5 sets the '+faults' row of a design expected clean; no variant "
     "checked here has one (fused-sweep): drop --fault-schedules"),
    (["check", "--h2-calls", "measured", "--hazard-off", "h2"],
     "--h2-calls measured shapes H2, but --hazard-off h2 switches H2 off"),
    (["check", "--h2-calls", "both", "--h2-scope", "device", "--hazard-off", "h2"],
     "--h2-calls both and --h2-scope device shape H2, but --hazard-off h2"),
    # configurations whose clean rows could only be vacuous (a fresh user's finding: they ran
    # and ended FAILED)
    (["check", "--buckets", "1,2,4,8", "--max-batch", "1"],
     "--max-batch 1: a single slot never compacts"),
    (["check", "--buckets", "1,2,4,8", "--max-batch", "2"],
     "--max-batch 2 with the buckets up to the one it pads to (1,2): every batch size is a "
     "bucket, so no replay is ever padded"),
    (["check", "--buckets", "2", "--max-batch", "2"],
     "--max-batch 2: with two slots a retirement can only move the last slot"),
    # every row count the check's 17 requests can make is a bucket, so nothing pads
    (["check", "--buckets", ",".join(map(str, range(1, 18))) + ",32", "--max-batch", "32"],
     "17,32): no serving step of the check's workload reaches a padded graph replay here"),
])
def test_bad_values_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, prefix", [
    (["check", "--bogus"], "lockstep check"),
    (["make-model", "--preset", "tiny", "--out", "m", "--bogus"], "lockstep make-model"),
    (["--bogus"], "lockstep"),
])
def test_an_unknown_option_is_named_by_its_subcommand(argv, prefix, capsys):
    """It read 'lockstep: error:' whatever the subcommand, unlike every other error of it."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert err[-1] == f"{prefix}: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("argv, stray", [
    (["bench", "--presets", "tiny"], "--presets tiny"),
    (["bench", "--bogus"], "--bogus"),
    (["make-model", "--out", "m", "--bogus"], "--bogus"),
    (["make-model", "--prest", "tiny", "--out", "m"], "--prest tiny"),
    (["generate", "--modle", "m", "--prompt-ids", "1"], "--modle m"),
    (["--bogus", "bench"], "--bogus"),
    (["--bogus", "make-model", "--out", "m"], "--bogus"),
])
def test_an_unknown_option_is_named_before_a_required_one_is_missed(argv, stray, capsys):
    """Found by a fresh user: `lockstep bench --bogus` said only "one of the arguments --preset
    --model is required", so a misspelt required option (--presets) read as one not given;
    a stray before the subcommand too (a reviewer's finding)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    command = next(arg for arg in argv if not arg.startswith("-"))
    assert err == [f"lockstep {command}: error: unrecognized arguments: {stray}"]


def test_a_parser_with_positionals_keeps_argparse_s_reading():
    """A reviewer's finding: the first pass read positionals as strays, so Python 3.11's
    `parse_intermixed_args` (which parses them as extras) refused every positional."""
    from lockstep.cli import OneLineParser

    p = OneLineParser(prog="x")
    p.add_argument("--a", required=True)
    p.add_argument("files", nargs="+")
    args = p.parse_intermixed_args(["f1", "--a", "1", "f2"])
    assert (args.a, args.files) == ("1", ["f1", "f2"])


def test_a_required_option_missing_is_still_named(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--steps", "3"])
    assert capsys.readouterr().err.strip() == (
        "lockstep bench: error: one of the arguments --preset --model is required")


@pytest.mark.parametrize("argv", [["--replay", "a.json", "--replay", "b.json"],
                                  ["--replay=a.json", "--json", "--replay", "a.json"]])
def test_replay_given_twice_is_refused_naming_the_option(argv, capsys, no_simulation):
    """Old behaviour: the last --replay won and the first trace was silently not replayed."""
    with pytest.raises(SystemExit) as exit_:
        main(["check"] + argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1
    assert err.startswith("lockstep check: error: argument --replay: given twice ('a.json', then ")


ONE_VALUE = {"--ranks": ("2", "3"), "--buckets": ("1,2,4,8", "8,16"), "--max-batch": ("8", "4"),
             "--topology": ("shared", "shared"), "--strategy": ("pct", "random"),
             "--schedules": ("3", "5"), "--fault-schedules": ("1", "2"),
             "--time-budget": ("10.5", "20.5"), "--seed": ("1", "2"), "--jobs": ("1", "2"),
             "--h2-scope": ("device", "peers"), "--h2-calls": ("assumed", "measured"),
             "--replay": ("a.json", "b.json"), "--trace-out": ("t1", "t2")}
"""Two good values of each option of `lockstep check` that takes one value."""


def test_every_option_that_takes_one_value_is_in_the_repeat_test():
    """A new option that takes a value must join ONE_VALUE, so that giving it twice is tested."""
    import argparse

    from lockstep.cli import build_parser

    check = build_parser().subcommands["check"]
    takes_one = {a.option_strings[0] for a in check._actions
                 if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._AppendAction)}
    assert takes_one == set(ONE_VALUE)


@pytest.mark.parametrize("flag", sorted(ONE_VALUE))
def test_an_option_given_twice_is_refused_naming_it(flag, tmp_path, monkeypatch, capsys,
                                                    no_simulation):
    """Old behaviour (every option but --replay): the last value won and the first was silently
    dropped (`--schedules 3 --schedules 5` searched 5 schedules). The same value twice is
    refused too: the rule is one use per option, as `--replay` had it."""
    monkeypatch.chdir(tmp_path)
    first, second = ONE_VALUE[flag]
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--variant", "correct", flag, first, f"{flag}={second}"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"lockstep check: error: argument {flag}: given twice ({first!r}, "
                            f"then {second!r}); give it once\n")
    assert not (tmp_path / "t1").exists()


@pytest.mark.parametrize("argv", [["--variant", "correct", "--variant", "correct"],
                                  ["--hazard-off", "h1", "--hazard-off", "h1"],
                                  ["--json", "--json", "--variant", "correct"]])
def test_a_repeatable_option_or_a_switch_may_be_given_twice(argv, capsys, no_simulation):
    """The repeatable options append (a name given twice counts once) and a switch given twice
    is the same switch: `--list` reads them and searches nothing (it runs no world for the
    correct protocol; for a bad variant whose bug needs a fault it makes the one fault-free run
    by which the check decides reachability, `sim.check.unreachable_here`)."""
    assert main(["check", "--list", *argv]) == (2 if "--hazard-off" in argv else 0)
    err = capsys.readouterr().err
    assert "given twice" not in err
    if "--hazard-off" in argv:
        assert err == "lockstep check: error: --list checks nothing; drop --hazard-off\n"


def test_replay_of_non_trace_json_exits_2(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    assert main(["check", "--replay", str(path)]) == 2
    assert "not a lockstep trace" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_fused_sweep_check_reports_deadlock_and_writes_replayable_trace(tmp_path, capsys):
    out = tmp_path / "traces"
    code = main(["check", "--variant", "fused-sweep", "--schedules", "30", "--no-progress",
                 "--jobs", "1", "--trace-out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "fused-sweep" in text and "deadlock" in text and "to go idle" in text
    assert "driver lock" not in text.split("==> deadlock")[1]  # H1 is not on the cycle
    trace = out / "fused-sweep.shared.json"
    assert trace.exists() and (out / "fused-sweep.shared.mmd").read_text().startswith("sequenceDiagram")
    assert main(["check", "--replay", str(trace)]) == 0
    assert "replayed" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_json_output_and_exit_1_on_mismatch(tmp_path, capsys):
    variant = tmp_path / "v.py"
    variant.write_text(
        "from sim.variants import Variant\n"
        "WRONG = Variant(name='claims-clean-but-is-fused', summary='s', source='test',\n"
        "    expected={'shared': 'clean', 'per-rank': 'clean'},\n"
        "    controller_cls=__import__('sim.variants', fromlist=['x']).FusedSweepController,\n"
        "    worker_cls=__import__('sim.variants', fromlist=['x']).FusedSweepWorker)\n")
    code = main(["check", "--variant-file", str(variant), "--variant", "claims-clean-but-is-fused",
                 "--topology", "shared", "--schedules", "20", "--fault-schedules", "0", "--json",
                 "--no-progress", "--jobs", "1"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["ok"] is False
    assert data["rows"][0]["got"] == "deadlock"


@pytest.mark.timeout(300)
def test_default_check_exits_0_from_the_console_script():
    proc = subprocess.run([sys.executable, "-m", "lockstep", "check", "--schedules", "40",
                           "--fault-schedules", "40", "--no-progress", "--jobs", "1"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    from sim.variants import REGISTRY, SHIPPED
    # two topologies; a protocol expected clean has a second row under injected faults, unless
    # the variant caps its faulted schedules at 0
    rows = sum(2 * (2 if all(v == "clean" for v in REGISTRY[n].expected.values())
                    and REGISTRY[n].fault_schedules != 0 else 1)
               for n in SHIPPED)
    import re
    ok = re.search(r"OK: (\d+)/(\d+) verdicts as expected(?:, (\d+) not reachable here)?",
                   proc.stdout)
    assert ok and ok.group(1) == ok.group(2), proc.stdout[-2000:]
    # a row a configuration cannot reach (warmup-scratch-free with one process per rank) is
    # reported as such, not compared
    assert int(ok.group(1)) + int(ok.group(3) or 0) == rows


def test_trace_out_that_is_a_file_is_rejected_before_search(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(SystemExit) as info:
        main(["check", "--trace-out", str(f)])
    assert info.value.code == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("content,needle", [
    ("VARIANTS = 5\n", "VARIANTS must be a list of Variant"),
    ("VARIANTS = ['fused-sweep']\n", "VARIANTS must be a list of Variant"),
    ("import sys\nsys.exit(3)\n", "failed to import: SystemExit: 3"),
    ("x = 1\n", "defines no Variant"),
    ("def broken(:\n", "failed to import: SyntaxError"),
    ("from sim.variants import Variant\nV = Variant(name='v', summary='s', source='x', "
     "expected={'shared': 'bogus', 'per-rank': 'clean'})\n", "expected verdict for topology 'shared' is 'bogus'"),
    ("from sim.variants import Variant\nV = Variant(name='v', summary='s', source='x', "
     "expected={'shared': 'deadlock', 'per-rank': 'deadlock'}, also_expected=('clean',))\n",
     "also_expected verdict 'clean' is not one of the failing verdicts"),
    ("from sim.variants import Variant\nV = Variant(name='v', summary='s', source='x', "
     "expected={'shared': 'clean', 'per-rank': 'clean'}, also_expected=('oom',))\n",
     "the variant is expected clean in every topology"),
    ("from sim.variants import Variant\nV = Variant(name='v', summary='s', source='x', "
     "expected={'shared': 'deadlock', 'per-rank': 'deadlock'}, also_expected='oom')\n",
     "also_expected is 'oom'; expected a tuple of verdicts"),
    ("from sim.variants import Variant\nV = [Variant(name='dup', summary='s', source='x', "
     "expected={'shared': 'clean', 'per-rank': 'clean'})] * 2\nVARIANTS = V\n", "defines variant 'dup' twice"),
    ("from sim.variants import Variant\nV = Variant(name='correct', summary='s', source='x', "
     "expected={'shared': 'clean', 'per-rank': 'clean'})\n", "'correct' is already registered"),
])
def test_bad_variant_files_exit_2(tmp_path, capsys, content, needle):
    path = tmp_path / "vf.py"
    path.write_text(content)
    assert main(["check", "--variant-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_variant_file_may_derive_from_a_shipped_variant(tmp_path, capsys):
    path = tmp_path / "derived.py"
    path.write_text("import dataclasses\nfrom sim.variants import CORRECT\n"
                    "MINE = dataclasses.replace(CORRECT, name='my-correct-derived')\n")
    assert main(["check", "--variant-file", str(path), "--schedules", "5", "--fault-schedules", "0",
                 "--no-progress", "--jobs", "1"]) == 0
    assert "my-correct-derived" in capsys.readouterr().out


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(choices=None), "'choices' must be a list"),
    (lambda d: d["scenario"].update(hazards_off=["h99"]), "unknown hazard 'h99'"),
    (lambda d: d["scenario"].update(faults=[{"x": 1}]), "bad scenario in trace"),
    (lambda d: d["scenario"].update(faults=["boom"]), "bad scenario in trace"),
    (lambda d: d.update(format=2), "trace format 2 is not 1"),
    (lambda d: d.pop("scenario"), "it has no 'scenario'"),
    (lambda d: d.update(scenario={}), "trace's 'scenario' lacks ranks, buckets, max_batch"),
    (lambda d: d["scenario"].pop("h2_calls"), "trace's 'scenario' lacks h2_calls ("),
    # a fresh user's finding: a null stood in for the default, and the replay "departed"
    (lambda d: d["scenario"].update(topology=None),
     "topology = null: a recording writes a value here (null only for buckets and max_batch"),
    (lambda d: d["scenario"].update(ranks=None), "bad scenario in trace: ranks = null"),
    (lambda d: d.update(variant_file="xyz"), "'variant_file' is \"xyz\": not 12 lowercase hex"),
    (lambda d: d["scenario"].update(faults=None), "bad scenario in trace: faults = null"),
    # a hostile user's trial: 0, "" and {} read as "no faults", a hazard named twice was taken
    (lambda d: d["scenario"].update(faults=0), "bad scenario in trace: faults = 0: not a list"),
    (lambda d: d["scenario"].update(faults=""), "bad scenario in trace: faults = '': not a list"),
    (lambda d: d["scenario"].update(faults={}), "bad scenario in trace: faults = {}: not a list"),
    (lambda d: d["scenario"].update(hazards_off=["h9", "h9"]),
     "bad scenario in trace: hazards_off = ['h9', 'h9']: hazard 'h9' is named twice; name each "
     "once"),
    # a fresh user's finding: these leaked "TypeError ... (at difflib.py:280)", exit 1
    # a fresh user's finding: hand-edited traces read as the simulator's NONDETERMINISM
    (lambda d: d["choices"].__setitem__(0, "rank7"),
     "'choices'[0] is 'rank7', but the trace's scenario has 2 ranks (0-1)"),
    (lambda d: d.update(trace="x"), "'trace' must be a list of events, not \"x\""),
    (lambda d: d.update(variant=None), "'variant' must be a string (a variant name), not null"),
    (lambda d: d.update(variant=5), "'variant' must be a string (a variant name), not 5"),
    (lambda d: d.update(variant=["x"]), "'variant' must be a string (a variant name), not [\"x\"]"),
])
def test_bad_trace_contents_exit_2(fused_trace, capsys, edit, needle):
    _rewrite(fused_trace, edit)
    assert main(["check", "--replay", str(fused_trace)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("field, value, words", [
    ("ranks", 3, "ranks = 3: the recording has ranks 2 (its scenario_digest says so; the field "
                 "or the digest edited by hand?)"),
    ("buckets", [1, 2, 4, 8], "buckets = [1, 2, 4, 8]: not the recording's buckets (its "
                              "scenario_digest says so; the field or the digest edited by "
                              "hand?)"),
    ("max_batch", 3, "max_batch = 3: not the recording's max_batch"),
    ("hazards_off", ["h9"], "hazards_off = ['h9']: the recording has hazards_off []"),
    ("hazards_off", ["h1"], "hazards_off = ['h1']: the recording has hazards_off []"),
    ("topology", "per-rank", "topology = 'per-rank': the recording has topology 'shared'"),
    ("h2_scope", "device", "h2_scope = 'device': the recording has h2_scope 'process'"),
    ("h2_calls", "assumed", "h2_calls = 'assumed': the recording has h2_calls 'both'"),
    ("rank_overhead", [], "rank_overhead = []: the recording has no rank_overhead (its "
                          "scenario_digest names none; added by hand?)"),
])
def test_a_scenario_edited_by_hand_is_a_bad_trace_not_nondeterminism(fused_trace, capsys, field,
                                                                      value, words,
                                                                      no_simulation):
    """A hostile user's trial: ranks, buckets, max_batch or hazards_off edited in a trace
    replayed into "NONDETERMINISM: replay departed ...", exit 1, blaming the simulator (or,
    for some, "replayed exactly" a scenario no run had). The trace carries a digest of each
    field of its scenario (`sim.report.scenario_digest`), and a field that no longer matches
    it is a bad trace naming it, exit 2, before any run."""
    _rewrite(fused_trace, lambda d: d["scenario"].__setitem__(field, value))
    assert main(["check", "--replay", str(fused_trace)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1, captured
    assert err.startswith(f"lockstep check: error: {fused_trace}: bad scenario in trace: "
                          f"{words}"), err


def test_a_trace_records_the_digest_of_the_scenario_it_was_written_with(fused_trace, tmp_path,
                                                                       capsys):
    """The control for the refusals above: an unedited trace replays exactly (the digest of
    its scenario as read back from JSON is the one written), and so does its replay's own
    trace (--trace-out)."""
    from sim.report import RECORD_FIELDS, record_digest, scenario_digest

    data = json.loads(fused_trace.read_text())
    assert data["scenario_digest"] == scenario_digest(data["scenario"])
    assert set(data["scenario_digest"]) == set(data["scenario"])
    assert data["record_digest"] == record_digest(data)
    assert set(data["record_digest"]) == set(RECORD_FIELDS) - {"variant_file", "variant_path"}
    out = tmp_path / "again"
    assert main(["check", "--replay", str(fused_trace), "--trace-out", str(out)]) == 0
    capsys.readouterr()
    assert main(["check", "--replay", str(out / "fused-sweep.shared.replayed.json")]) == 0


def test_a_trace_without_a_scenario_digest_still_replays(fused_trace, capsys):
    """Traces written before 2026-12-07 have no scenario_digest: they replay as before, and a
    departure says that an edit of the scenario cannot be told from it."""
    _rewrite(fused_trace, lambda d: d.pop("scenario_digest"))
    assert main(["check", "--replay", str(fused_trace)]) == 0
    assert capsys.readouterr().out.startswith("replayed ")
    _rewrite(fused_trace, lambda d: d["scenario"].__setitem__("ranks", 3))
    assert main(["check", "--replay", str(fused_trace)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("NONDETERMINISM: replay departed from its recording"), out
    assert out.rstrip().endswith("; the trace has no scenario_digest (traces written before "
                                 "2026-12-07 do not), so an edit by hand of its scenario cannot "
                                 "be told from a departure"), out


@pytest.mark.parametrize("digest, shown", [
    ("x", '"x"'), (["ranks"], '["ranks"]'), ({"ranks": "zz"}, '{"ranks": "zz"}'),
    ({"bogus": "0" * 12}, '{"bogus": "000000000000"}'), ({"ranks": 5}, '{"ranks": 5}'),
    (None, "null"),
])
def test_a_scenario_digest_no_recording_has_is_named(fused_trace, capsys, digest, shown,
                                                     no_simulation):
    _rewrite(fused_trace, lambda d: d.__setitem__("scenario_digest", digest))
    assert main(["check", "--replay", str(fused_trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lockstep check: error: {fused_trace}: 'scenario_digest' is {shown}: not an "
                   "object of scenario fields, each 12 lowercase hex digits (the hash of each "
                   "field of the recording's scenario, `sim.report.scenario_digest`)"), err


def test_replay_names_the_invariant_as_the_table_does(tmp_path, capsys):
    """A fresh user's finding: the table said `invariant:I5`, the replay "exactly: invariant"."""
    out = tmp_path / "t"
    assert main(["check", "--variant", "single-warmup", "--topology", "shared", "--schedules",
                 "20", "--no-progress", "--jobs", "1", "--trace-out", str(out)]) == 0
    assert "invariant:I5" in capsys.readouterr().out
    assert main(["check", "--replay", str(out / "single-warmup.shared.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(" actions exactly: invariant:I5")


@pytest.mark.parametrize("argv", [
    ["--matrix"],  # refused after parsing
    ["--variant", "nope"],  # refused after parsing
    ["--ranks", "1"],  # refused while parsing, after --trace-out
    ["--stats"],
])
def test_a_refused_command_creates_no_trace_directory(tmp_path, capsys, argv, no_simulation):
    """A fresh user's finding: --trace-out created the directory and its parents while the
    arguments were parsed, even for a command then refused."""
    target = tmp_path / "x" / "a" / "b"
    with pytest.raises(SystemExit) if "--ranks" in argv else _nullctx():
        assert main(["check", "--trace-out", str(target), *argv]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_trace_out_is_created_with_its_parents_when_traces_are_written(tmp_path, capsys):
    target = tmp_path / "x" / "a"
    assert main(["check", "--variant", "fused-sweep", "--topology", "shared", "--schedules",
                 "20", "--no-progress", "--jobs", "1", "--trace-out", str(target)]) == 0
    assert (target / "fused-sweep.shared.json").is_file()


@pytest.mark.parametrize("target, words", [
    ("/proc/newdir/a", "cannot create '/proc/newdir/a' (in '/proc')"),
    ("/dev/null/traces", "cannot create '/dev/null/traces': '/dev/null' is not a directory"),
])
def test_a_trace_out_that_cannot_be_created_is_refused_without_creating(target, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", "--trace-out", target])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


def test_a_departing_trace_is_nondeterminism_not_silence(fused_trace, capsys):
    _rewrite(fused_trace, _restamped(lambda d: d["trace"][3].update(detail="edited")))
    assert main(["check", "--replay", str(fused_trace), "--json"]) == 1
    assert "differs from the recording at event 3" in json.loads(capsys.readouterr().out)["nondeterminism"]


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["trace"][3].update(detail="edited"), "trace = [{"),
    (lambda d: d.update(verdict="clean"), "verdict = 'clean': the recording has verdict "
                                          "'deadlock'"),
    (lambda d: d.update(invariant="I7"), "invariant = 'I7': the recording has invariant None"),
    (lambda d: d.update(variant="correct"), "variant = 'correct': the recording has variant "
                                            "'fused-sweep'"),
    (lambda d: d.update(model="0" * 12), "model = '000000000000': the recording has model '"),
    (lambda d: d["choices"].reverse(), "choices = ["),
    (lambda d: d.update(variant_file="0" * 12), "variant_file = '000000000000': the recording "
                                                "has no variant_file (its record_digest names "
                                                "none; added by hand?)"),
    (lambda d: d.pop("invariant"), "invariant is missing, but the recording has one"),
    (lambda d: d.update(record_digest={}), "its record_digest is empty, but every recording "
                                           "names its fields there (emptied by hand?)"),
])
def test_a_record_edited_by_hand_is_a_bad_trace_not_nondeterminism(fused_trace, capsys, edit,
                                                                   words, no_simulation):
    """A fresh reader's finding: a trace's verdict or variant name edited by hand replayed into
    "NONDETERMINISM", exit 1, blaming the simulator. The trace carries a digest of each field
    outside its scenario that the replay reads (`sim.report.record_digest`), and a field that
    no longer matches it is a bad trace naming it, exit 2, before any run."""
    _rewrite(fused_trace, edit)
    assert main(["check", "--replay", str(fused_trace)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1, captured
    assert err.startswith(f"lockstep check: error: {fused_trace}: bad trace: {words}"), err
    assert "its record_digest " in err, err


def test_a_trace_whose_numbers_a_json_tool_rewrote_still_replays(fused_trace, capsys):
    """A reviewer's finding: `jq . trace.json` writes the events' 0.0 as 0, and the record
    digest, hashing the number's text, refused the trace as edited by hand; the replay itself
    compares with ==."""
    def as_jq_writes(d):
        floats = [e for e in d["trace"] if any(isinstance(v, float) and v.is_integer()
                                                for v in e.values())]
        assert floats, "the trace has no whole float for jq to rewrite"
        for e in d["trace"]:
            e.update({k: int(v) for k, v in e.items() if isinstance(v, float) and v.is_integer()})

    _rewrite(fused_trace, as_jq_writes)
    assert main(["check", "--replay", str(fused_trace)]) == 0, capsys.readouterr()
    assert "exactly" in capsys.readouterr().out


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(variant="fused-swep"), "bad trace: variant = 'fused-swep': the recording "
                                               "has variant 'fused-sweep'"),
    (lambda d: d.update(variant="my-gone", variant_path="/x.py\nlockstep: ok"),
     "bad trace: variant_path = '/x.py\\nlockstep: ok': the recording has no variant_path"),
])
def test_an_edited_variant_name_or_path_is_named_before_the_file_hint(fused_trace, capsys,
                                                                      edit, words,
                                                                      no_simulation):
    """A reviewer's findings: a misspelt shipped variant's name drew the hint to replay "with
    its file", and an edited variant_path was repeated as the file that recorded the trace,
    newline and all."""
    _rewrite(fused_trace, edit)
    assert main(["check", "--replay", str(fused_trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep check: error: {fused_trace}: {words}"), err
    assert len(err.splitlines()) == 1, err


def test_a_trace_without_a_record_digest_still_replays(fused_trace, capsys):
    """Traces written before 2026-12-07, 22:40 UTC, have no record_digest: they replay as
    before, and an edited verdict reads as a departure that says it may be an edit (a fresh
    user's finding: it drew no note; with both digests gone, the note named the scenario)."""
    _rewrite(fused_trace, lambda d: d.pop("record_digest"))
    assert main(["check", "--replay", str(fused_trace)]) == 0
    capsys.readouterr()
    _rewrite(fused_trace, lambda d: d.update(verdict="clean"))
    assert main(["check", "--replay", str(fused_trace)]) == 1
    out = capsys.readouterr().out.rstrip()
    assert out.startswith("NONDETERMINISM: replay gave verdict deadlock, the recording clean")
    assert out.endswith("; the trace has no record_digest (traces written before 2026-12-07, "
                        "22:40 UTC do not), so an edit by hand of its verdict, variant, choices "
                        "or events cannot be told from a departure"), out
    _rewrite(fused_trace, lambda d: d.pop("scenario_digest"))
    assert main(["check", "--replay", str(fused_trace)]) == 1
    assert capsys.readouterr().out.rstrip().endswith(
        "; the trace has no scenario_digest or record_digest (traces written before 2026-12-07, "
        "22:40 UTC do not), so an edit by hand of its scenario or its verdict, variant, choices "
        "or events cannot be told from a departure")


def test_a_replay_compares_the_recorded_invariant(fused_trace, capsys):
    """The recorded invariant was not compared: a replay breaking another rule read as exact."""
    _rewrite(fused_trace, _restamped(lambda d: d.update(invariant="I7")))
    assert main(["check", "--replay", str(fused_trace)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("NONDETERMINISM: replay broke no invariant, the recording "
                          "invariant I7"), out


def test_non_utf8_trace_exit_2(tmp_path, capsys):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe")
    assert main(["check", "--replay", str(path)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_exhaustive_budget_is_reported(capsys):
    assert main(["check", "--strategy", "exhaustive", "--variant", "correct", "--topology", "shared",
                 "--time-budget", "1", "--fault-schedules", "0", "--no-progress", "--json"]) in (0, 1)
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["complete"] is False and row["budget_reached"] is True
    assert row["got"] == "incomplete" and not row["passed"]


def test_variant_file_must_be_python(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert main(["check", "--variant-file", str(path)]) == 2
    assert "is not a Python file (.py)" in capsys.readouterr().err


def test_user_variant_trace_replays_with_its_file(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["check", "--variant-file", "docs/examples/my_variant.py", "--topology", "shared",
                 "--schedules", "10", "--no-progress", "--jobs", "1", "--trace-out", str(out)]) == 0
    capsys.readouterr()
    trace = out / "no-sync-launch.shared.json"
    assert main(["check", "--replay", str(trace), "--variant-file", "docs/examples/my_variant.py"]) == 0
    assert "replayed" in capsys.readouterr().out
    # without its file (a new process: this one registered the file's variants) the variant
    # is unknown, and the error says how to replay it
    res = subprocess.run([sys.executable, "-m", "lockstep", "check", "--replay", str(trace)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    err = res.stderr
    named = f"--variant-file \"{Path('docs/examples/my_variant.py').resolve()}\" (the path"
    assert "unknown variant 'no-sync-launch'" in err and named in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("choices, words", [
    (["x"] * 3, "'choices'[0] is \"x\": not one of the actor names (controller, "),
    (["rank0", "bogus"], "'choices'[1] is \"bogus\": not one of the actor names"),
    (["rank0", 99], "'choices'[1] is 99: not one of the actor names"),
    (["rank0", "rank1", None], "'choices'[2] is null: not one of the actor names"),
    ("rank0", "'choices' must be a list of actor names (controller, collectives, rank<r>, "
              "device<r>), not \"rank0\""),
])
def test_trace_with_unknown_actor_names_is_bad_input(fused_trace, capsys, choices, words):
    """A fresh user's finding: one bad entry gave "'choices' must be a list of actor names",
    naming neither the entry nor its place."""
    _rewrite(fused_trace, lambda d: d.update(choices=choices))
    assert main(["check", "--replay", str(fused_trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep check: error: {fused_trace}: {words}"), err
    assert len(err.splitlines()) == 1


def test_hazards_off_are_named_and_h2_removes_the_fused_sweep_deadlock(capsys):
    """With a hazard off, bad variants' verdicts are reported (not compared): exit 0."""
    code = main(["check", "--variant", "fused-sweep", "--topology", "shared", "--hazard-off", "h2",
                 "--schedules", "30", "--no-progress", "--jobs", "1"])
    out = capsys.readouterr().out
    assert "hazards switched off: h2" in out
    assert "differs" in out and "MISMATCH" not in out and "\nOK: " not in out
    # nothing was compared: the headline and the summary say so instead of "OK: 0/0 verdicts
    # as expected" (a fresh user read "OK" over a verdict that differs as a pass)
    assert "REPORTED: no verdict compared with an expected one; 1 of 1 bad-variant" in out
    assert "0/0" not in out
    main(["check", "--variant", "fused-sweep", "--topology", "shared", "--hazard-off", "h2",
          "--schedules", "30", "--no-progress", "--jobs", "1", "--json"])
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert code == 0 and row["got"] == "invariant:I4" and row["expected"] == "deadlock"
    assert row["compared"] is False


@pytest.mark.timeout(120)
def test_variant_selects_one_variant_of_a_multi_variant_file(capsys):
    path = "docs/examples/state_variants.py"
    assert main(["check", "--variant-file", path, "--variant", "my-fresh-logits", "--json",
                 "--no-progress", "--jobs", "1", "--schedules", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {row["variant"] for row in data["rows"]} == {"my-fresh-logits"}


@pytest.mark.timeout(120)
def test_every_example_of_the_state_hooks_gets_its_expected_verdict(capsys):
    """docs/variants.md shows one example per simulator capability; each must be caught."""
    assert main(["check", "--variant-file", "docs/examples/state_variants.py", "--json",
                 "--no-progress", "--jobs", "1", "--schedules", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    got = {(row["variant"], row["got"]) for row in data["rows"]}
    assert got == {("my-side-stream-custom-ar", "deadlock"), ("my-fresh-logits", "invariant:I15"),
                   ("my-idle-skips-decode", "divergence"), ("my-ignores-death", "invariant:I13")}


@pytest.mark.timeout(120)
def test_a_vacuous_row_says_under_the_table_what_was_never_reached(tmp_path, capsys):
    """Old behaviour (found by a fresh user): a vacuous row read `vacuous MISMATCH` with no
    reason in the table; only --json held "never reached: ...". A clean design that claims to
    reach preemption, under the default scenario (whose KV pool never runs out)."""
    variant = tmp_path / "v.py"
    variant.write_text(
        "from sim.variants import Variant\n"
        "WANTS = Variant(name='wants-preemption', summary='s', source='test',\n"
        "    expected={'shared': 'clean', 'per-rank': 'clean'}, reaches=('preemption',))\n")
    code = main(["check", "--variant-file", str(variant), "--buckets", "1,2,4,8",
                 "--max-batch", "8", "--topology", "shared", "--schedules", "5",
                 "--fault-schedules", "0", "--no-progress", "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 1
    note = [line for line in out.splitlines() if line.startswith("note: wants-preemption")]
    assert len(note) == 1 and "vacuous: never reached: preemption" in note[0]
    assert "only 5 schedules ran" in note[0] and "preemption needs a KV pool" in note[0]


@pytest.mark.timeout(120)
def test_a_vacuous_row_cut_short_by_schedules_names_the_schedules_first(capsys):
    """Found by a fresh user: `lockstep check --schedules 5` read correct-short-path as vacuous
    and asked only whether the max batch or the bucket set was too small, although the default
    configuration reaches first_row_behind within the default schedules. A row whose search ran
    fewer schedules than the default now names --schedules as the first cause; with the default
    budget the same row passes, so that was the cause."""
    argv = ["check", "--variant", "correct-short-path", "--topology", "shared",
            "--no-progress", "--jobs", "1"]
    assert main(argv + ["--schedules", "5"]) == 1
    notes = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("note: correct-short-path / shared: vacuous:")]
    assert len(notes) == 1
    assert notes[0].endswith("(only 5 schedules ran: a larger --schedules (default 20 for this "
                             "row) may reach them, unless the max batch or the bucket set is "
                             "too small to need them)"), notes[0]
    assert main(argv) == 0
    assert "vacuous" not in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_vacuous_row_is_unproven_in_the_table_and_the_matrix(capsys):
    """A fresh user's `--matrix --schedules 5`: the vacuous cells had no note (only the table's
    word), and the check ended FAILED, as if the correct protocol had been caught, where a
    search cut short by its budget ends NOT PROVEN. A vacuous row contradicts nothing either:
    its status reads unproven, each matrix cell gets its note, and the headline is NOT
    PROVEN (still exit 1: nothing was established)."""
    argv = ["check", "--variant", "correct-short-path", "--schedules", "5", "--no-progress",
            "--jobs", "1"]
    assert main(argv + ["--topology", "shared"]) == 1
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("correct-short-path ")]
    assert row and row[0].split()[3] == "vacuous" and row[0].endswith("unproven"), row
    assert out.rstrip().splitlines()[-1].startswith("NOT PROVEN: ")
    assert main(argv + ["--matrix", "--fault-schedules", "2"]) == 1
    out = capsys.readouterr().out
    cells = sum(line.count("vacuous (expected clean)") for line in out.splitlines()
                if line.startswith("| correct-short-path |"))
    notes = [line for line in out.splitlines()
             if line.startswith("note: correct-short-path / TP") and ": vacuous: " in line]
    assert cells >= 1 and len(notes) == cells, (cells, notes)
    assert all("only 5 schedules ran" in note for note in notes)
    assert out.rstrip().splitlines()[-1].startswith("NOT PROVEN: ")


def test_a_vacuous_row_that_ran_its_default_schedules_blames_only_the_configuration():
    """The schedules are named only where they can be the cause: fewer than the row runs by
    default (35 for a clean row, 18 faulted, or the variant's own caps: correct-short-path
    runs 20 and 10), and not every state covered. A reviewer's finding: compared with 300,
    every vacuous clean row of a default run blamed --schedules."""
    from sim.variants import CORRECT, get_variant

    budgets = cli.default_budgets([CORRECT, get_variant("correct-short-path")])
    assert budgets == {"correct": (35, 18), "correct-short-path": (20, 10)}

    def causes(schedules, variant="correct", complete=False):
        return cli._vacuous_causes(Row(variant, "shared", "clean", "vacuous", SearchStats(
            schedules=schedules, complete=complete)), budgets)

    config_only = "(is the max batch or the bucket set too small to need them?)"
    assert causes(35) == config_only
    assert causes(20, "correct-short-path") == config_only
    assert causes(7, complete=True) == config_only
    assert causes(7).startswith("(only 7 schedules ran: a larger --schedules (default 35 for")
    assert causes(1).startswith("(only 1 schedule ran")
    assert causes(19, "correct-short-path").startswith("(only 19 schedules ran")
    assert causes(18, "correct+faults") == config_only
    assert causes(10, "correct-short-path+faults") == config_only
    assert causes(2, "correct+faults") == (
        config_only + "; only 2 faulted schedules ran: raise --fault-schedules (default 18 for "
        "this row)")

    def missing(*events, schedules=35):
        return cli._vacuous_causes(Row("correct", "shared", "clean", "vacuous", SearchStats(
            schedules=schedules), missing=events), budgets)

    assert missing("preemption").startswith("(preemption needs a KV pool")
    assert missing("preemption", "chunked_prefill").count(" needs ") == 2
    assert missing("preemption", schedules=3).startswith("(only 3 schedules ran")
    assert "preemption needs" in missing("preemption", schedules=3)
    assert missing("replay", "preemption") == config_only  # what a bigger batch set may need
    assert missing("short_replay", "short_declined") == (
        "(short_replay and short_declined need the short-context decode path, as "
        "adjust=sim.scenario.short_path_on gives)")


@pytest.mark.timeout(120)
def test_a_vacuous_row_of_a_default_run_blames_only_the_configuration(tmp_path, capsys):
    """A clean design that claims to reach preemption, under the default scenario (whose KV
    pool never runs out) and the default schedules: nothing about --schedules. The hint names
    what preemption needs, a small KV pool; it used to ask whether the max batch or the bucket
    set was too small, which no larger one would change (found by a fresh variant author)."""
    variant = tmp_path / "v.py"
    variant.write_text(
        "from sim.variants import Variant\n"
        "WANTS = Variant(name='wants-preemption-default', summary='s', source='test',\n"
        "    expected={'shared': 'clean', 'per-rank': 'clean'}, reaches=('preemption',))\n")
    assert main(["check", "--variant-file", str(variant), "--topology", "shared",
                 "--fault-schedules", "0", "--no-progress", "--jobs", "1"]) == 1
    note, = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("note: wants-preemption-default")]
    assert note.endswith("(preemption needs a KV pool of fewer pages than the running "
                         "requests grow into, as adjust=sim.variants_paging.page_pressure "
                         "gives)"), note


@pytest.mark.timeout(120)
def test_trace_out_says_where_it_wrote_and_a_hazard_named_twice_is_switched_off_once(
        tmp_path, capsys):
    """Found by a fresh user: --trace-out wrote silently, and `--hazard-off h2 --hazard-off h2`
    printed "h2, h2"."""
    code = main(["check", "--variant", "fused-sweep", "--topology", "shared", "--no-progress",
                 "--hazard-off", "h4", "--hazard-off", "h4", "--trace-out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0
    assert "hazards switched off: h4 (" in captured.out
    assert f"1 minimal trace (.txt, .mmd, .json) written to {tmp_path}" in captured.err
    assert (tmp_path / "fused-sweep.shared.json").is_file()


@pytest.mark.parametrize("argv, needle", [
    (["check", "--buckets", "-1,2"], "bucket -1 at position 0"),
    (["bench", "--preset", "tiny", "--batch-sizes", "-4,8"], "batch size -4"),
])
def test_a_list_option_starting_with_a_negative_number_names_it(argv, needle, capsys):
    """Found by a fresh user: argparse read '-1,2' as an option and said only 'argument
    --buckets: expected one argument'."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own check (check), or the command's (bench)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv, where", [
    (["--buckets", "1,2,4,8", "--max-batch", "100"], "the largest of --buckets 1,2,4,8"),
    (["--max-batch", "300"], "the largest default bucket 256"),
])
def test_max_batch_past_the_buckets_names_its_flags(argv, where, capsys):
    """A fresh user's finding: the error used the Python name (max_batch=100)."""
    assert main(["check", *argv]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lockstep check: error: --max-batch {argv[-1]} exceeds {where}; add a bucket "
        "(--buckets) or lower --max-batch")


@pytest.mark.parametrize("buckets, rest", [
    ("1,2", "2 (not given; it defaults to the largest of --buckets 1,2) with the buckets up to the "
            "one it pads to (1,2): every batch size is a bucket, so no replay is ever padded; use "
            "a --max-batch that is not a bucket, or leave a batch size between two buckets"),
    ("1", "1 (not given; it defaults to the largest of --buckets 1): a single slot never "
          "compacts, so no schedule can show slot compaction; use --max-batch 3 or more, and "
          "--buckets that reach it"),
])
def test_a_max_batch_not_given_is_named_as_the_default_of_the_buckets(buckets, rest, capsys,
                                                                      no_simulation):
    """A fresh user's finding: `--buckets 1,2` was refused as "--max-batch 2 with the buckets
    ...", blaming an option nobody typed. --max-batch defaults to the largest bucket; the error
    says so and names the --buckets given (a --max-batch given is named as before:
    test_bad_values_exit_2)."""
    assert main(["check", "--buckets", buckets, "--no-progress", "--jobs", "1"]) == 2
    assert capsys.readouterr().err == f"lockstep check: error: --max-batch {rest}\n"


def test_defaulted_fields_says_where_max_batch_comes_from():
    from argparse import Namespace

    from sim.cli import defaulted_fields

    assert defaulted_fields(Namespace(max_batch=8, buckets=(1, 4, 8))) == {}
    assert defaulted_fields(Namespace(max_batch=None, buckets=(1, 4, 8))) == {
        "max_batch": "the largest of --buckets 1,4,8"}
    assert defaulted_fields(Namespace(max_batch=None, buckets=None)) == {
        "max_batch": "the largest default bucket"}


@pytest.mark.timeout(60)
def test_a_scenario_past_the_modelled_memory_names_the_buckets_flag(capsys, no_simulation):
    """It ended "use smaller buckets", the simulator's field name, not the option."""
    assert main(["check", "--buckets", "100000"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lockstep check: error: --buckets up to 100000 need 205 GiB per rank in the modelled "
        "memory, more than its 141 GiB; use smaller --buckets")


@pytest.mark.parametrize("config, message", [
    ({"world_size": 0}, "--ranks 0 must be a positive integer"),
    ({"max_batch": 0}, "--max-batch 0 must be a positive integer"),
    ({"buckets": (1, 2, 4, 8), "max_batch": 100},
     "--max-batch 100 exceeds the largest of --buckets 1,2,4,8; add a bucket (--buckets) or "
     "lower --max-batch"),
    ({"page_size": 0}, "page_size=0 must be a positive integer"),  # no option sets it
])
def test_the_protocols_config_errors_name_the_check_flags(config, message):
    """The protocol names its fields; `lockstep check` spells them as the options that set
    them, one mapping for every error (it re-checked --max-batch itself to name its flags)."""
    from protocol.config import ProtocolConfig
    from protocol.errors import ConfigError
    from sim.cli import flag_names

    with pytest.raises(ConfigError) as info:
        ProtocolConfig(**config)
    assert flag_names(info.value) == message


def test_coverage_errors_name_the_field_in_the_library_and_the_flag_on_the_command_line(capsys):
    from protocol.errors import ConfigError
    from sim.check import check_coverage_reachable
    from sim.scenario import default_scenario

    with pytest.raises(ConfigError) as info:
        check_coverage_reachable(default_scenario(buckets=(1, 2, 4, 8), max_batch=1))
    assert str(info.value).startswith("max_batch=1: a single slot never compacts")
    assert main(["check", "--buckets", "1,2,4,8", "--max-batch", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lockstep check: error: --max-batch 1: a single slot never compacts, so no schedule can "
        "show slot compaction; use --max-batch 3 or more, and --buckets that reach it")


@pytest.mark.timeout(60)
def test_a_row_not_reachable_here_expects_no_verdict(capsys):
    """A row whose bug the configuration cannot reach was checked against nothing; its
    expected column read `clean` (a clean-in-this-topology bad variant) or the bug's verdict."""
    assert main(["check", "--variant", "warmup-scratch-free", "--variant", "local-bucket",
                 "--buckets", "8", "--max-batch", "3", "--topology", "per-rank",
                 "--no-progress", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines[2:4]] == [
        [name, "per-rank", "-", "not", "reachable", "here", "0", "0", "0.00s", "-", "n/a"]
        for name in ("warmup-scratch-free", "local-bucket")]


def test_hazard_off_accepts_the_docs_spelling(capsys):
    """The docs write H2; the option's values are h1..h9. A bad value is named as given."""
    assert main(["check", "--variant", "fused-sweep", "--topology", "shared", "--hazard-off",
                 "H2", "--schedules", "5", "--no-progress", "--jobs", "1"]) == 0
    assert "hazards switched off: h2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["check", "--hazard-off", "X9"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("argument --hazard-off: invalid choice: 'X9' (choose from h1, h2, h3, "
                        "h4, h5, h6, h7, h8, h9)") and len(err.splitlines()) == 1


def test_replay_of_a_token_divergence_names_the_step_that_sampled_it(tmp_path, capsys):
    """As the report the trace was written from: the replay attributes the wrong token."""
    out = tmp_path / "t"
    assert main(["check", "--variant", "chunk-token-kept", "--topology", "shared",
                 "--no-progress", "--jobs", "1", "--trace-out", str(out)]) == 0
    capsys.readouterr()
    assert main(["check", "--replay", str(out / "chunk-token-kept.shared.json"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["verdict"] == "divergence" and got["invariant"] is None
    assert isinstance(got["step"], int) and f"(the token step {got['step']} sampled)" in got["detail"]


def test_list_prints_every_variant_with_its_expected_verdicts(capsys):
    """A fresh user found no way to list variant names but docs/variants.md."""
    from sim.variants import SHIPPED, get_variant

    assert main(["check", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    lines = lines[:lines.index("")]  # the table; its notes follow a blank line
    assert lines[0].split() == ["variant", "shared", "per-rank", "summary"]
    assert [line.split()[0] for line in lines[1:]] == list(SHIPPED)
    fused = next(line for line in lines if line.startswith("fused-sweep "))
    assert fused.split()[1:3] == [get_variant("fused-sweep").expected["shared"],
                                  get_variant("fused-sweep").expected["per-rank"]]
    assert main(["check", "--list", "--json", "--variant-file",
                 "docs/examples/my_variant.py"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in rows] == ["no-sync-launch"] and rows[0]["summary"]


@pytest.mark.timeout(120)
def test_list_shows_the_reachability_the_check_decides(capsys):
    """`--list` showed per-rank "clean" for warmup-scratch-free and autotune-cache-shared,
    where `lockstep check` reads "not reachable here" (each rank has its own process). It now
    shows the check's own decision, with the check's reason; a variant whose bug needs a fault
    (watchdog-armed-on-error) and the correct protocol are listed with their expected verdicts,
    as the check searches them."""
    from sim.check import NOT_REACHABLE, CheckSpec, check_variant
    from sim.variants import get_variant

    assert main(["check", "--list"]) == 0
    text = capsys.readouterr().out.splitlines()
    for name in ("warmup-scratch-free", "autotune-cache-shared"):
        line = next(x for x in text if x.startswith(name + " "))
        assert line.split()[1:5] == [get_variant(name).expected["shared"], "not", "reachable",
                                     "here"], line
        assert any(x.startswith(f"note: {name} / per-rank: not reachable here: ") for x in text)
    assert main(["check", "--list", "--json"]) == 0
    listed = {r["variant"]: r for r in json.loads(capsys.readouterr().out)}
    spec = CheckSpec(schedules=20, fault_schedules=0, jobs=1)
    for name in ("warmup-scratch-free", "autotune-cache-shared", "watchdog-armed-on-error",
                 "correct"):
        for topology in ("shared", "per-rank"):
            row = check_variant(get_variant(name), spec, topology)[0]
            assert (listed[name][topology] == NOT_REACHABLE) == (row.got == NOT_REACHABLE)
            assert listed[name]["not_reachable"].get(topology) == (
                row.detail if row.got == NOT_REACHABLE else None), (name, topology)
            if row.got != NOT_REACHABLE:
                assert listed[name][topology] == row.expected


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("lockstep ")


def test_a_trace_write_that_fails_after_the_search_keeps_the_table(tmp_path, monkeypatch, capsys):
    """A reviewer's finding: the failed write returned before the verdict table was printed."""
    import errno

    import sim.cli

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sim.cli, "write_trace", full_disk)
    code = main(["check", "--variant", "fused-sweep", "--topology", "shared", "--schedules", "5",
                 "--jobs", "1", "--no-progress", "--trace-out", str(tmp_path / "t")])
    out, err = capsys.readouterr()
    assert code == 2
    assert "fused-sweep" in out and "OK:" in out
    assert err.strip().splitlines()[-1].endswith("No space left on device")


@pytest.mark.timeout(120)
def test_a_search_too_small_to_catch_or_to_fire_faults_names_the_option_to_raise(capsys):
    """Found by a fresh user: with --schedules 2 --fault-schedules 1 the check printed FAILED
    with MISMATCH rows and no word on the two budgets. A bad variant the search missed now
    says how many schedules found nothing and which option to raise; a vacuous faulted row
    says how few faulted schedules ran. With the default budgets both rows pass."""
    argv = ["check", "--variant", "kv-zero-unordered", "--variant", "correct", "--buckets",
            "1,4", "--max-batch", "3", "--topology", "shared", "--no-progress", "--jobs", "1"]
    assert main(argv + ["--schedules", "1", "--fault-schedules", "1"]) == 1
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert ("note: kv-zero-unordered / shared: not caught: 1 schedule found no invariant:I11; "
            "a larger --schedules (default up to 300)") in notes[0]
    assert notes[1].startswith("note: correct+faults / shared: vacuous:")
    assert notes[1].endswith("only 1 faulted schedule ran: raise --fault-schedules (default 18 "
                             "for this row)")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "not caught" not in out and "raise --fault-schedules" not in out


def test_replay_of_a_device_or_an_oversized_file_is_one_line_before_reading_it(
        tmp_path, capsys, monkeypatch):
    """Found by a fresh user: `--replay /dev/zero` read until the OOM killer stopped it."""
    import sim.cli as cli

    assert main(["check", "--replay", "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert err == ("lockstep check: error: trace file '/dev/zero' is not a regular file (a "
                   "device or a pipe: --trace-out writes regular files)\n"), err
    big = tmp_path / "big.json"
    big.write_text("{}" + " " * 100)
    monkeypatch.setattr(cli, "MAX_TRACE_BYTES", 50)
    assert main(["check", "--replay", str(big)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lockstep check: error: trace file {str(big)!r} holds 102 bytes, "
                          "more than the 50 of any trace") and err.count("\n") == 1, err


@pytest.mark.timeout(120)
def test_a_trace_that_cannot_be_written_is_named_by_its_own_path(tmp_path, capsys):
    """Found by a fresh user: a directory standing where a trace file goes was reported as
    "cannot write traces to '<the --trace-out folder>': Is a directory"."""
    blocker = tmp_path / "fused-sweep.shared.txt"
    blocker.mkdir()
    assert main(["check", "--variant", "fused-sweep", "--topology", "shared", "--no-progress",
                 "--jobs", "1", "--trace-out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"lockstep check: error: cannot write traces to {str(blocker)!r}: Is a directory\n", err


def test_a_row_not_reachable_here_has_no_expected_verdict_in_json(capsys):
    """The table's expected column reads "-" for such a row, and its status "n/a"; the JSON gave
    the variant's expected verdict (a fresh helper's finding: "clean" for warmup-scratch-free
    per-rank) and "passed": true for a row checked against no verdict."""
    import json

    argv = ["check", "--variant", "warmup-scratch-free", "--buckets", "1,2,4,8", "--json",
            "--no-progress", "--jobs", "1"]
    assert main(argv) == 0
    rows = {r["topology"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["per-rank"]["got"] == "not reachable here" and rows["per-rank"]["expected"] is None
    assert rows["per-rank"]["passed"] is None  # it read true: a JSON reader counted a pass
    assert rows["shared"]["expected"] == rows["shared"]["got"] == "deadlock"
    assert rows["shared"]["passed"] is True


@pytest.mark.timeout(300)
def test_the_matrix_reports_bad_verdicts_under_another_model_as_the_plain_check_does(capsys):
    """A fresh reviewer's finding: `--matrix --hazard-off h3` held fused-sweep to its expected
    verdicts (FAILED 12/24, exit 1) where the plain check reports them, not compared."""
    argv = ["check", "--matrix", "--variant", "fused-sweep", "--schedules", "5",
            "--fault-schedules", "0", "--no-progress", "--jobs", "1"]
    assert main(argv + ["--hazard-off", "h3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hazards switched off: h3")
    assert "bad-variant verdicts differ from the full model's" in out and "FAILED" not in out
    assert main(argv) == 0
    assert "OK: 24/24 verdicts as expected" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_an_incomplete_search_of_one_scenario_at_a_time_counts_its_scenarios(capsys):
    """A fresh reviewer's finding: Hypothesis over the drawn short-path members said "after 47
    of 5 schedules" (5 was each member's budget, not the search's; the row's schedules are now
    shared among its members, `sim.check.schedule_shares`). At the default configuration its
    38 members, one schedule each (the variant caps its schedules at 20), take about four times
    the 1 s budget on this project's machine."""
    argv = ["check", "--strategy", "hypothesis", "--variant", "correct-short-path",
            "--time-budget", "1", "--fault-schedules", "0", "--topology", "shared",
            "--no-progress", "--jobs", "1"]
    assert main(argv) == 1
    [note] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    m = re.search(r"after (\d+) schedules over (\d+) scenarios searched one at a time "
                  r"\(20 shared among them, at least one each\)", note)
    assert m and int(m.group(1)) <= int(m.group(2)) < 38, note  # one each, the last cut short


@pytest.mark.timeout(120)
def test_a_budget_that_ends_a_clean_search_reads_not_proven_not_failed(capsys):
    """A fresh user's finding: an exhaustive search of the correct protocol cut short by
    --time-budget printed `incomplete ... MISMATCH` and `FAILED`, as if it had found a bug. It
    is still not as expected (exit 1: nothing was proven), but says so in its own words and
    names the option to raise; a row that contradicts its expected verdict still reads FAILED."""
    argv = ["check", "--variant", "correct", "--strategy", "exhaustive", "--time-budget", "0.3",
            "--fault-schedules", "0", "--topology", "shared", "--no-progress", "--jobs", "1"]
    assert main(argv + ["--json"]) == 1
    assert json.loads(capsys.readouterr().out)["headline"] == "NOT PROVEN"
    assert main(argv) == 1
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.startswith("correct ")]
    assert row.split()[3] == "incomplete" and row.split()[-1] == "unproven", row
    assert "MISMATCH" not in out and "FAILED" not in out
    assert "\nNOT PROVEN: 0/1 verdicts as expected" in out
    [note] = [line for line in out.splitlines() if line.startswith("note: correct / shared")]
    # a fresh user's finding: at the default 36 buckets no sensible budget finishes it
    assert note.endswith("a larger --time-budget (default 60 s) may finish it; or a smaller "
                         "configuration: the states an exhaustive search visits grow with the "
                         "buckets and the max batch (the README's example: --buckets 1,2,4,8 "
                         "--max-batch 8)"), note
    rows = [Row("correct", "shared", "clean", "incomplete", SearchStats(), "", None),
            Row("v", "shared", "deadlock", "clean", SearchStats(), "", None)]
    assert cli._headline(rows) == "FAILED" and cli._headline(rows[:1]) == "NOT PROVEN"
    assert cli._headline([]) == "OK" and [cli._status(r) for r in rows] == ["unproven", "MISMATCH"]


def test_a_reported_row_whose_search_was_cut_short_is_unproven_not_a_verdict_that_differs():
    """A reviewer's finding: under --hazard-off two bad-variant rows that the time budget ended
    read "OK: ...; 2 of 2 bad-variant verdicts differ from the full model's", exit 0."""
    import argparse

    from sim.variants import REGISTRY

    variant = REGISTRY["death-drops-requests"]
    args = argparse.Namespace(hazard_off=["h3"], h2_calls=None, h2_scope=None)
    cut = Row(variant.name, "shared", variant.expected["shared"], "incomplete", SearchStats())
    done = Row(variant.name, "per-rank", variant.expected["per-rank"], "clean", SearchStats())
    cli._report_only(variant, [cut, done], args)
    assert (cut.report, cut.passed, cli._status(cut)) == ("unproven", False, "unproven")
    assert (done.report, done.passed) == ("differs", True)
    assert cli._headline([cut, done]) == "NOT PROVEN" and cli._headline([done]) == "REPORTED"
    assert "1 of 2 bad-variant verdicts differ" in cli._summary([cut, done])


def test_a_check_of_only_unreachable_rows_says_nothing_was_checked(capsys):
    """A fresh user's finding: it printed "OK: 0/0 verdicts as expected", read as a pass."""
    assert main(["check", "--buckets", "4", "--max-batch", "3", "--variant", "split-eligibility",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\nNOTHING CHECKED: 0/0 verdicts as expected, 2 not reachable here" in out
    assert "\nOK" not in out


@pytest.mark.parametrize("model, hint", [
    ("same", None),
    ("000000000000", "the trace was recorded by other code of protocol/ and sim/ (model "
                     "000000000000, this one "),
    (None, "the trace does not name the code that recorded it"),
])
def test_a_departing_replay_says_when_other_code_recorded_it(fused_trace, capsys, model, hint):
    """A fresh user's finding: a trace recorded 4 hours earlier replayed as "NONDETERMINISM",
    blaming the simulator, when the simulator had changed since. A trace names the code that
    recorded it (`model_fingerprint`), and a departure says when that is not this code."""
    from sim.report import model_fingerprint

    data = json.loads(fused_trace.read_text())
    assert data["model"] == model_fingerprint() and len(data["model"]) == 12
    mid = len(data["choices"]) // 2  # a schedule this code cannot follow: a departure
    other = next(a for a in ("rank0", "rank1", "controller") if a != data["choices"][mid])

    def edit(d):
        d["choices"][mid] = other
        if model is None:
            d.pop("model")
        elif model != "same":
            d["model"] = model

    _rewrite(fused_trace, _restamped(edit))
    assert main(["check", "--replay", str(fused_trace)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("NONDETERMINISM: replay departed from its recording"), out
    if hint is None:
        assert "recorded" not in out.split("recording", 1)[1], out
    else:
        assert hint in out, out


@pytest.mark.timeout(120)
def test_an_exhaustive_budget_note_gives_distinct_and_visited_states_as_the_table_does(capsys):
    """A fresh user's finding: the table said `states 553859` and the note "after 1355 unique
    states", two counts side by side with nothing to tie them. The note now names both, the
    visited count being the table's."""
    rc = main(["check", "--strategy", "exhaustive", "--variant", "correct", "--topology",
               "shared", "--time-budget", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1, out
    row = next(line.split() for line in out.splitlines() if line.startswith("correct "))
    visited = row[5]
    note = re.search(r"after (\d+) distinct states \((\d+) visited, the table's states\)", out)
    assert note is not None, out
    assert note.group(2) == visited and int(note.group(1)) <= int(visited)


def _denied(*args, **kwargs):
    raise PermissionError(13, "Permission denied")


@pytest.mark.parametrize("method", ["read_text", "exists"])
def test_an_unreadable_trace_is_one_line(tmp_path, capsys, monkeypatch, method):
    """Found by a fresh user (non-root, a trace of mode 000 or in a folder of mode 700): a
    PermissionError traceback from reading the trace, or from the stat before it. Denied here
    by a stand-in, since the tests may run as root, whom no mode stops."""
    trace = tmp_path / "t.json"
    trace.write_text("{}")
    monkeypatch.setattr(Path, method, _denied)
    assert main(["check", "--replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err == (f"lockstep check: error: trace file {str(trace)!r} cannot be read: "
                   "Permission denied\n"), err


def test_a_variant_file_in_a_folder_it_may_not_enter_is_one_line(tmp_path, capsys, monkeypatch):
    """Found by a fresh user: `Path.exists` raised PermissionError for a file in a folder of
    mode 700 owned by another user, a traceback from `load_variant_file`."""
    mine = tmp_path / "v.py"
    mine.write_text("")
    monkeypatch.setattr(Path, "exists", _denied)
    assert main(["check", "--variant-file", str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"variant file {str(mine)!r} cannot be read: Permission denied" in err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_trace_of_deeply_nested_json_is_one_line(tmp_path, capsys):
    """Found by a fresh user: 100,000 nested brackets gave a RecursionError traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["check", "--replay", str(deep)]) == 2
    err = capsys.readouterr().err
    assert err == (f"lockstep check: error: trace file {str(deep)!r} is not a trace: its JSON "
                   "nests too deeply\n"), err


def test_a_trace_holding_an_integer_of_thousands_of_digits_is_one_line(tmp_path, capsys):
    """Found by a fresh user: a 10,000-digit number gave a ValueError traceback from
    `json.loads` (Python's limit on converting long digit strings)."""
    trace = tmp_path / "big.json"
    trace.write_text('{"variant": "fused-sweep", "choices": [], "format": 1' + "0" * 10_000 + "}")
    assert main(["check", "--replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lockstep check: error: trace file {str(trace)!r} is not a trace: a "
                          "value in it cannot be read (Exceeds the limit"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_progress_forces_the_bar_where_stderr_is_not_a_terminal(capsys):
    """A fresh user's matrix run in a log stayed silent for six minutes: tqdm shows no bar
    off a terminal. --progress shows it anyway; without it (stderr captured here, not a
    terminal) there is none; --progress with --no-progress is refused."""
    argv = ["check", "--variant", "single-warmup", "--schedules", "5", "--jobs", "1"]
    assert main(argv + ["--progress"]) == 0
    assert "lockstep check" in capsys.readouterr().err
    assert main(argv) == 0
    assert "lockstep check" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--progress", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and len(err.strip().splitlines()) <= 3


@pytest.mark.parametrize("verdict, code, words", [
    (None, 0, "replayed {n} actions exactly: deadlock"),
    ("clean", 1, "NONDETERMINISM: replay gave verdict deadlock, the recording clean"),
])
def test_a_replay_compares_the_verdict_only_where_the_trace_records_one(fused_trace, capsys,
                                                                       verdict, code, words):
    """A fresh user's finding: a trace without its ``verdict`` (a field the format allows to be
    absent, as ``actions`` and ``model`` are) replayed as "NONDETERMINISM: replay gave verdict
    deadlock, the recording None", exit 1. A recorded verdict the replay does not give is still
    a departure."""
    n = len(json.loads(fused_trace.read_text())["choices"])

    def edit(d):
        if verdict is None:
            d.pop("verdict")
        else:
            d["verdict"] = verdict

    _rewrite(fused_trace, _restamped(edit))
    assert main(["check", "--replay", str(fused_trace)]) == code
    out = capsys.readouterr().out
    assert out.startswith(words.format(n=n)), out


def test_a_row_not_reachable_under_another_model_is_not_reported_as_differing(capsys):
    """A reviewer's finding: under --hazard-off, warmup-scratch-free's per-rank row (not
    reachable here: checked against no verdict) read "report": "differs" in the JSON and was
    counted in "2 of 2 bad-variant verdicts differ"."""
    import json

    argv = ["check", "--variant", "warmup-scratch-free", "--buckets", "1,2,4,8", "--hazard-off",
            "h3", "--no-progress", "--jobs", "1"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["topology"]: r for r in data["rows"]}
    assert rows["per-rank"]["got"] == "not reachable here"
    assert rows["per-rank"]["report"] is None and rows["per-rank"]["passed"] is None
    assert rows["shared"]["report"] == "differs" and data["headline"] == "REPORTED"
    assert main(argv) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert ("no verdict compared with an expected one, 1 not reachable here; 1 of 1 "
            "bad-variant verdicts differ") in summary, summary


def test_unknown_variant_with_a_variant_file_says_how_to_list_them_all():
    """With a variant file, the count of known variants includes the file's, and plain
    `--list` prints only the shipped ones, `--list` with the file only the file's: the hint
    says which prints which (a fresh user's finding). New processes: this one may have
    registered example files already."""
    res = subprocess.run([sys.executable, "-m", "lockstep", "check", "--variant-file",
                          "docs/examples/state_variants.py", "--variant", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1
    listed = subprocess.run([sys.executable, "-m", "lockstep", "check", "--variant-file",
                             "docs/examples/state_variants.py", "--list"],
                            capture_output=True, text=True, timeout=60)
    shipped = subprocess.run([sys.executable, "-m", "lockstep", "check", "--list"],
                             capture_output=True, text=True, timeout=60)
    def rows(out: str) -> int:  # the table's rows: after the header, before a blank line
        return len(out.split("\n\n")[0].strip().splitlines()) - 1

    n_file, n_shipped = rows(listed.stdout), rows(shipped.stdout)
    assert n_file > 0 and n_shipped > 0
    assert (f"{n_file + n_shipped} are known: `lockstep check --list` prints the {n_shipped} "
            f"shipped, `--list` with the same --variant-file options the {n_file} from files"
            ) in err, err


@pytest.mark.timeout(120)
def test_a_missed_variant_that_names_its_own_strategy_says_an_explicit_one_replaced_it(capsys):
    """Found by a fresh user: `--strategy random` on warmup-scratch-free (a rare interleaving,
    searched with PCT by default) printed FAILED with no word that the option had replaced the
    variant's own strategy."""
    argv = ["check", "--variant", "warmup-scratch-free", "--topology", "shared", "--strategy",
            "random", "--schedules", "3", "--no-progress", "--jobs", "1"]
    assert main(argv) == 1
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes[0].endswith("(warmup-scratch-free names pct as its own, which an explicit "
                             "--strategy replaces)"), notes
    from sim.cli import _own_strategy

    assert _own_strategy("local-bucket") == ""  # searched with the default, nothing to add


@pytest.mark.timeout(120)
def test_a_replay_after_its_variant_file_was_edited_says_so(tmp_path, capsys):
    """A fresh variant author replayed a trace after editing the file and read NONDETERMINISM
    with no word on the edit: the trace now records the file's hash (`variant_file`)."""
    import sim.variants as variants
    from sim.variants import REGISTRY

    path = tmp_path / "edited_variant.py"
    source = ("from protocol.worker import Worker\n"
              "from sim.variants import Variant\n"
              "class SkipWorker(Worker):\n"
              "    def forward_ops(self, step):\n"
              "        if self.rank == 1 and step.key is not None and step.key.bucket == 1:\n"
              "            return []\n"
              "        return super().forward_ops(step)\n"
              "V = Variant(name='test-edited-file', summary='s', source='x',\n"
              "            expected={'shared': 'divergence', 'per-rank': 'divergence'},\n"
              "            worker_cls=SkipWorker)\n")
    path.write_text(source)
    out = tmp_path / "traces"
    try:
        assert main(["check", "--variant-file", str(path), "--variant", "test-edited-file",
                     "--topology", "shared", "--no-progress", "--jobs", "1",
                     "--trace-out", str(out)]) == 0
        trace = out / "test-edited-file.shared.json"
        recorded = json.loads(trace.read_text())["variant_file"]
        assert re.fullmatch("[0-9a-f]{12}", recorded)
        capsys.readouterr()
        assert main(["check", "--replay", str(trace)]) == 0  # this process has the file loaded
        assert "exactly" in capsys.readouterr().out
        variants._LOADED_FILES.pop(str(path.resolve()), None)
        REGISTRY.pop("test-edited-file", None)
        # a fresh reader's finding: the refusal said "--variant-file PATH", not which file
        assert main(["check", "--replay", str(trace)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith("a trace of a variant from a file replays with that file: --replay "
                            f"TRACE --variant-file \"{path.resolve()}\" (the path the trace "
                            "records)"), err
        path.write_text(source.replace("bucket == 1", "bucket == 2"))
        assert main(["check", "--replay", str(trace), "--variant-file", str(path)]) == 1
        text = capsys.readouterr().out
        assert "NONDETERMINISM: replay departed" in text
        assert f"the variant file was edited since the recording (variant_file {recorded}, now " in text
    finally:
        REGISTRY.pop("test-edited-file", None)
        variants._ORIGIN.pop("test-edited-file", None)
        variants._LOADED_FILES.pop(str(path.resolve()), None)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("event", sorted(EVENT_NEEDS))
def test_what_a_vacuous_hint_says_an_event_needs_makes_the_correct_protocol_reach_it(event):
    """Each ``adjust`` a vacuous row's hint names (`sim.common.EVENT_NEEDS`) is one under which
    the correct protocol records that event, clean: the hint is advice that works."""
    import dataclasses

    import sim.scenario
    import sim.variants_chunked
    import sim.variants_comms
    import sim.variants_overlap
    import sim.variants_paging
    from sim.check import CheckSpec, check_variant
    from sim.variants import CORRECT

    adjust = eval(EVENT_NEEDS[event][1], {"sim": sim})
    wants = dataclasses.replace(CORRECT, name=f"wants-{event.replace('_', '-')}",
                                adjust=adjust, reaches=(event,))
    row = check_variant(wants, CheckSpec(clean_schedules=35, fault_schedules=0, jobs=1),
                        "shared")[0]
    assert row.got == "clean", (row.got, row.detail)


@pytest.mark.parametrize("suffix", [".txt", ".mmd"])
def test_replaying_the_story_of_a_trace_names_its_json(fused_trace, capsys, suffix):
    """A fresh user's finding: `--replay traces/x.shared.txt` said only "is not JSON"."""
    story = fused_trace.with_suffix(suffix)
    assert story.is_file()
    assert main(["check", "--replay", str(story)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep check: error: trace file {str(story)!r} is not JSON: "), err
    assert err.endswith(f"; the trace to replay is the JSON beside it, {str(fused_trace)!r} "
                        "(--trace-out writes .json, .txt and .mmd)"), err
    assert len(err.splitlines()) == 1
