"""Device state in the simulator (issue 10 items 1, 2, 7): per-slot KV contents that the modelled
next token reads, padding rows on the scratch slot, buffers with generations that graphs
capture, and direct invariants checked at the step where they break."""

import re
from dataclasses import replace

import pytest

from protocol.backend import RunEager
from protocol.commands import DecodeRow, Step
from protocol.controller import Broadcast, Controller
from protocol.keys import GraphKey
from protocol.worker import Worker
from sim.check import CheckSpec, check_bad
from sim.devices import DeviceModel
from sim.kv import ModelledKV, next_token
from sim.ops import ModelledBackend
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import REGISTRY, Variant
from tests.sim.test_variants import SPEC

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)


def test_next_token_reads_the_whole_history_and_kv_slots_hold_positions():
    assert next_token((1, 2, 3), 1000) != next_token((9, 2, 3), 1000)
    kv = ModelledKV(4)
    for position, token in enumerate((5, 6, 7)):
        kv.write(1, position, token)
    assert kv.read(1, 2) == (5, 6, 7) and kv.read(1, 3) == (5, 6, 7, -1)
    kv.copy(1, 0)
    kv.write(1, 0, 9)
    assert kv.read(0, 2) == (5, 6, 7) and kv.read(1, 0) == (9,)
    kv.lengths[1] = 3
    kv.copy(1, 0)
    assert kv.lengths[0] == 3
    kv.copy(3, 2)  # a never-written slot copies as empty: no row, length 0 (seq_lens)
    assert kv.read(2, 0) == (-1,) and kv.lengths[2] == 0


@pytest.mark.timeout(60)
def test_correct_protocol_reaches_padded_replays_and_matches_the_reference():
    result = run_schedule(default_scenario(**SMALL), REGISTRY["correct"], RandomWalk(0))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached["padded_replay"] > 0 and result.reached["replay"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
def test_padding_into_a_live_slot_is_caught_at_its_step(topology):
    row = check_bad(REGISTRY["padding-into-live-slot"], SPEC, topology)
    outcome = row.minimal.outcome
    assert row.got == "invariant:I8" and outcome.step is not None and outcome.rank is not None
    assert f"step {outcome.step}" in outcome.detail


@pytest.mark.timeout(120)
def test_padding_into_a_live_slot_corrupts_tokens_through_the_kv(monkeypatch):
    """Without the direct I8 check the bug still shows: padding rows overwrite the live
    request's KV, and its next tokens differ from running it alone."""
    monkeypatch.setattr(DeviceModel, "check_rows", lambda self, r, seq, rows: True)
    sc = default_scenario(**SMALL)
    outcome = run_schedule(sc, REGISTRY["padding-into-live-slot"], RandomWalk(0)).outcome
    assert outcome.verdict == "divergence" and "diverged at output token" in outcome.detail


@pytest.mark.timeout(120)
def test_replay_over_a_reallocated_kv_cache_is_i14_and_computes_from_stale_memory(monkeypatch):
    sc = default_scenario(topology="per-rank", **SMALL)
    variant = REGISTRY["kv-realloc-under-graphs"]
    outcome = run_schedule(sc, variant, RandomWalk(0)).outcome
    assert outcome.invariant == "I15" and "generation 1" in outcome.detail
    assert re.search(r"but command \d+ \(Finalize\) re-allocated kv since", outcome.detail)
    assert outcome.rank is not None and outcome.step is not None
    monkeypatch.setattr(ModelledBackend, "live_buffers", lambda self, r, host, graph: True)
    outcome = run_schedule(sc, variant, RandomWalk(0)).outcome
    # the stale cache's sequences are not the live ones: a row reads KV nobody wrote there
    assert outcome.invariant == "I21" and outcome.step is not None
    monkeypatch.setattr(DeviceModel, "check_continues",
                        lambda self, r, seq, kv, rows, padding=None: True)
    outcome = run_schedule(sc, variant, RandomWalk(0)).outcome
    assert outcome.verdict == "divergence" and "diverged at output token" in outcome.detail


def _mutant(name, controller_cls):
    return Variant(name=name, summary="test mutant", source="test",
                   expected={"shared": "clean", "per-rank": "clean"}, controller_cls=controller_cls)


class KeepsWatchdogArmed(Controller):
    """Issue 11: the watchdog is not disarmed at the end of a successful sweep."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.watchdog.disarm = lambda: None


class AdmitsPastTheFittedCap(Controller):
    """Admission uses the requested max batch, not the memory-fitted cap."""

    def sweep_commands(self, seq, index):
        if self.memory is not None and self.memory.batch_cap < self.config.max_batch:
            self.memory = replace(self.memory, batch_cap=self.config.max_batch)
        return super().sweep_commands(seq, index)

    def fit_memory(self, reports, graph_bytes):
        return replace(super().fit_memory(reports, graph_bytes), batch_cap=2)


class ReplaysASmallerGraph(Controller):
    """Picks the bucket below the row count (floor instead of ceiling)."""

    def next_action(self):
        action = super().next_action()
        step = getattr(action, "command", None)
        if isinstance(step, Step) and step.key is not None and len(step.rows) > 1:
            smaller = max(b for b in self.plan.buckets if b < len(step.rows))
            step = replace(step, key=GraphKey(smaller), bucket=smaller)
            self.current = step
            return Broadcast(step)
        return action


@pytest.mark.timeout(60)
@pytest.mark.parametrize("controller_cls, invariant", [
    (KeepsWatchdogArmed, "I6"), (AdmitsPastTheFittedCap, "I9"), (ReplaysASmallerGraph, "I7")])
def test_direct_invariants_fire_at_the_step_that_breaks_them(controller_cls, invariant):
    sc = default_scenario(**SMALL)
    assert run_schedule(sc, REGISTRY["correct"], RandomWalk(1)).outcome.verdict == "clean"
    outcome = run_schedule(sc, _mutant("m", controller_cls), RandomWalk(1)).outcome
    assert (outcome.verdict, outcome.invariant) == ("invariant", invariant), outcome.detail
    assert outcome.step is not None


class RunsEagerOnRankOne(Worker):
    """Rank 1 runs every serving step eagerly, whatever graph the command names."""

    def forward_ops(self, step):
        return [RunEager(step)] if self.rank == 1 else super().forward_ops(step)


@pytest.mark.timeout(60)
def test_a_rank_that_leaves_the_commanded_path_is_caught_at_its_step():
    """The direct I2 check of the path a rank takes in a serving step (`commanded_path`):
    a rank that runs eagerly where the step says replay no longer runs its peers' program.
    No shipped variant leaves the commanded path, so a mutant that let an eager run pass for
    any replay command survived; the run then ended as the collectives' own divergence,
    naming neither the rank nor its departure (docs/mutation.md)."""
    variant = Variant(name="eager-rank-test", summary="rank 1 ignores the step's graph",
                      source="test",
                      expected={"shared": "invariant:I2", "per-rank": "invariant:I2"},
                      worker_cls=RunsEagerOnRankOne)
    outcome = run_schedule(default_scenario(**SMALL), variant, RandomWalk(0)).outcome
    assert (outcome.verdict, outcome.invariant, outcome.rank) == ("divergence", "I2", 1)
    assert "rank 1 ran eagerly in step" in outcome.detail and "says replay" in outcome.detail


def test_the_sampler_kernel_reads_only_what_its_own_command_computed():
    """A logits row or prefill output left by an earlier command reads as token -1: a read of
    stale device data must look wrong, or early-token-read and its kin would look clean."""
    from sim.devices import Device, DeviceModel, SampledIds, SampleKernel

    dev = Device(rank=0)
    dev.allocate("logits", {0: (5, 11), 1: (6, 12)})   # row 0 from command 5, row 1 from 6
    dev.prefill_out.update({7: (6, 13), 8: (5, 14)})    # request 8 was prefilled by command 5
    DeviceModel(world=None).execute(0, dev, SampleKernel(6, 2, (7, 8)))
    assert dev.sampled == SampledIds(6, (-1, 12, 13, -1))
    DeviceModel(world=None).execute(0, dev, SampleKernel(5, 1, (8,)))
    assert dev.sampled == SampledIds(5, (11, 14))


@pytest.mark.timeout(120)
def test_async_row_parallel_diverges_exactly_when_any_rank_reads_an_unfinished_all_reduce():
    """async-row-parallel's consumer reads a partial sum only when its all-reduce has not
    completed: a schedule where the collective finishes first computes the right token. The
    next layer's all-reduce sums every rank's hidden state, so a partial sum read on any rank
    makes the sampled token wrong, not only one read on rank 0, the rank that samples (before,
    the model corrupted rank 0's logits alone, and rank 1's early reads changed nothing). With
    every random schedule of the check's workload some consumer runs early and some late, so the
    verdict stayed divergence when mutant #3008 (docs/mutation.md) corrupted the *completed*
    reads instead; one request with one decode step has runs of each kind, among them runs where
    only rank 1 read early."""
    from protocol.requests import Request
    from sim.scenario import Arrival
    from sim.variants import ConsumeAsync, _sim_consume_async

    reads = []

    def consume(world, r, dev, kernel):
        reads.append((r, dev.completed_collectives >= kernel.needed))
        return _sim_consume_async(world, r, dev, kernel)

    variant = replace(REGISTRY["async-row-parallel"], name="async-row-parallel-spied",
                      sim_kernels={**REGISTRY["async-row-parallel"].sim_kernels,
                                   ConsumeAsync: consume})
    sc = variant.scenario(default_scenario(buckets=(1, 2), max_batch=2))
    sc = sc.with_(workload=(Arrival(0, Request(0, prompt=(1, 2, 3), max_tokens=2)),))
    verdicts, only_rank_1 = set(), 0
    for seed in range(40):
        reads.clear()
        outcome = run_schedule(sc, variant, RandomWalk(seed)).outcome
        early = {r for r, complete in reads if not complete}
        assert {r for r, _ in reads} == {0, 1}, seed
        assert outcome.verdict == ("divergence" if early else "clean"), (seed, reads, outcome.detail)
        verdicts.add(outcome.verdict)
        only_rank_1 += early == {1}
    assert verdicts == {"clean", "divergence"}  # both kinds of schedule were run
    assert only_rank_1 > 0  # and the rank that does not sample was the only one to read early


@pytest.mark.timeout(60)
def test_the_correct_protocol_replays_mixed_steps_and_matches_the_reference():
    result = run_schedule(default_scenario(**SMALL), REGISTRY["correct"], RandomWalk(0))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached["mixed_replay"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
def test_a_prefill_dispatched_into_the_graph_is_caught_at_its_step(topology):
    row = check_bad(REGISTRY["prefill-dispatched-into-graph"], SPEC, topology)
    outcome = row.minimal.outcome
    assert row.got == "invariant:I21" and outcome.step is not None and outcome.rank is not None
    assert f"step {outcome.step} decodes request" in outcome.detail


@pytest.mark.timeout(120)
def test_a_prefill_dispatched_into_the_graph_corrupts_tokens_through_the_kv(monkeypatch):
    """Without the direct I21 check the bug still shows: the admitted prompts' KV was never
    written, so their tokens differ from running them alone."""
    monkeypatch.setattr(DeviceModel, "check_continues",
                        lambda self, r, seq, kv, rows, padding=None: True)
    sc = default_scenario(**SMALL)
    outcome = run_schedule(sc, REGISTRY["prefill-dispatched-into-graph"], RandomWalk(0)).outcome
    assert outcome.verdict == "divergence" and "diverged at output token" in outcome.detail


def test_i21_flags_a_row_whose_slot_caches_fewer_tokens_than_its_position():
    world = run_schedule(default_scenario(**SMALL), REGISTRY["correct"], RandomWalk(0)).world
    world.outcome = None
    kv = ModelledKV(9)
    kv.write(0, 0, 5)
    kv.lengths[0] = 1
    row = DecodeRow(slot=0, request_id=7, token=5, position=1)
    assert world.device_model.check_continues(0, 1, kv, [row]) and world.outcome is None
    gap = DecodeRow(slot=0, request_id=7, token=5, position=2)  # position 1 never written
    assert not world.device_model.check_continues(0, 1, kv, [gap])
    assert world.outcome.invariant == "I21" and world.outcome.step == 1


@pytest.mark.timeout(60)
def test_i21_flags_a_row_over_a_slot_that_caches_nothing():
    """I21's case from vllm-project/vllm #53051 is a request taken into the decode graph as a
    row before its prompt was ever prefilled: its slot caches nothing at all. A slot with no
    length yet must count as 0 cached tokens, so a one-token prompt's first decode row
    (position 1) over an empty slot breaks I21; the simulator audit's mutant that read an
    absent slot as 1 token passed every other test (docs/mutation.md)."""
    world = run_schedule(default_scenario(**SMALL), REGISTRY["correct"], RandomWalk(0)).world
    world.outcome = None
    row = DecodeRow(slot=3, request_id=7, token=5, position=1)
    assert not world.device_model.check_continues(0, 4, ModelledKV(9), [row])
    assert (world.outcome.invariant, world.outcome.step) == ("I21", 4)
    assert "caches 0 tokens" in world.outcome.detail


@pytest.mark.timeout(120)
def test_overlapped_eager_decode_feeds_its_rows_and_matches_the_reference():
    """Served without graphs, overlapped scheduling's decode steps (mixed ones too) run eagerly
    and read their input tokens on the device (`EagerDecode.feed`). With graphs on, every decode
    step of the check's workload replays, so no shipped row runs this path any more: a fed
    eager decode that ignores its feed survived `lockstep check` and tests/sim."""
    from sim.variants_overlap import overlapped

    sc = overlapped(default_scenario(**SMALL, cuda_graphs=False))
    result = run_schedule(sc, REGISTRY["correct"], RandomWalk(0))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached["eager_decode"] > 0 and result.reached["replay"] == 0
    assert result.reached["fed_row"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["chunk-token-kept", "overlap-keeps-leftover-token",
                                  "async-row-parallel"])
def test_a_token_divergence_names_the_step_that_sampled_the_wrong_token(name):
    """Issue 10 item 1: the report points at the step that produced the wrong token, not at
    teardown; that step (the overlapped reply's `read` step under overlap) holds a row or an
    admission of the request."""
    from sim.checks import first_wrong_token
    from sim.strategies import Replay

    row = check_bad(REGISTRY[name], SPEC, "shared")
    minimal = row.minimal
    outcome = minimal.outcome
    assert outcome.verdict == "divergence" and outcome.step is not None
    assert outcome.invariant is None and outcome.check == "tokens"  # it does not know the rule
    assert f"(the token step {outcome.step} sampled)" in outcome.detail
    rid = first_wrong_token(minimal.world).request
    steps = {}

    def record(world):
        if isinstance(world.ctrl.current, Step):
            steps[world.ctrl.current.seq] = world.ctrl.current

    run_schedule(minimal.world.scenario, REGISTRY[name], Replay(minimal.choices), on_state=record)
    step = steps[outcome.step]
    chunk = (step.chunk.request_id,) if step.chunk is not None else ()
    assert rid in step.rows.request_ids + tuple(a.request_id for a in step.admits) + chunk
    assert outcome.step < max(steps)  # not the last serving step by default, nor teardown


def test_the_reducer_never_trades_one_kind_of_divergence_for_another():
    """A token divergence and a request that never finished both name no invariant; the
    reducer tells them apart by the check that found them (a reviewer's finding: once token
    divergences lost their guessed I11/I12, the two compared equal)."""
    from types import SimpleNamespace

    from sim.common import Outcome
    from sim.reduce import same_failure

    def run(outcome):
        return SimpleNamespace(outcome=outcome)

    tokens = Outcome("divergence", "request 3 diverged at output token 4", check="tokens")
    unfinished = Outcome("divergence", "requests [3] never finished", check="unfinished")
    assert same_failure(run(tokens), run(Outcome("divergence", "another token", check="tokens")))
    assert not same_failure(run(tokens), run(unfinished))


class _ReportsOneGraphLess(Worker):
    """Rank 1 reports a captured set one graph short at Finalize (the controller's I3 check)."""

    def reply(self, command, results):
        from dataclasses import replace as _replace

        from protocol.commands import Finalize

        out = super().reply(command, results)
        if isinstance(command, Finalize) and self.rank == 1:
            captured = out.payload.captured
            out = _replace(out, payload=_replace(out.payload,
                                                 captured=captured - {min(captured)}))
        return out


@pytest.mark.timeout(60)
def test_a_rank_reporting_another_graph_set_at_finalize_is_an_i3_divergence():
    """The controller's Finalize check (I3): ranks must report the same captured graph set. No
    shipped variant reaches it (the verdict's `return` survived a targeted mutation run,
    docs/mutation.md 2026-12-06)."""
    from dataclasses import replace

    from sim.scenario import default_scenario

    variant = replace(REGISTRY["correct"], name="reports-one-graph-less",
                      worker_cls=_ReportsOneGraphLess)
    result = run_schedule(default_scenario(buckets=(1, 2, 4, 8), max_batch=8), variant,
                          RandomWalk(0))
    out = result.outcome
    assert (out.verdict, out.invariant) == ("divergence", "I3"), out.detail
    assert "rank 1 captured a different graph set" in out.detail


@pytest.mark.timeout(120)
def test_i11_names_the_command_that_read_the_overwritten_ids():
    """An overlapped step reads the ids of the step before it; when a later copy overwrote
    them, the I11 finding names the command that read (where the harm happens), not the step
    whose ids were lost (a targeted mutation run left this choice untested)."""
    import re

    row = check_bad(REGISTRY["overlap-one-token-buffer"],
                    CheckSpec(schedules=30, fault_schedules=0, jobs=1), "shared")
    out = row.minimal.outcome
    read = int(re.search(r"read the token ids of step (\d+)", out.detail).group(1))
    assert out.invariant == "I11" and out.step > read, (out.step, out.detail)


@pytest.mark.timeout(60)
def test_chunked_prefill_counts_each_prefill_that_carries_a_chunk(monkeypatch):
    """`reached["chunked_prefill"]` (what the chunked variants must reach, `Variant.reaches`)
    counts one per rank's prefill that carries a chunk or a last chunk, and no other."""
    from sim.ops import ModelledBackend

    calls = []
    real = ModelledBackend.prefill

    def recording(self, r, host, admits, chunk=None):
        calls.append(chunk is not None or any(a.start for a in admits))
        return real(self, r, host, admits, chunk)

    monkeypatch.setattr(ModelledBackend, "prefill", recording)
    variant = REGISTRY["chunked-prefill"]
    result = run_schedule(variant.scenario(default_scenario(**SMALL)), variant, RandomWalk(0))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert any(calls) and result.reached["chunked_prefill"] == sum(calls)


def test_chunked_prefill_chunks_prompts_of_two_tokens_too():
    """The variant's budget is the shortest prompt less one token, at least one, so that every
    prompt is chunked: prompts of 2 tokens are prefilled a token at a time. The check's workload
    has prompts of 3 tokens, where a floor of 1 or 2 gives the same budget; mutant #3178 made it
    2 and left prompts of 2 tokens whole, with nothing chunked."""
    from sim.scenario import with_prompt_lengths

    base = default_scenario(**SMALL)
    variant = REGISTRY["chunked-prefill"]
    sc = variant.scenario(with_prompt_lengths(base, [2] * len(base.workload)))
    assert sc.config.max_prefill_tokens == 1
    result = run_schedule(sc, variant, RandomWalk(0))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached["chunked_prefill"] > 0


def test_freeing_the_graphs_empties_the_shared_pool_and_the_registrations():
    from protocol.keys import GraphKey
    from sim.common import DONE
    from sim.devices import Graph
    from sim.world import World

    world = World(default_scenario(**SMALL), REGISTRY["correct"])
    key = GraphKey(8)
    world.graphs[0][key] = Graph(key, 300)
    world.used[0] += 300
    world.graph_pool[0] = 300
    world.devices[0].registered.append((key, "tp", "all-reduce"))
    before = world.used[0] - 300
    assert world.backend.free_graphs(0, world.hosts[0], probe=False) == DONE
    assert world.graph_pool[0] == 0 and not world.graphs[0] and not world.devices[0].registered
    assert world.used[0] == before


@pytest.mark.timeout(60)
def test_a_clean_run_s_trace_marks_every_event_ok_and_the_watchdog_s_arming():
    """The trace the invariants and the narrative read: a clean run has no failed event, and
    the startup watchdog's arming (with its deadline) and disarming are events of their own."""
    result = run_schedule(default_scenario(**SMALL), REGISTRY["correct"], RandomWalk(0))
    assert result.outcome.verdict == "clean", result.outcome.detail
    trace = result.world.trace
    assert all(e.ok for e in trace)
    kinds = [e.kind for e in trace]
    transitions = [k for k in kinds if k in ("watchdog-arm", "watchdog-disarm")]
    assert transitions[::2] == ["watchdog-arm"] * len(transitions[::2])  # they alternate
    assert transitions[1::2] == ["watchdog-disarm"] * len(transitions[1::2])
    arm = kinds.index("watchdog-arm")
    assert trace[arm].detail.startswith("deadline ") and trace[arm].detail.endswith("s")
    assert "watchdog-disarm" in kinds[arm:]
    first_capture = next(i for i, e in enumerate(trace) if e.kind == "send" and e.what == "Capture")
    assert arm < first_capture


def _replayed_on_a_replaced_cache(name: str):
    """(scenario, variant, result) of the shipped variant ``name`` on the small scenario, whose
    run the buffer-generation check must end at a replay of a re-allocated buffer (I15)."""
    variant = REGISTRY[name]
    sc = variant.scenario(default_scenario(topology="shared", **SMALL))
    result = run_schedule(sc, variant, RandomWalk(0))
    assert result.outcome.invariant == "I15" and result.outcome.check == "replay-of-freed-buffer"
    return sc, variant, result


def _stale_cache_shows_without_the_direct_checks(sc, variant, monkeypatch) -> None:
    """A replay on a stale KV cache, with the buffer-generation check (I15) off, is caught as a
    row that reads a cache its sequence never wrote (I21); with that off too, in the tokens."""
    monkeypatch.setattr(ModelledBackend, "live_buffers", lambda self, r, host, graph: True)
    outcome = run_schedule(sc, variant, RandomWalk(0)).outcome
    assert outcome.invariant == "I21" and outcome.check == "decode-row-past-cache"
    monkeypatch.setattr(DeviceModel, "check_continues",
                        lambda self, r, seq, kv, rows, padding=None: True)
    outcome = run_schedule(sc, variant, RandomWalk(0)).outcome
    assert outcome.verdict == "divergence" and "diverged at output token" in outcome.detail


@pytest.mark.timeout(120)
def test_a_wake_that_reallocates_the_kv_cache_replays_freed_memory(monkeypatch):
    """kv-realloc-on-wake: the sleep/wake's second AllocateKV, taken by a worker without the
    lifecycle rule, leaves the startup graphs on the freed cache (I15, at the first replay);
    without that direct check the stale cache still shows in the tokens. The first round
    replays the same graphs on the cache they captured, and is served."""
    sc, variant, result = _replayed_on_a_replaced_cache("kv-realloc-on-wake")
    outcome = result.outcome
    assert "kv generation 1" in outcome.detail and "live generation 2" in outcome.detail
    wake = re.search(r"but command (\d+) \(AllocateKV\) re-allocated kv since", outcome.detail)
    assert wake and int(wake.group(1)) < outcome.step
    before = [e for e in result.world.trace if e.seq is not None and e.seq < int(wake.group(1))]
    assert any(e.kind == "op" and e.what == "launch" and e.detail.startswith("decode")
               for e in before)  # serving replays before the wake
    assert result.world.ctrl.finished  # the first round's requests finished
    _stale_cache_shows_without_the_direct_checks(sc, variant, monkeypatch)


def _against_the_protocols_worker(controller_cls, sc):
    """Run a variant's controller against the protocol's own worker; its lifecycle rule must
    refuse, I15, as the ranks' reply (the run's result)."""
    variant = Variant(name="against-the-rule", summary="test", source="test",
                      expected={"shared": "clean", "per-rank": "clean"},
                      controller_cls=controller_cls)
    result = run_schedule(sc, variant, RandomWalk(0))
    assert result.outcome.invariant == "I15" and result.outcome.check == "rank:error"
    return result


@pytest.mark.timeout(120)
def test_the_lifecycle_rule_refuses_the_wake_before_any_memory_moves():
    """The same sleep/wake controller against the protocol's own worker: every rank refuses
    the second AllocateKV (I15, from the rank's reply), and no buffer was re-allocated."""
    from sim.scenario import in_rounds
    from sim.variants_state import SleepWakeController
    result = _against_the_protocols_worker(SleepWakeController,
                                           in_rounds(default_scenario(topology="shared", **SMALL)))
    outcome = result.outcome
    assert "AllocateKV" in outcome.detail and "allocated already" in outcome.detail
    assert all(dev.buffers["kv"].generation == 1 for dev in result.world.devices)


@pytest.mark.timeout(120)
def test_graphs_captured_before_the_kv_allocation_replay_the_placeholder(monkeypatch):
    """capture-before-kv: a sweep run before AllocateKV, taken by a worker without the rule,
    captures the measurement's placeholder cache (generation 0), which the allocation then
    replaces: caught at the first serving replay (I15); without that direct check the replay
    reads a cache the prefill never wrote (I21), and without that the tokens diverge."""
    sc, variant, result = _replayed_on_a_replaced_cache("capture-before-kv")
    outcome = result.outcome
    assert "kv generation 0" in outcome.detail and "live generation 1" in outcome.detail
    sent = [e.what for e in result.world.trace if e.kind == "send"]
    assert sent.index("Capture") < sent.index("AllocateKV") < sent.index("Finalize")
    assert outcome.cause is not None and f"command {outcome.cause} (AllocateKV)" in outcome.detail
    _stale_cache_shows_without_the_direct_checks(sc, variant, monkeypatch)


@pytest.mark.timeout(120)
def test_the_lifecycle_rule_refuses_a_capture_before_the_kv_allocation():
    """The same early sweep against the protocol's own worker: every rank refuses the first
    Capture (I15, from the rank's reply) and records no graph."""
    from sim.variants_state import CaptureBeforeKVController
    result = _against_the_protocols_worker(CaptureBeforeKVController,
                                           default_scenario(topology="shared", **SMALL))
    outcome = result.outcome
    assert "Capture of" in outcome.detail and "before AllocateKV" in outcome.detail
    assert not any(result.world.graphs[r] for r in range(len(result.world.devices)))


def test_the_sleep_wake_model_frees_the_cache_it_allocates_again():
    """kv-realloc-on-wake's memory: the sleep frees the KV cache's bytes and the wake takes
    as many again, so each rank holds what it held once startup ended (a release that freed
    nothing, or freed it twice, moved the total); the wake comes between rounds, when no
    request holds a slot, as the next command in sequence; and the controller's state hashing
    tells an idle spell whose wake was sent from one whose was not (exhaustive search must not
    merge them)."""
    from protocol.commands import AllocateKV, Finalize
    from sim.variants_state import SleepWakeController

    variant = REGISTRY["kv-realloc-on-wake"]
    sc = variant.scenario(default_scenario(topology="shared", **SMALL))
    after: list[tuple[type, list[int]]] = []  # each command, and the bytes held once it ran
    woke: list[bool] = []
    seqs: list[int] = []
    live_at_wake: list[tuple] = []
    last = [None]

    def watch(world) -> None:
        current = world.ctrl.current
        if current is not None and current is not last[0]:
            if last[0] is not None:  # the command before this one has every reply
                after.append((type(last[0]), list(world.used)))
            last[0] = current
            seqs.append(current.seq)
            if isinstance(current, AllocateKV) and world.ctrl.serving:
                live_at_wake.append(world.ctrl.slots.requests())
        woke.append(world.ctrl.woke)

    result = run_schedule(sc, variant, RandomWalk(0), on_state=watch)
    assert result.outcome.invariant == "I15"
    finalize = [used for kind, used in after if kind is Finalize]
    wakes = [used for kind, used in after if kind is AllocateKV]
    assert len(finalize) == 1 and len(wakes) == 2  # startup's allocation, then the wake's
    assert wakes[-1] == finalize[0] and min(finalize[0]) > 0
    assert True in woke and False in woke
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # the wake is one command more
    assert live_at_wake == [()]  # between rounds: no request holds a slot
    ctrl = SleepWakeController(sc.config)
    woken = SleepWakeController(sc.config)
    woken.woke = True
    assert ctrl.fingerprint() != woken.fingerprint()


def test_in_rounds_keeps_the_first_wave_and_sends_the_rest_when_idle():
    from sim.scenario import AFTER_IDLE, in_rounds

    sc = default_scenario(topology="shared", **SMALL)
    rounds = in_rounds(sc).workload
    assert [a.request for a in rounds] == [a.request for a in sc.workload]
    first = min(a.after_step for a in sc.workload)
    assert {a.after_step for a in rounds} == {first, AFTER_IDLE}
    assert all((a.after_step == first) == (b.after_step == first)
               for a, b in zip(rounds, sc.workload))


def test_the_story_of_a_replay_of_a_freed_buffer_shows_the_command_that_freed_it():
    """A reader's finding: kv-realloc-on-wake's story showed the replay and the step before
    it, not the wake two commands earlier. The outcome names it (`Outcome.cause`) and the
    story shows its events, then the tail."""
    from sim.report import narrative

    variant = REGISTRY["kv-realloc-on-wake"]
    result = run_schedule(variant.scenario(default_scenario(topology="shared", **SMALL)),
                          variant, RandomWalk(0))
    cause = result.outcome.cause
    assert cause is not None and cause < result.outcome.step
    story = narrative(result)
    assert f"controller sends command {cause} AllocateKV" in story
    assert "rank 0 release_kv" in story and "rank 1 release_kv" in story
    assert story.index(f"command {cause} AllocateKV") < story.index(
        f"controller sends command {result.outcome.step} Step")
