"""Property (b): every shipped variant is caught with its expected verdict in each topology."""

import re
from pathlib import Path

import pytest

from protocol.errors import ConfigError
from sim.check import CheckSpec, check_bad, check_correct
from sim.variants import REGISTRY, SHIPPED, load_variant_file

BAD = [n for n in SHIPPED if any(v != "clean" for v in REGISTRY[n].expected.values())]
SPEC = CheckSpec(schedules=50, fault_schedules=0, time_budget=20)
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
@pytest.mark.parametrize("name", BAD)
def test_bad_variant_caught_as_expected(name, topology):
    variant = REGISTRY[name]
    row = check_bad(variant, SPEC, topology)
    if row.got == "not reachable here":  # e.g. a bug that needs two ranks in one process
        assert row.passed and row.detail and variant.unreachable is not None
        return
    assert row.got == variant.expected[topology], row.detail
    assert row.minimal is not None and row.minimal.actions <= row.stats.max_depth + 50


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["shared", "per-rank"])
def test_correct_protocol_is_clean_and_reaches_interesting_events(topology):
    rows = check_correct(REGISTRY["correct"], CheckSpec(schedules=20, fault_schedules=40), topology)
    assert [r.got for r in rows] == ["clean", "abort"], [r.detail for r in rows]
    assert rows[0].stats.reached["replay"] > 0
    assert rows[0].stats.reached["compaction_moves_live"] > 0
    assert rows[1].stats.reached["fault_fired"] > 0


def test_fused_sweep_deadlock_story_names_host_call_and_collective_not_the_lock():
    """The cycle is H2 (wait for idle) + H3 (spin); the lock (H1) is not on it."""
    row = check_bad(REGISTRY["fused-sweep"], SPEC, "shared")
    story = " ".join(why for _, why in row.minimal.outcome.cycle)
    assert "driver lock" not in story and "to go idle" in story
    assert any(w in story for w in ("instantiate", "upload", "launch"))
    assert "spins in all-reduce" in story


def test_fused_sweep_is_safe_with_one_process_per_rank():
    row = check_bad(REGISTRY["fused-sweep"], CheckSpec(schedules=30, fault_schedules=0), "per-rank")
    assert row.got == "invariant:I4"
    assert row.stats.verdicts.get("deadlock", 0) == 0
    assert "no deadlock or divergence manifested" in row.detail


def test_fused_sweep_deadlock_needs_quiescence_not_the_driver_lock():
    """The old story credited the driver lock (H1); the cycle is H2 + H3."""
    h1_off = check_bad(REGISTRY["fused-sweep"], CheckSpec(schedules=40, fault_schedules=0,
                                                          hazards_off=("h1",)), "shared")
    h2_off = check_bad(REGISTRY["fused-sweep"], CheckSpec(schedules=40, fault_schedules=0,
                                                          hazards_off=("h2",)), "shared")
    assert h1_off.got == "deadlock" and h2_off.got != "deadlock"


def test_vacuous_model_cannot_pass():
    variant = REGISTRY["correct"]
    from dataclasses import replace
    vac = replace(variant, name="vacuous", adjust=lambda sc: sc.with_(workload=()))
    rows = check_correct(vac, CheckSpec(schedules=3, fault_schedules=0), "shared")
    assert rows[0].got == "vacuous"


def test_user_variant_file_is_loaded_and_checked():
    variants = load_variant_file("docs/examples/my_variant.py")
    assert [v.name for v in variants] == ["no-sync-launch"]
    row = check_bad(REGISTRY["no-sync-launch"], SPEC, "shared")
    assert row.got == "invariant:I11"
    assert load_variant_file("docs/examples/my_variant.py")[0] is variants[0]


def test_a_variant_this_process_has_is_unpickled_from_the_registry_without_its_file(tmp_path):
    """A variant from a user's file pickles as its name and the file (`Variant.__reduce__`); a
    process that lacks it loads the file, one that has it takes the registered object and
    leaves the file alone, so a file moved or removed after loading does not break the run.
    Mutant #2851 (docs/mutation.md) read the file again whenever it had one, and failed here."""
    import pickle

    import sim.variants as variants

    path = tmp_path / "moved_variant.py"
    path.write_text("from dataclasses import replace\n"
                    "from sim.variants import REGISTRY\n"
                    "MOVED = replace(REGISTRY['correct'], name='test-moved-file-variant')\n")
    [variant] = load_variant_file(path)
    try:
        path.unlink()
        assert pickle.loads(pickle.dumps(variant)) is variant
    finally:
        REGISTRY.pop(variant.name, None)
        variants._ORIGIN.pop(variant.name, None)
        variants._LOADED_FILES.pop(str(path.resolve()), None)


def test_a_variant_file_edited_after_loading_is_loaded_again(tmp_path):
    """A property-test writer's finding (2026-12-07): in one process, loading a file again
    after editing it gave the old objects back, so a notebook or a rerun test session checked
    old code. Same bytes: the same objects; edited: its variants replaced, a renamed one's old
    name gone."""
    import sim.variants as variants

    path = tmp_path / "edited.py"
    source = ("from dataclasses import replace\n"
              "from sim.variants import REGISTRY\n"
              "V = replace(REGISTRY['correct'], name='test-edited-{n}', summary='{summary}')\n")
    path.write_text(source.format(n=1, summary="first"))
    try:
        [first] = load_variant_file(path)
        assert load_variant_file(path)[0] is first
        path.write_text(source.format(n=1, summary="second"))
        [second] = load_variant_file(path)
        assert second.summary == "second" and REGISTRY["test-edited-1"] is second
        path.write_text(source.format(n=2, summary="renamed"))
        [third] = load_variant_file(path)
        assert third.name == "test-edited-2" and "test-edited-1" not in REGISTRY
        assert variants._ORIGIN["test-edited-2"] == str(path.resolve())
        assert "test-edited-1" not in variants._ORIGIN
    finally:
        for name in ("test-edited-1", "test-edited-2"):
            REGISTRY.pop(name, None)
            variants._ORIGIN.pop(name, None)
        variants._LOADED_FILES.pop(str(path.resolve()), None)


def test_an_edited_variant_file_that_now_fails_leaves_none_of_its_variants(tmp_path):
    """A reviewer's finding: keeping the earlier variants after a failed reload left them
    registered in this process while worker processes, which import the file by path, failed
    on it (a parallel search raised WorkerError)."""
    import sim.variants as variants

    path = tmp_path / "breaks.py"
    path.write_text("from dataclasses import replace\n"
                    "from sim.variants import REGISTRY\n"
                    "V = replace(REGISTRY['correct'], name='test-breaks-later')\n")
    try:
        [variant] = load_variant_file(path)
        path.write_text("raise RuntimeError('half-edited')\n")
        with pytest.raises(ConfigError, match="failed to import: RuntimeError: half-edited"):
            load_variant_file(path)
        assert "test-breaks-later" not in REGISTRY and variant.name == "test-breaks-later"
        assert "test-breaks-later" not in variants._ORIGIN
        path.write_text("from dataclasses import replace\n"
                        "from sim.variants import REGISTRY\n"
                        "V = replace(REGISTRY['correct'], name='test-breaks-later')\n")
        assert load_variant_file(path)[0].name == "test-breaks-later"  # mended: loads again
    finally:
        REGISTRY.pop("test-breaks-later", None)
        variants._ORIGIN.pop("test-breaks-later", None)
        variants._LOADED_FILES.pop(str(path.resolve()), None)


def test_a_variant_file_loads_as_a_script_would(tmp_path):
    """A fresh user's findings: a file that starts with ``from __future__ import annotations``
    (as every shipped variant module does) and defines a dataclass Op failed to import
    (AttributeError: the module was not in sys.modules), and one that imports a helper module
    beside it failed with "No module named". The folder is on sys.path only while it runs."""
    import sys

    import sim.variants as variants

    (tmp_path / "variant_helpers_beside.py").write_text("NAME = 'test-script-like-variant'\n")
    path = tmp_path / "scripted.py"
    path.write_text("from __future__ import annotations\n"
                    "from dataclasses import dataclass, replace\n"
                    "from typing import ClassVar\n"
                    "from protocol.backend import Op\n"
                    "from sim.variants import REGISTRY\n"
                    "from variant_helpers_beside import NAME\n"
                    "@dataclass(frozen=True)\n"
                    "class SizedOp(Op):\n"
                    "    name: ClassVar[str] = 'sized'\n"
                    "    size: int = 0\n"
                    "V = replace(REGISTRY['correct'], name=NAME)\n")
    try:
        [variant] = load_variant_file(path)
        assert variant.name == "test-script-like-variant"
        assert str(tmp_path) not in sys.path
    finally:
        REGISTRY.pop("test-script-like-variant", None)
        variants._ORIGIN.pop("test-script-like-variant", None)
        variants._LOADED_FILES.pop(str(path.resolve()), None)
        sys.modules.pop("variant_helpers_beside", None)


@pytest.mark.timeout(120)
def test_a_variant_registered_by_code_reaches_the_workers_of_a_parallel_search(monkeypatch):
    """`register` from the caller's own code puts a variant in this process's registry only; a
    worker of a parallel search starts from the forkserver, which imports the shipped variants,
    so the variant must travel by its fields. Pickled by name, the worker died unpickling it
    ("unknown variant") and the search raised ``WorkerError``. Its fields pickle, so the search
    does use the workers (a job that does not pickle runs in this process instead)."""
    from dataclasses import replace

    import sim.workers
    from sim.check import CLEAN, Fixed
    from sim.scenario import default_scenario
    from sim.search import sample_search
    from sim.variants import register

    pools = []
    started = sim.workers.WorkerPool._start
    monkeypatch.setattr(sim.workers.WorkerPool, "_start",
                        lambda self, *args: pools.append(args) or started(self, *args))
    variant = register(replace(REGISTRY["correct"], name="test-registered-by-code"))
    try:
        sc = default_scenario(buckets=(1, 2), max_batch=2)
        res = sample_search(Fixed(sc), variant, CLEAN, schedules=12, time_budget=60, jobs=2)
        assert res.failure is None and res.stats.schedules == 12
        assert len(pools) == 1
    finally:
        REGISTRY.pop(variant.name, None)


@pytest.mark.parametrize("max_batch, reachable", [(1, False), (2, True), (3, True)])
def test_split_eligibility_is_reachable_whenever_two_buckets_fit_the_batch(max_batch, reachable):
    """Judged before the variant's own cap: at max batch 2 or 3 of buckets (1, 2, 4, 8) the
    sweep captures 1 and 2, which a cap of 1 splits (it was reported unreachable, counting the
    buckets after that cap; a fresh user's finding)."""
    from sim.check import bad_search_setup

    spec = CheckSpec(buckets=(1, 2, 4, 8), max_batch=max_batch)
    _, _, reason = bad_search_setup(REGISTRY["split-eligibility"], spec, "shared")
    assert (reason is None) == reachable, reason
    if reachable:
        assert check_bad(REGISTRY["split-eligibility"], spec, "shared").got == "divergence"


def test_the_shipped_variants_are_the_ones_the_docs_list():
    """docs/variants.md's table lists every shipped variant once, and each known-bad one has
    a walkthrough page. Without a registration (mutant #3139 deleted chunk-restarts-at-zero's)
    the default check simply runs one variant fewer and passes; the walkthrough and README tests
    that notice it (`test_docs.py`) are slow, outside the mutation tool's killers."""
    listed = re.findall(r"^\| ([a-z0-9+-]+) \| ", (DOCS / "variants.md").read_text(), re.M)
    assert listed[0] == "variant" and sorted(listed[1:]) == sorted(SHIPPED)
    pages = {p.stem for p in (DOCS / "walkthroughs").glob("*.md")} - {"README"}
    assert pages == set(BAD)


@pytest.mark.parametrize("typed,suggested", [
    ("fused-swep", "fused-sweep"),
    ("FUSED-SWEEP", "fused-sweep"),
    ("lazy-capture", "lazy-serving-capture"),
    ("local_bucket", "local-bucket"),
    ("nonexist", None),  # drew "no-liveness" at difflib's 0.53 (a fresh user's finding)
])
def test_an_unknown_variant_suggests_only_close_names(typed, suggested):
    from protocol.errors import ConfigError
    from sim.variants import get_variant

    with pytest.raises(ConfigError) as err:
        get_variant(typed)
    message = str(err.value)
    if suggested is None:
        assert "did you mean" not in message, message
    else:
        assert f"did you mean {suggested}" in message, message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("returned, shown", [("'launch'", "'launch'"), ("None", "None"),
                                             ("[1]", "[1]")])
def test_a_worker_hook_returning_no_list_of_ops_is_an_error_naming_the_hook(returned, shown):
    """A fresh user's forward_ops returning a string failed with "'str' object has no attribute
    'name' (at ops.py:236)", and None with a TypeError inside protocol/worker.py: neither named
    the hook."""
    from dataclasses import replace

    from protocol.worker import Worker

    class BadWorker(Worker):
        def forward_ops(self, step):
            return eval(returned)

    bad = replace(REGISTRY["correct"], name="test-bad-forward-ops", worker_cls=BadWorker)
    with pytest.raises(TypeError) as info:  # `lockstep check` makes it the variant's error row
        check_correct(bad, CheckSpec(schedules=2, fault_schedules=0, jobs=1), "shared")
    assert str(info.value) == (f"Worker.forward_ops returned {shown}; expected a list of "
                               "protocol.backend.Op")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("returned", ["'yes'", "7", "True"])
def test_a_sim_op_handler_returning_no_status_is_an_error_naming_the_handler(tmp_path, returned):
    """A fresh user's handler returned "yes": read as not DONE forever, the run ended in
    `livelock` after 200,000 actions, naming neither the handler nor its value. An int that is
    no status, and True (equal to PROGRESS), are refused too."""
    import sim.variants as variants

    text = Path("docs/examples/state_variants.py").read_text()
    assert "    return backend.done(host)\n" in text
    path = tmp_path / "yes_handler.py"
    path.write_text(text.replace("    return backend.done(host)\n", f"    return {returned}\n")
                    .replace('name="my-', 'name="test-yes-'))
    loaded = load_variant_file(path)
    try:
        variant = REGISTRY["test-yes-fresh-logits"]
        with pytest.raises(TypeError) as info:
            check_bad(variant, CheckSpec(schedules=2, fault_schedules=0, jobs=1), "shared")
        assert str(info.value).startswith("sim_ops handler '_sim_new_logits' for NewLogits "
                                          f"returned {returned}; expected BLOCKED, PROGRESS or "
                                          "DONE")
    finally:
        for v in loaded:
            REGISTRY.pop(v.name, None)
            variants._ORIGIN.pop(v.name, None)
        variants._LOADED_FILES.pop(str(path.resolve()), None)


@pytest.mark.timeout(180)
def test_a_variant_whose_runs_differ_is_an_error_not_a_clean_row(tmp_path):
    """A fresh user's Worker kept state in a class attribute: rank 1 skipped its forward the
    first time it met a bucket. A worker process of a parallel search found the divergence, and
    this process, whose attribute an earlier row had filled, ran that schedule again clean: the
    row read `clean` after 5 schedules (the search had stopped at its failure)."""
    import sim.variants as variants
    from sim.strategies import NondeterminismError

    path = tmp_path / "class_cache.py"
    path.write_text(
        "from protocol.worker import Worker\n"
        "from sim.variants import Variant\n"
        "class ForgetfulWorker(Worker):\n"
        "    _seen = set()\n"
        "    def forward_ops(self, step):\n"
        "        key = (self.rank, step.key)\n"
        "        if self.rank == 1 and key not in ForgetfulWorker._seen:\n"
        "            ForgetfulWorker._seen.add(key)\n"
        "            return []\n"
        "        return super().forward_ops(step)\n"
        "V = Variant(name='test-class-cache', summary='s', source='a fresh user',\n"
        "            expected={'shared': 'divergence', 'per-rank': 'divergence'},\n"
        "            worker_cls=ForgetfulWorker)\n")
    [variant] = load_variant_file(path)
    try:
        spec = CheckSpec(schedules=60, jobs=2)
        assert check_bad(variant, spec, "shared").got == "divergence"  # fills the attribute here
        with pytest.raises(NondeterminismError, match="run [0-9]+ failed in a worker process "
                                                      "and passed when run again in this one"):
            check_bad(variant, spec, "per-rank")
    finally:
        REGISTRY.pop(variant.name, None)
        variants._ORIGIN.pop(variant.name, None)
        variants._LOADED_FILES.pop(str(path.resolve()), None)


@pytest.mark.parametrize("fields, words", [
    (dict(name="   "), "variant name '   ' must be letters, digits, '-', '_' and '.'"),
    (dict(name="a\nb"), "variant name 'a\\nb' must be letters"),
    (dict(name="x+faults"), "variant name 'x+faults' must be letters"),
    (dict(name="zz", expected="divergence"),
     "variant 'zz': expected is 'divergence'; expected a dict of topology ('shared', "
     "'per-rank') -> verdict"),
    (dict(name="zz", expected={"shared": "clean"}),
     "variant 'zz': expected has no verdict for topology 'per-rank'; give both"),
    (dict(name="zz", expected={}),
     "variant 'zz': expected has no verdict for topology 'shared'; give both"),
])
def test_a_variant_name_or_expected_a_table_cannot_hold_is_refused(fields, words):
    """A fresh variant author's name of spaces printed a blank cell and one with a newline broke
    the verdict table; `expected="divergence"` read "expected verdict for topology 'shared' is
    None"."""
    from dataclasses import replace

    from protocol.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        replace(REGISTRY["correct"], **fields)
    assert str(info.value).startswith(words), info.value


def test_a_controller_that_stops_its_ranks_in_no_known_way_is_refused_and_events_may_be_a_list():
    """A fresh variant author's `abort_how = "explode"` was taken silently; `events` refused the
    list that `reaches` accepts."""
    from dataclasses import replace

    from protocol.controller import Controller
    from protocol.errors import ConfigError

    class Exploding(Controller):
        abort_how = "explode"

    with pytest.raises(ConfigError) as info:
        replace(REGISTRY["correct"], name="test-explode", controller_cls=Exploding)
    assert str(info.value) == ("variant 'test-explode': controller_cls.abort_how is 'explode'; "
                               "expected 'abort' or 'exit'")
    listed = replace(REGISTRY["correct"], name="test-listed", events=["scrub"], reaches=["scrub"])
    assert list(listed.events) == ["scrub"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook, returned, words", [
    ("fit_memory", "12", "Controller.fit_memory returned 12; expected a protocol.memory.MemoryPlan"),
    ("warmup_sizes", "'abc'", "Controller.warmup_sizes returned 'abc'; expected a tuple of "
                              "message sizes in bytes, each an int > 0"),
    ("measure_keys", "None", "Controller.measure_keys returned None; expected a tuple of "
                             "protocol.keys.GraphKey"),
])
def test_a_controller_hook_returning_the_wrong_kind_of_value_is_an_error_naming_it(
        hook, returned, words):
    """A fresh variant author's fit_memory returning 12 failed at controller.py:546, naming no
    hook; warmup_sizes returning "abc" was reported as the invariant I5."""
    from dataclasses import replace

    from protocol.controller import Controller

    def wrong(self, *args):
        return eval(returned)

    bad_controller = type("BadController", (Controller,), {hook: wrong})
    bad = replace(REGISTRY["correct"], name="test-bad-controller-hook",
                  controller_cls=bad_controller)
    with pytest.raises(TypeError) as info:
        check_correct(bad, CheckSpec(schedules=2, fault_schedules=0, jobs=1), "shared")
    assert str(info.value) == words
