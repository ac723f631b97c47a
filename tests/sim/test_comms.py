"""Communicators and groups in the simulator (issue 10 item 3): named communicators with their
own sequence numbers, sub-groups, point-to-point pairs, host groups, and hazard H9 (two
collectives of one communicator in flight at once wedge)."""

from types import SimpleNamespace

import pytest

from protocol.commands import Capture
from protocol.errors import ConfigError
from protocol.keys import GraphKey
from sim.common import DONE, PROGRESS, Signature
from sim.comms import Communicator
from sim.run import run_schedule
from sim.scenario import default_scenario
from sim.strategies import RandomWalk
from sim.variants import REGISTRY
from sim.world import World

SMALL = dict(buckets=(1, 2, 4, 8), max_batch=8)


def _world(world_size=2, *comms):
    sc = default_scenario(world_size=world_size, **SMALL).with_communicators(*comms)
    return World(sc, REGISTRY["correct"])


def _sig(comm="tp", nbytes=64, mode="eager", op="all-reduce", peer=None):
    return Signature(op, 1, nbytes, "test", comm, mode, peer)


def _drain_collectives(world):
    done = 0
    while "collectives" in world.enabled():
        world.device_model.step_collective()
        done += 1
    return done


def test_each_communicator_numbers_its_own_collectives():
    w = _world(2, Communicator("tp2"))
    w.backend.enqueue(0, _sig("tp"))
    w.backend.enqueue(0, _sig("tp2"), side=True)
    w.backend.enqueue(0, _sig("tp"))
    kernels = w.devices[0].main + w.devices[0].side
    assert [(k.sig.comm, k.index) for k in kernels] == [("tp", 0), ("tp", 1), ("tp2", 0)]


def test_collectives_of_two_communicators_overlap_and_complete_in_any_order():
    w = _world(2, Communicator("tp2"))
    for r in (0, 1):
        w.backend.enqueue(r, _sig("tp"))
    # rank 0 issues the second communicator's call on its side stream, rank 1 on its main one
    w.backend.enqueue(0, _sig("tp2"), side=True)
    w.backend.enqueue(1, _sig("tp2"))
    assert _drain_collectives(w) == 2
    assert all(not d.busy() for d in w.devices) and w.outcome is None


def test_a_sub_group_collective_needs_only_its_members():
    w = _world(3, Communicator("pair", ranks=(0, 1)))
    w.backend.enqueue(0, _sig("pair"))
    w.backend.enqueue(1, _sig("pair"))
    assert _drain_collectives(w) == 1 and not w.devices[0].busy()
    with pytest.raises(ConfigError, match="rank 2 .*'pair'"):
        w.backend.enqueue(2, _sig("pair"))


def test_send_and_receive_pair_up_and_a_size_mismatch_diverges():
    """A matching send/receive pair completes on both devices with no outcome; only a
    mismatch diverges. `_drain_collectives` counts a step that reported a divergence too, so
    the count alone let a check that flagged every matching pair pass (the simulator audit's
    mutants of the pair's peer, op and index comparisons, docs/mutation.md)."""
    w = _world(2)
    w.backend.send(0, 1, 128)
    w.backend.recv(1, 0, 128)
    assert _drain_collectives(w) == 1
    assert w.outcome is None and not any(d.busy() for d in w.devices)
    w.backend.send(0, 1, 128)
    w.backend.recv(1, 0, 256)
    w.device_model.step_collective()
    assert w.outcome.verdict == "divergence" and "point-to-point" in w.outcome.detail


def test_each_pair_of_ranks_numbers_its_own_sends_and_receives():
    """Rank 1 receives from rank 0, then sends to rank 2: each pair is its own channel, so
    rank 1's send is the first of pair (1, 2) and matches rank 2's first receive. Numbered in
    one channel for all pairs, it would be rank 1's second call and pair with nothing."""
    w = _world(3)
    w.backend.send(0, 1, 128)
    w.backend.recv(1, 0, 128)
    w.backend.send(1, 2, 64)
    w.backend.recv(2, 1, 64)
    assert [len(d.main) for d in w.devices] == [1, 2, 1] and not any(d.side for d in w.devices)
    assert _drain_collectives(w) == 2
    assert w.outcome is None and not any(d.busy() for d in w.devices)


def test_an_in_graph_and_an_eager_call_at_one_sequence_number_diverge():
    w = _world(2)
    w.backend.enqueue(0, _sig(mode="graph"))
    w.backend.enqueue(1, _sig(mode="eager"))
    w.device_model.step_collective()
    assert w.outcome.verdict == "divergence" and w.outcome.invariant == "I2"
    assert "on communicator tp" in w.outcome.detail


def test_two_in_graph_calls_of_one_communicator_in_flight_wedge_even_in_the_same_order():
    w = _world(2)
    for r in (0, 1):
        w.backend.enqueue(r, _sig(mode="graph"))
        w.backend.enqueue(r, _sig(mode="graph"), side=True)
    assert "collectives" not in w.enabled()
    w.settle()
    assert w.outcome.verdict == "deadlock" and w.outcome.invariant == "I16"
    assert w.outcome.rank == 0


def test_eager_nccl_calls_of_one_communicator_serialize_instead():
    w = _world(2)
    for r in (0, 1):
        w.backend.enqueue(r, _sig())
        w.backend.enqueue(r, _sig(), side=True)
    assert _drain_collectives(w) == 2 and w.outcome is None


def test_a_one_in_flight_communicator_wedges_eagerly_too():
    w = _world(2, Communicator("car", one_in_flight=True))
    for r in (0, 1):
        w.backend.enqueue(r, _sig("car"))
        w.backend.enqueue(r, _sig("car"), side=True)
    w.settle()
    assert w.outcome.invariant == "I16"


def test_host_group_collective_blocks_until_every_member_arrives():
    w = _world(2)
    host0, host1 = w.hosts
    sig = _sig("cpu")
    assert w.backend.host_collective(0, host0, sig, probe=False) == 1  # arrived
    assert w.backend.host_collective(0, host0, sig, probe=True) == 0  # waits for rank 1
    assert w.backend.host_collective(1, host1, sig, probe=False) == 1
    assert w.backend.host_collective(0, host0, sig, probe=True) == 2


def test_a_host_collective_completes_on_every_member_and_a_mismatch_diverges():
    """The host-group collective's I2 check: members that call with the same signature all
    return and the next call has the next index; members whose calls differ end the run as a
    divergence naming the call. No shipped protocol op calls a host collective (it is there
    for variants' ``sim_ops``), and the test above stops before anyone completes, so a
    mutant that reported every completed host collective as a divergence survived (the
    simulator audit, docs/mutation.md)."""
    w = _world(2)
    for host in w.hosts:  # inside a command, as a variant's op would be
        host.run = SimpleNamespace(command=SimpleNamespace(seq=7))
    for r in (0, 1):
        assert w.backend.host_collective(r, w.hosts[r], _sig("cpu"), probe=False) == PROGRESS
    for r in (0, 1):
        assert w.backend.host_collective(r, w.hosts[r], _sig("cpu"), probe=False) == DONE
    assert w.outcome is None and not w.host_arrivals
    assert w.host_seq == {(0, "cpu"): 1, (1, "cpu"): 1}
    for r, nbytes in ((0, 64), (1, 128)):
        w.backend.host_collective(r, w.hosts[r], _sig("cpu", nbytes=nbytes), probe=False)
    assert w.backend.host_collective(0, w.hosts[0], _sig("cpu"), probe=False) == DONE
    assert (w.outcome.verdict, w.outcome.invariant, w.outcome.step) == ("divergence", "I2", 7)
    assert "call #1" in w.outcome.detail and "128 bytes" in w.outcome.detail


def test_unknown_and_misused_communicators_are_one_line_errors():
    w = _world(2)
    with pytest.raises(ConfigError, match="unknown communicator 'nope'; the scenario has tp, cpu"):
        w.backend.enqueue(0, _sig("nope"))
    with pytest.raises(ConfigError, match="host group"):
        w.backend.enqueue(0, _sig("cpu"))
    with pytest.raises(ConfigError, match="defined twice"):
        default_scenario(**SMALL).with_communicators(Communicator("tp"))
    with pytest.raises(ConfigError, match="outside world size"):
        default_scenario(**SMALL).with_communicators(Communicator("x", ranks=(0, 5)))
    with pytest.raises(ConfigError, match="ascending"):
        Communicator("x", ranks=(1, 0))
    for name in ("", None, 5):
        with pytest.raises(ConfigError, match=f"communicator name {name!r} must be a non-empty"):
            Communicator(name)
    for ranks in ((0, 0), (1, 2, 1), ()):
        with pytest.raises(ConfigError, match="must be distinct and not empty"):
            Communicator("x", ranks=ranks)
    assert Communicator("solo", ranks=(1,)).members(3) == (1,)  # one rank is a group too


@pytest.mark.timeout(60)
def test_overlap_on_one_communicator_wedges_at_its_first_launch():
    sc = default_scenario(**SMALL)
    out = run_schedule(sc, REGISTRY["overlap-one-communicator"], RandomWalk(0)).outcome
    assert out.verdict == "deadlock" and out.invariant == "I16" and out.step is not None


@pytest.mark.timeout(60)
def test_overlap_on_one_communicator_depends_on_h9():
    sc = default_scenario(**SMALL)
    sc = sc.with_(hazards=sc.hazards.without("h9"))
    out = run_schedule(sc, REGISTRY["overlap-one-communicator"], RandomWalk(0)).outcome
    assert out.verdict == "clean", out.detail


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_on_two_communicators_is_clean(seed):
    variant = REGISTRY["overlap-two-communicators"]
    result = run_schedule(variant.scenario(default_scenario(**SMALL)), variant, RandomWalk(seed))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached["replay"] > 0


@pytest.mark.timeout(60)
def test_an_overlapped_launch_splits_its_bucket_s_rows_between_the_two_all_reduces():
    """Dual-batch overlap splits a bucket of b rows into micro-batches of ceil(b/2) and
    floor(b/2) rows; each all-reduce carries its own micro-batch's rows, on its own
    communicator, and a one-row bucket has no second. Every rank issues the same sizes, so no
    verdict reads them: mutant #3208 (docs/mutation.md) sent 2b rows and then -b rows and the
    design stayed clean. Bucket 3 is the odd split."""
    from sim.devices import Collective
    from sim.variants_comms import SECOND_STREAM_COMM

    variant = REGISTRY["overlap-two-communicators"]
    sc = variant.scenario(default_scenario(buckets=(1, 2, 3), max_batch=3))
    shape = sc.config.shape
    seen = set()

    def on_state(world):
        for dev in world.devices:
            for kernel in dev.main + dev.side:
                if isinstance(kernel, Collective) and kernel.sig.mode == "graph":
                    seen.add((kernel.sig.label, kernel.sig.comm, kernel.sig.nbytes))

    result = run_schedule(sc, variant, RandomWalk(0), on_state=on_state)
    assert result.outcome.verdict == "clean", result.outcome.detail
    want = set()
    for bucket in (1, 2, 3):
        first, second = -(-bucket // 2), bucket // 2
        want.add((f"graph decode@{bucket} micro-batch 0", "tp", shape.allreduce_bytes(first)))
        if second:
            want.add((f"graph decode@{bucket} micro-batch 1", SECOND_STREAM_COMM,
                      shape.allreduce_bytes(second)))
    assert seen == want


@pytest.mark.timeout(60)
def test_every_rank_registers_the_same_graph_buffers_in_the_correct_protocol():
    result = run_schedule(default_scenario(**SMALL), REGISTRY["correct"], RandomWalk(0))
    assert result.outcome.verdict == "clean"
    tables = [d.registered for d in result.world.devices]
    assert tables[0] == [] and tables[1] == []  # teardown freed the graphs and their buffers


@pytest.mark.timeout(60)
def test_registration_tables_that_differ_are_caught_at_the_end_of_the_capture():
    result = run_schedule(default_scenario(**SMALL), REGISTRY["registration-mismatch"],
                          RandomWalk(0))
    out = result.outcome
    assert out.verdict == "invariant" and out.invariant == "I17" and out.rank == 1
    capture = next(e for e in result.world.trace if e.kind == "send" and e.seq == out.step)
    assert capture.what == "Capture"
    counts = [len(d.registered) for d in result.world.devices]
    assert counts[0] != counts[1]


def test_the_registration_check_compares_the_live_ranks_only():
    """I17 compares the registration tables of the ranks still alive when the command after a
    capture is sent: a dead rank's table (cleared or half-written when it died) says nothing
    about the exchange among the others, which still breaks when two live ranks differ. No
    test killed a rank between a capture and the next command, so a mutant that compared the
    dead ranks instead survived (docs/mutation.md)."""
    w = _world(3)
    key = GraphKey(1)
    for r in range(3):
        w.graphs[r][key] = None
    w.devices[0].registered = [(key, "tp", "all-reduce input")]
    w.devices[1].registered = []
    w.devices[2].registered = [(key, "tp", "all-reduce input")] * 2
    w._sent = [5]
    w.dead = {2}
    assert not w._check_registrations(Capture(6, key))
    assert (w.outcome.invariant, w.outcome.rank, w.outcome.step) == ("I17", 1, 5)
    assert "rank 2" not in w.outcome.detail
    w.outcome = None
    w.devices[1].registered = list(w.devices[0].registered)  # the live ranks agree
    assert w._check_registrations(Capture(6, key)) and w.outcome is None


def test_data_parallel_lanes_give_each_rank_its_own_batch():
    from protocol.commands import Admit, DecodeRow, Step
    step = Step(7, rows=(DecodeRow(0, 4, 1, 3), DecodeRow(1, 5, 1, 3)),
                admits=(Admit(6, 2, (1, 2)),))
    sc = default_scenario(**SMALL)
    assert sc.lane_batch(1, step) == (4, 5, 6)  # without lanes every rank has every row
    sc = sc.with_(data_parallel=True)
    assert sc.lane_batch(0, step) == (4, 6) and sc.lane_batch(1, step) == (5,)


@pytest.mark.timeout(60)
def test_an_idle_rank_that_skips_the_forward_is_caught_naming_it_and_the_step():
    variant = REGISTRY["dp-idle-rank-skips-forward"]
    result = run_schedule(variant.scenario(default_scenario(**SMALL)), variant, RandomWalk(0))
    out = result.outcome
    assert out.verdict == "divergence" and out.step is not None
    assert result.world.workers[out.rank].rank_batch == ()  # the idle rank is the one named


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_correct_protocol_is_clean_with_idle_ranks(seed, monkeypatch):
    from sim.scenario import Scenario

    idle = []  # one per (rank, step with rows or admissions) whose lane has none of them
    real = Scenario.lane_batch

    def recording(self, rank, step):
        batch = real(self, rank, step)
        idle.append(not batch and bool(step.rows or step.admits))
        return batch

    monkeypatch.setattr(Scenario, "lane_batch", recording)
    variant = REGISTRY["dp-idle-rank-dummy-batch"]
    result = run_schedule(variant.scenario(default_scenario(**SMALL)), variant, RandomWalk(seed))
    assert result.outcome.verdict == "clean", result.outcome.detail
    assert result.reached.get("idle_rank_step", 0) == sum(idle) > 0


def test_a_rank_waiting_in_a_host_collective_is_explained():
    from sim.waits import wait_edges
    w = _world(2)
    assert w.backend.host_collective(0, w.hosts[0], _sig("cpu"), probe=False) == 1
    edges = [(e[0], e[1]) for e in wait_edges(w) if "host collective" in e[2]]
    assert edges == [("rank0", "rank1")]


def test_without_spinning_collectives_a_device_runs_a_lone_collective_and_idles_empty():
    """H3 off (`--hazard-off h3`): a collective does not hold its stream waiting for peers, so
    a device whose head is one can run; a device with nothing queued cannot."""
    from sim.hazards import HazardModel

    sc = default_scenario(world_size=2, **SMALL)
    w = World(sc.with_(hazards=HazardModel(h3_spinning_collectives=False)), REGISTRY["correct"])
    w.backend.enqueue(0, _sig("tp"))
    assert w.device_model.device_ready(0) and not w.device_model.device_ready(1)
    spinning = _world(2)
    spinning.backend.enqueue(0, _sig("tp"))
    assert not spinning.device_model.device_ready(0)  # H3: it waits for its peer
