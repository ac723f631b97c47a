"""The configuration matrix (issue 11 item 3): no catch depends on the default configuration,
no variant hard-codes a configuration number, and an unreachable bug says so."""

import inspect
import re

import pytest

import sim.variants
import sim.variants_admission
import sim.variants_comms
import sim.variants_paging
import sim.variants_state
from lockstep.cli import main
from sim.check import CheckSpec, check_bad, check_correct
from sim.matrix import BUCKET_SETS, render_markdown, run_matrix
from sim.variants import REGISTRY, SHIPPED

SPEC = CheckSpec(schedules=30, fault_schedules=10, time_budget=60, jobs=1)
BAD = [REGISTRY[n] for n in SHIPPED if REGISTRY[n].expected["shared"] != "clean"]


@pytest.mark.timeout(600)
def test_reduced_matrix_catches_every_bad_variant_or_says_why_not():
    """CI form: ranks 2 and 3, the small and the not-a-bucket sets, both topologies."""
    cells = run_matrix(BAD, SPEC, ranks=(2, 3), bucket_sets=("1,2,4,8", "1..16-max-12"))
    wrong = [(c.config, c.row.variant, c.row.got, c.row.detail) for c in cells if not c.row.passed]
    assert wrong == []
    assert all(c.row.got != "clean" for c in cells)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_matrix():
    cells = run_matrix([REGISTRY[n] for n in SHIPPED], CheckSpec(schedules=100, fault_schedules=30,
                                                                 time_budget=120, jobs=2))
    wrong = [(c.config, c.row.variant, c.row.got, c.row.detail) for c in cells if not c.row.passed]
    assert wrong == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, buckets, max_batch, ranks", [
    ("split-eligibility", (1, 2, 4, 8), 8, 2),  # was clean: its cap of 16 was hard-coded
    ("reserve-by-requested-batch", (1, 2, 4, 8, 16), 12, 2),  # was oom: max batch not a bucket
    ("watchdog-armed-on-error", (1, 2, 4, 8), 8, 3),  # fault occurrence was len(buckets)+2
    ("exit-on-timeout", (1, 2, 4, 8), 8, 4),
    ("no-liveness", (1, 2, 4, 8), 8, 3),  # the dying rank and op were fixed by hand
])
def test_catches_outside_the_default_configuration(name, buckets, max_batch, ranks):
    variant = REGISTRY[name]
    spec = CheckSpec(ranks=ranks, buckets=buckets, max_batch=max_batch, schedules=40,
                     fault_schedules=0, jobs=1)
    for topology in ("shared", "per-rank"):
        row = check_bad(variant, spec, topology)
        assert row.got == variant.expected[topology], (topology, row.got, row.detail)


def test_an_unreachable_bug_is_reported_with_its_reason(capsys):
    row = check_bad(REGISTRY["split-eligibility"], CheckSpec(buckets=(8,), max_batch=8, jobs=1),
                    "shared")
    assert row.got == "not reachable here" and row.passed
    assert "at least two" in row.detail
    assert main(["check", "--variant", "split-eligibility", "--buckets", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "not reachable here" in out and "n/a" in out and "FAILED" not in out


@pytest.mark.parametrize("module", [sim.variants, sim.variants_state, sim.variants_paging,
                                    sim.variants_comms, sim.variants_admission])
def test_no_variant_places_a_fault_or_a_cap_by_hand(module):
    source = inspect.getsource(module)
    assert not re.search(r"\bFault\(", source) and "occurrence=" not in source
    assert "graph_batch_cap=16" not in source and "len(sc.config.buckets)" not in source


def test_matrix_option_refuses_what_it_chooses(capsys):
    assert main(["check", "--matrix", "--ranks", "3"]) == 2
    assert "drop --ranks" in capsys.readouterr().err


def test_markdown_has_a_table_per_bucket_set():
    cells = run_matrix([REGISTRY["single-warmup"]], SPEC, ranks=(2,), bucket_sets=tuple(BUCKET_SETS))
    text = render_markdown(cells)
    assert text.count("| variant |") == len(BUCKET_SETS) and "invariant:I5" in text
    assert "(36 buckets; max batch 256)" in text and "buckets 36" not in text  # read twice


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, buckets, max_batch, was", [
    # the check's 17 requests never held 17 rows, so no retirement crossed from 32 back to 16
    ("local-bucket", (16, 32), 20, "clean"),
    ("local-bucket", (16, 32), 32, "clean"),
    # the check's workload never leaves one row behind a retirement (its last two requests
    # retire together): the variant now draws the workload per run (WorkloadDraw)
    ("local-bucket", (1, 9), 9, "clean"),
    # 32 holds more rows than max batch 20, and was not counted as a bucket the cap could forbid
    ("split-eligibility", (16, 32), 20, "not reachable here"),
])
def test_catches_where_the_smallest_bucket_is_large(name, buckets, max_batch, was):
    variant = REGISTRY[name]
    spec = CheckSpec(buckets=buckets, max_batch=max_batch, schedules=40, fault_schedules=0,
                     jobs=1)
    for topology in ("shared", "per-rank"):
        row = check_bad(variant, spec, topology)
        assert row.got == variant.expected[topology] != was, (topology, row.got, row.detail)


@pytest.mark.timeout(120)
def test_split_eligibility_s_oom_is_its_other_harm_and_only_that_one_passes():
    """At buckets 8,16 and max batch 16 the graph of 16 that the reserve leaves out does not fit
    the room the KV cache's page rounding leaves, so rank 1 runs out of memory capturing it
    before the captured sets are compared (the row read oom, a MISMATCH). `also_expected` lets
    that verdict catch the variant; without it the same row fails."""
    from dataclasses import replace

    variant = REGISTRY["split-eligibility"]
    spec = CheckSpec(buckets=(8, 16), max_batch=16, schedules=20, fault_schedules=0, jobs=1)
    row = check_bad(variant, spec, "shared")
    assert row.got == "oom" and row.passed and "also_expected" in row.detail, row.detail
    assert not check_bad(replace(variant, also_expected=()), spec, "shared").passed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("buckets, max_batch", [((8,), 5), ((4, 8), 3), ((8,), 8)])
def test_split_eligibility_s_unreachable_reason_holds_when_forced(buckets, max_batch):
    """Where the row reads "not reachable here" (the sweep captures one bucket), the variant
    forced past that check finds nothing. Old behaviour: rank 0 compared each bucket with the
    plan's row cap, so at max batch 5 it skipped bucket 8, the bucket a full batch replays,
    and the forced copy diverged with no numeric cap at all (a fresh helper's finding)."""
    from dataclasses import replace

    variant = REGISTRY["split-eligibility"]
    spec = CheckSpec(buckets=buckets, max_batch=max_batch, schedules=20, fault_schedules=0,
                     jobs=1)
    assert check_bad(variant, spec, "shared").got == "not reachable here"
    forced = check_bad(replace(variant, unreachable=None), spec, "shared")
    assert forced.got == "clean", forced.detail


@pytest.mark.timeout(120)
def test_also_expected_passes_no_topology_expected_clean():
    """A fresh reviewer's finding: a variant expected clean per-rank, with also_expected
    ("divergence",), passed a per-rank divergence."""
    from dataclasses import replace

    variant = replace(REGISTRY["local-bucket"], name="lb-perrank-clean",
                      expected={"shared": "divergence", "per-rank": "clean"},
                      also_expected=("divergence",))
    spec = CheckSpec(buckets=(8, 16), max_batch=16, schedules=10, fault_schedules=0, jobs=1)
    row = check_bad(variant, spec, "per-rank")
    assert row.got == "divergence" and not row.passed
    assert check_bad(variant, spec, "shared").passed


@pytest.mark.timeout(120)
def test_the_first_row_bug_needs_a_short_graph_of_two_rows():
    """A fresh reviewer's finding: at --buckets 1,32 only bucket 1 has a short-path graph, so
    a step of two rows pads to 32 and cannot replay it; short-path-first-row read clean (a
    MISMATCH) and the clean row counted first_row_behind at replays of bucket 32. Now the bad
    row is not reachable here (forced past that, it finds nothing), and the clean row reads
    clean with that event left out, saying why."""
    from dataclasses import replace

    spec = CheckSpec(buckets=(1, 32), max_batch=32, schedules=20, fault_schedules=0, jobs=1)
    bad = REGISTRY["short-path-first-row"]
    row = check_bad(bad, spec, "shared")
    assert row.got == "not reachable here" and "graph of bucket 1 only" in row.detail
    assert check_bad(replace(bad, unreachable=None), spec, "shared").got == "clean"
    [clean] = check_correct(REGISTRY["correct-short-path"], spec, "shared")
    assert clean.got == "clean", clean.detail
    assert "first_row_behind not reachable here" in clean.detail
    assert "first_row_behind" not in clean.detail.split(";")[0]
    assert not clean.stats.reached.get("first_row_behind")  # counted only where it can harm
