"""The engine's decode step, timed per batch size on one or more ranks: eager and graph replay.

Each rank builds a `RankExecutor` exactly as serving does (same model, paged KV cache, static
input buffers), fills the whole KV cache with random values and times `decode_forward` at
each (batch, context) point with CUDA events around each step: eager (the Python forward) and
graph replay (one captured graph per bucket, all buckets in one shared memory pool, captured
largest first, as startup does). Every step gets fresh random token ids. Before timing, the
graph's logits are compared with the eager logits at the same inputs.

With tensor_parallel_size > 1, one process per GPU runs the same sequence of steps (NCCL
all-reduces inside the step, and inside the graphs); rank 0's times are reported, with every
rank's capture time and graph memory, and the all-reduce latency at each batch.

Graphs are the engine's own (`RankExecutor` with `cuda_graph=True`, `engine.graphs`): the
capture sweep runs record, instantiate and upload for every bucket as startup does (after one
eager warm-up step per bucket on the capture stream, timed apart), and each timed graph step is
`prepare_replay(step)` then `launch(key)`, the serving path; eager steps are `run_eager(step)`.
Each timed step is a protocol `Step` command run by the reference driver
`protocol.execution.run_command` on a `protocol.worker.Worker` whose slots and pages mirror the
bench's (`bench_worker`), exactly as serving runs it: the worker's ops, a device-wide
synchronize, and (rank 0) the sampler's enqueue and token read, which here sample and read
nothing (`BenchBackend`). The events are the
executor's own (`engine.executor.PhaseTimer`, recorded around the graph launch / the eager
forward), so they enclose only the launch / the forward; before each forward the stream is held
for `HOLD_CYCLES` so that the launch is queued before the start event runs, and the host's
driver work between steps is not timed.
"""

from __future__ import annotations

import os
import time
import traceback

from engine.ranks import reap
from engine.rendezvous import HeldStore, StoreAddress, join_process_group
from engine.seeds import derived_seed

# Decode buckets of the engine (pegainfer's 36); mirrors protocol.buckets.DEFAULT_DECODE_BUCKETS.
PAGE_SIZE = 16

HOLD_CYCLES = 200_000
"""GPU clock cycles (``torch.cuda._sleep``) the stream is held before each timed forward: about
0.1 ms at an H200's 1.98 GHz, longer than the host needs to go from the step's prepare to the
graph launch. Each step ends with a device-wide synchronize (the serving path), so without the
hold the start event would run on an idle device and the interval would include the host's
launch latency; with it the events time the device work alone, as when steps were queued back
to back."""


class BenchBackend:
    """The executor as the bench's protocol backend, driven by `protocol.execution.run_command`.

    The decode ops are the executor's own (`prepare_replay`, `launch`, `run_eager`,
    `synchronize`); `enqueue_sample` samples nothing and `read_tokens` returns an empty tuple
    (the bench times the forward only).
    ``hold`` is called right before each forward is queued (`HOLD_CYCLES`); None holds nothing.

    Args:
        executor: an `engine.executor.RankExecutor` (or any object with those four methods).
        hold: callable of no arguments, or None.
    """

    def __init__(self, executor, hold=None):
        self.executor = executor
        self._hold = hold or (lambda: None)

    def prepare_replay(self, step) -> None:
        """The executor's `prepare_replay`, then the hold before the launch."""
        self.executor.prepare_replay(step)
        self._hold()

    def launch(self, key):
        """The executor's `launch` (its `PhaseTimer`, if set, times the replay)."""
        return self.executor.launch(key)

    def run_eager(self, step) -> None:
        """The hold, then the executor's `run_eager` (timed by its `PhaseTimer`, if set)."""
        self._hold()
        self.executor.run_eager(step)

    def synchronize(self) -> None:
        """The executor's device-wide synchronize."""
        self.executor.synchronize()

    def enqueue_sample(self, step) -> None:
        """No token is sampled: drops the step's logits."""
        self.executor._decode_logits = None

    def read_tokens(self, step) -> tuple[int, ...]:
        """No token was sampled: returns ()."""
        return ()


def bench_worker(rank: int, settings, batch: int, captured=()):
    """A `protocol.worker.Worker` for ``batch`` decode rows: requests 0..batch-1 in slots
    0..batch-1, each holding the pages `RankExecutor.assign_pages_per_slot` gives its slot
    (slot s: pages [s * pages_per_seq, (s + 1) * pages_per_seq)), and ``captured`` graph keys.
    The state a controller's admissions would have left, set through the protocol's own
    slot and page maps, so the bench's steps pass the worker's checks (I8, I14).

    Args:
        settings: the bench's `engine.engine_config.EngineConfig`.
    Raises:
        SlotError: ``batch`` exceeds ``settings.max_batch``.
    """
    from protocol.commands import Admit, PageAssign
    from protocol.eligibility import GraphPlan
    from protocol.pages import PageMap
    from protocol.worker import Worker

    worker = Worker(rank, settings.world_size, GraphPlan.from_config(settings.protocol_config()),
                    settings.max_batch)
    pps = settings.pages_per_seq
    worker.pages = PageMap(settings.max_batch * pps, settings.page_size)
    for slot in range(batch):
        worker.slots.admit(Admit(slot, slot, ()))
        worker.pages.assign(PageAssign(slot, slot, 0, tuple(range(slot * pps, (slot + 1) * pps))))
    worker.captured |= set(captured)
    worker.serving = True
    return worker


def time_steps(worker, backend, steps, timer) -> list[float]:
    """Run each of ``steps`` (protocol `Step` commands) through `run_command` on ``worker`` and
    ``backend``; returns each step's decode time in seconds, read from ``timer``'s events:
    the executor's own timer (``executor.phases``, an `engine.executor.PhaseTimer`, or
    `engine.bench.host_overhead.CpuPhaseTimer` on the CPU), whose ``take``, ``close_step``
    and ``steps`` it uses; another timer would read no phases and give 0 s.

    Raises:
        RuntimeError: a step's reply failed (its error, which poisoned the worker).
    """
    from protocol.execution import run_command

    for step in steps:
        reply = run_command(worker, backend, step)
        if not reply.ok:
            raise RuntimeError(f"bench step {step.seq} (batch {len(step.rows)}, bucket "
                               f"{step.bucket}) failed on rank {worker.rank}: {reply.error}")
        timer.close_step(len(step.rows), 0, timer.take())
    return [s["decode"] / 1e3 for s in timer.steps[-len(steps):]] if steps else []


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarize(times_s: list[float]) -> dict:
    """{'median_ms', 'p90_ms', 'min_ms', 'n'} of step times in seconds."""
    return {"median_ms": 1e3 * _pct(times_s, 0.5), "p90_ms": 1e3 * _pct(times_s, 0.9),
            "min_ms": 1e3 * min(times_s), "n": len(times_s)}


def slots_for(opts) -> int:
    """Decode slots the benchmark allocates: the largest bucket measured, 256 with the capture
    sweep (which captures every bucket)."""
    from protocol.buckets import DEFAULT_DECODE_BUCKETS, select_bucket

    return 256 if opts.capture_sweep else select_bucket(max(opts.batch_sizes),
                                                        DEFAULT_DECODE_BUCKETS)


def engine_settings(model_dir: str, opts, world_size: int):
    """EngineConfig for the benchmark: slots for the largest bucket measured (256 with the
    capture sweep), room for the longest context plus the measured token."""
    from engine.engine_config import EngineConfig, short_decode_default
    from protocol.buckets import DEFAULT_DECODE_BUCKETS

    top = slots_for(opts)
    buckets = tuple(b for b in DEFAULT_DECODE_BUCKETS if b <= top)
    s = EngineConfig(model_dir=str(model_dir), world_size=world_size, device="cuda",
                       dtype=opts.dtype, max_batch=top, max_model_len=max(opts.context_lens) + 1,
                       page_size=PAGE_SIZE, buckets=buckets, cuda_graph=opts.graphs,
                       decode_gemm=opts.decode_gemm,
                       short_decode=short_decode_default("cuda", opts.graphs, world_size))
    s.validate()
    return s


def measure_rank(rank: int, world_size: int, opts, model_dir: str) -> dict:
    """Build this rank's executor and run every measurement; returns a JSON-able dict.

    Must run with torch.distributed initialised (NCCL) when world_size > 1, and
    torch.cuda.set_device(rank) done.
    """
    import torch

    from dataclasses import replace

    from engine.bench.floor import (attention_flops, gemm_flops, kv_bytes_read,
                                    measure_matmul_rate, measure_read_bandwidth, weight_bytes)
    from engine.executor import PhaseTimer, RankExecutor
    from engine.parallel import TPGroup
    from protocol.buckets import DEFAULT_DECODE_BUCKETS, select_bucket
    from protocol.commands import DecodeRow, Step
    from protocol.eligibility import GraphPlan
    from protocol.keys import SHORT

    dev = torch.device("cuda", torch.cuda.current_device())
    out: dict = {"rank": rank, "device_name": torch.cuda.get_device_name(dev)}
    out["read_bandwidth_Bps"] = measure_read_bandwidth(dev)
    out["matmul_Fps"] = measure_matmul_rate(dev)
    settings = engine_settings(model_dir, opts, world_size)
    t0 = time.perf_counter()
    ex = RankExecutor(settings, TPGroup(rank, world_size))
    ex.load_model()
    ex.allocate_kv(ex.pages_needed())
    ex.assign_pages_per_slot()
    out["load_s"] = time.perf_counter() - t0
    cfg = ex.cfg
    kvh = cfg.num_kv_heads // world_size
    out["weight_bytes"] = weight_bytes(ex.model)
    gen = torch.Generator(device=dev).manual_seed(derived_seed(opts.seed, 1))
    for layer in range(cfg.num_layers):  # random K/V everywhere: no zeros anywhere
        ex.kv.k[layer].normal_(generator=gen)
        ex.kv.v[layer].normal_(generator=gen)
    n_steps = opts.warmup + opts.steps
    rng = torch.Generator().manual_seed(derived_seed(opts.seed, 3))  # host: the same on every rank

    def steps_for(batch: int, bucket: int, context: int) -> list:
        ids = torch.randint(0, cfg.vocab_size, (n_steps, batch), generator=rng).tolist()
        return [Step(seq=0, rows=tuple(DecodeRow(slot=r, request_id=r, token=t,
                                                 position=context - 1)
                                       for r, t in enumerate(row)), bucket=bucket)
                for row in ids]

    graphs = ex.graphs if opts.graphs else None
    # each point replays the graph the controller would choose for it (its bucket, and the
    # short path where every row's context fits it)
    plan = GraphPlan.from_config(settings.protocol_config())
    points_keys = {(b, c): plan.key_for(b, c)[0] for b in opts.batch_sizes
                   for c in opts.context_lens} if opts.graphs else {}
    backend = BenchBackend(ex, lambda: torch.cuda._sleep(HOLD_CYCLES))
    captured: set = set()
    if graphs is not None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for key in plan.keys():  # as the startup warm-up does
            graphs.on_stream(lambda key=key: ex.decode_forward(key.bucket,
                                                               short=key.path == SHORT))
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        wanted = (plan.keys() if opts.capture_sweep else
                  tuple(k for k in plan.keys() if k in points_keys.values()))
        free0 = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        for key in wanted:  # the plan's order: largest bucket first
            ex.record(key)
        t1 = time.perf_counter()
        for key in wanted:
            ex.instantiate(key)
        t2 = time.perf_counter()
        for key in wanted:
            ex.upload(key)
        captured = set(wanted)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        out["capture"] = {
            "buckets": len({k.bucket for k in wanted}), "graphs": len(wanted),
            "seconds": t3 - t0, "record_s": t1 - t0,
            "instantiate_s": t2 - t1, "upload_s": t3 - t2, "warmup_s": warm_s,
            "graph_memory_bytes": ex.graph_memory(),
            "device_free_drop_bytes": free0 - torch.cuda.mem_get_info(dev)[0]}
        out["graph_source"] = "engine.graphs (record/instantiate/upload per bucket, one pool)"
    else:
        for b in (settings.max_batch, 1):
            ex._pad_rows(b)
            ex.decode_forward(b)
        torch.cuda.synchronize()

    points = []
    for context in opts.context_lens:
        for batch in opts.batch_sizes:
            bucket = select_bucket(batch, DEFAULT_DECODE_BUCKETS)
            steps = steps_for(batch, bucket, context)
            point = {"batch": batch, "bucket": bucket, "context": context,
                     "kv_bytes": kv_bytes_read(cfg.num_layers, kvh, cfg.head_dim, batch,
                                               context, ex.dtype.itemsize),
                     "weight_bytes": weight_bytes(ex.model, batch),
                     "gemm_flops": gemm_flops(ex.model, batch),
                     "attention_flops": attention_flops(
                         cfg.num_layers, cfg.num_q_heads // world_size, cfg.head_dim, batch,
                         context)}
            graph_key = points_keys.get((batch, context))
            if graphs is not None:
                point["graph"] = str(graph_key)
                if graph_key.path == SHORT:
                    point["short_fused"] = ex.model.fuses_short_path(bucket)
                    point["short_tail"] = ex.model.attends_in_qkv_tail(bucket)
                ex.prepare_replay(steps[0])
                ex._step = None
                eager_logits = ex.decode_forward(
                    bucket, short=graph_key.path == SHORT)[:batch].clone()
                ex.prepare_replay(steps[0])
                ex.launch(graph_key)
                torch.cuda.synchronize()
                g_logits = ex.logits_buf[:batch]
                point["graph_vs_eager_max_abs"] = float((g_logits - eager_logits).abs().max())
                point["logits_finite"] = bool(torch.isfinite(g_logits).all())
                ex._decode_logits = None  # the bench reads no tokens
            modes = (["graphs"] if graphs is not None else []) + (["eager"] if opts.eager else [])
            for mode in modes:
                key = graph_key if mode == "graphs" else None
                worker = bench_worker(rank, settings, batch, captured)
                ex.phases = PhaseTimer()
                try:
                    times = time_steps(worker, backend, [
                        replace(s, seq=i, key=key) for i, s in enumerate(steps)], ex.phases)
                finally:
                    ex.phases = None
                point[mode] = summarize(times[opts.warmup:])
            if opts.profile:
                point["profile"] = profile_point(ex, graph_key if graphs is not None else None,
                                                 steps[0], bucket, out["read_bandwidth_Bps"])
            if world_size > 1:
                point["allreduce"] = allreduce_latency(bucket, cfg.hidden_size, ex.dtype, dev)
            points.append(point)
    out["points"] = points
    out["config"] = {"num_layers": cfg.num_layers, "hidden": cfg.hidden_size,
                     "kv_heads_per_rank": kvh, "head_dim": cfg.head_dim,
                     "vocab": cfg.vocab_size, "dtype": opts.dtype}
    out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
    graphs = None
    ex.free_graphs()
    del ex
    torch.cuda.empty_cache()
    return out


def profile_point(ex, key, step, bucket: int, read_bandwidth_Bps: float) -> dict:
    """Kernels per step of the graph replay of `key` (None: of the eager forward) and each
    GEMM's weight-read bandwidth over eager forwards of `step` (`engine.bench.kernel_profile`;
    every rank runs the same calls, so collectives pair)."""
    from engine.bench.kernel_profile import gemm_bandwidth, launches_per_step

    def eager():
        ex.prepare_replay(step)
        ex._step = None
        ex.decode_forward(bucket)

    def replay():
        ex.prepare_replay(step)
        ex.launch(key)

    prof = launches_per_step(replay if key is not None else eager)
    prof["gemms"] = gemm_bandwidth(ex.model, eager, read_bandwidth_Bps, rows=bucket)
    ex._decode_logits = None  # the bench reads no tokens
    return prof


def allreduce_latency(rows: int, hidden: int, dtype, dev, repeats: int = 20) -> dict:
    """Latency of one all-reduce of [rows, hidden] as the decode step issues it: `repeats`
    all-reduces captured in one graph, replayed 10 times; median per all-reduce, in us."""
    import torch
    import torch.distributed as dist

    x = torch.randn(rows, hidden, dtype=dtype, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        for _ in range(repeats):
            dist.all_reduce(x)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / repeats)
    return {"bytes": x.numel() * x.element_size(), "median_us": _pct(times, 0.5)}


def _rank_entry(rank: int, world_size: int, opts, model_dir: str,
                store_address: StoreAddress, queue) -> None:
    try:
        import datetime

        import torch
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast here
        torch.cuda.set_device(rank)
        join_process_group("nccl", store_address, rank, world_size,
                           datetime.timedelta(seconds=600), device_id=torch.device("cuda", rank))
        res = measure_rank(rank, world_size, opts, model_dir)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", res))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc(limit=6)))


def measure_engine(opts, model_dir: str) -> list[dict]:
    """Run `measure_rank` on every rank (in-process for TP 1, spawned processes otherwise).

    Returns each rank's result dict, in rank order.
    Raises:
        RuntimeError: a rank failed (its traceback) or did not report within 30 minutes.
    """
    world = opts.tensor_parallel_size
    if world == 1:
        import torch

        torch.cuda.set_device(0)
        return [measure_rank(0, 1, opts, model_dir)]
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = HeldStore()
    procs = [ctx.Process(target=_rank_entry,
                         args=(r, world, opts, str(model_dir), store.address, q),
                         daemon=True) for r in range(world)]
    results: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        while len(results) < world:
            try:
                rank, status, payload = q.get(timeout=1800)
            except queue_mod.Empty:
                raise RuntimeError("bench ranks silent for 30 minutes") from None
            if status != "ok":
                raise RuntimeError(f"bench rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        try:
            reap(procs, timeout_s=30)
        finally:
            store.close()
    return [results[r] for r in range(world)]
