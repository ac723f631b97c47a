"""Absurd sizes are refused in one line naming the value, before any search (issue 13)."""

import json

import pytest

from lockstep.cli import main
from protocol.errors import ConfigError
from sim.check import CheckSpec, replay_trace
from sim.limits import MAX_BUCKET, MAX_BUCKETS, MAX_JOBS, MAX_RANKS, MAX_SCHEDULES, MAX_TIME_BUDGET


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv,needle", [
    (["--ranks", "1000000"], "--ranks: ranks 1000000 is above 64"),
    (["--ranks", str(MAX_RANKS + 1)], f"ranks {MAX_RANKS + 1} is above"),
    (["--buckets", "1,2,100000000"], "--buckets: bucket 100000000 is above 1048576"),
    (["--buckets", ",".join(map(str, range(1, MAX_BUCKETS + 2)))], f"{MAX_BUCKETS + 1} buckets is above"),
    (["--max-batch", str(10**19)], f"--max-batch: max batch {10**19} is above 1048576, the most "
                                   "decode rows the simulator models in one step"),
    # more digits than any bound has: refused unparsed (its echo clipped past 32 characters)
    (["--max-batch", str(10**30)], f"--max-batch: {10**30} has more than 20 digits"),
    (["--schedules", str(10**12)], f"--schedules: schedules {10**12} is above 1000000"),
    (["--fault-schedules", str(10**10)], f"--fault-schedules: fault schedules {10**10} is above"),
    (["--jobs", "100000"], "--jobs: jobs 100000 is above 256"),
    (["--time-budget", "1e300"], "--time-budget: time budget 1e+300 is above 86400"),
])
def test_huge_values_are_refused_at_once(argv, needle, capsys, no_simulation):
    """Refused, not started: no simulated world is built (`no_simulation`)."""
    with pytest.raises(SystemExit) as info:
        main(["check", "--no-progress", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("field,value", [
    ("ranks", MAX_RANKS + 1), ("buckets", (1, MAX_BUCKET + 1)), ("max_batch", MAX_BUCKET + 1),
    ("schedules", MAX_SCHEDULES + 1), ("clean_schedules", MAX_SCHEDULES + 1),
    ("fault_schedules", MAX_SCHEDULES + 1), ("jobs", MAX_JOBS + 1),
    ("time_budget", MAX_TIME_BUDGET * 2),
])
def test_library_refuses_the_same_values(field, value):
    with pytest.raises(ConfigError, match="is above"):
        CheckSpec(**{field: value}).scenario("shared")


def test_largest_accepted_values_pass_the_limits():
    CheckSpec(ranks=MAX_RANKS, schedules=MAX_SCHEDULES, fault_schedules=MAX_SCHEDULES,
              jobs=MAX_JOBS, time_budget=MAX_TIME_BUDGET).scenario("shared")


def test_replayed_trace_with_absurd_ranks_is_refused():
    data = {"format": 1, "variant": "correct", "choices": [], "scenario": {"ranks": 10**6}}
    with pytest.raises(ConfigError, match="ranks 1000000 is above 64"):
        replay_trace(json.loads(json.dumps(data)))


def test_a_bucket_set_past_the_modelled_memory_is_refused_with_its_need():
    """The modelled rank (`sim.scenario.MemoryModel`: 4 GiB of weights, 2 MiB of eager
    activations a row, a graph pool of 64 KiB a row, 141 GiB) cannot hold a bucket of 100,000
    rows: refused before any search, naming what it needs. This test is in the mutation tool's
    killers; the same line through the command line (`test_cli.py`) is not, and a per-row
    activation of 1 MiB (mutant #2402) let the bucket through."""
    with pytest.raises(ConfigError, match="buckets up to 100000 need 205 GiB per rank in the "
                                          "modelled memory, more than its 141 GiB"):
        CheckSpec(buckets=(100000,)).scenario("shared")
