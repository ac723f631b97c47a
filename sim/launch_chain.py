"""A chain of kernels on one stream under programmatic dependent launch (PDL), checked for stale
reads by exhaustive search over the orders the hardware allows.

Hardware model (CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization";
PTX ISA, `griddepcontrol`):
- A kernel launched without PDL starts once the kernel before it on the stream has completed.
- A kernel launched with PDL may start once the kernel before it has *triggered*
  (`griddepcontrol.launch_dependents` in every program, or completion); its programs then run
  what precedes their `griddepcontrol.wait`, which returns once the kernel before has completed
  and its writes are visible.
- A kernel triggers where its code says: before its wait, after it, or (no trigger) when it
  completes; it completes after its wait.
The model is about ordering, not values: a read is *stale* when a kernel earlier in the chain
that writes the buffer has not completed at the time of the read, and a write is *early* when
a kernel earlier in the chain that reads or writes the buffer has not completed. Reads and
writes before the wait happen when the kernel starts (the earliest they can), those after it
when the wait returns.

`check_chain` explores every order of the events (start, wait, trigger, complete of each kernel)
breadth first, so the first stale read it reports comes with a shortest event trace. It also
reports whether any order overlapped a kernel with the one before it (a chain in which nothing
ever overlaps would pass vacuously).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

BEFORE_WAIT, AFTER_WAIT, AT_EXIT = "before wait", "after wait", "at exit"
TRIGGERS = (BEFORE_WAIT, AFTER_WAIT, AT_EXIT)

# phases of a kernel in a search state
_IDLE, _STARTED, _WAITED, _DONE = 0, 1, 2, 3


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of a chain.

    Attributes:
        name: for traces.
        pdl: launched with PDL (may start when the kernel before it triggers).
        reads_before_wait / reads_after_wait: buffer names it loads before / after its wait.
        writes: buffer names it stores after its wait.
        writes_before_wait: buffer names it stores before its wait (the rule allows none).
        trigger: where it lets the next kernel start: `BEFORE_WAIT`, `AFTER_WAIT` or
            `AT_EXIT` (no `launch_dependents`: at completion).
    Raises:
        ValueError: an unknown trigger, or reads or writes before the wait of a kernel
            launched without PDL (it has no wait).
    """

    name: str
    pdl: bool = True
    reads_before_wait: frozenset[str] = frozenset()
    reads_after_wait: frozenset[str] = frozenset()
    writes: frozenset[str] = frozenset()
    trigger: str = AFTER_WAIT
    writes_before_wait: frozenset[str] = frozenset()

    def __post_init__(self):
        if self.trigger not in TRIGGERS:
            raise ValueError(f"kernel {self.name!r}: trigger {self.trigger!r}, expected one of "
                             f"{', '.join(TRIGGERS)}")
        if not self.pdl and (self.reads_before_wait or self.writes_before_wait):
            raise ValueError(f"kernel {self.name!r} is launched without PDL: it has no wait to "
                             f"read before")


@dataclass(frozen=True)
class StaleRead:
    """A read (or an early write) of a buffer before an earlier kernel that uses it completes.

    Attributes:
        reader: the later kernel (the one that reads, or writes early).
        writer: the earlier kernel, still running, that writes (or uses) the buffer.
        buffer: the buffer. early_write: the later kernel writes, not reads.
        trace: the shortest event sequence that reaches it, e.g. ("start qkv", ...).
    """

    reader: str
    writer: str
    buffer: str
    trace: tuple[str, ...]
    early_write: bool = False

    def __str__(self) -> str:
        what = "writes" if self.early_write else "reads"
        uses = "uses" if self.early_write else "writes"
        return (f"{self.reader} {what} {self.buffer} before {self.writer}, which {uses} it, "
                f"has completed: {' -> '.join(self.trace)}")


@dataclass(frozen=True)
class ChainResult:
    """`check_chain`'s answer: the first stale read (None: none in any order), the number of
    states explored, and whether some order started a kernel before the one before it
    completed."""

    stale: StaleRead | None
    states: int
    overlapped: bool


def check_chain(chain: list[KernelSpec] | tuple[KernelSpec, ...]) -> ChainResult:
    """Search every order of the chain's events for a stale read (module docstring).

    Args:
        chain: the kernels in stream order (the first one starts on its own).
    Returns:
        ChainResult; its `stale` carries a shortest trace to the first stale read found.
    Raises:
        ValueError: an empty chain.
    """
    if not chain:
        raise ValueError("an empty chain has nothing to check")
    chain = tuple(chain)
    n = len(chain)
    start_state = (_IDLE,) * n + (False,) * n  # phases, then "triggered" flags
    seen = {start_state}
    queue = deque([(start_state, ())])
    overlapped = False
    while queue:
        state, trace = queue.popleft()
        phases, triggered = state[:n], state[n:]
        for i, spec in enumerate(chain):
            for event, new in _events(chain, i, phases, triggered):
                if event == "start" and i and phases[i - 1] != _DONE:
                    overlapped = True
                step = trace + (f"{event} {spec.name}",)
                conflict = _conflict(chain, i, event, phases)
                if conflict is not None:
                    other, buffer, early_write = conflict
                    return ChainResult(StaleRead(spec.name, other.name, buffer, step,
                                                 early_write), len(seen), overlapped)
                if new not in seen:
                    seen.add(new)
                    queue.append((new, step))
    return ChainResult(None, len(seen), overlapped)


def _conflict(chain, i, event, phases):
    """(earlier kernel, buffer, early write?) of the first access kernel i makes at `event`
    while an earlier kernel that writes (for a read) or uses (for a write) the buffer has not
    completed; None when there is none."""
    spec = chain[i]
    reads = (spec.reads_before_wait if event == "start" else
             spec.reads_after_wait if event == "wait" else ())
    writes = spec.writes_before_wait if event == "start" else ()
    for accessed, early_write in ((reads, False), (writes, True)):
        for buffer in sorted(accessed):
            for other, phase in zip(chain[:i], phases):
                uses = other.writes if not early_write else (
                    other.writes | other.reads_before_wait | other.reads_after_wait)
                if buffer in uses and phase != _DONE:
                    return other, buffer, early_write
    return None


def _events(chain, i, phases, triggered):
    """The events kernel i can take from this state, each with the state after it."""
    spec = chain[i]
    phase = phases[i]
    prev_done = i == 0 or phases[i - 1] == _DONE
    prev_triggered = i == 0 or triggered[i - 1] or prev_done

    def moved(new_phase, trig=None):
        p = list(phases)
        t = list(triggered)
        p[i] = new_phase
        if trig is not None:
            t[i] = trig
        return tuple(p) + tuple(t)

    out = []
    if phase == _IDLE and (prev_triggered if spec.pdl else prev_done):
        out.append(("start", moved(_STARTED, True if spec.trigger == BEFORE_WAIT else None)))
    elif phase == _STARTED and prev_done:
        out.append(("wait", moved(_WAITED, True if spec.trigger == AFTER_WAIT else None)))
    elif phase == _WAITED:
        out.append(("complete", moved(_DONE, True)))
    return out
