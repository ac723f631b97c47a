"""`World.enabled` answers from shortcuts (counts of replies in flight and of queued kernels, the
controller's due time, a readiness table, the collectives' cache); after every action of many
runs its answer must equal a probe of every actor (`World.enabled_by_full_probe`), and a
shortcut whose update is dropped must be caught by that comparison."""

import pickle
import re
from dataclasses import replace

import pytest

import sim.run
from sim.check import CheckSpec
from sim.devices import DeviceModel
from sim.ops import ModelledBackend
from sim.run import run_schedule
from sim.scenario import TOPOLOGIES, Fault
from sim.search import _chooser, run_length
from sim.variants import SHIPPED, get_variant
from sim.world import World
from tests.tools import load_tool

trace_hash = load_tool("trace_hash")

SPEC = CheckSpec(buckets=(1, 2, 4, 8), max_batch=8)


class CheckedWorld(World):
    """A world whose every `enabled` answer is compared with a full probe, and whose counts
    are compared with a recount (a count too high changes no answer, only the cost: the
    comparison of answers alone would miss it)."""

    def enabled(self) -> list[str]:
        got = super().enabled()
        want = self.enabled_by_full_probe()
        assert got == want, f"after {self.actions} actions: enabled {got}, a full probe {want}"
        in_flight = sum(map(len, self.transit))
        assert self._in_flight == in_flight, (f"{self._in_flight} replies counted in flight, "
                                              f"{in_flight} are")
        queued = sum(len(dev.main) + len(dev.side) for dev in self.devices)
        assert self.queued == queued, f"{self.queued} kernels counted queued, {queued} are"
        kept, fresh = self.device_model.ready_collective(), self.device_model.find_ready_collective()
        assert kept == fresh, f"the collectives' kept answer {kept}, a fresh one {fresh}"
        return got


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setattr(sim.run, "World", CheckedWorld)


def _runs(names, strategies=("random", "pct"), runs=1):
    """(variant, scenario, chooser) of each run: every topology and every scenario the golden
    hash runs (base, a random fault, the variant's own fault search)."""
    for name in names:
        variant = get_variant(name)
        for topology in TOPOLOGIES:
            try:
                scenarios = trace_hash._scenarios(variant, SPEC, topology)
            except Exception:  # noqa: BLE001 - a variant this configuration cannot set up
                continue
            for _, scenario_for in scenarios:
                for strategy in strategies:
                    steps = run_length(scenario_for(0), variant, strategy, SPEC.seed)
                    for i in range(runs):
                        yield variant, scenario_for(i), _chooser(strategy, SPEC.seed, i, steps)


def test_enabled_equals_a_full_probe_after_every_action(checked):
    ran = 0
    for variant, scenario, chooser in _runs(SHIPPED):  # no shipped run raises: any error fails
        run_schedule(scenario, variant, chooser)
        ran += 1
    assert ran > 4 * len(SHIPPED)


def _forget_count(monkeypatch, cls, method: str, counted) -> None:
    """Make ``cls.method`` leave the count ``counted(self)`` reads as it found it: the update
    a bug would leave out."""
    original = getattr(cls, method)
    owner, name = counted

    def forgetful(self, *args, **kwargs):
        holder = owner(self)
        before = getattr(holder, name)
        original(self, *args, **kwargs)
        setattr(holder, name, before)

    monkeypatch.setattr(cls, method, forgetful)


DROPS = {
    "reply sent": (World, "_send_reply", (lambda world: world, "_in_flight"), "a full probe|counted in flight"),
    "reply delivered": (World, "_deliver", (lambda world: world, "_in_flight"), "counted in flight"),
    "kernel enqueued": (ModelledBackend, "enqueue", (lambda backend: backend.world, "queued"),
                        "a full probe|counted queued"),
    "kernel run": (DeviceModel, "step_device", (lambda model: model.world, "queued"),
                   "counted queued"),
    "collective completed": (DeviceModel, "step_collective", (lambda model: model.world, "queued"),
                             "counted queued"),
}


def _keep_answer(monkeypatch, cls, method: str, model) -> None:
    """Make ``cls.method`` leave the collectives' kept answer as it found it: the
    `DeviceModel.heads_moved` a bug would leave out."""
    original = getattr(cls, method)

    def forgetful(self, *args, **kwargs):
        holder = model(self)
        kept = holder._ready, holder._ready_kept
        original(self, *args, **kwargs)
        holder._ready, holder._ready_kept = kept

    monkeypatch.setattr(cls, method, forgetful)


@pytest.mark.parametrize("method", ["enqueue", "step_device", "step_collective"])
def test_a_dropped_move_of_a_stream_head_is_caught(checked, monkeypatch, method):
    cls, model = ((ModelledBackend, lambda backend: backend.world.device_model)
                  if method == "enqueue" else (DeviceModel, lambda device_model: device_model))
    _keep_answer(monkeypatch, cls, method, model)
    variant, scenario, chooser = next(_runs(["correct"], strategies=("random",)))
    with pytest.raises(AssertionError, match="a full probe|kept answer"):
        run_schedule(scenario, variant, chooser)


@pytest.mark.parametrize("dropped", sorted(DROPS))
def test_a_dropped_update_of_a_count_is_caught(checked, monkeypatch, dropped):
    cls, method, counted, message = DROPS[dropped]
    _forget_count(monkeypatch, cls, method, counted)
    variant, scenario, chooser = next(_runs(["correct"], strategies=("random",)))
    with pytest.raises(AssertionError, match=message):
        run_schedule(scenario, variant, chooser)


@pytest.mark.parametrize("dropped", ["count", "head"])
def test_a_dropped_update_at_a_death_is_caught(checked, monkeypatch, dropped):
    if dropped == "count":
        _forget_count(monkeypatch, World, "_die", (lambda world: world, "queued"))
    else:
        _keep_answer(monkeypatch, World, "_die", lambda world: world.device_model)
    variant = get_variant("correct")
    # rank 1 dies at its third warm-up call, its first two still queued on its device (and,
    # in some schedules, one of them ready to complete with rank 0's)
    scenario = replace(variant.scenario(SPEC.scenario("per-rank")),
                       faults=(Fault("die", 1, "warmup_collective", 3),))
    caught = 0
    for i in range(20):
        try:
            run_schedule(scenario, variant, _chooser("random", SPEC.seed, i))
        except AssertionError as exc:
            assert re.search("counted queued|kept answer|a full probe", str(exc))
            caught += 1
    assert caught


def test_a_pickled_world_keeps_its_counts_and_answers():
    """A bad row's counterexample world comes back from its worker process by pickle; a copy
    made after any action answers as the world does."""
    variant = get_variant("correct")
    for seed in range(3):
        world = World(variant.scenario(SPEC.scenario("shared")), variant)
        chooser = _chooser("random", SPEC.seed, seed)
        while world.outcome is None:
            copy = pickle.loads(pickle.dumps(world))  # before anything asked the world
            enabled = world.enabled()
            assert copy.enabled() == enabled == copy.enabled_by_full_probe()
            assert (copy.queued, copy._in_flight) == (world.queued, world._in_flight)
            if not enabled:
                world.settle()
                continue
            world.step(enabled[0] if len(enabled) == 1 else chooser.choose(enabled, world.actions))
