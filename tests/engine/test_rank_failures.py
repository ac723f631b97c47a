"""Which rank failed, and how, when a rank is killed or stopped as from a shell; rank process
titles; one exception type per message; the missing main guard (issue 13, items 4 and 5)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from engine.errors import RankError
from engine.llm import LLM
from engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
LONG = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)


# Command 6 is a decode step: rank 0 is in its all-reduces when rank 1 goes away, and its gloo
# error ("connection closed") races with rank 1's exit being seen.
@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_a_killed_rank_is_named_not_the_survivor(tiny_dir, attempt):
    with pytest.raises(RankError) as info:
        with LLM(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32,
                 _fault=(1, 6, "kill")) as llm:
            llm.generate([[1, 2, 3]], LONG)
    assert info.value.rank == 1, str(info.value)
    assert "killed by signal SIGKILL" in str(info.value)
    assert str(info.value).startswith("rank 1 failed")
    assert multiprocessing.active_children() == []


def test_a_stopped_rank_is_named_after_the_step_timeout(tiny_dir):
    with pytest.raises(RankError) as info:
        with LLM(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32,
                 step_timeout_s=4.0, startup_timeout_s=300, _fault=(1, 6, "stop")) as llm:
            llm.generate([[1, 2, 3]], LONG)
    assert info.value.rank == 1, str(info.value)
    assert "is stopped" in str(info.value)
    assert multiprocessing.active_children() == []


def test_rank_processes_have_titles(tiny_dir):
    with LLM(tiny_dir, tensor_parallel_size=2, max_batch=2, max_model_len=32) as llm:
        titles = []
        for p in llm.ranks.procs:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                titles.append(f.read().replace(b"\0", b" ").decode().strip())
    assert titles == [f"lockstep rank {r}/2 (cpu, {tiny_dir.name})" for r in (0, 1)]


def test_an_op_error_names_its_type_once(tiny_dir, monkeypatch):
    llm = LLM(tiny_dir, max_batch=2, max_model_len=32)

    def boom(*args):
        raise ValueError("boom in prefill")

    monkeypatch.setattr(llm.ranks.executor, "prefill", boom)
    with pytest.raises(RankError) as info:
        llm.generate([[1, 2, 3]], LONG)
    assert "ValueError: boom in prefill" in str(info.value)
    assert "Error: RuntimeError" not in str(info.value) and "RuntimeError: ValueError" not in str(info.value)


def test_generate_passes_step_timeout(tiny_dir, monkeypatch, capsys):
    import engine.llm
    from lockstep.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(model, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(engine.llm, "LLM", fake_llm)
    with pytest.raises(Stop):
        main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2", "--step-timeout", "7"])
    assert seen["step_timeout_s"] == 7.0


def test_script_without_main_guard_gets_one_line(tiny_dir, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from engine.llm import LLM
        llm = LLM({str(tiny_dir)!r}, tensor_parallel_size=2, max_model_len=32)
        print(llm.generate([[1, 2, 3]])[0].token_ids)
        llm.shutdown()
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=150, cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert 'put the code that builds the LLM under `if __name__ == "__main__":`' in last
    assert "unguarded.py" in last
    assert "bootstrapping phase" not in proc.stderr
    assert proc.stderr.count("Traceback") == 1  # the script's own uncaught error only


@pytest.mark.timeout(60)
def test_reap_kills_a_process_that_outlives_its_join_and_skips_one_never_started():
    """`engine.ranks.reap`, shared by `SpawnedRanks.close` and the bench's spawned ranks:
    a process that exits is joined, one that hangs is killed and joined, and one that never
    started is left alone (joining it would raise)."""
    import signal
    import time

    from engine.ranks import reap

    ctx = multiprocessing.get_context("fork")
    done = ctx.Process(target=time.sleep, args=(0,))
    hung = ctx.Process(target=time.sleep, args=(600,))
    never = ctx.Process(target=time.sleep, args=(0,))
    done.start()
    hung.start()
    reap([done, never, hung], timeout_s=0.5)
    assert done.exitcode == 0
    assert hung.exitcode == -signal.SIGKILL
    assert never.pid is None and never.exitcode is None


def _report_sigint(queue) -> None:
    import signal

    queue.put(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


@pytest.mark.timeout(120)
def test_a_rank_starts_with_sigint_ignored_and_the_parent_keeps_its_handler():
    """A fresh user's Ctrl-C at TP 2 (sent to the whole process group) caught a rank still
    importing, before `rank_main` ignores SIGINT: a KeyboardInterrupt traceback. The ranks now
    start with it ignored; the parent's own handler is back once they have started."""
    import signal

    from engine.ranks import reap, sigint_ignored_by_children

    ctx = multiprocessing.get_context("spawn")
    before = signal.getsignal(signal.SIGINT)
    seen = []
    for ignored in (True, False):
        queue = ctx.Queue()
        p = ctx.Process(target=_report_sigint, args=(queue,), daemon=True)
        if ignored:
            with sigint_ignored_by_children():
                p.start()
        else:
            p.start()
        seen.append(queue.get(timeout=60))
        reap([p], 30)
    assert seen == [True, False]  # without it a spawned child takes Ctrl-C as Python's default
    assert signal.getsignal(signal.SIGINT) is before
