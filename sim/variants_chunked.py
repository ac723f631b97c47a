"""Variants of chunked prefill (issue 12 item 2, I19): the scenario whose prompts are all longer
than a step's prefill budget, a known-bad worker that writes every chunk from position 0, and a
known-bad design that keeps the token sampled after a non-final chunk.

`chunked` turns any scenario into one whose step prefill budget is one token short of its
shortest prompt, so every prompt is prefilled over at least two steps: non-final `Chunk`s
through the chunk slot, then its last chunk as an `Admit` with ``start`` > 0 that moves the
sequence into a decode slot and samples, decode rows of other requests going on in the same
steps. The correct protocol must give every request the tokens it gets alone: the modelled
prefill reads the whole prompt back from the paged KV cache, so a chunk written at the wrong
position, a chunk whose pages were not handed out, or a token sampled from part of the prompt
changes the request's tokens. Both clean rows draw ``memory_headroom_bytes`` per run
(`sim.headroom.HeadroomDraw`), as the ``correct`` row does, so a fit that mishandles the
headroom does not read as correct under chunked prefill; the pressure row keeps its pool of one
sequence in every run that serves (`sim.variants_paging`).

The ``chunk-restarts-at-zero`` worker prefills each chunk as if it began the sequence: its
tokens land at positions 0.. (the cached length reset at each chunk), as in a prefill whose KV
write "unconditionally starts at index 0" (hw-native-sys/pypto-lib PR #160 review) or whose
chunk positions ignore what earlier chunks cached (huggingface/transformers #43082: chunked
prefill's position_ids cover only the current chunk). The modelled device keeps each slot's
cached length (the engine's ``seq_lens``), and its prefill checks that every piece continues
its sequence (I19): the second piece of a prompt, written from 0 over a sequence that caches
the first, is caught in the step that writes it. Without that check the last chunk's read of
the prompt would see the tail where the head should be, and the request's first token would
diverge.

The ``chunk-token-kept`` design samples a token for every sequence of a prefill batch, a
non-final chunk included, and appends it to the request's output: the scheduler does not
discard the token of a partial prefill (vLLM's model runner discards it; tenstorrent/tt-xla
#5830 appended a token to rows that had no complete prefill in the step). That token is
predicted from part of the prompt, so the request's output diverges from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from protocol.backend import EnqueueSample, Op, Prefill, ReadTokens
from protocol.commands import Reply, Step
from protocol.controller import Controller
from protocol.worker import Worker
from sim.common import DONE
from sim.devices import SampleKernel
from sim.headroom import HeadroomDraw
from sim.scenario import Scenario
from sim.variants import Variant, register
# the module, not its function: where a script imports sim.variants_paging first, that module is
# still half run when this one is imported, and its page_pressure not yet defined
from sim import variants_paging


def chunked(sc: Scenario) -> Scenario:
    """``sc`` with a step prefill budget of its shortest prompt less one token (at least one):
    every prompt of its workload is prefilled in chunks."""
    shortest = min((len(a.request.prompt) for a in sc.workload), default=2)
    return sc.with_(config=replace(sc.config, max_prefill_tokens=max(1, shortest - 1)))


register(Variant(
    name="chunked-prefill",
    summary="the correct protocol with every prompt longer than a step's prefill budget: "
            "prompts are prefilled in chunks beside decode rows; only the last chunk samples",
    source="Agrawal et al., \"Taming Throughput-Latency Tradeoff in LLM Inference with "
           "Sarathi-Serve\", OSDI 2024 (chunked prefills in mixed batches)",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: each chunk writes its tokens after those already cached, through "
           "the chunk slot, with the pages its command hands out; the last chunk moves the "
           "sequence into its decode slot and alone samples.",
    adjust=chunked,
    reaches=("chunked_prefill",), draw=HeadroomDraw))


register(Variant(
    name="chunked-prefill-pressure",
    summary="chunked prefill under a KV pool of one full-length sequence: the request in "
            "chunked prefill is preempted first when decode rows need pages, and restarts",
    source="vLLM recompute preemption (Kwon et al., SOSP 2023, section 4.5) with chunked "
           "prefill (Sarathi-Serve, OSDI 2024)",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: preempting the request in chunked prefill frees its pages and "
           "its chunk slot in the step's command; it is prefilled again from its first chunk.",
    adjust=lambda sc: chunked(variants_paging.page_pressure(sc)),
    reaches=("chunked_prefill", "preemption"), draw=HeadroomDraw))


class ChunkRestartsWorker(Worker):
    """Prefills every chunk from position 0, as if each began the sequence: a non-final chunk
    is written at 0..len-1 and the last chunk's tokens too, over the head of the prompt."""

    def _ops_step(self, step: Step) -> list[Op]:
        ops = super()._ops_step(step)
        return [Prefill(tuple(replace(a, prompt=a.tokens, start=0) for a in op.admits),
                        replace(op.chunk, start=0) if op.chunk is not None else None)
                if isinstance(op, Prefill) else op for op in ops]


register(Variant(
    name="chunk-restarts-at-zero",
    summary="each rank writes every prefill chunk from position 0 (the cached length reset at "
            "each chunk) instead of after the tokens earlier chunks cached",
    source="hw-native-sys/pypto-lib PR #160 review (prefill KV write hard-coded to start at "
           "index 0 corrupts continued/chunked prefill); huggingface/transformers #43082 "
           "(chunked prefill position_ids cover only the current chunk)",
    expected={"shared": "invariant:I19", "per-rank": "invariant:I19"},
    remedy="A chunk carries its start (the tokens already cached) and the worker writes it "
           "there; only the last chunk, which has read the whole prompt, samples.",
    worker_cls=ChunkRestartsWorker,
    adjust=chunked))


@dataclass(frozen=True)
class SampleChunkToo(Op):
    """Rank 0: sample every admitted and decoded request of ``step`` and, after them, the
    request of the step's non-final chunk from its chunk's last token."""

    name: ClassVar[str] = "sample_chunk_too"
    step: Step


def _sim_sample_chunk_too(backend, r, host, op, probe):
    """The modelled sampler, then the chunk's token from the modelled prefill's output."""
    if probe:
        return DONE
    step, dev = op.step, backend.world.devices[r]
    backend.world.device_model.execute(r, dev, SampleKernel(
        step.seq, len(step.rows), tuple(a.request_id for a in step.admits)))
    seq, token = dev.prefill_out.get(step.chunk.request_id, (None, -1))
    host.result = dev.sampled.ids + (token if seq == step.seq else -1,)
    return DONE


class ChunkTokenWorker(Worker):
    """Rank 0 samples the step's non-final chunk too and replies with its token last."""

    def _ops_step(self, step: Step) -> list[Op]:
        ops = super()._ops_step(step)
        if self.rank != 0 or step.chunk is None:
            return ops
        ops = [op for op in ops if not isinstance(op, (EnqueueSample, ReadTokens))]
        return ops + [SampleChunkToo(step)]

    def reply(self, command, results) -> Reply:
        reply = super().reply(command, results)
        if (self.rank == 0 and isinstance(command, Step) and command.chunk is not None
                and not (command.rows or command.admits)):
            reply = replace(reply, payload=results[-1])
        return reply


class ChunkTokenKeptController(Controller):
    """Takes a token for the step's non-final chunk (rank 0's reply carries it last) and
    appends it to that request's output, as for any other prefill."""

    def _validate(self, reply: Reply) -> None:
        step = self.current
        if (reply.rank == 0 and isinstance(step, Step) and step.chunk is not None
                and isinstance(reply.payload, tuple) and reply.payload):
            reply = replace(reply, payload=reply.payload[:-1])
            if not (step.rows or step.admits):
                reply = replace(reply, payload=None)
        super()._validate(reply)

    def _absorb_step(self, step: Step, tokens: tuple) -> None:
        if step.chunk is not None and tokens:
            self.outputs[step.chunk.request_id].append(tokens[-1])
            tokens = tokens[:-1]
        super()._absorb_step(step, tokens)


register(Variant(
    name="chunk-token-kept",
    summary="rank 0 samples every sequence of a prefill batch, a non-final chunk included, and "
            "the scheduler appends the chunk's token to the request's output instead of "
            "discarding it",
    source="tenstorrent/tt-xla #5830 (tokens appended to rows without a complete prefill during "
           "chunked prefill); vLLM's model runner discards the sampled token of a partial "
           "prefill",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy="Only the last chunk samples: a non-final chunk is a `Chunk`, which rank 0's reply "
           "carries no token for (the reply holds exactly the rows and admissions, I19).",
    controller_cls=ChunkTokenKeptController,
    worker_cls=ChunkTokenWorker,
    sim_ops={SampleChunkToo: _sim_sample_chunk_too},
    adjust=chunked))
