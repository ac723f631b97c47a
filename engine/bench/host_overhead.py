"""Host overhead of one decode step, on the CPU, with the model's forward stubbed out.

What a serving step costs the host besides the device's forward and sampling: the controller
(absorbing the last step's tokens, page growth, building the next `Step`), the transport and
the worker (checking the step against the rank's slot and page maps), the executor's
bookkeeping (writing the replay buffers, the replay call) and the sampler's host side (the
reply's token ids). It runs the real `LLM` step loop in one process (`InProcessRanks`,
graphs through the CPU stand-in, `graph_standin=True`) on the `tiny` preset, with the model's
forward replaced by a stub that returns fixed logits, so every step runs the whole host path
and next to no arithmetic. The sampler still runs its torch path on those [rows, 512] logits;
its time is reported apart (`sample`), as the GPU breakdown reports sampling apart.

For each batch size: B requests of 16-token prompts, greedy, `ignore_eos`, `--steps` decode
steps each, served `--repeats` times; the decode-only steps at B rows are pooled. Per step:
wall (from the top of the driver loop to the step's last reply, so the controller's work is
inside); host, the wall less the forward stub and the sampler (both timed with perf_counter
around the executor's phases, as the GPU breakdown subtracts device decode and sampling);
of the host, the controller (`next_action` + `on_reply`) and the rest (transport, worker,
executor bookkeeping, the reply). Medians and p99s are taken per column over the steps.

    python -m engine.bench.host_overhead --batch-sizes 1,256 --steps 200 --repeats 5

These are CPU figures of this machine, not the H200 host's: on the GPU the same path is
measured by `lockstep bench --workload throughput` (`engine.bench.serving.host_overhead`).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

from engine.cli_args import integer
from engine.bench.options import BenchArgError, check_output_path, check_range, parse_int_list


class CpuPhaseTimer:
    """`engine.executor.PhaseTimer` on the CPU: perf_counter around each phase (the CPU runs
    a phase synchronously, so its wall time is its compute). `steps` holds one dict per step:
    rows, admits and milliseconds per phase."""

    def __init__(self):
        self._open: list = []
        self.steps: list[dict] = []

    def start(self) -> float:
        """Now, in seconds."""
        return time.perf_counter()

    def stop(self, phase: str, start: float) -> None:
        """Close `phase`, started at `start`."""
        self._open.append((phase, time.perf_counter() - start))

    def take(self) -> list:
        """The phases recorded since the last `take` (see `PhaseTimer.take`)."""
        taken, self._open = self._open, []
        return taken

    def close_step(self, rows: int, admits: int, phases: list) -> None:
        """Fold a step's ``phases`` (from `take`) into `steps`."""
        step = {"rows": rows, "admits": admits, "prefill": 0.0, "decode": 0.0, "sample": 0.0}
        for phase, sec in phases:
            step[phase] += 1e3 * sec
        self.steps.append(step)


class StubModel:
    """Stands in for `Qwen3ForCausalLM`: the forward returns an empty hidden state [T, hidden]
    and `compute_logits` fixed float32 logits [T, vocab] (random, seed 0), so a step does the
    engine's host work and no model arithmetic."""

    def __init__(self, hidden: int, vocab: int, rows: int = 1 << 14):
        import torch

        self.hidden = hidden
        self.logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))

    def __call__(self, ids, positions, ctx):
        import torch

        return torch.empty(ids.shape[0], self.hidden)

    def compute_logits(self, hidden, out=None):
        """The first len(hidden) rows of the fixed logits (a view, or copied into `out`)."""
        rows = self.logits[:hidden.shape[0]]
        return rows if out is None else out.copy_(rows)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `xs` by linear interpolation."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def build_llm(max_batch: int, steps: int, model_dir: str):
    """An in-process CPU `LLM` on `model_dir` (graphs through the stand-in) whose rank-0
    executor runs `StubModel`."""
    from engine.llm import LLM

    llm = LLM(model_dir, device="cpu", max_batch=max_batch, max_model_len=16 + steps + 16,
              cuda_graph=True, graph_standin=True)
    ex = llm.ranks.executor
    ex.model = StubModel(ex.cfg.hidden_size, ex.cfg.vocab_size)
    return llm


def measure(llm, rows: int, steps: int, repeats: int) -> dict:
    """Per decode step at `rows` rows, pooled over `repeats` runs: median and p99 of the step
    wall and of each part, in ms."""
    from engine.sampling import SamplingParams

    ex = llm.ranks.executor
    samples: dict[str, list[float]] = {"wall": [], "host": [], "controller": [], "forward": [],
                                       "sample": [], "other": []}
    for _ in range(repeats):
        ex.phases = timer = CpuPhaseTimer()
        llm.step_log = []
        llm.generate([[1 + i % 1000] * 16 for i in range(rows)],
                     SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
        ex.phases = None
        timed = [s for s in llm.step_log if s[0] != "retire"]
        for (kind, r, _, sec, _, ctrl), d in zip(timed, timer.steps):
            if kind != "decode" or r != rows:
                continue
            wall = 1e3 * sec
            samples["wall"].append(wall)
            samples["host"].append(wall - d["decode"] - d["sample"])
            samples["controller"].append(1e3 * ctrl)
            samples["forward"].append(d["decode"])
            samples["sample"].append(d["sample"])
            samples["other"].append(wall - 1e3 * ctrl - d["decode"] - d["sample"])
        llm.step_log = None
    out = {"rows": rows, "steps": len(samples["wall"])}
    for name, xs in samples.items():
        out[f"{name}_ms_median"] = statistics.median(xs)
        out[f"{name}_ms_p99"] = percentile(xs, 99)
    return out


def format_table(results: list[dict]) -> str:
    """One line per batch size: median / p99 in ms of the wall and each part."""
    head = (f"{'batch':>5} {'steps':>6} {'wall':>15} {'host':>15} {'controller':>15} "
            f"{'forward stub':>15} {'sampler':>15} {'rest':>15}")
    lines = ["decode step on the CPU, model forward stubbed; median / p99 ms "
             "(host = wall - forward - sampler, as the GPU breakdown counts it)", head,
             "-" * len(head)]
    for r in results:
        cells = [f"{r[f'{k}_ms_median']:.3f} / {r[f'{k}_ms_p99']:.3f}"
                 for k in ("wall", "host", "controller", "forward", "sample", "other")]
        lines.append(f"{r['rows']:>5} {r['steps']:>6} " + " ".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print the table (and write --json); exit status."""
    from lockstep.cli import OneLineParser

    p = OneLineParser(prog="python -m engine.bench.host_overhead", error_name="host_overhead",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,256",
                   help="comma-separated decode batch sizes, each 1..256 (default 1,256)")
    p.add_argument("--steps", type=integer, default=200, help="decode steps per run (default 200)")
    p.add_argument("--repeats", type=integer, default=5, help="runs per batch size (default 5)")
    p.add_argument("--threads", type=integer, default=1,
                   help="torch CPU threads (default 1: the host path is single-threaded)")
    p.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    try:
        sizes = parse_int_list(args.batch_sizes, "--batch-sizes")
        for name, value, lo, hi in [("--steps", args.steps, 2, 10**6),
                                    ("--repeats", args.repeats, 1, 10**4),
                                    ("--threads", args.threads, 1, 1024)] + [
                ("--batch-sizes", b, 1, 256) for b in sizes]:
            check_range(name, value, lo, hi)
    except BenchArgError as exc:
        print(f"host_overhead: error: {exc}", file=sys.stderr)
        return 2
    if args.json_path is not None:  # before the run, not after it
        try:
            check_output_path("--json", args.json_path)
        except BenchArgError as exc:
            print(f"host_overhead: error: {exc}", file=sys.stderr)
            return 2
    import torch

    from engine.model_dir import write_model_dir

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model_dir("tiny", tmp, seed=0, dtype="float32"))
        llm = build_llm(max(sizes), args.steps, model_dir)
        try:
            measure(llm, min(sizes), 8, 1)  # warm-up: first calls of every path
            results = [measure(llm, b, args.steps, args.repeats) for b in sizes]
        finally:
            llm.shutdown()
    print(format_table(results))
    if args.json_path:
        try:
            with open(args.json_path, "w") as f:
                json.dump({"batch_sizes": sizes, "steps": args.steps, "repeats": args.repeats,
                           "threads": args.threads, "torch": torch.__version__,
                           "results": results}, f, indent=2)
        except OSError as exc:
            print(f"host_overhead: error: cannot write --json {args.json_path!r}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
