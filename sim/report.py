"""Counterexamples for people and machines: text narrative, Mermaid sequence diagram, JSON.

The narrative keeps what explains the failure -- commands, lock-holding driver calls, launches,
synchronizes, replies, collectives -- and drops per-kernel noise; it ends with the wait-for cycle
or the divergence, sentence by sentence.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

from protocol.trace import TraceEvent
from sim.run import RunResult

TRACE_FORMAT = 1


@lru_cache(maxsize=1)
def model_fingerprint() -> str:
    """12 hex digits of a hash of every source file of `protocol/` and `sim/`: what decides
    whether a recorded schedule replays. A trace records it (``"model"``), so a replay that
    departs from a recording made by other code says so instead of blaming the simulator's
    determinism (a fresh user's finding: a 4-hour-old trace read as "NONDETERMINISM"). A
    variant loaded from a file is not part of it."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in ("protocol", "sim"):
        for path in sorted((root / package).glob("*.py")):
            digest.update(f"{package}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def variant_file_fingerprint(variant_name: str) -> str | None:
    """12 hex digits of a hash of the file that defined ``variant_name``
    (`sim.variants.load_variant_file`), or None for a variant from no file or a file no longer
    readable. A trace records it (``"variant_file"``): a fresh user's replay after editing the
    file read as the simulator's NONDETERMINISM."""
    from sim.variants import file_digest, origin_of

    origin = origin_of(variant_name)
    try:
        return None if origin is None else file_digest(origin)[:12]
    except OSError:
        return None


def field_digest(name: str, value) -> str:
    """12 hex digits of a SHA-256 of one field of a trace (of its ``scenario``, or one of its
    `RECORD_FIELDS`): its name and its value as canonical JSON (keys sorted, no spaces, a
    whole float as its integer), so the same value hashes alike however the file is laid out
    or a JSON tool rewrote its numbers (jq writes 0.0 as 0; the replay compares with ``==``),
    and a field's value never passes for another field's."""
    text = json.dumps(_whole_floats_as_ints(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{name}\0{text}".encode()).hexdigest()[:12]


def _whole_floats_as_ints(value):
    """``value`` (parsed JSON) with every float that is a whole number replaced by its int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (list, tuple)):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def scenario_digest(scenario_spec: dict) -> dict[str, str]:
    """Field -> `field_digest` of each field of a trace's ``scenario`` object. A trace records
    it (``"scenario_digest"``): a replay of a scenario edited by hand (ranks, buckets, hazards
    off) departed from its recording and read as the simulator's NONDETERMINISM (a hostile
    user's trial); with the digest it is a bad trace naming the edited field
    (`sim.check.replay_trace`)."""
    return {name: field_digest(name, value) for name, value in scenario_spec.items()}


NOISY_OPS = {"graph_memory", "release_slot", "move_slot", "prepare_replay"}
_GAP = "     ... (events in between left out)"
EARLIER = "earlier"
"""`_window`'s first item when it starts after the run's first event: the story is a tail."""
DEVICE_OPS = ("launch", "warmup_collective", "run_eager", "prefill", "enqueue_sample")
"""Ops drawn as an arrow to the rank's device in the sequence diagrams (they enqueue its work)."""


def _is_story_event(e: TraceEvent) -> bool:
    """Whether the story tells ``e``: kernels and bookkeeping ops (`NOISY_OPS`) it leaves out."""
    return e.kind != "kernel" and not (e.kind == "op" and e.what in NOISY_OPS)


def _told_step(outcome) -> int | None:
    """The command whose events the story must show besides its tail: the failure's cause
    where it names one (`Outcome.cause`), else the step at which it broke."""
    return outcome.cause if outcome.cause is not None else outcome.step


def _window(events: list[TraceEvent], limit: int, step: int | None = None,
            at: int | None = None) -> list:
    """The events since the command before the last one, at most ``limit`` of them.

    The window starts with `EARLIER` when it leaves out events before its first one. When
    the verdict names the command ``step`` at which a rule broke and none of that
    command's events is in the tail (a trace check at the end of the run flags a step of the
    sweep, say), the window starts with that command's events -- up to half of ``limit``, its
    last ones, ending with the breaking event ``events[at]`` where the verdict names it
    (`sim.common.Outcome.at`) -- then a None marking the events left out, then the tail, so
    the story always shows the step that broke the rule.
    """
    keep = [e for e in events if _is_story_event(e)]
    breaking = events[at] if at is not None else None
    sends = [i for i, e in enumerate(keep) if e.kind == "send"]
    start = sends[-2] if len(sends) >= 2 else 0
    tail_start = max(start, len(keep) - limit)
    tail = keep[tail_start:]
    head = [i for i, e in enumerate(keep[:tail_start]) if e.seq == step] if step is not None else []
    cut = next((i for i in head if keep[i] is breaking), None)
    if cut is not None:  # nothing of the command after the event that broke the rule
        head = [i for i in head if i <= cut]
    if not head or any(e.seq == step for e in tail):
        return ([EARLIER] if tail_start > 0 else []) + tail
    first = next((i for i in head if keep[i].kind == "send"), head[0])
    head = [i for i in head if i >= first][-(limit // 2):]
    if keep[first] is not keep[head[0]]:
        head = [first] + head[1:]  # the command's send stays first: what was asked
    tail = tail[-(limit - len(head)):]
    return ([EARLIER] if head[0] > 0 else []) + [keep[i] for i in head] + [None] + tail


def _sentence(e: TraceEvent) -> str:
    if e.kind == "send":
        return f"controller sends command {e.seq} {e.what}" + (f" ({e.detail})" if e.detail else "")
    if e.kind == "op":
        status = "" if e.ok else " FAILED"
        return f"rank {e.rank} {e.what}{f' {e.detail}' if e.detail else ''}{status}"
    if e.kind == "reply":
        return f"rank {e.rank} replies to command {e.seq}" + ("" if e.ok else f" with error: {e.detail}")
    if e.kind == "collective":
        return f"{e.actor.replace('device', 'device ')} completes {e.detail}"
    if e.kind == "fault":
        return f"rank {e.rank}: {e.detail} in {e.what}"
    return f"{e.actor} {e.kind}" + (f": {e.detail}" if e.detail else "")


def _kept_before(trace: list[TraceEvent], window: list) -> int:
    """How many story events (those `_window` keeps) come before the window's first event."""
    first = next(e for e in window if e is not EARLIER and e is not None)
    before = next(i for i, e in enumerate(trace) if e is first)  # by identity: events may repeat
    return sum(map(_is_story_event, trace[:before]))


def narrative(result: RunResult, limit: int = 40) -> str:
    """Numbered story of the failure's last steps, then the verdict's explanation. Each event
    shows its simulated time when the story's times differ (a watchdog or a timeout moved the
    clock), and none when they are all equal."""
    outcome = result.outcome
    events = _window(result.world.trace, limit, _told_step(outcome), outcome.at)
    breaking = result.world.trace[outcome.at] if outcome.at is not None else None
    shown = [e for e in events if e is not EARLIER and e is not None]
    timed = len({e.time for e in shown}) > 1  # simulated time that never moves says nothing
    lines, number = [], 0
    for e in events:
        if e is EARLIER:
            lines.append(f"     ... ({_kept_before(result.world.trace, events)} earlier story "
                         "events left out)")
        elif e is None:
            lines.append(_GAP)
        else:
            number += 1
            mark = f"   <== {outcome.invariant} breaks here" if e is breaking else ""
            lines.append(f"{number:>3}. " + (f"t={e.time:g}s " if timed else "") + _sentence(e)
                         + mark)
    lines.append(f"==> {outcome.verdict}" + (f" ({outcome.invariant})" if outcome.invariant else ""))
    if outcome.cycle:
        for node, why in outcome.cycle:
            lines.append(f"    - {why}")
    else:
        lines.append(f"    {outcome.detail}")
    return "\n".join(lines)


def _participant(actor: str) -> str:
    if actor == "controller":
        return "C"
    if actor.startswith("rank"):
        return "R" + actor[4:]
    if actor.startswith("device"):
        return "D" + actor[6:]
    return "C"


def _mermaid_text(text: str) -> str:
    text = text.replace(";", ",").replace("#", "no. ").replace(":", " -")
    return text if len(text) <= 160 else text[:159].rstrip() + "…"


def mermaid(result: RunResult, limit: int = 40) -> str:
    """A Mermaid sequence diagram of the same window, ending in the cycle or divergence."""
    world = result.world
    ranks = range(world.ws)
    lines = ["sequenceDiagram", "    participant C as controller"]
    for r in ranks:
        lines.append(f"    participant R{r} as rank {r} host")
    for r in ranks:
        lines.append(f"    participant D{r} as device {r}")
    outcome = result.outcome
    breaking = world.trace[outcome.at] if outcome.at is not None else None
    for e in _window(world.trace, limit, _told_step(outcome), outcome.at):
        if e is EARLIER:
            lines.append("    Note over C: ... earlier events left out")
        elif e is None:
            lines.append("    Note over C: ... events in between left out")
        elif e.kind == "send":
            for r in ranks:
                lines.append(f"    C->>R{r}: {e.seq} {e.what} {_mermaid_text(e.detail)}".rstrip())
        elif e.kind == "op":
            arrow = "->>" if e.what in DEVICE_OPS else None
            text = _mermaid_text(f"{e.what} {e.detail}".strip() + ("" if e.ok else " FAILED"))
            if arrow:
                lines.append(f"    R{e.rank}{arrow}D{e.rank}: {text}")
            else:
                lines.append(f"    Note over R{e.rank}: {text}")
            if e is breaking:
                lines.append(f"    Note over R{e.rank}: {outcome.invariant} breaks here")
        elif e.kind == "reply":
            lines.append(f"    R{e.rank}-->>C: reply {e.seq}" + ("" if e.ok else " error"))
        elif e.kind == "collective":
            span = ",".join(f"D{r}" for r in ranks) if e.actor == "collectives" else _participant(e.actor)
            lines.append(f"    Note over {span}: {_mermaid_text(e.detail)}")
        elif e.kind in ("abort", "exit", "watchdog-fire", "fault"):
            where = _participant(e.actor)
            lines.append(f"    Note over {where}: {e.kind} {_mermaid_text(e.detail)}")
    if outcome.cycle:
        for i, (node, why) in enumerate(outcome.cycle):
            target = outcome.cycle[(i + 1) % len(outcome.cycle)][0]
            lines.append(f"    {_participant(node)}--x{_participant(target)}: {_mermaid_text(why)}")
    else:
        lines.append(f"    Note over C: {outcome.verdict} - {_mermaid_text(outcome.detail)}")
    return "\n".join(lines) + "\n"


RECORD_FIELDS = ("model", "variant_file", "variant_path", "variant", "verdict", "invariant",
                 "choices", "trace")
"""The fields of a trace outside its ``scenario`` that a replay reads, compares or names: the
code and variant that recorded it, what it found, and the run itself. Not ``detail``,
``check``, ``cycle`` (text for a reader, never read back) or ``actions`` (checked against the
choices)."""


def record_digest(trace: dict) -> dict[str, str]:
    """Field -> `field_digest` of each of a trace's `RECORD_FIELDS` it holds. A trace records it
    (``"record_digest"``): a replay of a verdict, variant name, invariant or schedule edited by
    hand departed from the recording and was reported as the simulator's nondeterminism; with
    the digest it is a bad trace naming the edited field (`sim.check.replay_trace`)."""
    return {name: field_digest(name, trace[name]) for name in RECORD_FIELDS if name in trace}


def to_json(result: RunResult, variant_name: str, scenario_spec: dict) -> dict:
    """Everything needed to replay the run exactly and to read it without the simulator. A
    variant from a file (`sim.variants.load_variant_file`) adds its file's fingerprint
    (``variant_file``) and resolved path (``variant_path``): a replay names the file to load,
    and never loads it itself (a trace is data; running the code a trace names is not)."""
    from sim.variants import origin_of

    data = {
        "format": TRACE_FORMAT,
        "model": model_fingerprint(),
        **({"variant_file": fingerprint, "variant_path": origin_of(variant_name)}
           if (fingerprint := variant_file_fingerprint(variant_name)) is not None else {}),
        "variant": variant_name,
        "scenario": scenario_spec,
        "scenario_digest": scenario_digest(scenario_spec),
        "verdict": result.outcome.verdict,
        "invariant": result.outcome.invariant,
        "check": result.outcome.check,
        "detail": result.outcome.detail,
        "cycle": [list(edge) for edge in result.outcome.cycle],
        "actions": result.actions,
        "choices": result.choices,
        "trace": [e.to_json() for e in result.world.trace],
    }
    return {**data, "record_digest": record_digest(data)}


def write_trace(directory: str | Path, name: str, result: RunResult, variant_name: str,
                scenario_spec: dict) -> dict[str, Path]:
    """Write ``name``.json, ``name``.txt and ``name``.mmd under ``directory``; returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / f"{name}.json", "txt": directory / f"{name}.txt",
             "mmd": directory / f"{name}.mmd"}
    paths["json"].write_text(json.dumps(to_json(result, variant_name, scenario_spec), indent=1))
    paths["txt"].write_text(narrative(result) + "\n")
    paths["mmd"].write_text(mermaid(result))
    return paths


__all__ = ["narrative", "mermaid", "to_json", "write_trace", "asdict"]
