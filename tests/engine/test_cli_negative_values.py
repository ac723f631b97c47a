"""A negative value that argparse does not take for a number ("-inf", "-nan", "-1e9") is the
value of the option before it, as with "=": one line naming the option and the value, from the
option's own check. Old behaviour: argparse read it as an unknown option and said only
"argument --temperature: expected one argument" (`--temperature=-inf` was named)."""

from __future__ import annotations

import math

import pytest

from lockstep.cli import OneLineParser, build_parser, main


def _error(argv, capsys) -> str:
    """The one error line of ``lockstep ARGV`` (exit status 2, by argparse or the command)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and len(err) < 200, err
    assert "expected one argument" not in err, err
    return err


GENERATE = ["generate", "--model", "m", "--prompt-ids", "1"]
THROUGHPUT = ["bench", "--preset", "tiny", "--workload", "throughput"]


@pytest.mark.parametrize("argv, flag", [
    *[(GENERATE, f) for f in ("--temperature", "--top-p", "--gpu-memory-utilization",
                              "--startup-timeout", "--step-timeout", "--max-tokens", "--top-k",
                              "--seed", "-tp")],
    *[(THROUGHPUT, f) for f in ("--temperature", "--top-p", "--num-requests", "-n")],
])
@pytest.mark.parametrize("value", ["-inf", "-nan", "-1e9", "-Infinity", "-1.", "-1_0"])
def test_a_negative_value_is_named_as_with_an_equals_sign(argv, flag, value, capsys,
                                                          nothing_loads):
    spaced = _error([*argv, flag, value], capsys)
    joined = _error([*argv, f"{flag}={value}"], capsys)
    assert spaced == joined, (spaced, joined)
    named = {"-tp": "--tensor-parallel-size", "-n": "--num-requests"}.get(flag, flag)
    assert named in spaced, spaced


def test_temperature_minus_inf_is_refused_by_its_range_check(capsys, nothing_loads):
    assert _error([*GENERATE, "--temperature", "-inf"], capsys) == (
        "lockstep generate: error: --temperature -inf must be a finite number >= 0 (0 = greedy)")


def test_minus_nan_is_a_value_not_bench_option_n(capsys, nothing_loads):
    """`-nan` is also `-n an` (bench's -n/--num-requests, joined to its value) to argparse."""
    err = _error([*THROUGHPUT, "--temperature", "-nan"], capsys)
    assert err.startswith("lockstep bench: error: --temperature ") and "nan" in err, err
    assert "--num-requests" not in err, err


def test_the_bench_tools_take_a_negative_value_too():
    from engine.bench.sampler_passes import build_parser as sampler_parser

    assert sampler_parser().parse_args(["--scale", "-inf"]).scale == -math.inf


def test_an_option_is_still_an_option():
    """What names an option stays one: `-tp` after --temperature, and a parser's own option
    spelt as a negative number (argparse's reading is kept there)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([*GENERATE, "--temperature", "-tp", "2"])
    args = build_parser().parse_args([*GENERATE, "-tp", "2", "--top-k", "-1"])
    assert (args.tensor_parallel_size, args.top_k) == (2, -1)
    parser = OneLineParser(prog="p")
    parser.add_argument("-1", dest="one", action="store_true")
    parser.add_argument("--x")
    assert parser.parse_args(["-1"]).one is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--x", "-1"])
