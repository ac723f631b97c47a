"""HF transformers reference: StaticCache + torch.compile(mode="reduce-overhead") decode step.

The same model directory (same weights) is loaded with `AutoModelForCausalLM` in the bench
dtype on cuda:0; a StaticCache holds `context` tokens per row (one eager prefill of random
tokens), and the compiled forward decodes one token per row at position `context - 1`,
overwriting that cache row each step, so every step attends to the same `context` tokens as
the engine's. Compile time is the wall clock of the first three calls (Inductor compile and
the CUDA-graph recording of reduce-overhead mode).
"""

from __future__ import annotations

import time

from engine.bench.decode import summarize
from engine.seeds import derived_seed


def measure_hf(model_dir: str, batch_sizes: list[int], context: int, dtype: str, steps: int,
               warmup: int, seed: int = 0) -> list[dict]:
    """Decode-step times of HF compiled at each batch size; returns one dict per batch:
    {'batch', 'context', 'compile_s', 'median_ms', 'p90_ms', 'min_ms', 'n'}."""
    import torch
    from transformers import AutoModelForCausalLM, StaticCache

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    tdtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).to(dev).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator(device=dev).manual_seed(derived_seed(seed, 2))
    results = []
    for batch in batch_sizes:
        torch._dynamo.reset()
        # A cache only 16 slots past the context trips an Inductor bounds assert in the compiled
        # decode step (transformers 5.17, torch 2.11, measured on the H200); 400 spare slots ran.
        cache = StaticCache(config=model.config, max_cache_len=context + 400)
        with torch.no_grad():
            prompt = torch.randint(0, vocab, (batch, context - 1), device=dev, generator=gen)
            if context > 1:
                model(input_ids=prompt, past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(context - 1, device=dev))
            else:  # nothing cached yet: a one-token prefill sizes the cache
                model(input_ids=prompt[:, :0].new_zeros(batch, 1), past_key_values=cache,
                      use_cache=True, cache_position=torch.zeros(1, dtype=torch.long,
                                                                  device=dev))
        pos = torch.full((1,), context - 1, dtype=torch.long, device=dev)
        position_ids = pos.expand(batch, 1).contiguous()

        def step(ids):
            return model(input_ids=ids, past_key_values=cache, cache_position=pos,
                         position_ids=position_ids, use_cache=True).logits

        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        n = warmup + steps
        ids = torch.randint(0, vocab, (n + 3, batch, 1), device=dev, generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                compiled(ids[n + i])
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            for i in range(n):
                torch.compiler.cudagraph_mark_step_begin()
                starts[i].record()
                logits = compiled(ids[i])
                ends[i].record()
            torch.cuda.synchronize()
        assert torch.isfinite(logits).all(), "HF compiled produced non-finite logits"
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)][warmup:]
        results.append(dict(batch=batch, context=context, compile_s=compile_s,
                            **summarize(times)))
        del compiled, cache
    del model
    torch.cuda.empty_cache()
    return results
