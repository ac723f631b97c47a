"""`--help` of the engine subcommands and of `python -m engine.bench.profile` and `step_tune`:
every option says what it does and, unless it is a switch or required, its default (issue 13,
item 14)."""

from __future__ import annotations

import argparse

import pytest

from lockstep.cli import build_parser


def _subparser(name):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("name", ["generate", "bench", "make-model"])
def test_every_option_has_help_and_shows_its_default(name):
    _check_every_option(_subparser(name), name)


def test_profile_has_a_description_and_every_option_help_and_its_default(capsys):
    """Old behaviour: `python -m engine.bench.profile --help` listed --preset, --batch,
    --context and --steps with no word on what they do or their defaults."""
    from engine.bench import profile

    assert "random weights of a preset" in _bench_tool_help(profile, capsys)


def test_step_tune_help_shows_every_default(capsys):
    """Old behaviour: `python -m engine.bench.step_tune --help` gave --top, --steps, --warmup,
    --context and --seed with no default, and its parser was built inside `main`."""
    from engine.bench import step_tune

    # argparse wraps the help text
    out = " ".join(_bench_tool_help(step_tune, capsys).split())
    for text in ("(1..32; default 4)", "(1..10000; default 100)", "(0..1000; default 10)",
                 "tokens cached per row (default 128)", "K/V and tokens (default 0)"):
        assert text in out, text


def test_sampler_passes_has_help_and_a_default_for_every_option(capsys):
    """Old behaviour: its eight options had no help at all."""
    from engine.bench import sampler_passes

    assert "--rows" in _bench_tool_help(sampler_passes, capsys)


def test_gemm_sweep_help_shows_the_defaults_of_what_it_times(capsys):
    """Old behaviour: --presets, --tp, --rows and --repeats gave no default."""
    from engine.bench import gemm_sweep

    with pytest.raises(SystemExit) as exit_:
        gemm_sweep.main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for text in ("(default qwen3-0.6b,qwen3-4b,qwen3-8b)", "shapes to time (default 1,2)",
                 "(1..64; default 1,8,16,32,64)", "(1..1000; default 20)"):
        assert text in out, text


def _bench_tool_help(module, capsys) -> str:
    """`module`'s parser checked (a description, its `python -m` prog, help and a default for
    every option), then its `main(["--help"])`: exit status 0; returns what it printed."""
    name = module.__name__.rsplit(".", 1)[-1]
    p = module.build_parser()
    assert p.description and p.prog == f"python -m {module.__name__}"
    _check_every_option(p, name)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert out.err == "", out.err
    return out.out


def _check_every_option(p, name):
    required_groups = {id(a) for g in p._mutually_exclusive_groups if g.required
                       for a in g._group_actions}
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help, f"{name} {flag} has no help"
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if switch or action.required or id(action) in required_groups:
            continue
        assert "default" in action.help, f"{name} {flag}: help does not show the default"


def test_help_renders(capsys):
    for name in ("generate", "bench", "make-model"):
        with pytest.raises(SystemExit):
            _subparser(name).parse_args(["--help"])
        assert "default" in capsys.readouterr().out


def test_attention_sweep_help_prints_its_usage_and_exits_0(capsys):
    """Old behaviour: `python -m engine.bench.attention_sweep --help` was refused ("error:
    unexpected arguments ['--help']", status 2); it hand-parsed its argv."""
    from engine.bench import attention_sweep

    out = _bench_tool_help(attention_sweep, capsys)
    assert out.startswith("usage: python -m engine.bench.attention_sweep [-h] [--context] "
                          "[OUT.json]"), out


@pytest.mark.parametrize("subcommand", ["bench", "generate", "make-model"])
def test_every_engine_subcommand_s_help_says_a_repeated_option_keeps_its_last_value(
        subcommand, capsys):
    """bench behaves so (`-n 0 -n 5` runs 5) but its help said nothing, unlike the other two (a
    fresh user's finding); `lockstep check` refuses a repeat instead and says so."""
    from lockstep.cli import main

    with pytest.raises(SystemExit):
        main([subcommand, "--help"])
    assert "A repeated option keeps its last value." in capsys.readouterr().out


@pytest.mark.parametrize("argv, required, optional", [
    (["make-model", "--help"], ["--preset {", "--out OUT"], ["[--seed SEED]"]),
    (["generate", "--help"], ["--model MODEL"], ["[--device {cpu,cuda}]"]),
    (["bench", "--help"], ["(--preset {"], ["[--batch-sizes BATCH_SIZES]"]),
])
def test_help_shows_required_options_as_required(argv, required, optional, capsys):
    """A fresh user's finding: `make-model --help` printed `[--preset ...] [--out OUT]`, as if
    optional, since the parse that looks for stray arguments first (`OneLineParser.
    parse_known_args`) had made every required option optional while it ran."""
    from lockstep.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    for text in required:
        assert text in usage and f"[{text}" not in usage, usage
    for text in optional:
        assert text in usage, usage
