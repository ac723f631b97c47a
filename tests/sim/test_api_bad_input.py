"""The simulator's Python API refuses what a run could not use as it reads, in one line naming
the argument, before any search: a fresh user's findings (a false I13 against the correct
protocol from a death_detect_s past the step timeout, a search of 0 schedules or a NaN budget
that "found no failure", a fault that could never fire, raw IndexError / ZeroDivisionError /
MemoryError from deep inside)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import pytest

from protocol.backend import Op
from protocol.errors import ConfigError
from protocol.worker import Worker
from sim.common import DONE
from sim.scenario import Fault, default_scenario
from sim.search import exhaustive_search, hypothesis_search, sample_search
from sim.strategies import PCT, Drawn, RandomWalk, Replay, Sticky
from sim.run import run_schedule
from sim.variants import CORRECT, get_variant

SMALL = dict(world_size=2, buckets=(1, 2, 4), max_batch=4)


def _one_line(exc: Exception) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("change, words", [
    (dict(death_detect_s=math.inf), "death_detect_s inf must be a finite number of seconds "
                                    "above 0"),
    (dict(death_detect_s=math.nan), "death_detect_s nan"),
    (dict(death_detect_s=61.0, faults=(Fault("die", 1, "prefill"),)),
     "death_detect_s 61.0 is past the step timeout (60 s): a die fault's peers would time out"),
    (dict(death_detect_s=-1.0), "death_detect_s -1.0"),
    (dict(vocab=0), "vocab 0 is not an integer >= 1"),
    (dict(vocab="x"), "vocab 'x' is not an integer >= 1"),
    (dict(max_actions=-1), "max_actions -1 is not an integer >= 1"),
    (dict(pages_per_seq=0), "pages_per_seq 0 is not an integer >= 1"),
    (dict(config=None), "config None is not a ProtocolConfig"),
    (dict(hazards=None), "hazards None is not a HazardModel"),
    (dict(memory=None), "memory None is not a MemoryModel"),
    (dict(workload=None), "workload None is not a tuple"),
    (dict(faults=("raise",)), "fault 'raise' is not a Fault"),
    (dict(data_parallel="yes"), "data_parallel 'yes' is not True or False"),
])
def test_a_scenario_field_a_run_cannot_use_is_named(change, words):
    with pytest.raises(ConfigError) as info:
        default_scenario(**SMALL).with_(**change)
    assert _one_line(info.value).startswith(words), info.value


def test_what_a_run_can_use_is_still_taken():
    """A reviewer's findings on the first form of these checks: a step timeout of 5 s (the
    default death_detect_s) with no die fault, lists for the workload or faults, numpy integers
    and floats, and a Fraction budget all ran before and still do."""
    import fractions

    import numpy as np

    sc = default_scenario(step_timeout_s=5, **SMALL)
    assert sc.death_detect_s == 5.0
    died = sc.with_(faults=[Fault("die", 1, "prefill")], workload=list(sc.workload))
    assert isinstance(died.faults, tuple) and isinstance(died.workload, tuple)
    assert run_schedule(died, CORRECT, RandomWalk(0)).outcome.verdict == "abort"
    Fault("raise", np.int64(1), "prefill", np.int64(1), np.float32(0.5))
    sc.with_(max_actions=np.int64(100_000), death_detect_s=np.float32(2.0))
    result = sample_search(lambda i: sc, CORRECT, lambda r: True, "random", np.int64(2),
                           fractions.Fraction(10))
    assert result.stats.schedules == 2
    for strategy in ("random", "pct"):  # a numpy seed: RandomWalk once refused what it derived
        seeded = sample_search(lambda i: sc, CORRECT, lambda r: True, strategy, 2, 10,
                               seed=np.int64(5))
        plain = sample_search(lambda i: sc, CORRECT, lambda r: True, strategy, 2, 10, seed=5)
        assert seeded.stats.schedules == plain.stats.schedules == 2
        assert seeded.stats.actions == plain.stats.actions
    assert PCT(np.int64(1), np.int64(2), np.int64(50)).change_points == PCT(1, 2, 50).change_points
    # a review's finding: a large numpy seed overflowed in the search's own seed arithmetic
    # (silently, another search); numpy's booleans are switches as True and False are
    big = [sample_search(lambda i: sc, CORRECT, lambda r: True, "random", 2, 30, seed=seed,
                         stop_on_failure=flag)
           for seed, flag in ((2**62, True), (np.int64(2**62), np.True_))]
    assert big[0].stats.actions == big[1].stats.actions


def test_a_death_seen_before_the_step_timeout_still_reads_as_the_protocol_handles_it():
    """The control for the refusal above: the same die fault with the default detection time
    is the abort the correct protocol gives (with infinity it read as I13 broken)."""
    sc = default_scenario(**SMALL).with_(faults=(Fault("die", 1, "prefill"),))
    result = run_schedule(sc, CORRECT, RandomWalk(0))
    assert result.outcome.verdict == "abort", result.outcome


@pytest.mark.parametrize("args, words", [
    (("raise", 0, "prefill", 2.5), "fault occurrence 2.5 must be an integer >= 1"),
    (("raise", 0, "prefill", True), "fault occurrence True"),
    (("raise", "0", "prefill"), "fault rank '0' is not an integer"),
    (("die", 1, None), "fault op None is not an op name"),
    (("slow", 0, "prefill", 1, -5), "fault delay_s -5 must be a finite number >= 0"),
    (("slow", 0, "prefill", 1, math.nan), "fault delay_s nan"),
])
def test_a_fault_that_could_never_fire_as_written_is_named(args, words):
    with pytest.raises(ConfigError) as info:
        Fault(*args)
    assert _one_line(info.value).startswith(words), info.value


@pytest.mark.parametrize("kwargs, words", [
    (dict(buckets=()), "buckets (): expected a non-empty list of batch sizes"),
    (dict(buckets=None), "buckets None: expected a non-empty list"),
    (dict(world_size=65), "ranks 65 is above 64"),
    (dict(world_size=1), "world_size 1 must be at least 2: every hazard the simulator models "
                         "is between ranks"),
    (dict(world_size=0), "world_size 0 must be at least 2"),
    (dict(buckets=(1, 4, 2**40), max_batch=4), "bucket 1099511627776 is above 1048576"),
    # a hostile user's trial: a set failed as "'set' object is not subscriptable", and an
    # unknown keyword or a shape of one's own was a TypeError from ProtocolConfig
    (dict(buckets={1, 2}), "buckets {1, 2}: expected a non-empty list of batch sizes"),
    (dict(buckets=(1, 2), bogus=1), "default_scenario: 'bogus' is no field of ProtocolConfig; "
                                    "its fields: world_size, "),
    (dict(buckets=(1, 2), shape=None), "shape=None: expected a protocol.config.ModelShape"),
])
def test_default_scenario_names_a_bucket_list_or_size_it_cannot_model(kwargs, words):
    with pytest.raises(ConfigError) as info:
        default_scenario(**kwargs)
    assert _one_line(info.value).startswith(words), info.value


def test_default_scenario_takes_a_shape_of_ones_own():
    """The control for the refusals above: ``shape`` is a ProtocolConfig field like the others
    a caller may override (it was passed twice, a TypeError)."""
    from protocol.config import ModelShape

    shape = ModelShape(hidden_size=64, num_layers=2)
    assert default_scenario(buckets=(1, 2), shape=shape).config.shape is shape
    assert default_scenario(buckets=(1, 2)).config.shape.name == "Qwen3-4B"


FUSED_SWEEP = get_variant("fused-sweep")


def _bad(result) -> bool:
    return result.outcome.verdict == "clean"


@pytest.mark.parametrize("search, kwargs, words", [
    ("sample", dict(schedules=0), "schedules = 0: expected an integer >= 1"),
    ("sample", dict(schedules=-3), "schedules = -3"),
    ("sample", dict(schedules=2.5), "schedules = 2.5"),
    ("sample", dict(time_budget=math.nan), "time_budget = nan: expected a finite number"),
    ("sample", dict(time_budget=0), "time_budget = 0"),
    ("sample", dict(time_budget="5"), "time_budget = '5'"),
    ("sample", dict(jobs=0), "jobs = 0"),
    ("sample", dict(seed=None), "seed = None: expected an integer"),
    # a hostile user's trial: the searches took what --seed and CheckSpec refuse, and -1 drew
    # the schedules of another seed
    ("sample", dict(seed=-1), "seed = -1: expected an integer in [0, 2**64)"),
    ("sample", dict(seed=2**64), "seed = 18446744073709551616: expected an integer in "
                                 "[0, 2**64)"),
    ("hypothesis", dict(seed=-1), "seed = -1: expected an integer in [0, 2**64)"),
    ("hypothesis", dict(seed=2**64), "seed = 18446744073709551616: expected an integer in "),
    ("hypothesis", dict(seed=1.5), "seed = 1.5: expected an integer in [0, 2**64)"),
    ("sample", dict(strategy="exhaustive"), "strategy = 'exhaustive': expected 'random' or "),
    ("exhaustive", dict(max_states=-1), "max_states = -1"),
    ("exhaustive", dict(time_budget=math.nan), "time_budget = nan"),
    ("exhaustive", dict(time_budget=-1), "time_budget = -1"),
    ("hypothesis", dict(time_budget=math.nan), "time_budget = nan"),
    ("hypothesis", dict(max_examples=0), "max_examples = 0"),
    ("sample", dict(stop_on_failure="no"), "stop_on_failure = 'no': expected True or False"),
    ("exhaustive", dict(symmetry="no"), "symmetry = 'no': expected True or False"),
    ("exhaustive", dict(symmetry=None), "symmetry = None: expected True or False"),
    ("exhaustive", dict(stop_on_failure=0), "stop_on_failure = 0: expected True or False"),
    ("hypothesis", dict(shrink="false"), "shrink = 'false': expected True or False"),
    # a hostile user's trial: progress=5 failed after the first run, "'int' object is not
    # callable"
    ("sample", dict(progress=5), "progress = 5: expected None or a function called with the "
                                 "number of runs just finished"),
    ("sample", dict(progress=True), "progress = True: expected None or a function"),
    ("exhaustive", dict(progress="bar"), "progress = 'bar': expected None or a function"),
])
def test_a_search_budget_that_runs_nothing_or_never_ends_is_refused(search, kwargs, words,
                                                                     no_simulation):
    """Old behaviour: schedules=0 on fused-sweep (a deadlocking variant) returned no failure,
    a NaN budget searched without a deadline, and a switch given as text (``symmetry='no'``)
    read as true. Refused before any run (`no_simulation`)."""
    sc = FUSED_SWEEP.scenario(default_scenario(**SMALL))
    with pytest.raises(ConfigError) as info:
        if search == "sample":
            sample_search(lambda i: sc, FUSED_SWEEP, _bad, **kwargs)
        elif search == "exhaustive":
            exhaustive_search(sc, FUSED_SWEEP, _bad, **kwargs)
        else:
            hypothesis_search(sc, FUSED_SWEEP, _bad, **kwargs)
    assert _one_line(info.value).startswith(words), info.value


@pytest.mark.timeout(60)
def test_the_smallest_budgets_still_search():
    sc = FUSED_SWEEP.scenario(default_scenario(**SMALL))
    result = sample_search(lambda i: sc, FUSED_SWEEP, _bad, schedules=1, time_budget=30)
    assert result.stats.schedules == 1


@pytest.mark.timeout(60)
def test_the_seeds_at_either_end_of_the_range_still_search():
    """The control for the seed refusals: 0 and 2**64 - 1 are seeds --seed takes."""
    sc = default_scenario(**SMALL)
    for seed in (0, 2**64 - 1):
        assert sample_search(lambda i: sc, CORRECT, lambda r: True, schedules=1, time_budget=30,
                             seed=seed).stats.schedules == 1
        assert hypothesis_search(sc, CORRECT, lambda r: True, max_examples=1, time_budget=30,
                                 seed=seed).stats.schedules == 1


class _Nobody:
    def choose(self, enabled, step):
        return "nobody"


class _Last:
    def choose(self, enabled, step):
        return enabled[-1]


@pytest.mark.parametrize("call, words", [
    (lambda sc: run_schedule(sc, CORRECT, None), "chooser None: expected an object with a "
                                                 "choose(enabled, step) method"),
    (lambda sc: run_schedule(sc, CORRECT, "random"), "chooser 'random': expected"),
    (lambda sc: run_schedule(sc, CORRECT, RandomWalk), "chooser <class "),
    # numpy's array has a choose method of its own: it failed inside the run
    (lambda sc: run_schedule(sc, CORRECT, np.array(["controller", "rank0"])),
     "chooser array(['controller', 'rank0'], dtype='<U10'): a sequence of choices; wrap a list "
     "of actor names in Replay(choices)"),
    (lambda sc: run_schedule(sc, CORRECT, ["controller"]), "chooser ['controller']: a sequence"),
    (lambda sc: run_schedule(sc, "correct", RandomWalk(0)), "variant 'correct': expected a "
                                                            "Variant"),
    (lambda sc: run_schedule(None, CORRECT, RandomWalk(0)), "scenario None: expected a "
                                                            "Scenario"),
    (lambda sc: run_schedule(sc, CORRECT, _Nobody()), "chooser _Nobody chose 'nobody' at "
                                                      "action "),
    (lambda sc: run_schedule(sc.with_(faults=(Fault("raise", 0, "nosuchop"),)), CORRECT,
                             RandomWalk(0)), "fault op 'nosuchop' is no op of correct's runs; "
                                             "one of "),
    (lambda sc: get_variant(None), "variant name None: expected a string"),
    (lambda sc: get_variant(["fused-sweep"]), "variant name ['fused-sweep']"),
    (lambda sc: RandomWalk(None), "seed = None: expected an integer"),
    (lambda sc: RandomWalk(1.5), "seed = 1.5"),
    (lambda sc: PCT(0, max_steps=0), "max_steps = 0: expected an integer >= 1"),
    (lambda sc: PCT(0, depth=2.5), "depth = 2.5"),
    (lambda sc: Replay(None), "choices = None: expected a list of actor names"),
])
def test_a_run_s_arguments_of_the_wrong_kind_are_named(call, words):
    """Old behaviour: AttributeError ('NoneType' object has no attribute 'choose' / 'config' /
    'controller_cls' / 'lower'), a KeyError for a chooser's unknown actor, randrange's
    "empty range" at the first choice, and RandomWalk(None) seeded from the OS."""
    with pytest.raises(ConfigError) as info:
        call(default_scenario(**SMALL))
    assert _one_line(info.value).startswith(words), info.value


def test_a_chooser_of_one_s_own_that_chooses_an_enabled_actor_runs():
    result = run_schedule(default_scenario(**SMALL), CORRECT, _Last())
    assert result.outcome.verdict == "clean"


@pytest.mark.parametrize("change, words", [
    (dict(schedules=0), "schedules = 0: expected an integer >= 1"),
    (dict(schedules=2.5), "schedules = 2.5: expected an integer >= 1"),
    (dict(clean_schedules=0), "clean_schedules = 0: expected an integer >= 1"),
    (dict(fault_schedules=-1), "fault_schedules = -1: expected an integer >= 0"),
    (dict(fault_schedules="5"), "fault_schedules = '5': expected an integer >= 0"),
    (dict(jobs=0), "jobs = 0: expected an integer >= 1"),
    (dict(jobs=257), "jobs 257 is above 256"),
    (dict(clean_schedules=2_000_000), "clean_schedules = 2000000: schedules 2000000 is above "),
    (dict(time_budget=math.nan), "time_budget = nan: expected a finite number of seconds"),
    (dict(time_budget=0), "time_budget = 0: expected a finite number of seconds"),
    (dict(seed=-1), "seed = -1: expected an integer in [0, 2**64)"),
    (dict(seed=None), "seed = None: expected an integer"),
    (dict(reduce_attempts=-1), "reduce_attempts = -1: expected an integer >= 0"),
    (dict(strategy="dfs"), "strategy = 'dfs': expected None or one of random, pct, "),
    (dict(ranks=1), "ranks = 1: 1 must be at least 2"),
    (dict(ranks="2"), "ranks = '2': '2' is not an integer"),
    (dict(max_batch=0), "max_batch = 0: 0 must be at least 1"),
    (dict(buckets=(4, 2)), "buckets = (4, 2): buckets must be strictly ascending"),
    (dict(hazards_off=("H6",)), "hazards_off = ('H6',): unknown hazard 'H6'; known: h1, "),
    (dict(hazards_off="h6"), "hazards_off = 'h6': 'h6' is not a list of hazard names"),
    (dict(hazards_off=("h1", "h1")), "hazards_off = ('h1', 'h1'): hazard 'h1' is named twice"),
    (dict(h2_scope="all"), "h2_scope = 'all': 'all' is not one of device, process, peers"),
    (dict(h2_calls=None), "h2_calls = None: None is not one of assumed, measured, both"),
    # a variant author's finding: taken, and each row then blamed the variant for it
    (dict(ranks=3, buckets=(1, 4, 8), max_batch=12),
     "max_batch=12 exceeds the largest of buckets 1,4,8; add a bucket (buckets) or lower "
     "max_batch"),
])
def test_a_check_spec_field_its_option_would_refuse_is_named(change, words):
    """Old behaviour: a CheckSpec built directly took what `lockstep check` refuses:
    ``schedules=0`` gave an ``incomplete`` row "after 0 of -1 schedules" and
    ``fault_schedules=-1`` dropped the faulted row without a word."""
    from sim.check import CheckSpec

    with pytest.raises(ConfigError) as info:
        CheckSpec(**change)
    assert _one_line(info.value).startswith(words), info.value


def test_check_variant_names_a_topology_it_does_not_have():
    """A Python user's finding: ``check_variant(v, spec, "both")`` gave an ``error`` row that
    blamed the variant ("variant 'x': ConfigError: topology 'both' ... (at <string>:15)")."""
    from sim.check import CheckSpec, check_variant

    with pytest.raises(ConfigError) as info:
        check_variant(CORRECT, CheckSpec(), "both")
    assert _one_line(info.value) == ("topology = 'both': expected one of shared, per-rank (check "
                                     "each for 'both')")


def test_a_check_spec_takes_what_its_options_take():
    """``fault_schedules=0`` is ``--fault-schedules 0``: no faulted row, not an error; lists
    read as tuples and numpy integers as ints (a spec is written as JSON in a trace)."""
    import numpy as np

    from sim.check import CheckSpec, has_faulted_row

    spec = CheckSpec(fault_schedules=0, buckets=[1, 2, 4], hazards_off=["h6"],
                     ranks=np.int64(3), seed=np.uint64(7), reduce_attempts=0)
    assert not has_faulted_row(CORRECT, spec)
    assert spec.buckets == (1, 2, 4) and spec.hazards_off == ("h6",)
    assert type(spec.ranks) is int and type(spec.seed) is int
    assert has_faulted_row(CORRECT, CheckSpec(fault_schedules=1))


EXPECTED_CLEAN = {"shared": "clean", "per-rank": "clean"}


@pytest.mark.parametrize("change, words", [
    (dict(summary=None), "variant 'mine': summary is None; expected a non-empty string"),
    (dict(summary=""), "variant 'mine': summary is ''; expected a non-empty string"),
    (dict(source=5), "variant 'mine': source is 5; expected a non-empty string"),
    (dict(source=("vLLM #1",)), "variant 'mine': source is ('vLLM #1',); expected a "),
    (dict(remedy=None), "variant 'mine': remedy is None; expected a string"),
])
def test_a_variant_s_text_fields_must_be_text(change, words):
    """Old behaviour: ``Variant(summary=None, source=5)`` was taken, and `lockstep check
    --list` printed "None"."""
    from sim.variants import Variant

    fields = dict(name="mine", summary="s", source="t", expected=EXPECTED_CLEAN) | change
    with pytest.raises(ConfigError) as info:
        Variant(**fields)
    assert _one_line(info.value).startswith(words), info.value


class _BytesPath:
    def __fspath__(self):
        return b"/x.py"


@pytest.mark.parametrize("path, words", [
    (None, "variant file None: expected a path (a str or an os.PathLike)"),
    (5, "variant file 5: expected a path"),
    (b"/x.py", "variant file b'/x.py': expected a path"),
    (_BytesPath(), "variant file <"),
])
def test_a_variant_file_that_is_no_path_is_named(path, words):
    """A hostile user's trial: None, 5 and bytes failed inside pathlib with a TypeError that
    named no argument."""
    from sim.variants import load_variant_file

    with pytest.raises(ConfigError) as info:
        load_variant_file(path)
    assert _one_line(info.value).startswith(words), info.value


def test_every_shipped_variant_still_constructs(monkeypatch):
    """The shipped variants and the documented examples pass the checks of their fields (they
    are made when loaded) and of their scenario (`Variant.scenario`, which refuses a fault's
    event in ``reaches`` where no fault can fire): each names only events a run records."""
    from pathlib import Path

    import sim.variants as variants
    from sim.check import CheckSpec
    from sim.common import EVENTS
    from sim.variants import REGISTRY, SHIPPED, load_variant_file

    for name in ("REGISTRY", "_ORIGIN", "_LOADED_FILES"):  # the examples register nowhere else
        monkeypatch.setattr(variants, name, dict(getattr(variants, name)))
    examples = Path(__file__).resolve().parents[2] / "docs" / "examples"
    loaded = [v for path in sorted(examples.glob("*.py")) for v in load_variant_file(path)]
    assert SHIPPED and loaded
    base = CheckSpec().scenario("shared")
    for variant in [REGISTRY[n] for n in SHIPPED] + loaded:
        variant.scenario(base)
        assert set(variant.reaches) <= set(EVENTS), variant.name


def test_a_fault_s_event_in_reaches_needs_a_fault_to_fire():
    """A review's finding: ``reaches=("fault_op_instantiate",)`` was taken, but a clean row's
    search injects no fault, so the row was vacuous whatever ran, and its note blamed the
    configuration. Refused where the variant's scenario has no fault; taken where adjust adds
    one on that op."""
    from sim.scenario import Fault
    from sim.variants import Variant

    wants = Variant("mine", "s", "t", EXPECTED_CLEAN, reaches=("fault_op_instantiate",))
    with pytest.raises(ConfigError) as info:
        wants.scenario(default_scenario(**SMALL))
    assert _one_line(info.value) == (
        "variant 'mine': reaches 'fault_op_instantiate', which a run counts only when a fault "
        "fires, but its scenario has no faults (add them in adjust, or drop it from reaches)")
    faulted = replace(wants, adjust=lambda sc: sc.with_(faults=(Fault("raise", 1, "instantiate"),)))
    assert faulted.scenario(default_scenario(**SMALL)).faults


@pytest.mark.parametrize("reaches, words", [
    (("no-such-event",), "variant 'mine': reaches entry is 'no-such-event'; expected an event "
                         "a run records: replay, padded_replay, "),
    (("preemption", "Preemption"), "variant 'mine': reaches entry is 'Preemption'"),
    (("fault_op_nosuchop",), "variant 'mine': reaches entry is 'fault_op_nosuchop'"),
])
def test_a_reaches_entry_no_run_records_is_named(reaches, words):
    """Old behaviour: taken, and the clean row read ``vacuous`` ("never reached:
    no-such-event") after its whole search."""
    from sim.variants import Variant

    with pytest.raises(ConfigError) as info:
        Variant("mine", "s", "t", EXPECTED_CLEAN, reaches=reaches)
    message = _one_line(info.value)
    assert message.startswith(words), message
    assert ("fault_fired_serving, one of its own events (declared in events), or fault_op_<op> "
            "for an op of its runs") in message


@dataclass(frozen=True)
class _Note(Op):
    """A variant's own op in the warm-up: counts the event ``noted`` when its flag says so."""

    name: ClassVar[str] = "note"
    counts: bool = True


def _sim_note(backend, r, host, op, probe):
    if not probe and op.counts:
        backend.world.count_event("noted")
    return DONE if probe else backend.done(host)


class _NotingWorker(Worker):
    counts = True

    def _ops_warmup(self, command):
        return [_Note(self.counts)] + super()._ops_warmup(command)


class _SilentWorker(_NotingWorker):
    counts = False


@pytest.mark.timeout(120)
def test_a_variant_s_own_event_may_be_required():
    """A variant author's finding: ``reaches`` took only the simulator's own events, so a clean
    counterpart could not require that its own op ran (a handler that never fired read
    clean). Declared in ``events`` and counted with ``world.count_event``, it may be named;
    a run that never counts it is vacuous, naming it."""
    from sim.check import CheckSpec, check_variant
    from sim.variants import Variant

    spec = CheckSpec(buckets=(1, 2, 4, 8), max_batch=8, schedules=3, fault_schedules=0, jobs=1)
    rows = {}
    for worker in (_NotingWorker, _SilentWorker):
        variant = Variant(f"mine-{worker.counts}", "s", "t", EXPECTED_CLEAN, worker_cls=worker,
                          sim_ops={_Note: _sim_note}, reaches=("noted",), events=("noted",))
        rows[worker.counts] = check_variant(variant, spec, "shared")[0]
    assert rows[True].got == "clean" and "noted" in rows[True].detail
    assert rows[False].got == "vacuous" and rows[False].detail == "never reached: noted"
    with pytest.raises(ConfigError, match="events is 'noted'; expected a tuple of event names"):
        Variant("mine", "s", "t", EXPECTED_CLEAN, events="noted")


def test_every_event_a_run_records_may_be_reached():
    """`sim.common.EVENTS` is every name the simulator counts an event under: each literal
    ``events["..."]`` / ``events.get("...")`` of sim/, every fault fired and the fault phases;
    a fault on an op of the variant's runs (``fault_op_<op>``) may be named too."""
    import re
    from pathlib import Path

    from sim.common import EVENTS, FAULT_FIRED_EVENT, fault_op_event, fault_phase_event
    from sim.variants import Variant

    source = "".join(p.read_text() for p in (Path(__file__).resolve().parents[2] / "sim")
                     .glob("*.py"))
    from sim.faults import PHASES

    counted = set(re.findall(r"""events(?:\[|\.get\()\s*["']([a-z_]+)["']""", source))
    assert re.search(r"fault_phase_event\(phase\), fault_op_event\(op.name\)", source)
    assert re.search(r"events\[FAULT_FIRED_EVENT\] \+= 1", source)
    assert set(EVENTS) == counted | {FAULT_FIRED_EVENT} | {fault_phase_event(phase)
                                                          for phase in PHASES}
    assert fault_op_event("instantiate") == "fault_op_instantiate"
    Variant("mine", "s", "t", EXPECTED_CLEAN, reaches=EVENTS + ("fault_op_instantiate",))


@pytest.mark.parametrize("call, words", [
    (lambda: Sticky({0: "bogus"}), "switches[0] = 'bogus': expected an actor name: controller, "
                                   "collectives, rank<n>, device<n> or link<n>"),
    (lambda: Sticky({3: None}), "switches[3] = None: expected an actor name"),
    (lambda: Sticky({-1: "rank0"}), "switches step = -1: expected an integer >= 0"),
    (lambda: Sticky({"0": "rank0"}), "switches step = '0': expected an integer >= 0"),
    (lambda: Sticky([(0, "rank0")]), "switches = [(0, 'rank0')]: expected a dict of step -> "
                                     "actor name"),
    (lambda: Sticky(None), "switches = None: expected a dict"),
    (lambda: Drawn(None), "draw_index = None: expected a function of the number of enabled "
                          "actors returning an index"),
    (lambda: Drawn(5), "draw_index = 5: expected a function"),
])
def test_a_sticky_or_drawn_chooser_s_arguments_are_checked(call, words):
    """Old behaviour: ``Sticky({0: 'bogus'})`` never applied its switch and the run went on as
    if it were not listed; ``Drawn(None)`` failed at the first choice ('NoneType' object is not
    callable)."""
    with pytest.raises(ConfigError) as info:
        call()
    assert _one_line(info.value).startswith(words), info.value


def test_a_sticky_chooser_of_every_actor_kind_runs():
    """Sticky takes the switch points of a real run (`sim.reduce.switch_points`) and replays
    it; every kind of actor name is taken."""
    from sim.reduce import switch_points

    sc = default_scenario(**SMALL)
    run = run_schedule(sc, CORRECT, RandomWalk(0))
    again = run_schedule(sc, CORRECT, Sticky(switch_points(run.choices)))
    assert again.choices == run.choices
    Sticky({0: "controller", 1: "collectives", 2: "rank1", 3: "device0", 4: "link1"})


ROWS = "array([[ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, ..."  # np.arange(100), 10 x 10


@pytest.mark.parametrize("call, words", [
    (lambda sc, a: sc.with_(config=a), f"config {ROWS} is not a ProtocolConfig"),
    (lambda sc, a: sc.with_(workload=a), f"workload {ROWS} is not a tuple"),
    (lambda sc, a: sc.with_(vocab=a), f"vocab {ROWS} is not an integer >= 1"),
    (lambda sc, a: sc.with_(data_parallel=a), f"data_parallel {ROWS} is not True or False"),
    (lambda sc, a: sc.with_(faults=(a,)), f"fault {ROWS} is not a Fault"),
    (lambda sc, a: get_variant(a), f"variant name {ROWS}: expected a string such as 'correct'"),
    (lambda sc, a: run_schedule(a, CORRECT, RandomWalk(0)), f"scenario {ROWS}: expected a "
                                                            "Scenario"),
    (lambda sc, a: run_schedule(sc, a, RandomWalk(0)), f"variant {ROWS}: expected a Variant"),
    (lambda sc, a: Replay(a), f"choices = {ROWS}: expected a list of actor names"),
    (lambda sc, a: sample_search(lambda i: sc, CORRECT, _bad, time_budget=a),
     f"time_budget = {ROWS}: expected a finite number of seconds above 0"),
    # a final review's finding: these still showed an array's repr over several lines, and a
    # kind or topology array raised numpy's "truth value ... is ambiguous" from `in`
    (lambda sc, a: Fault(a, 1, "instantiate"), f"fault kind {ROWS} is not one of raise, "),
    (lambda sc, a: Fault("raise", a, "instantiate"), f"fault rank {ROWS} is not an integer"),
    (lambda sc, a: Fault("raise", 1, a), f"fault op {ROWS} is not an op name"),
    (lambda sc, a: Fault("raise", 1, "instantiate", a), f"fault occurrence {ROWS} must be an "),
    (lambda sc, a: Fault("slow", 1, "instantiate", 1, a), f"fault delay_s {ROWS} must be a "),
    (lambda sc, a: sc.with_(topology=a), f"topology {ROWS} is not one of shared, per-rank"),
])
def test_a_value_whose_repr_spans_lines_is_named_on_one_line(call, words):
    """A numpy array's repr spans lines. Old behaviour: these messages cut it with a format
    spec (``{value!r:.60}``), which kept its first line break (the message ran over two lines,
    the second starting ``[10, 11, 1``) and gave no sign of the cut. Now its rows are joined
    and the cut is marked with "..." (`lockstep.args.one_line_repr`)."""
    import numpy as np

    with pytest.raises(ConfigError) as info:
        call(default_scenario(**SMALL), np.arange(100).reshape(10, 10))
    assert _one_line(info.value).startswith(words), info.value


@pytest.mark.parametrize("field_name", ["summary", "also_expected"])
def test_a_variant_field_whose_repr_spans_lines_is_named_on_one_line(field_name):
    """A Variant field shows up to 80 characters of the value, cut with "..."."""
    import numpy as np

    from sim.variants import Variant

    fields = dict(name="mine", summary="s", source="t", expected=EXPECTED_CLEAN)
    with pytest.raises(ConfigError) as info:
        Variant(**fields | {field_name: np.arange(100).reshape(10, 10)})
    message = _one_line(info.value)
    shown = "array([[ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, ..."
    assert len(shown) == 80
    assert message.startswith(f"variant 'mine': {field_name} is {shown}; expected "), message


def _ok(result) -> bool:
    return result.outcome.verdict == "clean"


@pytest.mark.parametrize("call, words", [
    (lambda sc: __import__("sim.check", fromlist=["x"]).check_variant(
        CORRECT, {"ranks": 2}, "shared"),
     "spec {'ranks': 2}: expected a CheckSpec"),
    (lambda sc: __import__("sim.check", fromlist=["x"]).check_variant(
        "local-bucket", __import__("sim.check", fromlist=["x"]).CheckSpec(), "shared"),
     "variant 'local-bucket': expected a Variant: sim.variants.get_variant('local-bucket') "
     "gives the variant of that name"),
    (lambda sc: sample_search(sc, CORRECT, _ok, schedules=1),
     "scenario_for = Scenario("),
    (lambda sc: sample_search(lambda i: sc, "correct", _ok, schedules=1),
     "variant 'correct': expected a Variant"),
    (lambda sc: sample_search(lambda i: sc, CORRECT, None, schedules=1),
     "acceptable = None: expected a function of a RunResult"),
    (lambda sc: exhaustive_search(lambda i: sc, CORRECT, _ok),
     "scenario <function"),
    (lambda sc: exhaustive_search(sc, CORRECT, "clean"),
     "acceptable = 'clean': expected a function"),
    (lambda sc: hypothesis_search(lambda i: sc, CORRECT, _ok, max_examples=1),
     "scenario <function"),
    (lambda sc: hypothesis_search(sc, CORRECT, bool, max_examples=1),
     "acceptable = <class 'bool'>: expected a function"),
    (lambda sc: __import__("sim.check", fromlist=["x"]).check_coverage_reachable("x"),
     "scenario 'x': expected a Scenario"),
    (lambda sc: sc.with_(colour=1), "Scenario has no field 'colour'; its fields: config, "),
])
def test_a_search_or_check_argument_of_the_wrong_kind_is_named(call, words):
    """A property-test writer's findings (2026-12-07): a dict as the CheckSpec gave an ``error``
    row blaming the shipped variant, a variant's name gave AttributeError from
    ``variant_spec``, a Scenario passed where a function of the run index goes (and the
    reverse) a TypeError / AttributeError from deep inside, ``acceptable=None`` a TypeError at
    the first run, and ``Scenario.with_`` a dataclass TypeError."""
    with pytest.raises(ConfigError) as info:
        call(default_scenario(**SMALL))
    assert _one_line(info.value).startswith(words), info.value


@pytest.mark.parametrize("search", ["sample", "exhaustive", "hypothesis"])
def test_an_acceptable_that_answers_other_than_true_or_false_is_named(search):
    """``acceptable=lambda r: "no"`` counted every run as passing."""
    sc = default_scenario(**SMALL)
    answer = lambda result: "no"  # noqa: E731
    run = {"sample": lambda: sample_search(lambda i: sc, CORRECT, answer, schedules=1),
           "exhaustive": lambda: exhaustive_search(sc, CORRECT, answer, max_states=10),
           "hypothesis": lambda: hypothesis_search(sc, CORRECT, answer, max_examples=1)}[search]
    with pytest.raises(ConfigError) as info:
        run()
    assert _one_line(info.value) == ("acceptable returned 'no' for a run whose verdict is "
                                     "clean: expected True or False")


def test_an_acceptable_answering_numpy_booleans_is_taken():
    sc = default_scenario(**SMALL)
    result = sample_search(lambda i: sc, CORRECT,
                           lambda r: np.bool_(r.outcome.verdict == "clean"), schedules=2)
    assert result.failure is None and result.stats.schedules == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("content", ["import os\nos._exit(0)\n",
                                     "from os import _exit\n\n_exit(3)\n"])
def test_a_variant_file_that_calls_os_exit_is_named_not_silent(tmp_path, content):
    """A hostile user's trial: a variant file calling os._exit(0) at import ended `lockstep
    check` at once, exit 0, with no output: read as success. In a subprocess: without the
    refusal the call would end the test's own process, which pytest alone reads as a pass."""
    import subprocess
    import sys

    path = tmp_path / "exits.py"
    path.write_text(content)
    code = content.split("(")[-1].split(")")[0]
    res = subprocess.run([sys.executable, "-m", "lockstep", "check", "--variant-file", str(path),
                          "--list"], capture_output=True, text=True, timeout=100)
    line = content.count("\n")
    assert (res.returncode, res.stdout) == (2, ""), res
    assert res.stderr.strip() == (f"lockstep check: error: variant file {str(path)!r} failed to "
                                  f"import: HardExitRefused: os._exit({code}) called (at "
                                  f"exits.py:{line})"), res.stderr


@pytest.mark.timeout(120)
def test_a_child_a_variant_file_forks_still_exits(tmp_path):
    """A reviewer's finding: the refusal replaced os._exit in the whole process, so a child
    the file forked while imported ran the parent's error path instead of exiting."""
    import subprocess
    import sys

    path = tmp_path / "forks.py"
    path.write_text("import os\n"
                    "from dataclasses import replace\n"
                    "from sim.variants import CORRECT\n"
                    "pid = os.fork()\n"
                    "if pid == 0:\n"
                    "    os._exit(7)\n"
                    "_, status = os.waitpid(pid, 0)\n"
                    "assert os.waitstatus_to_exitcode(status) == 7, status\n"
                    "V = replace(CORRECT, name='forks-and-waits')\n")
    res = subprocess.run([sys.executable, "-m", "lockstep", "check", "--variant-file", str(path),
                          "--list"], capture_output=True, text=True, timeout=100)
    assert res.returncode == 0 and res.stderr == "", res
    assert "forks-and-waits" in res.stdout, res.stdout
