"""The printed minimal trace always shows the step that broke the rule (issue 13)."""

import pytest

from sim.check import CheckSpec, check_bad
from sim.report import mermaid, narrative
from sim.variants import REGISTRY

SPEC = CheckSpec(schedules=20, jobs=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["fused-sweep", "lazy-serving-capture", "uncoordinated-profile"])
def test_rule_checked_at_the_end_still_shows_its_step(name):
    # per-rank: no deadlock, so the rule is flagged by the trace check after teardown, long
    # after the step that broke it; the tail alone would show only teardown
    row = check_bad(REGISTRY[name], SPEC, "per-rank")
    outcome = row.minimal.outcome
    assert outcome.verdict == "invariant" and outcome.step is not None
    story = narrative(row.minimal)
    assert f"sends command {outcome.step} " in story
    assert "events in between left out" in story
    assert f"C->>R0: {outcome.step} " in mermaid(row.minimal)


def test_breaking_event_is_in_the_story():
    row = check_bad(REGISTRY["fused-sweep"], SPEC, "per-rank")
    story = narrative(row.minimal)
    events = story.split("==> ")[0]  # the numbered events, not the verdict's explanation
    # I4: rank 0 launched the graph before the others uploaded it -- that launch is shown
    assert f"rank {row.minimal.outcome.rank} launch decode@" in events


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["fused-sweep", "lazy-serving-capture", "uncoordinated-profile"])
def test_a_rule_found_after_the_run_marks_the_event_that_broke_it(name):
    """A trace check that runs once the run has ended names the event that broke its rule; the
    story marks that line, shows nothing of the command after it, and the diagram notes it.
    Before, the head showed the command's last events, so the breaking one could fall out of
    it and nothing in the story said which line broke the rule."""
    result = check_bad(REGISTRY[name], SPEC, "per-rank").minimal
    outcome = result.outcome
    assert outcome.at is not None
    breaking = result.world.trace[outcome.at]
    assert breaking.seq == outcome.step and breaking.rank == outcome.rank
    lines = narrative(result).split("==> ")[0].splitlines()
    marked = [i for i, line in enumerate(lines) if line.endswith(f"<== {outcome.invariant} breaks here")]
    assert len(marked) == 1
    assert f"rank {breaking.rank} {breaking.what}" in lines[marked[0]]
    assert lines[marked[0] + 1] == "     ... (events in between left out)"
    assert f"{outcome.invariant} breaks here" in mermaid(result)


def test_an_outcome_found_as_the_run_goes_marks_no_line():
    result = check_bad(REGISTRY["local-bucket"], SPEC, "shared").minimal
    assert result.outcome.at is None and "breaks here" not in narrative(result)


def test_failure_in_the_tail_has_no_gap():
    row = check_bad(REGISTRY["local-bucket"], SPEC, "shared")
    story = narrative(row.minimal)
    assert f"command {row.minimal.outcome.step}" in story
    assert "events in between left out" not in story


def test_a_story_that_starts_mid_run_says_how_much_it_left_out():
    """Before, a tail of a 365-event run was numbered from 1 with nothing above it, so it read
    as the whole run. The marker's count and the numbered events add up to the run's story
    events, and the numbering starts at 1 after the marker."""
    from sim.report import _is_story_event

    result = check_bad(REGISTRY["local-bucket"], SPEC, "shared").minimal
    kept = [e for e in result.world.trace if _is_story_event(e)]
    assert len(kept) > 12
    lines = narrative(result, limit=10).split("==> ")[0].splitlines()
    assert lines[0].startswith(f"     ... ({len(kept) - 10} earlier story events left out")
    numbered = [line for line in lines if line[:3].strip().isdigit()]
    assert len(numbered) == 10 and numbered[0].startswith("  1. ")
    assert "earlier events left out" in mermaid(result, limit=10)


def test_a_story_that_starts_at_the_first_event_has_no_marker():
    from sim.report import EARLIER, _window

    result = check_bad(REGISTRY["local-bucket"], SPEC, "shared").minimal
    first_events = [e for e in result.world.trace if e.kind != "kernel"][:3]
    window = _window(first_events, 10)
    assert window == first_events and EARLIER not in window


def test_times_show_only_when_the_clock_moved_in_the_story():
    """Before, every line of most stories read t=0s: noise that looked like a measurement."""
    still = narrative(check_bad(REGISTRY["local-bucket"], SPEC, "shared").minimal)
    assert " t=" not in still.split("==> ")[0]
    moving = narrative(check_bad(REGISTRY["exit-on-timeout"], SPEC, "shared").minimal)
    times = {line.split(" t=")[1].split("s ")[0] for line in moving.split("==> ")[0].splitlines()
             if " t=" in line}
    assert len(times) > 1, moving


def test_a_run_of_two_commands_starts_its_story_at_the_first_command():
    """The window starts at the command before the last one, also when the run sent only two
    (mutant #2406, `>= 2` -> `>= 3`, started it at the watchdog's arming instead; no shipped
    variant's minimal trace has exactly two commands)."""
    from protocol.trace import TraceEvent as E
    from sim.report import EARLIER, _window

    events = [E("controller", "watchdog-arm", "watchdog"),
              E("controller", "send", "Warmup", 0, None, ""), E("rank0", "op", "synchronize", 0, 0),
              E("rank0", "reply", "Reply", 0, 0), E("controller", "send", "Capture", 1, None, ""),
              E("rank0", "op", "record", 1, 0, "decode@8")]
    assert _window(events, 40) == [EARLIER] + events[1:]


def test_the_breaking_command_takes_half_the_window():
    """When the command that broke the rule is not in the tail, its send and its last events
    take half the window, the tail the other half (mutant #2441, a third instead of a half,
    was not caught: every shipped story's head is shorter than either)."""
    from protocol.trace import TraceEvent as E
    from sim.report import EARLIER, _window

    def command(seq, ops):
        return [E("controller", "send", "Step", seq, None, "")] + [
            E("rank0", "op", f"op{i}", seq, 0) for i in range(ops)]

    events = command(0, 8) + command(1, 20) + command(2, 20)
    window = _window(events, 10, step=0)
    gap = window.index(None)
    assert window[0] is not EARLIER and window[0] is events[0]  # the send of command 0 first
    assert window[:gap] == [events[0]] + events[5:9]  # then its last four: five in all
    assert len(window) - gap - 1 == 5 and window[-1] is events[-1]
