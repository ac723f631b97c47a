"""The environment switches (`engine.env`): on when unset or "1", off at "0", and any other
value refused with one line naming the variable and its value, by `EngineConfig.create` and
`LLM(...)` before any rank starts, not taken as on."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from engine.engine_config import EngineConfig, short_decode_default
from engine.env import SWITCHES, check_switches, switch
from engine.errors import ParallelConfigError

BAD = ["false", "off", "no", "true", "on", " 0", "0 ", "00", ""]


@pytest.fixture(autouse=True)
def _unset(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_unset_and_1_are_on_0_is_off(name, monkeypatch):
    assert switch(name) is True
    monkeypatch.setenv(name, "1")
    assert switch(name) is True
    monkeypatch.setenv(name, "0")
    assert switch(name) is False


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_any_other_value_is_named_in_one_line(name, value, monkeypatch):
    """Old behaviour: only "0" turned a feature off; "false", "off" or " 0" left it on."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ParallelConfigError) as info:
        switch(name)
    message = str(info.value)
    assert f"{name} = {value!r} in the environment" in message and "\n" not in message
    with pytest.raises(ParallelConfigError, match=name):
        check_switches()


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_create_and_llm_refuse_a_bad_switch_before_any_rank_starts(tiny_dir, name,
                                                                   monkeypatch):
    """On the CPU too, where none of the three is read later: the value is wrong wherever it
    is set (LOCKSTEP_PDL is otherwise read only at a CUDA kernel's launch)."""
    from engine.llm import LLM

    monkeypatch.setenv(name, "off")
    with pytest.raises(ParallelConfigError, match=f"{name} = 'off' in the environment"):
        EngineConfig.create(tiny_dir)
    with pytest.raises(ParallelConfigError, match=f"{name} = 'off' in the environment"):
        LLM(tiny_dir, tensor_parallel_size=2)
    assert multiprocessing.active_children() == []
    monkeypatch.setenv(name, "0")
    EngineConfig.create(tiny_dir)


def test_the_readers_use_the_one_parser(monkeypatch):
    from engine.kernels import pdl

    monkeypatch.setenv("LOCKSTEP_SHORT_DECODE", "false")
    with pytest.raises(ParallelConfigError, match="LOCKSTEP_SHORT_DECODE = 'false'"):
        short_decode_default("cuda", True, 1)
    monkeypatch.setenv("LOCKSTEP_SHORT_DECODE", "0")
    assert short_decode_default("cuda", True, 1) is False
    monkeypatch.delenv("LOCKSTEP_SHORT_DECODE")
    monkeypatch.setenv("LOCKSTEP_FUSED_NORM", "no")
    with pytest.raises(ParallelConfigError, match="LOCKSTEP_FUSED_NORM = 'no'"):
        short_decode_default("cuda", True, 1)
    monkeypatch.setenv("LOCKSTEP_PDL", "off")
    with pytest.raises(ParallelConfigError, match="LOCKSTEP_PDL = 'off'"):
        pdl.use_pdl(torch.zeros(1))


def _bench(argv):
    from lockstep.cli import main

    return main(["bench", *argv])


def _tool(module):
    import importlib

    return importlib.import_module(f"engine.bench.{module}").main


@pytest.mark.parametrize("run, argv, prefix", [
    pytest.param(_bench, ["--preset", "tiny"], "lockstep bench: error: ", id="bench"),
    pytest.param(_bench, ["--preset", "tiny", "--workload", "throughput"],
                 "lockstep bench: error: ", id="bench-throughput"),
    pytest.param(_tool("step_tune"), ["--preset", "qwen3-0.6b", "--rows", "1"],
                 "step_tune: error: ", id="step_tune"),
    pytest.param(_tool("profile"), ["--preset", "tiny"], "profile: error: ", id="profile"),
    pytest.param(_tool("gemm_sweep"), ["--presets", "qwen3-0.6b", "--tp", "1"],
                 "gemm_sweep: error: ", id="gemm_sweep"),
])
def test_the_bench_tools_refuse_a_bad_switch_before_any_gpu_work(run, argv, prefix, capsys,
                                                                 monkeypatch):
    """Old behaviour: LOCKSTEP_PDL=off ran the benchmark with PDL on."""
    def boom(*a, **k):
        raise AssertionError("touched CUDA before the argument checks")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setenv("LOCKSTEP_PDL", "off")
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(prefix), err
    assert "LOCKSTEP_PDL = 'off' in the environment" in err


def test_no_other_module_reads_a_switch_itself():
    """Every reader goes through `engine.env.switch`, so all take the same values."""
    import re
    from pathlib import Path

    import engine

    pattern = re.compile(r"environ(\.get\(|\[)\s*['\"](" + "|".join(SWITCHES) + ")")
    root = Path(engine.__file__).parent
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if p.name != "env.py" and pattern.search(p.read_text())]
    assert readers == []
