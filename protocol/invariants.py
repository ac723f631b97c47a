"""Invariant checks on a protocol trace: the protocol ships its own checks.

The simulator and the engine record the same `TraceEvent`s (`protocol.execution` writes the
rank side of both), so one set of checkers validates both drivers. Each check reads the events
in order and returns the first violation of its invariant as a `Violation` record, or None;
`check_trace` runs them all. Invariants about state rather than order -- slot maps (I8),
captured sets (I3 at Finalize) -- are checked by the protocol itself and by `sim.checks` on the
simulated world.

When does the controller hold a reply (I1)? A trace with ``receive`` events (the simulator's:
its transport delivers replies one at a time) counts a reply from its delivery; a trace without
them (the engine's transports hand every reply over at collection) from the rank's ``reply``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter

from protocol.trace import TraceEvent


@dataclass(frozen=True)
class Violation:
    """One broken invariant.

    Attributes:
        invariant: ``"I1"`` .. ``"I13"``.
        text: one sentence naming the rank, command and value involved.
        rank: the rank that broke it, when one did.
        step: the command sequence number at which it broke, when known.
        clause: which rule of the invariant broke, a short name unique among the checks
            (I11 has two: ``tokens-read-early`` and ``replied-in-flight``); the simulator's
            reducer keeps it, so a counterexample never shrinks into another rule's.
        event: the event at which it broke (the object in the trace the check read), so a
            report can point at it in a trace that ran on past it.
    """

    invariant: str
    text: str
    rank: int | None = None
    step: int | None = None
    clause: str = ""
    event: TraceEvent | None = None


def _ranks(events: Sequence[TraceEvent]) -> list[int]:
    """The ranks that act in ``events``, ascending."""
    actors = list(map(_ACTOR, events))
    acting = {actor for actor in set(actors) if actor.startswith("rank")}  # a few distinct
    ranks = set(map(_RANK, compress(events, map(acting.__contains__, actors))))
    ranks.discard(None)
    return sorted(ranks)


_ACTOR, _RANK, _KIND = attrgetter("actor"), attrgetter("rank"), attrgetter("kind")


def check_i1_step_lock(events: Sequence[TraceEvent],
                       ranks: Sequence[int] | None = None) -> Violation | None:
    """I1: command N+1 is sent only after every rank replied to N. ``ranks``: the ranks of
    the whole trace, when ``events`` holds only some of its events (`check_trace`)."""
    ranks = _ranks(events) if ranks is None else ranks
    held = "receive" if "receive" in map(_KIND, events) else "reply"
    # the last command sent (if any was), and the ranks whose reply to it is not held yet
    sent, seq, waiting = False, None, set()
    for e in events:
        kind = e.kind
        if kind == "send":
            if waiting:
                return Violation("I1", f"command {e.seq} ({e.what}) was sent while the "
                                       f"controller held no reply from rank(s) "
                                       f"{sorted(waiting)} to command {seq}",
                                 min(waiting), e.seq, "sent-before-replies", e)
            sent, seq, waiting = True, e.seq, set(ranks)
        elif kind == held and sent and e.seq == seq:
            waiting.discard(e.rank)
    return None


def check_i3_no_serving_capture(events: Sequence[TraceEvent]) -> Violation | None:
    """I3: once serving began (first Step sent), no rank records a graph."""
    serving = False
    for e in events:
        if e.kind == "send" and e.what == "Step":
            serving = True
        elif serving and e.kind == "op" and e.ok and e.what == "record":
            return Violation("I3", f"rank {e.rank} recorded graph {e.detail} while serving (command {e.seq}); "
                          "serving under TP never captures", e.rank, e.seq,
                             "recorded-while-serving", e)
    return None


def check_i4_capture_barrier(events: Sequence[TraceEvent],
                             ranks: Sequence[int] | None = None) -> Violation | None:
    """I4: no rank launches a graph for the first time before every rank uploaded it.
    ``ranks``: as for `check_i1_step_lock`."""
    every = set(_ranks(events) if ranks is None else ranks)
    uploaded: dict[str, set[int]] = {}
    launched: set[tuple[int, str]] = set()
    for e in events:
        if e.kind != "op" or not e.ok:
            continue
        what = e.what
        if what == "upload":
            ranks_done = uploaded.get(e.detail)
            if ranks_done is None:
                ranks_done = uploaded[e.detail] = set()
            ranks_done.add(e.rank)
        elif what == "launch" and (first := (e.rank, e.detail)) not in launched:
            launched.add(first)
            missing = every - uploaded.get(e.detail, _NONE)
            if missing:
                itself = (" (itself included: a first launch without an upload uploads "
                          "implicitly)" if e.rank in missing else "")
                return Violation("I4", f"rank {e.rank} launched graph {e.detail} (command {e.seq}) before "
                              f"rank(s) {sorted(missing)} had uploaded it{itself}", e.rank, e.seq,
                                 "launched-before-upload", e)
    return None


def check_i5_warmup(events: Sequence[TraceEvent],
                    allreduce_bytes: Callable[[int], int] | None = None) -> Violation | None:
    """I5: a rank records a graph only after warming up the collective size that graph uses."""
    if allreduce_bytes is None:
        return None
    warmed: dict[int, set[int]] = {}
    sizes: dict[str, int] = {}  # graph key text -> its all-reduce size (every rank records it)
    for e in events:
        if e.kind != "op" or not e.ok:
            continue
        what = e.what
        if what == "warmup_collective":
            done = warmed.get(e.rank)
            if done is None:
                done = warmed[e.rank] = set()
            done.add(int(e.detail))
        elif what == "record":
            size = sizes.get(e.detail)
            if size is None:
                size = sizes[e.detail] = allreduce_bytes(int(e.detail.rsplit("@", 1)[1]))
            if size not in warmed.get(e.rank, _NONE):
                return Violation("I5", f"rank {e.rank} recorded graph {e.detail} before any warm-up "
                              f"all-reduce of its message size ({size} bytes)", e.rank, e.seq,
                                 "recorded-before-warmup", e)
    return None


def check_i6_watchdog(events: Sequence[TraceEvent]) -> Violation | None:
    """I6: the watchdog never fires once serving began, and is disarmed when the sweep fails."""
    serving = False
    for e in events:
        if e.kind == "send" and e.what == "Step":
            serving = True
        elif e.kind == "watchdog-fire" and serving:
            return Violation("I6", "the startup watchdog fired while serving: it was not disarmed",
                             None, e.seq, "watchdog-fired-while-serving", e)
    return None


def check_i9_reserve_before_kv(events: Sequence[TraceEvent]) -> Violation | None:
    """I9: every graph captured after KV sizing was measured (reserved) before it."""
    measured: dict[int, set[str]] = {}
    kv_done: set[int] = set()
    for e in events:
        if e.kind != "op" or not e.ok:
            continue
        what = e.what
        if what == "allocate_kv":
            kv_done.add(e.rank)
        elif what == "record" and e.rank not in kv_done:
            keys = measured.get(e.rank)
            if keys is None:
                keys = measured[e.rank] = set()
            keys.add(e.detail)
        elif what == "upload" and e.rank in kv_done and e.detail not in measured.get(e.rank, _NONE):
            return Violation("I9", f"rank {e.rank} captured graph {e.detail} whose memory was not reserved "
                          "before the KV cache was sized", e.rank, e.seq, "captured-unreserved", e)
    return None


def check_i10_teardown_order(events: Sequence[TraceEvent]) -> Violation | None:
    """I10: a rank destroys its communicator only after freeing every graph it holds."""
    live: dict[int, bool] = {}
    for e in events:
        if e.kind != "op" or not e.ok:
            continue
        if e.what == "record":
            live[e.rank] = True
        elif e.what == "free_graphs":
            live[e.rank] = False
        elif e.what == "destroy_communicator" and live.get(e.rank):
            return Violation("I10", f"rank {e.rank} destroyed its communicator while graphs that captured "
                           "it were alive", e.rank, e.seq, "communicator-before-graphs", e)
    return None


def check_i11_reply_after_sync(events: Sequence[TraceEvent]) -> Violation | None:
    """I11 (and I1's device half): a rank replies, and reads a step's sampled tokens, only once
    the device work they depend on completed. Work is complete after a synchronize, or -- under
    overlapped scheduling -- after an `await_step` of the `mark_step` that follows it on the
    stream. A reply may leave in flight only the work of its own command, and only if that
    command marked it (an overlapped step: its reply means "enqueued, previous step done")."""
    loose: dict[int, dict[int, str]] = {}    # rank -> command -> device work no mark covers
    marked: dict[int, dict[int, str]] = {}   # rank -> mark's command -> work it covers
    for e in events:
        kind = e.kind
        if kind == "op" and e.ok:
            what = e.what
            if what == "synchronize":  # the most frequent, and in neither set below
                loose.pop(e.rank, None)
                marked.pop(e.rank, None)
            elif what in _ENQUEUING or what.startswith("run_eager"):
                work = loose.get(e.rank)
                if work is None:
                    work = loose[e.rank] = {}
                work[e.seq] = what
            elif what == "mark_step":
                work = loose.pop(e.rank, {})
                marked.setdefault(e.rank, {})[e.seq] = next(reversed(work.values()), "mark_step")
            elif what == "await_step":
                waited = e.data[0] if e.data else e.seq
                for seq in [s for s in marked.get(e.rank, {}) if s <= waited]:
                    del marked[e.rank][seq]
            elif what == "read_tokens":
                read = e.data[0] if e.data else e.seq
                pending = [(s, w) for s, w in {**marked.get(e.rank, {}),
                                               **loose.get(e.rank, {})}.items() if s <= read]
                if pending:
                    return Violation("I11", f"rank {e.rank} read the tokens of step {read} before "
                                   f"its device work ({pending[0][1]} of command {pending[0][0]}) "
                                   "completed", e.rank, e.seq, "tokens-read-early", e)
        elif kind == "reply" and e.ok:
            covered = marked.get(e.rank)
            early = [(s, w) for s, w in covered.items() if s < e.seq] if covered else ()
            work = loose.get(e.rank)
            if work or early:
                s, what = next(iter(work.items())) if work else early[0]
                return Violation("I11", f"rank {e.rank} replied to command {e.seq} while its device work "
                               f"({what} of command {s}) was still in flight", e.rank, e.seq,
                                 "replied-in-flight", e)
    return None


def check_i12_replay_metadata(events: Sequence[TraceEvent]) -> Violation | None:
    """I12: every serving replay is preceded, in its step, by refreshing the replay buffers,
    and, where the backend reports what the replay read (an event's ``data``: the step's rows,
    then the rows read), it read the step's rows."""
    serving = False
    prepared: set[tuple[int, int]] = set()
    for e in events:
        if e.kind == "send" and e.what == "Step":
            serving = True
        elif e.kind == "op" and e.what == "prepare_replay":
            prepared.add((e.rank, e.seq))
        elif serving and e.kind == "op" and e.what == "launch" and (e.rank, e.seq) not in prepared:
            return Violation("I12", f"rank {e.rank} replayed {e.detail} in step {e.seq} without refreshing "
                           "its replay buffers (lengths, positions, tables)", e.rank, e.seq,
                                 "replay-not-refreshed", e)
        elif serving and e.kind == "op" and e.what == "launch" and e.data and e.data[0] != e.data[1]:
            return Violation("I12", f"rank {e.rank} replayed {e.detail} in step {e.seq} from replay "
                           f"buffers holding (slot,position,token) {e.data[1]}, not the step's rows "
                           f"{e.data[0]}: prepare_replay did not write them", e.rank, e.seq,
                                 "replay-read-other-rows", e)
    return None


def check_i13_failure_is_global(events: Sequence[TraceEvent]) -> Violation | None:
    """I13: after a failed reply, the controller sends nothing but Teardown."""
    failed = None
    for e in events:
        if e.kind == "reply" and not e.ok:
            failed = failed or e
        elif failed is not None and e.kind == "send" and e.what != "Teardown":
            return Violation("I13", f"command {e.seq} ({e.what}) was sent after rank {failed.rank} failed "
                           f"command {failed.seq}", failed.rank, e.seq, "sent-after-failure", e)
    return None


CHECKS = (check_i1_step_lock, check_i3_no_serving_capture, check_i4_capture_barrier,
          check_i6_watchdog, check_i9_reserve_before_kv, check_i10_teardown_order,
          check_i11_reply_after_sync, check_i12_replay_metadata, check_i13_failure_is_global)


def check_trace(events: Sequence[TraceEvent],
                allreduce_bytes: Callable[[int], int] | None = None) -> list[Violation]:
    """Every violation found, one per invariant, in invariant order.

    Each check reads only some kinds of event and skips the rest, so it is given just the
    events it may react to, in trace order (sorted out in one pass), and finds what it finds
    on the whole trace; the checks that count ranks get the whole trace's ranks.
    """
    ranks = _ranks(events)
    i1, i6, i13, i11, steps_and = [], [], [], [], []
    i4, i5, i9, i10 = [], [], [], []
    # who reads what: the done ops (ok) by name, the other kinds whole; a check of some ops
    # gets those ops and perhaps a few more it skips, never fewer
    done_ops = {"record": (i5, i9, i10), "upload": (i4, i9), "launch": (i4,),
                "warmup_collective": (i5,), "allocate_kv": (i9,), "free_graphs": (i10,),
                "destroy_communicator": (i10,)}
    other_kinds = {"send": (i1, i6, i13), "reply": (i1, i13, i11), "receive": (i1,),
                   "watchdog-fire": (i6,)}
    # an op's readers depend on its name and ok alone: worked out once per (name, ok), for
    # the few names a trace holds
    op_readers: dict[tuple[str, bool], tuple[list, ...]] = {}
    for e in events:
        kind = e.kind
        if kind == "op":
            readers = op_readers.get((e.what, e.ok))
            if readers is None:
                what = e.what
                readers = op_readers[(what, e.ok)] = (
                    ((i11,) if what in _I11_OPS or what.startswith("run_eager") else ())
                    + (done_ops.get(what, ()) if e.ok else ())
                    + ((steps_and,) if what in _STEP_RECORD_REPLAY else ()))
        else:
            readers = other_kinds.get(kind, ())
            if kind == "send" and e.what in _STEP_RECORD_REPLAY:
                steps_and.append(e)
        for reader in readers:
            reader.append(e)
    found = [check_i1_step_lock(i1, ranks),
             check_i3_no_serving_capture(steps_and),
             check_i4_capture_barrier(i4, ranks),
             check_i5_warmup(i5, allreduce_bytes),
             check_i6_watchdog(i6),
             check_i9_reserve_before_kv(i9),
             check_i10_teardown_order(i10),
             check_i11_reply_after_sync(i11),
             check_i12_replay_metadata(steps_and),
             check_i13_failure_is_global(i13)]
    return [v for v in found if v is not None]


_NONE: frozenset = frozenset()
_ENQUEUING = frozenset({"warmup_collective", "profile_memory", "launch", "prefill", "run_eager",
                        "move_slot", "prepare_replay", "enqueue_sample"})
"""The ops whose device work `check_i11_reply_after_sync` follows (and any ``run_eager*``)."""
_STEP_RECORD_REPLAY = frozenset({"Step", "record", "prepare_replay", "launch"})
"""What `check_i3_no_serving_capture` and `check_i12_replay_metadata` react to: the first
Step sent, and the record, prepare_replay and launch ops."""
_I11_OPS = frozenset({"warmup_collective", "profile_memory", "launch", "prefill", "run_eager",
                      "move_slot", "prepare_replay", "synchronize", "enqueue_sample",
                      "read_tokens", "mark_step", "await_step"})
"""The ops `check_i11_reply_after_sync` may react to (and any ``run_eager*``), beside the
replies: those that enqueue device work, synchronize, mark or await a step, read tokens."""



