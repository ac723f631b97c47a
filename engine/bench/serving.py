"""End-to-end serving throughput: workload W through `LLM.generate`, and the same prompts
through HF transformers continuous batching, in one run.

Workload W (the shape of nano-vllm's own benchmark): N requests; prompt lengths and output
lengths each uniform in [100, 1024]; prompt tokens uniform in [0, 10000); seed 0; ignore_eos,
so every request produces exactly its output length. Reported per system: output tok/s,
total (prompt + output) tok/s, time to first token (TTFT) p50/p99, time per output token
(TPOT) p50/p99, and for the engine a per-phase breakdown of the wall time (prefill, decode and
sampling device time from CUDA events, the rest host) and the host overhead per decode-only
step (step wall minus its device time) at batch 1 and at the largest batch.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass

from engine.seeds import derived_seed


W_VOCAB = 10000
"""Workload W draws prompt tokens uniform in [0, W_VOCAB) (or the model's vocabulary, if smaller)."""


@dataclass(frozen=True)
class Workload:
    """N requests of workload W. prompts: token-id lists; max_tokens: output length each."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def make(cls, n: int, seed: int = 0, lo: int = 100, hi: int = 1024,
             vocab: int = W_VOCAB) -> "Workload":
        """Prompt and output lengths uniform in [lo, hi], tokens uniform in [0, vocab)."""
        rng = random.Random(seed)
        prompts, outs = [], []
        for _ in range(n):
            prompts.append([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))])
            outs.append(rng.randint(lo, hi))
        return cls(prompts, outs)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(map(len, self.prompts))


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for an empty list."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def summarize(name: str, wall_s: float, prompt_tokens: int, output_tokens: int,
              ttft_s: list[float], tpot_s: list[float]) -> dict:
    """One result row: tok/s, TTFT and TPOT percentiles in ms."""
    return {"system": name, "wall_s": wall_s, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "output_tok_s": output_tokens / wall_s,
            "total_tok_s": (prompt_tokens + output_tokens) / wall_s,
            "ttft_p50_ms": 1e3 * percentile(ttft_s, 50), "ttft_p99_ms": 1e3 * percentile(ttft_s, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot_s, 50), "tpot_p99_ms": 1e3 * percentile(tpot_s, 99)}


def _say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def run_engine(llm, work: Workload, name: str, temperature: float, top_p: float,
               seed: int = 0) -> dict:
    """Run `work` through `llm.generate` once; returns the summary row plus `phases`."""
    from engine.executor import PhaseTimer
    from engine.sampling import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=temperature, top_p=top_p,
                             seed=derived_seed(seed, i), ignore_eos=True)
              for i, m in enumerate(work.max_tokens)]
    executor = getattr(llm.ranks, "executor", None)
    timer = PhaseTimer() if executor is not None and executor.device.type == "cuda" else None
    if executor is not None:
        executor.phases = timer
    llm.step_log = []
    t0 = time.perf_counter()
    outs = llm.generate(work.prompts, params)
    wall = time.perf_counter() - t0
    if executor is not None:
        executor.phases = None
    bad = [o.error for o in outs if o.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} requests rejected, first: {bad[0]}")
    ttft = [o.first_token_time - o.arrival_time for o in outs]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    row = summarize(name, wall, work.prompt_tokens, sum(len(o.token_ids) for o in outs),
                    ttft, tpot)
    row["phases"] = phase_breakdown(llm.step_log, timer.steps if timer else [], wall)
    llm.step_log = None
    return row


def phase_breakdown(step_log: list, device_steps: list[dict], wall_s: float) -> dict:
    """Seconds of `wall_s` in prefill, decode and sampling device time and in the host (the
    rest), the step counts by kind, and the median host overhead per decode-only step by
    batch rows (step wall minus its device time, ms)."""
    out = {"wall_s": wall_s, "steps": len(step_log)}
    for kind in ("prefill", "mixed", "decode", "retire"):
        out[f"{kind}_steps"] = sum(1 for s in step_log if s[0] == kind)
    out["first_steps"] = [(k, r, a, round(1e3 * sec, 2), n) for k, r, a, sec, n, _ in step_log[:24]]
    step_log = [s for s in step_log if s[0] != "retire"]  # no device phase: host time only
    if device_steps and len(device_steps) == len(step_log):
        for phase in ("prefill", "decode", "sample"):
            out[f"{phase}_s"] = sum(d[phase] for d in device_steps) / 1e3
        for kind in ("prefill", "mixed", "decode"):  # wall seconds per step kind
            out[f"{kind}_wall_s"] = sum(s[3] for s in step_log if s[0] == kind)
        out["host_s"] = wall_s - out["prefill_s"] - out["decode_s"] - out["sample_s"]
        host = {}
        for (kind, rows, _, sec, _, _), d in zip(step_log, device_steps):
            if kind == "decode":
                host.setdefault(rows, []).append(1e3 * sec - d["decode"] - d["sample"])
        out["host_ms_per_decode_step"] = {r: statistics.median(v) for r, v in sorted(host.items())}
        dec = [(1e3 * sec, d["decode"], d["sample"]) for (kind, rows, _, sec, _, _), d
               in zip(step_log, device_steps) if kind == "decode"]
        if dec:
            out["decode_step_ms_median"] = statistics.median(x[0] for x in dec)
            out["decode_gpu_ms_median"] = statistics.median(x[1] for x in dec)
            out["sample_gpu_ms_median"] = statistics.median(x[2] for x in dec)
    return out


def host_overhead(llm, rows: int, steps: int = 200) -> dict:
    """Per decode-only step at `rows` rows: median step wall (from the top of the driver loop,
    so the controller's work is inside), device decode and sampling time, host overhead (wall
    minus device; median and p99) and the controller's part of it, in ms; greedy, prompts of
    16 tokens."""
    from engine.executor import PhaseTimer
    from engine.sampling import SamplingParams

    executor = llm.ranks.executor
    executor.phases = timer = PhaseTimer()
    llm.step_log = []
    llm.generate([[1 + i % 1000] * 16 for i in range(rows)],
                 SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    executor.phases = None
    pts = [(1e3 * sec, d["decode"], d["sample"], 1e3 * ctrl) for (kind, r, _, sec, _, ctrl), d
           in zip([s for s in llm.step_log if s[0] != "retire"], timer.steps)
           if kind == "decode" and r == rows]
    llm.step_log = None
    med = statistics.median
    return {"rows": rows, "steps": len(pts), "step_ms": med(p[0] for p in pts),
            "decode_gpu_ms": med(p[1] for p in pts), "sample_gpu_ms": med(p[2] for p in pts),
            "host_ms": med(p[0] - p[1] - p[2] for p in pts),
            "host_ms_p99": percentile([p[0] - p[1] - p[2] for p in pts], 99),
            "controller_ms": med(p[3] for p in pts)}


def prefill_throughput(llm, prompts: int = 64, length: int = 1024) -> dict:
    """Prompt tokens per second of steps that hold only prefill: `prompts` random prompts of
    `length` tokens, one output token each (so no step decodes)."""
    from engine.sampling import SamplingParams

    rng = random.Random(1)
    llm.step_log = []
    vocab = min(W_VOCAB, llm.cfg.vocab_size)
    llm.generate([[rng.randrange(vocab) for _ in range(length)] for _ in range(prompts)],
                 SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    steps = [s for s in llm.step_log if s[0] == "prefill"]
    llm.step_log = None
    tokens, sec = sum(s[4] for s in steps), sum(s[3] for s in steps)
    return {"steps": len(steps), "prompt_tokens": tokens, "seconds": sec,
            "prompt_tok_s": tokens / sec, "tokens_per_step": tokens / len(steps)}


def run_hf(model_dir: str, work: Workload, dtype: str, temperature: float,
           top_p: float, device: str = "cuda:0") -> dict:
    """The same prompts and output lengths through HF continuous batching (the manager behind
    `generate_batch`, so that each request keeps its own max_new_tokens), sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="paged|sdpa").to(device)
    model.eval()
    sampled = temperature > 0
    gen = GenerationConfig(max_new_tokens=max(work.max_tokens), do_sample=sampled,
                           temperature=temperature if sampled else None,
                           top_p=top_p if sampled else None, eos_token_id=None,
                           pad_token_id=0, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    arrival, first, finish, n_out = {}, {}, {}, {}
    t0 = time.perf_counter()
    try:
        for i, (p, m) in enumerate(zip(work.prompts, work.max_tokens)):
            rid = f"r{i}"
            arrival[rid] = time.perf_counter()
            manager.add_request(p, request_id=rid, max_new_tokens=m, streaming=True)
        while len(finish) < len(work.prompts):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped early")
                continue
            now = time.perf_counter()
            first.setdefault(res.request_id, now)
            if res.is_finished():
                finish[res.request_id] = now
                n_out[res.request_id] = len(res.generated_tokens)
    finally:
        manager.stop(block=True)
    wall = time.perf_counter() - t0
    ttft = [first[r] - arrival[r] for r in finish]
    tpot = [(finish[r] - first[r]) / (n_out[r] - 1) for r in finish if n_out[r] > 1]
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summarize("HF continuous batching", wall, work.prompt_tokens, sum(n_out.values()),
                     ttft, tpot)


def format_table(doc: dict) -> str:
    """The stdout table of a throughput document."""
    head = (f"{'system':<34} {'out tok/s':>10} {'total tok/s':>11} {'TTFT p50/p99 ms':>17} "
            f"{'TPOT p50/p99 ms':>16} {'wall s':>7}")
    lines = [f"workload W: N={doc['n']}, prompt and output lengths uniform in [100, 1024], "
             f"seed {doc['seed']}, ignore_eos; {doc['model']} ({doc['dtype']}, "
             f"TP {doc.get('tensor_parallel_size', 1)}, "
             f"{'overlapped' if doc.get('decode_overlap') else 'step-locked'} scheduling), "
             f"{doc['versions'].get('gpu')}", head, "-" * len(head)]
    for r in doc["rows"]:
        lines.append(f"{r['system']:<34} {r['output_tok_s']:>10,.0f} {r['total_tok_s']:>11,.0f} "
                     f"{r['ttft_p50_ms']:>8,.0f}/{r['ttft_p99_ms']:<8,.0f} "
                     f"{r['tpot_p50_ms']:>7.2f}/{r['tpot_p99_ms']:<8.2f} {r['wall_s']:>7.1f}")
    for r in doc["rows"]:
        ph = r.get("phases")
        if ph and "host_s" in ph:
            lines.append(f"  {r['system']}: prefill {ph['prefill_s']:.2f} s, decode GPU "
                         f"{ph['decode_s']:.2f} s, sampling {ph['sample_s']:.2f} s, host "
                         f"{ph['host_s']:.2f} s; steps {ph['prefill_steps']} prefill + "
                         f"{ph['mixed_steps']} mixed + {ph['decode_steps']} decode")
    for h in doc.get("host_overhead", []):
        lines.append(f"  decode step at batch {h['rows']}: {h['step_ms']:.3f} ms wall = "
                     f"{h['decode_gpu_ms']:.3f} GPU + {h['sample_gpu_ms']:.3f} sampling + "
                     f"{h['host_ms']:.3f} host, of it {h.get('controller_ms', float('nan')):.3f} "
                     f"controller (median of {h['steps']}; host p99 "
                     f"{h.get('host_ms_p99', float('nan')):.3f})")
    pf = doc.get("prefill_only")
    if pf:
        lines.append(f"  prefill-only steps: {pf['prompt_tok_s']:,.0f} prompt tok/s "
                     f"({pf['steps']} steps of {pf['tokens_per_step']:,.0f} tokens)")
    for k, v in doc.get("ratios", {}).items():
        lines.append(f"  {k}: {v:.2f}x")
    return "\n".join(lines)


def write_plot(doc: dict, path: str) -> bool:
    """Output tok/s per system as bars; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["system"] for r in doc["rows"]]
    vals = [r["output_tok_s"] for r in doc["rows"]]
    ax.barh(names, vals)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"workload W, N={doc['n']}, {doc['model']}, {doc['versions'].get('gpu')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def measure_throughput(model_dir: str, model_name: str, n: int, seed: int, dtype: str,
                       max_batch: int, max_model_len: int, temperature: float, top_p: float,
                       compare_hf: bool, max_prefill_tokens: int = 8192,
                       tensor_parallel_size: int = 1, decode_overlap: bool | None = None) -> dict:
    """Runs of workload W through the engine (graphs on): greedy twice (the first pass meets
    every prefill shape for the first time), then sampled; host overhead at batch 1 and
    max_batch; with compare_hf the HF run (greedy, one GPU). One document. ``decode_overlap``:
    the engine's overlapped scheduling (None: its default, on at tensor_parallel_size 1).

    With tensor_parallel_size > 1 the ranks run in their own processes, so the per-phase
    device times and the host overhead per step (read from rank 0's executor in this
    process) are not measured; wall-clock figures (tok/s, TTFT, TPOT) are."""
    from engine.bench.report import versions
    from engine.llm import LLM

    doc = {"n": n, "seed": seed, "model": model_name, "dtype": dtype, "max_batch": max_batch,
           "tensor_parallel_size": tensor_parallel_size,
           "max_model_len": max_model_len, "max_prefill_tokens": max_prefill_tokens,
           "versions": versions(), "rows": []}
    t0 = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_batch=max_batch,
              max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens,
              tensor_parallel_size=tensor_parallel_size, decode_overlap=decode_overlap)
    doc["decode_overlap"] = llm.config.decode_overlap
    # W's token range, cut to the vocabulary of a smaller test model (the Qwen3 ones hold 151,936)
    vocab = min(W_VOCAB, llm.cfg.vocab_size)
    work = Workload.make(n, seed, vocab=vocab)
    doc["prompt_vocab"] = vocab
    _say(f"engine ready in {time.perf_counter() - t0:.1f} s")
    try:
        warm = Workload.make(8, seed + 1, 16, 64, vocab=vocab)
        run_engine(llm, warm, "warm-up", 0.0, 1.0)
        run_engine(llm, warm, "warm-up", temperature, top_p)
        cold = run_engine(llm, work, "lockstep greedy, first pass", 0.0, 1.0, seed)
        _say(f"greedy, first pass over these shapes: {cold['output_tok_s']:,.0f} output tok/s")
        greedy = run_engine(llm, work, "lockstep greedy", 0.0, 1.0, seed)
        _say(f"greedy: {greedy['output_tok_s']:,.0f} output tok/s")
        sampled = run_engine(llm, work, f"lockstep T={temperature:g} top-p={top_p:g}",
                             temperature, top_p, seed)
        _say(f"sampled: {sampled['output_tok_s']:,.0f} output tok/s")
        doc["rows"] += [cold, greedy, sampled]
        if getattr(llm.ranks, "executor", None) is not None:  # rank 0 in this process
            doc["host_overhead"] = [host_overhead(llm, 1), host_overhead(llm, max_batch)]
        prefill_throughput(llm, 16)  # first pass over the 1024-token shapes
        doc["prefill_only"] = prefill_throughput(llm)
    finally:
        llm.shutdown()
    import torch

    torch.cuda.empty_cache()
    doc["ratios"] = {"sampled / greedy": sampled["output_tok_s"] / greedy["output_tok_s"]}
    if compare_hf:
        _say("HF continuous batching (greedy) on the same prompts ...")
        try:
            hf = run_hf(model_dir, work, dtype, 0.0, 1.0)
        except Exception as exc:  # keep the engine's figures; say why HF has none
            doc["hf_error"] = f"{type(exc).__name__}: {exc}"
            _say(f"HF run failed: {doc['hf_error'][:300]}")
        else:
            doc["rows"].append(hf)
            doc["ratios"]["lockstep greedy / HF greedy"] = (greedy["output_tok_s"]
                                                            / hf["output_tok_s"])
    return doc
