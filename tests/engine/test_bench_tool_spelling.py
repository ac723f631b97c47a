"""The `python -m engine.bench.*` tools spell integers and numbers as every lockstep command
does (`lockstep.args`: ASCII digits, no underscores): int() and float() took '1_0' as 10 and
'\u0662' as 2 (a helper's finding after the engine commands were fixed)."""

import importlib

import pytest

INTEGER_OPTIONS = [
    ("gemm_sweep", "--repeats"),
    ("host_overhead", "--steps"), ("host_overhead", "--repeats"), ("host_overhead", "--threads"),
    ("profile", "--batch"), ("profile", "--context"), ("profile", "--steps"), ("profile", "--rows"),
    ("sampler_passes", "--rows"), ("sampler_passes", "--vocab"), ("sampler_passes", "--top-k"),
    ("step_tune", "--top"), ("step_tune", "--steps"), ("step_tune", "--warmup"),
    ("step_tune", "--context"),
    ("tma_probe", "--repeats"),
]
NUMBER_OPTIONS = [("sampler_passes", o) for o in ("--temperature", "--top-p", "--min-p", "--scale")]


def _refusal(tool: str, argv: list[str], capsys) -> str:
    main = importlib.import_module(f"engine.bench.{tool}").main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("tool, option", INTEGER_OPTIONS)
@pytest.mark.parametrize("text", ["1_0", "\u0662"])
def test_integer_options_refuse_underscores_and_other_scripts_digits(tool, option, text, capsys):
    err = _refusal(tool, [option, text], capsys)
    assert option in err and f"{text!r} is not an integer" in err


@pytest.mark.parametrize("tool, option", INTEGER_OPTIONS)
def test_integer_options_name_a_value_of_too_many_digits_without_repeating_it(tool, option,
                                                                              capsys):
    err = _refusal(tool, [option, "9" * 5000], capsys)
    assert "more than 20 digits" in err and len(err) < 300


@pytest.mark.parametrize("tool, option", NUMBER_OPTIONS)
def test_number_options_refuse_underscores(tool, option, capsys):
    err = _refusal(tool, [option, "0_5"], capsys)
    assert option in err and "'0_5' is not a number" in err
