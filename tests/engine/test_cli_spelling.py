"""Integer and number options of `lockstep generate` and `lockstep bench` are spelt as those of
`lockstep check` (`lockstep.args`): ASCII digits, no underscores, at most 20 digits; anything
else is one short line naming the option and the value, before any model is read or GPU
touched. Old behaviour (a fresh user's finding): `--max-tokens 1_0` generated 10 tokens,
`--max-tokens ٢` two, and a value of 5,000 digits was echoed whole."""

from __future__ import annotations

import math

import pytest

from lockstep.cli import build_parser, main

ODD_INTEGERS = [("1_0", "'1_0' is not an integer"),
                ("\u0662", "'\u0662' is not an integer"),  # ARABIC-INDIC DIGIT TWO
                ("9" * 5000, "99999999999999999999999999999... has more than 20 digits, above any "
                 "value this option takes")]
ODD_NUMBERS = [("0_5", "'0_5' is not a number"), ("\u0661", "'\u0661' is not a number"),
               ("1.5x", "'1.5x' is not a number")]


def _refused_by_argparse(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and len(err) < 200, err
    return err


# each flag as argparse names it in an error; the command line gives its first spelling
INTEGER_FLAGS = ["--tensor-parallel-size/-tp", "--max-tokens", "--top-k", "--max-model-len",
                 "--max-batch"]
NUMBER_FLAGS = ["--temperature", "--top-p", "--gpu-memory-utilization", "--startup-timeout",
                "--step-timeout"]


@pytest.mark.parametrize("flag, value, words", [
    *((f, v, w) for f in INTEGER_FLAGS for v, w in ODD_INTEGERS),
    *((f, v, w) for f in NUMBER_FLAGS for v, w in ODD_NUMBERS)])
def test_generate_numeric_options_take_ascii_digits_only(flag, value, words, capsys,
                                                         nothing_loads):
    err = _refused_by_argparse(["generate", "--model", "m", "--prompt-ids", "1",
                                flag.split("/")[0], value], capsys)
    assert err == f"lockstep generate: error: argument {flag}: {words}", err


def test_nan_still_reaches_the_range_check_that_names_it(capsys, nothing_loads):
    assert main(["generate", "--model", "m", "--prompt-ids", "1", "--top-p", "NaN"]) == 2
    assert capsys.readouterr().err.strip() == ("lockstep generate: error: --top-p NaN must be "
                                               "a number in (0, 1]")


def test_ordinary_spellings_are_still_taken():
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt-ids", "1", "--max-tokens", "+007",
         "--top-k", "-1", "--temperature", ".5", "--top-p", "1e-1", "--step-timeout", " 5. ",
         "--startup-timeout", "inf", "-tp", "2"])
    assert (args.max_tokens, args.top_k, args.tensor_parallel_size) == (7, -1, 2)
    assert (args.temperature, args.top_p, args.step_timeout) == (0.5, 0.1, 5.0)
    assert math.isinf(args.startup_timeout)  # its range check names it


def test_a_prompt_id_of_thousands_of_digits_is_one_short_line(capsys, nothing_loads):
    """Old behaviour: "invalid _ids value: '1,999...'" with every digit repeated."""
    err = _refused_by_argparse(["generate", "--model", "m", "--prompt-ids", "1," + "9" * 5000],
                               capsys)
    assert err == ("lockstep generate: error: argument --prompt-ids: "
                   "'1,999999999999999999999999999...': item 2 has more than 20 digits, above "
                   "any token id")


@pytest.mark.parametrize("argv", [["--tensor-parallel-size"], ["--steps"], ["--warmup"],
                                  ["--workload", "throughput", "--num-requests"],
                                  ["--workload", "throughput", "--max-batch"],
                                  ["--workload", "throughput", "--max-model-len"],
                                  ["--workload", "throughput", "--max-prefill-tokens"]])
@pytest.mark.parametrize("value, words", ODD_INTEGERS)
def test_bench_integer_options_take_ascii_digits_only(argv, value, words, capsys,
                                                      nothing_loads):
    err = _refused_by_argparse(["bench", "--preset", "tiny", *argv, value], capsys)
    assert err.startswith(f"lockstep bench: error: argument {argv[-1]}") and words in err, err


@pytest.mark.parametrize("flag", ["--temperature", "--top-p"])
@pytest.mark.parametrize("value, words", ODD_NUMBERS)
def test_bench_number_options_take_ascii_decimals_only(flag, value, words, capsys,
                                                       nothing_loads):
    err = _refused_by_argparse(["bench", "--preset", "tiny", "--workload", "throughput", flag,
                                value], capsys)
    assert err == f"lockstep bench: error: argument {flag}: {words}", err


@pytest.mark.parametrize("argv", [["--batch-sizes"], ["--context-lens"],
                                  ["--compare", "hf", "--hf-batch-sizes"]])
@pytest.mark.parametrize("value, words", ODD_INTEGERS)
def test_bench_integer_lists_take_ascii_digits_only(argv, value, words, capsys, nothing_loads):
    assert main(["bench", "--preset", "tiny", *argv, "1," + value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep bench: error: {argv[-1]} '1,") and words in err, err
    assert len(err.splitlines()) == 1 and len(err) < 200, err


@pytest.mark.parametrize("flag, value, rule", [
    ("--top-p", "1e308", "must be a number in (0, 1]"),
    ("--top-p", " 1.50 ", "must be a number in (0, 1]"),
    ("--temperature", "-nan", "must be a finite number >= 0 (0 = greedy)"),
    ("--temperature", "-1E3", "must be a finite number >= 0 (0 = greedy)"),
    ("--step-timeout", "1e400", "must be positive, finite seconds below 1e9"),
    ("--startup-timeout", "-0.0", "must be positive, finite seconds below 1e9"),
    ("--gpu-memory-utilization", "1e308", "must be a fraction in (0, 1]"),
    ("--max-tokens", "+0", "must be an integer >= 1"),
    ("--max-batch", "0300", "must be an integer from 1 to 256"),
])
def test_generate_names_a_value_as_it_was_typed(flag, value, rule, capsys, nothing_loads):
    """Old behaviour: the value read back, "--top-p 1e+308", "--step-timeout inf",
    "--temperature nan", "--max-batch 300"."""
    assert main(["generate", "--model", "m", "--prompt-ids", "1", flag, value]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lockstep generate: error: {flag} {value.strip()} {rule}")


def test_a_flag_greedy_decoding_ignores_is_named_as_typed():
    from engine.cli_generate import _ignored_when_greedy

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1",
                                      "--top-p", ".50", "--seed", "007"])
    assert _ignored_when_greedy(args).startswith("--top-p .50 has no effect")
    args.top_p = 1.0
    assert _ignored_when_greedy(args).startswith("--seed 007 has no effect")


@pytest.mark.parametrize("argv, words", [
    (["--workload", "throughput", "--top-p", "1e308"], "--top-p 1e308: expected a number in"),
    (["--workload", "throughput", "--temperature", "1e400"], "--temperature 1e400: expected a "
                                                             "finite number > 0"),
    (["--workload", "throughput", "-n", "000"], "--num-requests 000: expected 1..65536"),
    (["--temperature", "1e308"], "--temperature 1e308 applies to --workload throughput only"),
    (["--steps", "+0"], "--steps +0: expected 1..100000"),
])
def test_bench_names_a_value_as_it_was_typed(argv, words, capsys, nothing_loads):
    assert main(["bench", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep bench: error: {words}") and len(err.splitlines()) == 1, err


def test_sampler_passes_names_its_scale_as_typed(capsys):
    from engine.bench.sampler_passes import main as sampler_main

    assert sampler_main(["--scale", "1e308"]) == 2
    assert capsys.readouterr().err.startswith("sampler_passes: error: --scale 1e308: expected")


def test_a_value_remembers_its_text_but_travels_as_a_plain_number():
    import copy
    import pickle

    from engine.cli_args import integer, number, seed, shown

    values = (integer(" +007 "), number("1e308"), seed("0009"))
    assert [shown(v) for v in values] == ["+007", "1e308", "0009"]
    assert values == (7, 1e308, 9) and shown(300.0) == "300" and shown(None) == "None"
    assert shown(number("1." + "0" * 40)) == "1." + "0" * 27 + "..."  # clipped
    for v in values:
        assert type(pickle.loads(pickle.dumps(v))) in (int, float)
        assert type(copy.deepcopy(v)) in (int, float)
