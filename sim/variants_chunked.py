"""Variants of chunked prefill (issue 12 item 2): the scenario whose prompts are all longer than a
step's prefill budget, and a known-bad worker that writes every chunk from position 0.

`chunked` turns any scenario into one whose step prefill budget is one token short of its
shortest prompt, so every prompt is prefilled over at least two steps: non-final `Chunk`s
through the chunk slot, then its last chunk as an `Admit` with ``start`` > 0 that moves the
sequence into a decode slot and samples, decode rows of other requests going on in the same
steps. The correct protocol must give every request the tokens it gets alone: the modelled
prefill reads the whole prompt back from the paged KV cache, so a chunk written at the wrong
position, a chunk whose pages were not handed out, or a token sampled from part of the prompt
changes the request's tokens.

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
"""

from __future__ import annotations

from dataclasses import replace

from protocol.backend import Op, Prefill
from protocol.commands import Step
from protocol.worker import Worker
from sim.scenario import Scenario
from sim.variants import Variant, register
from sim.variants_paging import page_pressure


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
    reaches=("chunked_prefill",)))


register(Variant(
    name="chunked-prefill-pressure",
    summary="chunked prefill under a KV pool of one full-length sequence: the request in "
            "chunked prefill is preempted first when decode rows need pages, and restarts",
    source="vLLM recompute preemption (Kwon et al., SOSP 2023, section 4.5) with chunked "
           "prefill (Sarathi-Serve, OSDI 2024)",
    expected={"shared": "clean", "per-rank": "clean"},
    remedy="Nothing to fix: preempting the request in chunked prefill frees its pages and "
           "its chunk slot in the step's command; it is prefilled again from its first chunk.",
    adjust=lambda sc: chunked(page_pressure(sc)),
    reaches=("chunked_prefill", "preemption")))


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
