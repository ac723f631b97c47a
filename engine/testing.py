"""Test utilities shipped with the engine (as trio ships its own): random paged-attention
inputs and HF transformers reference helpers, shared by the CPU tests, GPU tests and benchmarks."""

from __future__ import annotations


def make_case(lengths, q_heads=4, kv_heads=2, head_dim=16, page_size=16, dtype=None,
              device="cpu", seed=0):
    """A KV cache whose slots hold `lengths` tokens on shuffled pages, plus one padding row.

    Returns (q, k_cache, v_cache, page_table, seq_lens, slot_ids): the batch rows are the slots
    in reverse order followed by one row on the padding slot (length 1, padding page).
    """
    import torch

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    slots = len(lengths)
    max_pages = max(-(-n // page_size) for n in lengths)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    pad_page, pad_slot = num_pages, slots
    k = torch.randn(num_pages + 1, page_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_pages + 1, page_size, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.full((slots + 1, max_pages), pad_page, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).tolist()
    for s, n in enumerate(lengths):
        for i in range(-(-n // page_size)):
            table[s, i] = perm.pop()
    lens = torch.tensor(list(lengths) + [1], dtype=torch.int32)
    slot_ids = torch.tensor(list(reversed(range(slots))) + [pad_slot], dtype=torch.int32)
    q = torch.randn(len(slot_ids), q_heads, head_dim, generator=g).to(dtype)
    return tuple(t.to(device) for t in (q, k, v, table, lens, slot_ids))


def hf_greedy(model, prompt, n):
    """HF greedy continuation of `prompt` by exactly `n` tokens (no EOS stop)."""
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, tokens):
    """HF float32 logits [len(tokens), vocab] of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def hf_cuda_logits(model_dir, dtype: str, attn: str, tokens) -> "torch.Tensor":
    """float32 logits [len(tokens), vocab] on the CPU of one sequence through HF transformers
    loaded from `model_dir` onto the GPU in `dtype` ("bfloat16", "float32") with
    `attn_implementation` `attn` ("eager", "sdpa"); the model is freed before returning (the
    eager-vs-sdpa difference is the GPU tests' noise floor). `tokens` may also be a list of
    B sequences of one length: then [B, length, vocab], one forward without padding."""
    import torch
    from transformers import AutoModelForCausalLM

    batch = bool(tokens) and isinstance(tokens[0], (list, tuple))
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype),
                                             attn_implementation=attn).cuda().eval()
    with torch.no_grad():
        logits = m(torch.tensor(tokens if batch else [tokens], device="cuda")).logits
        out = (logits if batch else logits[0]).float().cpu()
    del m
    torch.cuda.empty_cache()
    return out


def run_in_triton_interpreter(script: str, timeout_s: float = 540):
    """Run ``script`` (Python source) in a fresh interpreter with TRITON_INTERPRET=1 from the
    repository root; the variable must be set before triton is imported, hence the subprocess.

    Returns the `subprocess.CompletedProcess` (text stdout/stderr).
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
