"""`lockstep generate`: output format, exit statuses, TP 2 (spawned) and torchrun (env://)
giving the TP 1 tokens."""

from __future__ import annotations

import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _tp1_tokens(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2,3",
                 "--max-tokens", "5", "--logprobs"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[1].startswith("text: ")  # make-model writes a tokenizer
    del lines[1]
    assert lines[0].startswith("token_ids: ") and len(lines[0][11:].split(",")) == 5
    assert lines[1].startswith("logprobs: ") and lines[2] == "finish_reason: length"
    assert "model loaded" in out.err
    return lines[0]


def test_generate_prints_tokens_and_progress(tiny_dir, capsys):
    _tp1_tokens(tiny_dir, capsys)


@pytest.mark.parametrize("argv, status, fragment", [
    (["-tp", "3"], 2, "num_attention_heads = 4 is not divisible by tensor_parallel_size = 3"),
    (["--max-tokens", "0"], 2, "--max-tokens 0 must be an integer >= 1"),
])
def test_generate_errors_exit_2_with_one_line(tiny_dir, capsys, argv, status, fragment):
    base = ["generate", "--model", str(tiny_dir), "--max-tokens", "3"]
    if "--prompt" not in argv:
        base += ["--prompt-ids", "1,2"]
    assert main(base + argv) == status
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--max-tokens", "0"], "--max-tokens 0 must be"),
    (["--temperature", "-1"], "--temperature -1 must be"),
    (["--temperature", "nan"], "--temperature nan must be"),
    (["--temperature", "inf"], "--temperature inf must be a finite number >= 0"),
    # named by its flag, not as SamplingParams' "temperature = 1e-06" (it was)
    (["--temperature", "1e-6"], "--temperature 1e-6 must be 0 (greedy) or at least 1e-05"),
    (["--top-p", "2"], "--top-p 2 must be"),
    (["--top-k", "-2"], "--top-k -2 must be"),
    (["--top-k", "100000"], "--top-k 100000 is above the vocabulary size"),
    (["--max-batch", "0"], "--max-batch 0 must be an integer from 1 to 256"),
    (["--max-batch", "300"], "--max-batch 300 must be"),
    (["-tp", "0"], "--tensor-parallel-size 0 must be"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 must be"),
    (["--step-timeout", "0"], "--step-timeout 0 must be"),
    (["--step-timeout", "nan"], "--step-timeout nan must be"),
    (["--prompt-ids", "1,99999"], "prompt token id 99999 outside the vocabulary"),
    (["--prompt-ids", "1,2", "--max-model-len", "99999999"],
     "--max-model-len 99999999 exceeds the model's max_position_embeddings 2048"),
    (["--max-model-len", "0"], "--max-model-len 0 must be at least 1"),
])
def test_bad_requests_are_refused_before_the_model_loads(tiny_dir, capsys, monkeypatch, argv, fragment):
    import engine.llm

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the request was checked")
    monkeypatch.setattr(engine.llm, "LLM", no_load)
    base = ["generate", "--model", str(tiny_dir), "--max-tokens", "3"]
    if "--prompt" not in argv and "--prompt-ids" not in argv:
        base += ["--prompt-ids", "1,2"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("value, fragment", [
    ("-1", "argument --seed: -1 is outside [0, 2**64)"),
    (str(2**64), f"argument --seed: {2**64} is outside [0, 2**64)"),
    # int() of thousands of digits refuses, and the line must not repeat them all (it did:
    # generate's --seed was type=int while bench's and make-model's took the shared type)
    ("9" * 5000, "argument --seed: 99999999999999999999999999999... is outside [0, 2**64)"),
    ("seven", "argument --seed: 'seven' is not an integer"),
])
def test_bad_seed_is_one_short_line_before_the_model_loads(tiny_dir, capsys, monkeypatch, value,
                                                           fragment):
    import engine.llm

    monkeypatch.setattr(engine.llm, "LLM", None)  # refused before any load
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2", "--seed", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1 and len(err) < 200


def test_seed_at_the_top_of_the_range_is_accepted(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2", "--max-tokens", "2",
                 "--temperature", "1", "--seed", str(2**64 - 1)]) == 0
    assert capsys.readouterr().out.strip()


def test_text_prompt_needs_a_tokenizer(no_tokenizer_dir, capsys, monkeypatch):
    import engine.llm

    monkeypatch.setattr(engine.llm, "LLM", None)  # refused before any load
    assert main(["generate", "--model", str(no_tokenizer_dir), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no tokenizer; use --prompt-ids" in err and len(err.splitlines()) == 1


def test_text_prompt_with_the_make_model_tokenizer(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "hello", "--max-tokens",
                 "3", "--ignore-eos"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("token_ids: ") and len(lines[0][11:].split(",")) == 3
    assert lines[1].startswith("text: ")


def test_a_text_prompt_encoded_past_the_vocabulary_is_one_line(mismatched_tokenizer_dir, capsys):
    assert main(["generate", "--model", str(mismatched_tokenizer_dir), "--prompt", "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # progress lines, then the error
    assert lines[-1].startswith("lockstep generate: error: text prompt 'hi' encodes to token "
                                "id 700, outside the model's vocabulary [0, 512)")
    assert not any("Traceback" in line or "error" in line for line in lines[:-1])


def test_bad_prompt_ids_are_an_argparse_error(tiny_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,x"])
    assert info.value.code == 2 and "comma-separated" in capsys.readouterr().err


@pytest.mark.parametrize("ids, words", [("1,,2", "'1,,2': item 2 is empty"),
                                        ("1,2,", "'1,2,': item 3 is empty"),
                                        (",1", "',1': item 1 is empty"),
                                        ("1_0,2", "'1_0,2': '1_0' is not an integer"),
                                        ("+1", "'+1': '+1' is not an integer"),
                                        ("", "'' is empty")])
def test_prompt_ids_with_an_empty_or_odd_item_are_refused_naming_it(tiny_dir, capsys, ids, words):
    """Old behaviour: `1,,2` and `1,2,` were taken as 1,2 (the empty item dropped), `1_0` as 10."""
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(tiny_dir), "--prompt-ids", ids])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"lockstep generate: error: argument --prompt-ids: {words}")


@pytest.mark.timeout(120)
def test_tp2_spawned_and_torchrun_give_the_tp1_tokens(tiny_dir, capsys):
    want = _tp1_tokens(tiny_dir, capsys)
    args = ["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2,3", "--max-tokens", "5",
            "-tp", "2"]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == want
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not installed beside this python")
    import signal

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # --standalone: torchrun's agent binds a free port itself and holds it (a port chosen here
    # and closed could be taken by another test worker before the agent binds it)
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2",
                             "-m", "lockstep", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:  # end torchrun and its workers: they share its new session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.splitlines()[0] == want


@pytest.mark.parametrize("argv, fragment", [
    (["--startup-timeout", "nan"], "--startup-timeout nan must be"),
    (["--startup-timeout", "inf"], "--startup-timeout inf must be"),
    (["--prompt-ids", "1,2,3", "--max-model-len", "3"], "exceeds the max model length 3"),
])
def test_more_bad_generate_inputs_exit_2(tiny_dir, capsys, argv, fragment):
    base = ["generate", "--model", str(tiny_dir), "--max-tokens", "3"]
    if "--prompt-ids" not in argv:
        base += ["--prompt-ids", "1,2"]
    assert main(base + argv) == 2
    assert fragment in capsys.readouterr().err


def test_an_empty_model_is_named_empty_not_read_as_the_current_directory(capsys):
    """Found by a fresh user: `--model ''` said "config.json: missing (is '.' a Hugging Face
    model dir?)"; make-model says "--out is empty"."""
    assert main(["generate", "--model", "", "--prompt-ids", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("lockstep generate: error: --model is empty; "
                                               "name the model directory")


def _rank_pids(parent: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()[1:]
            if line.split()[1] == str(parent) and "lockstep rank" in line]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how, code", [("sigterm", 143), ("sigterm-group", 143),
                                       ("ctrl-c", 130)])
def test_a_signal_stops_tp2_generate_with_one_line_and_no_rank_traceback(tiny_dir, how, code):
    """Old behaviour: SIGTERM killed the parent at once; each rank then printed a
    ConnectionResetError traceback (and Ctrl-C a KeyboardInterrupt one from every rank)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "lockstep", "generate", "--model", str(tiny_dir),
                             "--device", "cpu", "-tp", "2", "--prompt-ids", "1,2,3",
                             "--max-tokens", "2000", "--ignore-eos"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stderr:  # wait until serving
        lines.append(line)
        if "ready in" in line:
            break
    ranks = _rank_pids(proc.pid)
    assert len(ranks) == 2, lines
    time.sleep(1.0)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:  # `timeout` or systemd signal the whole group; the terminal sends Ctrl-C to it
        os.killpg(proc.pid, signal.SIGTERM if how == "sigterm-group" else signal.SIGINT)
    out, rest = proc.communicate(timeout=60)
    assert proc.returncode == code, rest
    assert "Traceback" not in rest and "Process lockstep-rank" not in rest
    assert rest.strip().splitlines()[-1] == ("lockstep generate: interrupted" if how == "ctrl-c"
                                             else "lockstep generate: terminated")
    assert len(rest.strip().splitlines()) == 1, rest

    def alive():
        running = []
        for pid in ranks:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone
                continue
            if state != "Z":
                running.append(pid)
        return running

    deadline = time.monotonic() + 20  # an orphaned rank would still run at the deadline
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive() == []


def test_a_text_prompt_too_long_is_refused_before_the_engine_starts(tiny_dir, capsys,
                                                                    monkeypatch):
    """Old behaviour (found by a fresh user): `--prompt` of 3,000 tokens loaded the model and
    started the ranks, printed `ready`, and only then was refused (--prompt-ids was refused
    up front)."""
    import engine.llm

    def started(*a, **k):
        raise AssertionError("the engine started before the prompt's length was checked")

    monkeypatch.setattr(engine.llm.LLM, "__init__", started)
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "a" * 3000,
                 "--max-tokens", "2", "-tp", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "prompt of 3000 tokens + --max-tokens 2 exceeds the max model length" in err
    assert len(err.splitlines()) == 1


def test_a_one_token_prompt_too_long_is_named_in_the_singular(tiny_dir, capsys):
    """Found by a fresh user: "prompt of 1 tokens"."""
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1",
                 "--max-tokens", "2048"]) == 2
    assert capsys.readouterr().err.strip() == ("lockstep generate: error: prompt of 1 token + "
                                               "--max-tokens 2048 exceeds the max model length "
                                               "2048")


def test_an_empty_prompt_is_refused_before_the_model_config_is_read(tiny_dir, capsys,
                                                                   monkeypatch):
    """A fresh user waited for transformers' config import to hear that --prompt was empty."""
    import engine.config

    def read(*a, **k):
        raise AssertionError("the model's config was read before the prompt was checked")

    monkeypatch.setattr(engine.config, "load_model_config", read)
    assert main(["generate", "--model", str(tiny_dir), "--prompt", ""]) == 2
    assert capsys.readouterr().err.strip() == "lockstep generate: error: --prompt is empty"


def test_a_non_utf8_prompt_is_one_line_before_the_engine_starts(tiny_dir, capsys, monkeypatch):
    """Non-UTF-8 bytes on the command line reach Python as lone surrogates; the tokenizer
    raised a TypeError from deep inside (a fresh user's 19-line traceback)."""
    import engine.llm

    def started(*a, **k):
        raise AssertionError("the engine started before the prompt was checked")

    monkeypatch.setattr(engine.llm.LLM, "__init__", started)
    prompt = b"\xff\xfehello\x80".decode("utf-8", "surrogateescape")
    assert main(["generate", "--model", str(tiny_dir), "--prompt", prompt]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--prompt is not valid UTF-8 text: '\\udcff\\udcfe' at character 0"), err
    assert len(err.splitlines()) == 1


def test_decode_overlap_can_be_switched_off_and_the_log_names_the_scheduling(tiny_dir, capsys):
    overlapped = _tp1_tokens(tiny_dir, capsys)
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2,3",
                 "--max-tokens", "5", "--no-decode-overlap"]) == 0
    locked = capsys.readouterr()
    assert locked.out.splitlines()[0] == overlapped
    assert "scheduling: step-locked" in locked.err
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2,3",
                 "--max-tokens", "5"]) == 0
    assert "scheduling: overlapped" in capsys.readouterr().err


def test_a_config_json_that_is_a_directory_is_named_so_not_missing(tmp_path, capsys):
    """Found by a fresh user: a directory named config.json was reported as missing."""
    (tmp_path / "m" / "config.json").mkdir(parents=True)
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt-ids", "1,2",
                 "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'm' / 'config.json'}: not a regular file (a directory)" in err, err
    assert len(err.strip().splitlines()) == 1 and "missing" not in err, err


def test_generate_and_make_model_keep_the_last_of_a_repeated_option(tiny_dir, tmp_path, capsys):
    """The rule their --help and the README state (as in bench): the last value stands."""
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2",
                 "--max-tokens", "3", "--max-tokens", "0"]) == 2
    assert "--max-tokens 0 must be an integer >= 1" in capsys.readouterr().err
    for out, seeds in (("twice", ["--seed", "5", "--seed", "6"]), ("once", ["--seed", "6"]),
                       ("first", ["--seed", "5"])):
        assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / out),
                     *seeds]) == 0
    shards = sorted(p.name for p in (tmp_path / "once").glob("*.safetensors"))
    assert shards and all((tmp_path / "twice" / s).read_bytes() == (tmp_path / "once" / s)
                          .read_bytes() for s in shards)
    assert any((tmp_path / "first" / s).read_bytes() != (tmp_path / "once" / s).read_bytes()
               for s in shards)  # the seed matters, so the comparison above can fail


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]])
def test_gpu_memory_utilization_on_cpu_is_refused_before_the_model_is_read(device, capsys,
                                                                          monkeypatch):
    """Old behaviour (a fresh user's finding): `--gpu-memory-utilization 0.5` on CPU was
    taken and did nothing (the CPU path sizes its KV cache without it)."""
    import engine.config

    def read(*a, **k):
        raise AssertionError("the model's config was read before the flag was checked")

    monkeypatch.setattr(engine.config, "load_model_config", read)
    assert main(["generate", "--model", "m", "--prompt-ids", "1", *device,
                 "--gpu-memory-utilization", "0.5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lockstep generate: error: --gpu-memory-utilization 0.5 applies to --device cuda only "
        "(--device cpu, the default, sizes its KV cache without it); drop it")


@pytest.mark.parametrize("flag, passed", [([], {}),
                                          (["--gpu-memory-utilization", "0.5"],
                                           {"gpu_memory_utilization": 0.5})])
def test_gpu_memory_utilization_reaches_the_engine_on_cuda_only_when_given(
        tiny_dir, flag, passed, capsys, monkeypatch):
    """With --device cuda the flag is the engine's; left out, the engine's default holds."""
    import engine.errors
    import engine.llm

    seen = {}

    def record(model, **kwargs):
        seen.update(kwargs)
        raise ValueError("recorded")

    import torch

    monkeypatch.setattr(engine.errors, "cuda_missing", lambda: None)  # as if a GPU were there
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(engine.llm, "LLM", record)
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1", "--device", "cuda",
                 "--no-cuda-graph", *flag]) == 2
    assert capsys.readouterr().err.strip() == "lockstep generate: error: recorded"
    assert seen["device"] == "cuda"
    assert {k: v for k, v in seen.items() if k == "gpu_memory_utilization"} == passed


@pytest.mark.parametrize("timeouts, words", [
    (["--step-timeout", "0.01"], "0.01 s (--startup-timeout, defaulting to --step-timeout "
                                 "0.01) while"),
    (["--step-timeout", "0.01", "--startup-timeout", "0.02"], "0.02 s while"),
])
def test_a_load_timeout_says_where_its_limit_came_from(tiny_dir, timeouts, words, capsys,
                                                       monkeypatch):
    """Old behaviour (a fresh user's finding): `-tp 2 --step-timeout 0.01` was refused in
    words naming only --startup-timeout, which the user had not given."""
    import engine.llm
    from engine.errors import LoadTimeoutError

    def slow_ranks(model, **kwargs):
        raise LoadTimeoutError([0, 1], kwargs["startup_timeout_s"] or kwargs["step_timeout_s"])

    monkeypatch.setattr(engine.llm, "LLM", slow_ranks)
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1", "-tp", "2",
                 *timeouts]) == 1
    assert capsys.readouterr().err.strip() == (
        f"lockstep generate: error: startup watchdog expired after {words} the ranks loaded the "
        "model (ranks not ready: 0, 1); a larger --startup-timeout gives them longer")


@pytest.mark.parametrize("argv, words", [
    (["--top-p", "0.5"], "--top-p 0.5 has no effect"),
    (["--top-k", "5", "--temperature", "0"], "--top-k 5 has no effect"),
    (["--seed", str(2**64 - 1)], f"--seed {2**64 - 1} has no effect"),
])
def test_a_sampling_flag_greedy_decoding_would_ignore_is_refused(tiny_dir, argv, words, capsys,
                                                                  monkeypatch):
    """Old behaviour (a fresh user's finding, like --gpu-memory-utilization on CPU): `--top-p
    0.5` without --temperature (default 0, greedy) was taken, and the tokens were greedy."""
    import engine.llm

    monkeypatch.setattr(engine.llm, "LLM", None)  # refused before any load
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2", *argv]) == 2
    flag = argv[0]
    assert capsys.readouterr().err.strip() == (
        f"lockstep generate: error: {words} with --temperature 0 (greedy, the default); give a "
        f"--temperature above 0 to sample, or drop {flag}")


def test_sampling_flags_at_their_off_values_are_taken_with_greedy_decoding(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1,2", "--max-tokens", "2",
                 "--top-k", "-1", "--top-p", "1", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("token_ids: ")


def test_a_torchrun_rank_refuses_a_bad_model_dir_in_one_line(tmp_path, capsys, monkeypatch):
    """Old behaviour: under `torchrun ... lockstep generate --model MISSING -tp 2`, rank 0
    printed one line and rank 1 a 20-line ModelDirError traceback."""
    import engine.llm

    monkeypatch.setattr(engine.llm, "torchrun_world", lambda: (1, 2))
    missing = tmp_path / "missing"
    assert main(["generate", "--model", str(missing), "--prompt-ids", "1", "-tp", "2"]) == 2
    assert capsys.readouterr().err.strip() == (f"lockstep generate: error: rank 1: model "
                                               f"directory {str(missing)!r} does not exist")


def test_more_ranks_than_gpus_is_named_by_its_flag_before_the_engine_starts(tiny_dir, capsys,
                                                                          monkeypatch):
    """Old behaviour: refused in EngineConfig's words, "tensor_parallel_size = 2 needs that
    many GPUs; 1 visible", once the weights had been indexed."""
    import torch

    import engine.errors
    import engine.llm

    monkeypatch.setattr(engine.errors, "cuda_missing", lambda: None)  # one GPU, as it were
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(engine.llm, "LLM", None)  # refused before the engine starts
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1", "--device", "cuda",
                 "-tp", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("lockstep generate: error: --tensor-parallel-size "
                                               "2 with --device cuda needs that many GPUs; 1 "
                                               "visible")


@pytest.mark.parametrize("env, line", [
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK is set, as torchrun sets it, but RANK is not; start the "
                          "ranks with torchrun, or unset LOCAL_RANK"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, "TORCHELASTIC_RUN_ID is set, as torchrun sets "
                                                "it, but WORLD_SIZE is not"),
    ({"LOCAL_RANK": "0", "RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"LOCAL_RANK": "0", "RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside [0, WORLD_SIZE=2)"),
])
def test_a_launcher_variable_left_half_set_is_one_line(tiny_dir, capsys, monkeypatch, env, line):
    """A LOCAL_RANK left in the shell by another launcher (SLURM, accelerate) read as torchrun:
    a KeyError or int() traceback before; now the variable and its value, exit 2."""
    import engine.llm

    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(engine.llm, "LLM", None)  # refused before any load
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lockstep generate: error: {line}") and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match=re.escape(line)):
        engine.llm.torchrun_world()


def test_an_in_process_start_up_failure_is_one_line_as_a_spawned_rank_reports_it(
        tiny_dir, capsys, monkeypatch):
    """TP 1 loads in this process: an allocation that fails there (the RoPE table of a huge
    max_model_len, a KV cache past the device) printed a traceback, where TP 2 printed
    "rank 1 failed: start-up failed: ..."."""
    from engine.executor import RankExecutor

    def cannot_allocate(self):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "32000000000 bytes")

    monkeypatch.setattr(RankExecutor, "load_model", cannot_allocate)
    assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", "1"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == ("lockstep generate: error: rank 0 failed: start-up failed: RuntimeError: "
                         "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                         "32000000000 bytes")
    assert not any("Traceback" in line for line in lines)
