"""One rank's executor: the engine's implementation of `protocol.backend.Backend`.

The protocol's `Worker` decides which operations run for a command and in which order; this
class only performs them on the rank's device: model load, eager prefill and decode, KV
allocation, slot moves, sampling (rank 0), memory profile, warm-up collectives, and the CUDA
graph phases (record, instantiate, upload, launch, free; `engine.graphs`). It takes no
protocol decision of its own (bucket, slot compaction, eligibility, step lock): a graph op
for a key it holds no graph for is an error, never a fallback to eager.

Decode steps read their inputs from static device buffers (`input_ids`, `positions`,
`slot_ids`, sized for the largest bucket) refreshed by `prepare_replay` before the forward, and
per-slot metadata from the KV cache's device-resident page table and lengths (I12), so the
decode forward itself takes no host value that changes between steps. Every graph writes its
logits into one static buffer `logits_buf` [max bucket, vocab] (float32), so the shared pool
keeps intermediates only, and sampling runs outside the graph on rank 0.

A step's admissions are prefilled together: their prompts are packed into one ragged batch
(`engine.kernels.prefill_attention.PrefillBatch`), one forward, logits of each prompt's last
token only. Sampling (rank 0) is one batched pass over the step's rows in slot order (decode
rows are slots 0..n-1, the step's admissions the slots after them): the per-slot sampling
parameters live in device tensors written at admission and moved with the slot, so a step
reads no per-row host value, and only the int32 token ids come back to the host.

KV pages are handed out on demand by the controller (I14): the cache holds the pages the
memory plan sized, every page-table row starts at the padding page, and a step's
`assign_pages` writes the page ids its command carries into the slot's row of the
device-resident page table (a fixed-address buffer the graphs read, I12). A slot move copies
the row and clears the old one; a retired or preempted request's row is cleared. No page id is
ever chosen here.
"""

from __future__ import annotations

import functools
from array import array
from collections import Counter
from dataclasses import dataclass
from itertools import chain, repeat

import torch

from engine.config import ModelConfig, check_parallel, load_model_config
from engine.kernels.decode_attention import (
    SplitWorkspace,
    longest_first,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    takes_rows_in_order,
)
from engine.kernels.prefill_attention import (
    PrefillBatch,
    prefill_attention_torch,
    prefill_attention_triton,
)
from engine.graphs import CudaGraphs, GraphError, GraphTable, StandInGraphs
from engine.kernels.attention_oproj import AttnOprojWorkspace
from engine.kv_cache import KVCache
from engine.layers.attention import ShortAttention, StepContext
from engine.model import Qwen3ForCausalLM
from engine.parallel import TPGroup
from engine.sampling import BatchParams, SamplingParams, inverse_temperature, sample_batch, split_seed
from engine.engine_config import SHORT_DECODE_MAX_BUCKET, EngineConfig
from engine.weights import WeightIndex
from protocol.backend import Backend
from protocol.commands import NO_TOKEN
from protocol.keys import SHORT

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RankExecutor(Backend):
    """Device operations of one rank.

    Args:
        settings: engine settings (same object on every rank).
        tp: this rank's group; torch.distributed must already be initialised when
            tp.world_size > 1.
        cfg: the model config, read again from settings.model_dir when None.
    """

    def __init__(self, settings: EngineConfig, tp: TPGroup, cfg: ModelConfig | None = None):
        self.settings = settings
        self.tp = tp
        self.cfg = cfg or load_model_config(settings.model_dir)
        check_parallel(self.cfg, tp.world_size)
        self.dtype = TORCH_DTYPES[settings.dtype]
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}"
                                   if settings.device == "cuda" else "cpu")
        self.model: Qwen3ForCausalLM | None = None
        self.kv: KVCache | None = None
        self.decode_attention = paged_decode_attention_torch
        if self.device.type == "cuda":  # split-KV partials allocated here, before any capture
            self.decode_attention = functools.partial(
                paged_decode_attention_triton, workspace=SplitWorkspace.for_heads(
                    self.device, self.cfg.num_q_heads, self.cfg.num_kv_heads, self.cfg.head_dim))
        self.prefill_attention = (prefill_attention_triton if self.device.type == "cuda"
                                  else prefill_attention_torch)
        # the short path's fused attention + o_proj (CUDA; on the CPU the path runs the
        # ordinary attention, the same function), its partials allocated before any capture
        self.short_attention: ShortAttention | None = None
        if settings.short_context is not None:
            workspace = (AttnOprojWorkspace(self.device, settings.kv_heads_per_rank,
                                            self.cfg.hidden_size)
                         if self.device.type == "cuda" else None)
            self.short_attention = ShortAttention(settings.short_context, workspace)
        nb = max(settings.buckets)
        # replay inputs: token ids and positions are rows of one int64 buffer, so a step's
        # rows arrive in one host-to-device copy (from a pinned staging buffer on CUDA)
        # (a fourth row: the feed indices of an overlapped step, `protocol.commands.Step.feed`;
        # a fifth: the order in which decode attention takes the rows, `longest_first`, always
        # a permutation of the first `bucket` entries, so it starts as the identity)
        self._replay_in = torch.zeros(5, nb, dtype=torch.long, device=self.device)
        self._identity = torch.arange(nb, device=self.device)
        self._replay_in[4].copy_(self._identity)
        self.input_ids = self._replay_in[0]
        self.positions = self._replay_in[1]
        self.slot_ids = torch.zeros(nb, dtype=torch.int32, device=self.device)
        cuda = self.device.type == "cuda"
        # two pinned staging buffers, by step parity: under overlapped scheduling step n+1's
        # rows are written while step n's copy may still wait on the stream (I12)
        self._staging = torch.zeros(2, 5 * nb, dtype=torch.long, pin_memory=cuda)
        # the sampled token ids of a step's rows and admissions: on the device, where the next
        # overlapped step's rows read their input tokens (I20), and copied without blocking
        # into one of two pinned host buffers by step parity (one is read while the next
        # step's copy lands in the other, I11)
        self._sampled_dev = torch.zeros(settings.max_batch + 1, dtype=torch.long,
                                        device=self.device)
        self._sampled_host = torch.zeros(2, settings.max_batch, dtype=torch.int32,
                                         pin_memory=cuda)
        self._sampled_copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._marks: dict[int, "torch.cuda.Event"] = {}  # step seq -> the event mark_step recorded
        self._pending: dict[int, PendingSample] = {}  # step seq -> what read_tokens takes
        self._zeros = array("q", bytes(8 * nb))
        self._slot_range = array("q", range(nb))
        # request id -> (params, seed); registered by the driver before admission
        self.requests: dict[int, tuple[SamplingParams, int]] = {}
        self.slot_request: dict[int, int] = {}
        self.slots = SlotSampling(settings.max_batch, self.device)
        self._decode_logits: torch.Tensor | None = None   # float32 [>= rows, vocab], this step
        self._prefill_logits: torch.Tensor | None = None  # float32 [admits, vocab], this step
        self.outputs: dict[int, dict] = {}            # request id -> side outputs of this step
        self.phases: PhaseTimer | None = None  # benchmarks set one to time device phases
        self.graphs: GraphTable | None = None
        if settings.cuda_graph:
            self.graphs = (CudaGraphs(self.device, self._graph_forward)
                           if self.device.type == "cuda" else StandInGraphs(self._graph_forward))
        self.logits_buf: torch.Tensor | None = None    # float32 [max bucket, vocab], graph output
        self._placeholder_kv = False
        self._step = None                              # the step prepare_replay set up
        # rank 0 samples; under overlapped scheduling every rank does, for its fed rows (I20)
        self._samples_here = tp.rank == 0 or settings.decode_overlap

    # -- setup --------------------------------------------------------------------------------

    @torch.no_grad()
    def load_model(self) -> None:
        """Build this rank's shard of the model and read its weight slices; rank 0 reports
        progress on stderr every ~10% of the layers when settings.progress is set."""
        self.model = Qwen3ForCausalLM(self.cfg, self.tp, self.dtype, self.device,
                                      self.settings.decode_gemm,
                                      max_positions=self.settings.max_model_len)
        progress = None
        if self.settings.progress and self.tp.rank == 0:
            import sys

            step = max(1, self.cfg.num_layers // 10)

            def progress(done: int, total: int) -> None:
                if done % step == 0 or done == total:
                    print(f"lockstep: rank 0 loaded layer {done}/{total}", file=sys.stderr,
                          flush=True)

        self.model.load_weights(WeightIndex(self.cfg), progress)
        self.model.eval()

    def kv_page_bytes(self) -> int:
        """Bytes of one KV page on this rank, all layers, K and V."""
        return self.settings.kv_page_bytes

    def pages_needed(self) -> int:
        """Pages for every slot at full length (the padding page comes on top): past this,
        a larger KV cache is never used."""
        return self.settings.max_batch * self.settings.pages_per_seq

    # -- Backend: startup ---------------------------------------------------------------------

    def _scratch_kv(self, slots: int) -> KVCache:
        """A one-page cache with `slots` slots whose rows all point at its padding page."""
        return KVCache(self.cfg.num_layers, self.settings.kv_heads_per_rank,
                       self.cfg.head_dim, 1, self.settings.page_size, slots,
                       self.settings.pages_per_seq, self.dtype, self.device)

    @torch.no_grad()
    def _scratch_forward(self, rows: int, short: bool = False) -> torch.Tensor:
        """Eager decode of `rows` padding rows on a throw-away cache -> logits [rows, vocab],
        on the short path with `short`. Runs every collective of a decode step at that row
        count (TP > 1)."""
        kv = self._scratch_kv(1)
        ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        slots = torch.full((rows,), kv.padding_slot, dtype=torch.int32, device=self.device)
        pos = torch.zeros_like(ids)
        order = torch.arange(rows, device=self.device)  # the padding rows, all of one length
        return self.model.compute_logits(
            self.model(ids, pos, self._decode_context(slots, kv, order, short)))

    def _decode_context(self, slots: torch.Tensor, kv: KVCache, order: torch.Tensor,
                        short: bool = False) -> StepContext:
        """The attention context of a decode forward (the captured step and its warm-up alike,
        so the warm-up loads the same kernels: the ordered attention from ORDER_MIN_ROWS rows
        on). order: int64 [rows], the row order on the device. short: the step replays the
        short path (`protocol.keys.SHORT`): every row's context fits `short_attention`."""
        # the CPU's torch path is handed the order too, and ignores it
        return StepContext(False, slots, kv, self.decode_attention,
                           row_order=order if takes_rows_in_order(slots.shape[0]) else None,
                           short=self.short_attention if short else None)

    def warmup_collective(self, nbytes: int) -> None:
        """One eager all-reduce of `nbytes` bytes (rounded up to whole elements) (I5).

        With CUDA graphs, when `nbytes` is the activation all-reduce of a decode bucket
        (bucket x hidden x dtype bytes), also one eager decode step of that many padding rows
        on the capture stream: it runs every collective the bucket's graph will capture (the
        layers' all-reduces and the LM head's all-gather) at its real size, and loads every
        kernel the capture will use outside the capture.
        """
        n = max(1, -(-nbytes // self.dtype.itemsize))
        self.tp.all_reduce(torch.zeros(n, dtype=self.dtype, device=self.device))
        rows, rest = divmod(nbytes, self.cfg.hidden_size * self.dtype.itemsize)
        if isinstance(self.graphs, CudaGraphs) and not rest and rows in self.settings.buckets:
            self.graphs.on_stream(lambda: self._scratch_forward(rows))
            if self.short_attention is not None and rows <= SHORT_DECODE_MAX_BUCKET:
                self.graphs.on_stream(lambda: self._scratch_forward(rows, short=True))

    @torch.no_grad()
    def profile_memory(self, rows: int) -> tuple[int, int]:
        """Eager decode forward of `rows` padding rows on a throw-away one-page cache (I9:
        the profile runs eager, no graph).

        Returns (free bytes for graphs + KV, peak activation bytes). On CUDA, free is what
        the driver reports free after emptying the allocator's cache, less the share of the
        GPU that gpu_memory_utilization leaves to others. On CPU nothing is measured: free is
        the per-slot KV reservation plus a nominal 1 GiB for graphs, the peak 0.
        """
        want = (self.pages_needed() + 1) * self.kv_page_bytes()
        if self.device.type != "cuda":
            self._scratch_forward(rows)
            return want + (1 << 30), 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._scratch_forward(rows)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        keep_free = int((1 - self.settings.gpu_memory_utilization) * total)
        return max(0, free - keep_free), peak

    def allocate_kv(self, pages: int) -> None:
        """Allocate the paged KV cache: `pages` pages plus the reserved padding page; every
        page-table row points at the padding page until a step assigns pages (I14).

        Raises:
            ValueError: fewer pages than one full-length sequence (the protocol's memory plan
                never asks for that).
            GraphError: graphs are alive (they captured the old cache's addresses).
        """
        if self.graphs is not None and self.graphs.keys:
            raise GraphError(f"allocate_kv({pages}) with graphs {self.graphs.keys} alive: they "
                             "captured the old cache's addresses (free_graphs first)")
        s = self.settings
        if pages < s.pages_per_seq:
            raise ValueError(f"allocate_kv({pages}): one full-length sequence needs "
                             f"{s.pages_per_seq} pages")
        self.kv = KVCache(self.cfg.num_layers, self.settings.kv_heads_per_rank,
                          self.cfg.head_dim, pages, s.page_size, s.max_batch,
                          s.pages_per_seq, self.dtype, self.device)
        self._pad_rows(max(s.buckets))

    def assign_pages_per_slot(self) -> None:
        """Benchmark and test helper, outside the protocol: give slot s the pages
        [s * pages_per_seq, (s + 1) * pages_per_seq), so rows decoded without a controller
        read distinct pages. Needs a cache of at least `pages_needed()` pages.

        Raises:
            ValueError: the cache holds fewer pages.
        """
        pps = self.settings.pages_per_seq
        for slot in range(self.settings.max_batch):
            self.kv.assign_pages(slot, 0, list(range(slot * pps, (slot + 1) * pps)))

    # -- Backend: graphs ----------------------------------------------------------------------

    def _graphs(self, op: str, key=None) -> GraphTable:
        if self.graphs is None:
            raise GraphError(f"{op}({key if key is not None else ''}): this engine runs with "
                             "cuda_graph=False; the protocol's plan must never ask for a graph")
        return self.graphs

    def _graph_forward(self, key) -> None:
        """The captured body of `key`: decode over the static buffers on the key's path,
        logits into `logits_buf`."""
        self.decode_forward(key.bucket, out=self.logits_buf[:key.bucket],
                            short=key.path == SHORT)

    @torch.no_grad()
    def record(self, key) -> None:
        """Stream-capture one decode step of key.bucket rows into the shared pool.

        Before the KV cache exists (MeasureGraphs), the graph is captured against a one-page
        placeholder cache: its pool bytes do not depend on the KV size, and it is freed before
        `allocate_kv`. The static buffers hold padding rows while capturing.
        Raises:
            GraphError: cuda_graph is off, or the key is already held.
        """
        graphs = self._graphs("record", key)
        if self.kv is None:
            self.kv = self._scratch_kv(self.settings.max_batch)
            self._placeholder_kv = True
        if self.logits_buf is None:
            self.logits_buf = torch.empty(max(self.settings.buckets), self.cfg.vocab_size,
                                          dtype=torch.float32, device=self.device)
        self._pad_rows(key.bucket)
        graphs.record(key)

    def instantiate(self, key) -> None:
        """Instantiate the recorded graph of `key`. Raises GraphError out of order."""
        self._graphs("instantiate", key).instantiate(key)

    def upload(self, key) -> None:
        """Upload the executable graph of `key` (cudaGraphUpload). Raises GraphError out of
        order or when the driver call fails."""
        self._graphs("upload", key).upload(key)

    def launch(self, key):
        """Replay `key`'s graph on the current stream. In serving, `prepare_replay(step)` ran
        just before and the step's rows take their logits from `logits_buf` (rank 0); in the
        startup sweep (no step) the static buffers are set to padding rows first.

        Returns:
            With `EngineConfig.trace` set, the `protocol.backend.ReplayRows` the replay reads
            (the static buffers' first `key.bucket` rows, copied back to the host, which
            waits for the device), so the trace check can compare them with the step's rows
            (I12); else None.

        Raises:
            GraphError: cuda_graph is off, or no graph was captured for `key` (uncaptured or
                ineligible key).
        """
        graphs = self._graphs("launch", key)
        step, self._step = self._step, None
        if step is None:
            self._pad_rows(key.bucket)
        elif step.bucket != key.bucket:
            raise GraphError(f"launch({key}) for step {step.seq} of bucket {step.bucket}: the "
                             "command's key and bucket disagree")
        read = self._replay_rows(key.bucket) if getattr(self.settings, "trace", False) else None
        ev = self.phases.start() if self.phases is not None and step is not None else None
        graphs.launch(key)
        if ev is not None:
            self.phases.stop("decode", ev)
        if step is not None and self._samples_here:
            self._decode_logits = self.logits_buf
        return read

    def _replay_rows(self, bucket: int):
        """The static replay buffers' first `bucket` rows (host copies; waits for the device)."""
        from protocol.backend import ReplayRows

        return ReplayRows(tuple(self.input_ids[:bucket].tolist()),
                          tuple(self.positions[:bucket].tolist()),
                          tuple(self.slot_ids[:bucket].tolist()))

    def graph_memory(self) -> int:
        """Bytes held by this rank's graphs now: the shared pool's segments, every executable
        graph's driver memory, and the static logits buffer [max bucket, vocab] float32 the
        graphs write. 0 without graphs."""
        if self.graphs is None or not self.graphs.keys:
            return 0
        extra = self.logits_buf.numel() * 4 if self.device.type == "cuda" else 0
        return self.graphs.memory() + extra

    def free_graphs(self) -> None:
        """Free every graph, the pool and the logits buffer; drop the MeasureGraphs
        placeholder cache. Safe to call with no graphs (and with cuda_graph off)."""
        if self.graphs is not None:
            self.graphs.free()
        self.logits_buf = None
        if self._placeholder_kv:
            self.kv, self._placeholder_kv = None, False

    def destroy_communicator(self) -> None:
        """Destroy the TP communicator (after free_graphs, I10): the model's group, or the
        default group when the model uses that one."""
        if self.tp.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self.tp.group)

    # -- Backend: serving ---------------------------------------------------------------------

    def register(self, info: dict[int, tuple[SamplingParams, int]]) -> None:
        """Record the sampling parameters and seed of requests about to be admitted (rank 0
        uses them; other ranks ignore them). Engine data, not a protocol decision."""
        self.requests.update(info)

    def release_slot(self, slot: int) -> None:
        """The request in `slot` retired or was preempted: its page-table row points at the
        padding page again and its length drops to 0; the pages went back to the controller's
        pool (I14). A preempted request is registered again when it is re-admitted."""
        self.kv.clear_slot(slot)
        rid = self.slot_request.pop(slot, None)
        self.requests.pop(rid, None)
        self.slots.release(slot)

    def assign_pages(self, slot: int, first_index: int, pages: tuple[int, ...]) -> None:
        """Write the command's page ids into `slot`'s page-table row from `first_index` on
        (I14); the row lives at a fixed device address, so graphs read it at replay (I12).
        The write is checked now and staged (`KVCache.stage_pages`): the step's forward
        (`prefill`, `prepare_replay`) flushes every staged write in one copy first.

        Raises:
            ValueError: a slot, index or page id out of range.
        """
        self.kv.stage_pages(slot, first_index, pages)

    def move_slot(self, src: int, dst: int) -> None:
        """Move slot `src`'s sequence into the empty slot `dst`: copy its page-table row and
        length, and clear `src`."""
        self.kv.move_slot(src, dst)
        if src in self.slot_request:
            self.slot_request[dst] = self.slot_request.pop(src)
        self.slots.move(src, dst)

    @torch.no_grad()
    def prefill(self, admits, chunk=None) -> None:
        """Prefill every admitted prompt, and the step's chunk of a chunked prefill, in one
        packed forward (ragged batch, causal attention over the paged cache); keeps the logits
        of each admission's last token for `enqueue_sample` and writes each admission's sampling
        parameters into its slot.

        An admission with ``start`` > 0 is the last chunk of a chunked prefill: its first
        ``start`` tokens are cached already (the step's `move_slot` brought them from the chunk
        slot), so only ``prompt[start:]`` is computed, at positions ``start``.., attending
        over the cached ones. ``chunk`` (`protocol.commands.Chunk`) writes its tokens at
        positions ``chunk.start``.. of the chunk slot and samples nothing.

        Raises:
            ValueError: a prompt longer than max_model_len (the controller-side check failed).
        """
        self.kv.flush_pages()
        ev = self.phases.start() if self.phases is not None else None
        for admit in admits:
            if len(admit.prompt) > self.settings.max_model_len:
                raise ValueError(f"request {admit.request_id}: prompt of {len(admit.prompt)} "
                                 f"tokens exceeds max_model_len {self.settings.max_model_len}")
        pieces = [(a.slot, a.tokens, a.start) for a in admits]
        if chunk is not None:
            if chunk.end > self.settings.max_model_len:
                raise ValueError(f"request {chunk.request_id}: chunk up to position {chunk.end} "
                                 f"exceeds max_model_len {self.settings.max_model_len}")
            pieces.append((self.kv.chunk_slot, chunk.tokens, chunk.start))
        slots, tokens, ctxs = zip(*pieces)
        lens = list(map(len, tokens))
        T = sum(lens)
        batch = PrefillBatch.build(slots, lens, ctxs, self.device)
        ids = torch.tensor(list(chain.from_iterable(tokens)), dtype=torch.long)
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        seq = torch.repeat_interleave(torch.arange(len(pieces), device=self.device),
                                      batch.q_len.long(), output_size=T)
        pos = (torch.arange(T, device=self.device) - batch.q_start.long()[seq]
               + batch.ctx.long()[seq])
        slot_ids = batch.slot[seq]
        self.kv.seq_lens.index_copy_(0, batch.slot.long(), batch.ctx + batch.q_len)
        ctx = StepContext(True, slot_ids, self.kv, self.decode_attention, batch,
                          self.prefill_attention)
        hidden = self.model(ids, pos, ctx)
        a = len(admits)
        if a:  # logits of each admission's last token only: the chunk samples nothing
            last = (batch.q_start[:a] + batch.q_len[:a] - 1).long()
            logits = self.model.compute_logits(hidden[last])  # collective: every rank
        for admit in admits:
            self.slot_request[admit.slot] = admit.request_id
        if self._samples_here and a:
            self._prefill_logits = logits
            # a recomputed request's prompt ends with its first output_index outputs
            self.slots.admit([x.slot for x in admits], [x.request_id for x in admits],
                             [self.requests[x.request_id] for x in admits],
                             [len(x.prompt) - x.output_index for x in admits])
        if ev is not None:
            self.phases.stop("prefill", ev)

    def _pad_rows(self, bucket: int) -> None:
        """Static buffers [:bucket] = padding rows (padding slot, position 0, token 0)."""
        pad = self.kv.padding_slot if self.kv is not None else 0
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_ids[:bucket].fill_(pad)
        self._replay_in[4, :bucket].copy_(self._identity[:bucket])  # after a larger bucket's order

    def prepare_replay(self, step) -> None:
        """Write the step's tokens, positions and slots into the static buffers (I12); rows
        past len(step.rows) up to step.bucket are padding (padding slot, position 0, token 0).
        The next `launch` reads its rows from this step.

        The step's columns (`protocol.commands.DecodeRows`) are packed into one int64 host
        array [3, bucket] (tokens, positions, slots) by C-level copies -- no Python work per
        row -- and sent in one copy (pinned staging, non-blocking, on CUDA); the slot ids are
        then converted to int32 on the device. An overlapped step (``step.feed``) carries no
        tokens: a fourth row holds the feed indices, and row i's token is gathered on the
        device from the ids the previous step sampled (I20). A bucket of ORDER_MIN_ROWS rows
        or more adds a fifth row: the order in which decode attention takes the rows
        (`longest_first` of the positions, one host sort; a launch of its own on the device
        cost more), the fourth row then zeros unless fed.
        """
        self.kv.flush_pages()
        rows, n, bucket = step.rows, len(step.rows), step.bucket
        pad = bucket - n
        fed = step.feed is not None
        packed = array("q", self._zeros[:n] if fed else rows.tokens)
        packed += self._zeros[:pad]
        packed.extend(rows.positions)
        packed += self._zeros[:pad]
        packed += self._slot_range[:n]
        packed.extend(repeat(self.kv.padding_slot, pad))
        if fed:
            packed.extend(step.feed)
            packed += self._zeros[:pad]
        nrows = 4 if fed else 3
        ordered = takes_rows_in_order(bucket)
        if ordered:  # a fifth row, the order, written below (the fourth zeros unless fed)
            if not fed:
                packed += self._zeros[:bucket]
            packed += self._zeros[:bucket]
            nrows = 5
        host = torch.frombuffer(packed, dtype=torch.long)
        if self.device.type == "cuda":  # the buffer of this step's parity (overlap: I12)
            host = self._staging[step.seq % 2, :nrows * bucket].copy_(host)
        host = host.view(nrows, bucket)
        if ordered:
            longest_first(host[1], out=host[4])
        self._replay_in[:nrows, :bucket].copy_(host, non_blocking=True)
        self.slot_ids[:bucket].copy_(self._replay_in[2, :bucket])
        if fed:
            torch.index_select(self._sampled_dev, 0, self._replay_in[3, :n],
                               out=self.input_ids[:n])
        self._step = step

    @torch.no_grad()
    def decode_forward(self, bucket: int, out: torch.Tensor | None = None,
                       short: bool = False) -> torch.Tensor:
        """The decode step over the first `bucket` rows of the static buffers -> float32 logits
        [bucket, vocab] (written into `out` when given), on the short path
        (`protocol.keys.SHORT`) with `short`: the caller vouches that every row's context
        fits it. Reads only device buffers (graph-capturable)."""
        ids, pos, slots = self.input_ids[:bucket], self.positions[:bucket], self.slot_ids[:bucket]
        self.kv.seq_lens.index_copy_(0, slots.long(), (pos + 1).to(torch.int32))
        hidden = self.model(ids, pos, self._decode_context(slots, self.kv,
                                                           self._replay_in[4, :bucket], short))
        return self.model.compute_logits(hidden, out)

    def run_eager(self, step) -> None:
        """Eager decode of the step's rows padded to its bucket; keeps the logits (rank 0)."""
        self.prepare_replay(step)
        self._step = None
        ev = self.phases.start() if self.phases is not None else None
        logits = self.decode_forward(step.bucket)
        if ev is not None:
            self.phases.stop("decode", ev)
        if self._samples_here:
            self._decode_logits = logits

    def synchronize(self) -> None:
        """Wait for this rank's device work (collectives included) to complete; staged
        page-table writes are flushed first."""
        if self.kv is not None:
            self.kv.flush_pages()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def enqueue_sample(self, step) -> None:
        """Rank 0 (every rank under overlapped scheduling): enqueue the next token of every
        decoded and admitted request of `step`, one batched pass over slots 0..rows+admits-1
        (`engine.sampling.sample_batch`), behind the step's forward, and the copy of the int32
        token ids into the pinned host buffer of the step's parity; under overlap the ids also
        stay in `_sampled_dev` for the next step's fed rows. Returns once the kernels are
        launched: their host work overlaps the forward still running, and `read_tokens` takes
        the ids after the step's synchronize (or `await_step`).

        A request whose logit row is not finite gets -1 from the sampler's own pass (the
        finiteness test runs on the device inside the same pass).
        Raises:
            ValueError: the step's admissions do not take the slots right after its rows.
        """
        n, a = len(step.rows), len(step.admits)
        for i, admit in enumerate(step.admits):
            if admit.slot != n + i:
                raise ValueError(f"step {step.seq}: admission {admit.request_id} in slot "
                                 f"{admit.slot}, expected {n + i} (after the decode rows)")
        parts = []
        if n:
            parts.append(self._decode_logits[:n])
        if a:
            parts.append(self._prefill_logits)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        index = None  # output index of each row's token: decode rows from their position
        if n:
            index = self.positions[:n] - self.slots.prompt_len[:n] + 1
        if a:  # an admission's first token is output output_index (0 unless recomputed)
            first = torch.tensor([x.output_index for x in step.admits], dtype=torch.int64)
            if self.device.type == "cuda":  # pageable memory would make the copy blocking
                first = first.pin_memory().to(self.device, non_blocking=True)
            index = first if index is None else torch.cat([index, first])
        ev = self.phases.start() if self.phases is not None else None
        bp = self.slots.batch(n + a, index)
        tokens, logprobs = sample_batch(logits, bp, want_logprobs=self.slots.n_logprobs > 0)
        if ev is not None:
            self.phases.stop("sample", ev)
        if step.overlap:  # the next step's rows read them here; -1 (not finite) feeds token 0
            self._sampled_dev[:n + a].copy_(tokens.clamp(min=0))
            if any(want for _, want in self.slots.side.values()):
                logits = logits.clone()  # the next step's replay rewrites the graph's logits
        copied = None
        if self.device.type == "cuda":  # a non-blocking copy: complete only once synchronized
            tokens = self._sampled_host[step.seq % 2, :n + a].copy_(tokens, non_blocking=True)
            copied = self._sampled_copied[step.seq % 2]
            copied.record()
        self._pending[step.seq] = PendingSample(
            step.seq, tokens, logprobs, logits, copied, self.slots.request_ids[:n + a],
            dict(self.slots.side), self.phases.take() if self.phases is not None else [])
        self._decode_logits = self._prefill_logits = None

    def mark_step(self, seq: int) -> None:
        """Overlapped scheduling: record a CUDA event behind command ``seq``'s device work
        (nothing to record off CUDA, where every call completes before it returns)."""
        if self.device.type == "cuda":
            event = self._marks.pop(seq - 2, None) or torch.cuda.Event()
            event.record()
            self._marks[seq] = event

    def await_step(self, seq: int) -> None:
        """Overlapped scheduling: block until the device work `mark_step` marked for ``seq``
        completed; the device goes on with what was enqueued after it.

        Raises:
            RuntimeError: ``seq`` was never marked (a protocol error: the worker awaits only
                the previous step's mark).
        """
        if self.device.type != "cuda":
            return
        event = self._marks.get(seq)
        if event is None:
            raise RuntimeError(f"await_step({seq}): no mark_step recorded for command {seq}")
        event.synchronize()

    def read_tokens(self, step) -> tuple[int | None, ...]:
        """Rank 0, after the step's synchronize: the token ids `enqueue_sample` computed for
        `step`, in slot order (the rows, then the admissions), as a tuple -- no Python work per
        row. A request whose logit row is not finite gets `protocol.commands.NO_TOKEN` (the
        controller ends it) and an ``"error"`` side output. Side outputs (logprob, logits when
        asked for) are left in `self.outputs`.
        Raises:
            RuntimeError: `enqueue_sample` did not run for `step` (it must, before the
                step's synchronize), or the copy of its ids has not completed (this read came
                before the synchronize: I11).
        """
        pending = self._pending.pop(step.seq, None)
        if pending is None:
            raise RuntimeError(f"step {step.seq}: no sampled tokens to read; enqueue_sample "
                               f"must run for this step first (sampled and unread: "
                               f"{sorted(self._pending) or 'none'})")
        if pending.copied is not None and not pending.copied.query():
            self._pending[step.seq] = pending
            raise RuntimeError(f"step {step.seq}: the token ids' copy to the host has not "
                               "completed; read_tokens must come after the step's synchronize "
                               "or its await_step (I11)")
        tokens, logprobs, logits = pending.tokens, pending.logprobs, pending.logits
        n, a = len(step.rows), len(step.admits)
        ids = tokens.tolist()
        if self.phases is not None:
            self.phases.close_step(n, a, pending.phases)
        rids = pending.request_ids  # as the step had them: later steps' moves came since
        self.outputs = {}
        if -1 in ids:
            for slot in [i for i, t in enumerate(ids) if t == -1]:
                bad = int((~torch.isfinite(logits[slot])).sum())
                ids[slot] = NO_TOKEN
                self.outputs[rids[slot]] = {"error": f"{bad} of the {logits.shape[-1]} logits "
                                                     "of its next token are not finite (NaN or "
                                                     "inf)"}
        if pending.side:
            lp = logprobs.tolist() if logprobs is not None else None
            for slot, (want_lp, want_logits) in pending.side.items():
                if slot >= n + a or ids[slot] is NO_TOKEN:
                    continue
                out = self.outputs.setdefault(rids[slot], {})
                if want_lp:
                    out["logprob"] = lp[slot]
                if want_logits:
                    out["logits"] = logits[slot].to("cpu", copy=True)  # may view logits_buf
        return tuple(ids)


@dataclass
class PendingSample:
    """What `RankExecutor.enqueue_sample` left for `read_tokens`: the step's sequence number,
    its token ids (int32 [rows + admits]: the pinned host buffer on CUDA, complete once
    `copied` has), logprobs (float32, or None), the logits rows they came from, the CUDA
    event recorded after the copy (None off CUDA), and, as they were when the step sampled,
    the request id of each slot, the slots that want side outputs and the phases a
    `PhaseTimer` recorded (under overlapped scheduling the next step's slot moves and phases
    come before the read)."""

    seq: int
    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    logits: torch.Tensor
    copied: "torch.cuda.Event | None"
    request_ids: list
    side: dict
    phases: list


class SlotSampling:
    """Per-slot sampling parameters in device tensors, moved with their slots.

    Float parameters live in `f` [4, slots + 1] (inverse temperature, noise flag, top_p,
    min_p) and integer ones in `i` [4, slots + 1] (top_k, seed low and high 32 bits, prompt
    length), so the first n slots of each are contiguous slices. Host side: the request id of
    each slot and the slots that want side outputs.
    """

    def __init__(self, max_slots: int, device):
        # decode slots, the padding slot and the chunk slot (a chunked prefill moves out of it)
        self.f = torch.zeros(4, max_slots + 2, dtype=torch.float32, device=device)
        self.i = torch.zeros(4, max_slots + 2, dtype=torch.int64, device=device)
        self.request_ids: list[int | None] = [None] * (max_slots + 2)
        self.params: list[SamplingParams | None] = [None] * (max_slots + 2)
        self.side: dict[int, tuple[bool, bool]] = {}  # slot -> (logprobs, return_logits)
        self.counts = {"top_p": 0, "min_p": 0}
        self.top_ks: Counter[int] = Counter()  # top_k value -> live sampled slots with it
        self.n_logprobs = 0
        self.device = device

    @property
    def prompt_len(self) -> torch.Tensor:
        """int64 [slots + 1]: prompt length of each slot's request."""
        return self.i[3]

    def _count(self, p: SamplingParams, sign: int) -> None:
        sampled = p.temperature > 0
        if sampled and p.top_k > 0:  # the live top-k values, so their maximum needs no sync
            self.top_ks[p.top_k] += sign
            if not self.top_ks[p.top_k]:
                del self.top_ks[p.top_k]
        self.counts["top_p"] += sign * (sampled and p.top_p < 1)
        self.counts["min_p"] += sign * (sampled and p.min_p > 0)
        self.n_logprobs += sign * bool(p.logprobs)

    def admit(self, slots: list[int], request_ids: list[int],
              entries: list[tuple[SamplingParams, int]], prompt_lens: list[int]) -> None:
        """Write the parameters (SamplingParams, seed) of requests entering `slots` (one
        host-to-device copy each for the float and the integer table)."""
        fcols, icols = [], []
        for slot, rid, (p, seed), n in zip(slots, request_ids, entries, prompt_lens):
            self.request_ids[slot] = rid
            sampled = p.temperature > 0
            fcols.append([inverse_temperature(p.temperature), 1.0 if sampled else 0.0,
                          p.top_p if sampled else 1.0, p.min_p if sampled else 0.0])
            icols.append([max(p.top_k, 0) if sampled else 0, *split_seed(seed), n])
            self.params[slot] = p
            self._count(p, +1)
            if p.logprobs or p.return_logits:
                self.side[slot] = (p.logprobs, p.return_logits)
        idx = torch.tensor(slots, dtype=torch.long)
        f = torch.tensor(fcols, dtype=torch.float32).T.contiguous()
        i = torch.tensor(icols, dtype=torch.int64).T.contiguous()
        if self.f.is_cuda:  # pinned (torch's host allocator keeps it until the copy ran)
            idx, f, i = (t.pin_memory().to(self.device, non_blocking=True) for t in (idx, f, i))
        self.f.index_copy_(1, idx, f)
        self.i.index_copy_(1, idx, i)

    def release(self, slot: int) -> None:
        """Forget the request in `slot`."""
        p = self.params[slot]
        if p is not None:
            self._count(p, -1)
        self.params[slot] = None
        self.request_ids[slot] = None
        self.side.pop(slot, None)

    def move(self, src: int, dst: int) -> None:
        """The request in `src` moves to the empty slot `dst`."""
        self.f[:, dst] = self.f[:, src]
        self.i[:, dst] = self.i[:, src]
        self.params[dst], self.params[src] = self.params[src], None
        self.request_ids[dst], self.request_ids[src] = self.request_ids[src], None
        if src in self.side:
            self.side[dst] = self.side.pop(src)

    def batch(self, rows: int, index: torch.Tensor | None) -> BatchParams:
        """The BatchParams of slots 0..rows-1 (views), with output indices `index` (int64
        [rows]; zeros when None)."""
        if index is None:
            index = torch.zeros(rows, dtype=torch.int64, device=self.f.device)
        return BatchParams(
            inv_temp=self.f[0, :rows], noise=self.f[1, :rows], top_p=self.f[2, :rows],
            min_p=self.f[3, :rows], top_k=self.i[0, :rows], seed_lo=self.i[1, :rows],
            seed_hi=self.i[2, :rows], index=index, any_top_k=bool(self.top_ks),
            any_top_p=self.counts["top_p"] > 0, any_min_p=self.counts["min_p"] > 0,
            max_top_k=max(self.top_ks, default=0))


class PhaseTimer:
    """Device time of each phase of a serving step (prefill, decode, sample), from CUDA events
    recorded around them; read once the step synchronised. For benchmarks (CUDA only).

    `steps` holds one dict per step: rows, admits and milliseconds per phase.
    """

    def __init__(self):
        self._open: list = []
        self.steps: list[dict] = []

    def start(self):
        """Record and return a start event on the current stream."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, phase: str, start) -> None:
        """Close `phase`, started at event `start`."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((phase, start, end))

    def take(self) -> list:
        """The phases recorded since the last `take`, for a later `close_step`: under
        overlapped scheduling a step's phases are read after the next step recorded its own."""
        taken, self._open = self._open, []
        return taken

    def close_step(self, rows: int, admits: int, phases: list) -> None:
        """Fold a step's ``phases`` (from `take`) into `steps` (their events must have
        completed)."""
        step = {"rows": rows, "admits": admits, "prefill": 0.0, "decode": 0.0, "sample": 0.0}
        for phase, a, b in phases:
            step[phase] += a.elapsed_time(b)
        self.steps.append(step)
