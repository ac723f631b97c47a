"""Tensor parallelism over NCCL on two GPUs (marker `gpu`; skipped with fewer than 2 GPUs):
spawned ranks and torchrun give HF's logits and the TP 1 tokens; a dying rank is named and
no process survives."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    from engine.model_dir import write_model_dir

    return write_model_dir("tiny-tied", tmp_path_factory.mktemp("tt"), seed=4, dtype="float32")


@pytest.mark.timeout(300)
def test_tp2_nccl_matches_hf_and_tp1(tiny_tied):
    from transformers import AutoModelForCausalLM

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    prompt = list(range(10, 60))
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, return_logits=True)
    with LLM(tiny_tied, tensor_parallel_size=2, device="cuda", max_model_len=128) as llm:
        tp2, = llm.generate([prompt], greedy)
        tp2_batch = llm.generate([prompt[:5], prompt, prompt[:20]],
                                 SamplingParams(max_tokens=9, temperature=0.7, seed=1,
                                                ignore_eos=True))
    with LLM(tiny_tied, tensor_parallel_size=1, device="cuda", max_model_len=128) as llm:
        tp1, = llm.generate([prompt], greedy)
        tp1_batch = llm.generate([prompt[:5], prompt, prompt[:20]],
                                 SamplingParams(max_tokens=9, temperature=0.7, seed=1,
                                                ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_tied), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tp2.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    rel = float((tp2.logits - ref).abs().max() / ref.abs().max())
    print(f"\nTP2 NCCL float32 vs HF: max relative logit error {rel:.3g}")
    assert rel < 1e-4
    assert tp2.token_ids == tp1.token_ids
    assert [o.token_ids for o in tp2_batch] == [o.token_ids for o in tp1_batch]
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(300)
def test_tp2_nccl_dying_rank_is_named(tiny_tied):
    from engine.errors import RankError
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    with pytest.raises(RankError) as info:
        llm = LLM(tiny_tied, tensor_parallel_size=2, device="cuda", max_model_len=64,
                  _fault=(1, 6, "exit"))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert info.value.rank == 1 and "exited with code 17" in str(info.value)
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(300)
def test_torchrun_nccl_gives_the_tp1_tokens(tiny_tied):
    args = ["generate", "--model", str(tiny_tied), "--prompt-ids", "1,2,3", "--max-tokens",
            "6", "--device", "cuda"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    one = subprocess.run([sys.executable, "-m", "lockstep", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=200)
    assert one.returncode == 0, one.stderr[-3000:]
    # --standalone: the agent binds a free port itself and holds it
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2",
                             "-m", "lockstep", *args, "-tp", "2"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert out.splitlines()[0] == one.stdout.splitlines()[0]
