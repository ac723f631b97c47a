"""Vocabulary shared by the simulator's modules: op statuses, verdicts, the modelled model."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ProtocolError

BLOCKED, PROGRESS, DONE = 0, 1, 2
"""What an op attempt did: nothing, changed state without finishing, finished."""

FOREVER = float("inf")


class SimFault(ProtocolError):
    """An error a modelled backend op raised.

    ``kind`` is ``"injected"`` (a fault the scenario placed), ``"oom"`` (the modelled memory
    ran out: H7), ``"lazy-connect"`` (a collective connected inside capture: H4) or
    ``"unmodelled"``; ``invariant`` names the rule the failure shows broken, if any.
    """

    kind = "sim"


OUTCOME_VERDICTS = ("clean", "abort", "deadlock", "hang", "hang-at-exit", "divergence", "oom",
                    "startup-refused", "invariant", "livelock", "budget")
"""Every verdict a run can end with (`Outcome.verdict`); a trace's ``verdict`` is one of them."""

INVARIANTS = tuple(f"I{n}" for n in range(1, 23))
"""The invariants of docs/design.md, I1 .. I22: what `Outcome.invariant` and a trace's
``invariant`` may name."""

FAULT_FIRED_EVENT = "fault_fired"
"""The event a run counts for every fault fired; ``<it>_<phase>`` counts those of one phase
(`fault_phase_event`)."""

FAULT_OP_EVENT = "fault_op_"
"""Prefix of the events that count faults fired on one op (``fault_op_<op>``, `fault_op_event`)."""


def fault_op_event(op: str) -> str:
    """The event a run counts when a fault fires on ``op``: ``fault_op_<op>``."""
    return FAULT_OP_EVENT + op


def fault_phase_event(phase: str) -> str:
    """The event a run counts when a fault fires in ``phase`` ("sweep" or "serving")."""
    return f"{FAULT_FIRED_EVENT}_{phase}"


EVENTS = ("replay", "padded_replay", "mixed_replay", "eager_decode", "short_replay",
          "short_declined", "first_row_behind", "chunked_prefill", "compaction_moves_live",
          "preemption", "overlapped_step", "fed_row", "leftover_row", "idle_rank_step",
          FAULT_FIRED_EVENT, fault_phase_event("sweep"), fault_phase_event("serving"))
"""Every event a run counts (`sim.world.World.events`, a run's ``reached``) but one family,
``fault_op_<op>`` (a fault fired on that op): the names a `sim.variants.Variant`'s ``reaches``
may list. Each is counted where it happens (sim/world.py, sim/ops.py, sim/devices.py); a test
(tests/sim/test_api_bad_input.py) holds this list to those places."""

EVENT_NEEDS = {
    "preemption": ("a KV pool of fewer pages than the running requests grow into",
                   "sim.variants_paging.page_pressure"),
    "chunked_prefill": ("a step prefill budget below the prompts' length",
                        "sim.variants_chunked.chunked"),
    "overlapped_step": ("overlapped scheduling", "sim.variants_overlap.overlapped"),
    "fed_row": ("overlapped scheduling", "sim.variants_overlap.overlapped"),
    "leftover_row": ("overlapped scheduling and requests that end on stop tokens",
                     "lambda sc: sim.variants_overlap.stopping("
                     "sim.variants_overlap.overlapped(sc))"),
    "short_replay": ("the short-context decode path", "sim.scenario.short_path_on"),
    "short_declined": ("the short-context decode path", "sim.scenario.short_path_on"),
    "idle_rank_step": ("data-parallel lanes", "sim.variants_comms.data_parallel_lanes"),
}
"""Event -> (the configuration a run needs to record it, a Python expression of a variant
``adjust`` that gives it), where that is not a max batch or bucket set large enough: the hint
of a vacuous row that never reached the event (`sim.cli`)."""


@dataclass
class Outcome:
    """How a run ended: a structured verdict.

    Attributes:
        verdict: one of OUTCOME_VERDICTS (`__post_init__` refuses another with ValueError).
        detail: one-paragraph explanation (the wait-for cycle for a deadlock).
        invariant: the invariant named by the verdict (``"I6"``), if any.
        cycle: wait-for cycle as (node, sentence) pairs, for deadlocks.
        rank: the rank the verdict blames, when one is to blame.
        step: the command sequence number at which the failure happened, when known.
        check: the check that found the failure, a short name unique to the place that sets
            the outcome (``"tokens"``: a sampled token differs from running its request alone;
            ``"unfinished"``: a request never finished; ``"token-copy-not-done"``: the direct
            I11 check of a token read; a trace invariant's `protocol.invariants.Violation`
            clause; ``"rank:oom"``: a failure a rank reported, by its kind); "" for a clean
            run. The reducer keeps it (`sim.reduce.same_failure`), so a counterexample never
            shrinks into another rule's failure of the same invariant (I11 has four checks).
        at: for a rule the trace checker found after the run ended, the index in the run's
            trace of the event that broke it (the run went on past it); None otherwise.
        cause: the command that made the state the failure reads (the re-allocation under a
            graph that I15 flags at a later replay), when it comes before the failing step;
            the story shows its events even where its window would leave them out.
    """

    verdict: str
    detail: str = ""
    invariant: str | None = None
    cycle: tuple = ()
    rank: int | None = None
    step: int | None = None
    check: str = ""
    at: int | None = None
    cause: int | None = None

    def __post_init__(self):
        if self.verdict not in OUTCOME_VERDICTS:
            raise ValueError(f"Outcome verdict {self.verdict!r} is not one of "
                             f"{', '.join(OUTCOME_VERDICTS)}")

    @property
    def kind(self) -> str:
        """The verdict's kind (same as ``verdict``)."""
        return self.verdict


@dataclass(frozen=True)
class Signature:
    """What a device collective is, for matching across ranks (H3).

    Attributes:
        op: ``"all-reduce"``, ``"all-gather"`` ... for a collective; ``"send"`` or ``"recv"``
            for point-to-point.
        count: collectives this kernel stands for (a graph's all-reduces, one per layer half).
        nbytes: message size of each.
        label: where it comes from (``"graph decode@8"``, ``"warm-up"``), for reports only.
        comm: the communicator it runs on (`sim.comms.Communicator` name).
        mode: ``"eager"`` (launched on its own) or ``"graph"`` (inside a CUDA graph, on buffers
            registered at capture).
        peer: for ``send``/``recv``, the other rank; None for a collective.
    """

    op: str
    count: int
    nbytes: int
    label: str = ""
    comm: str = "tp"
    mode: str = "eager"
    peer: int | None = None

    def matches(self, other: "Signature") -> bool:
        """Same communicator, op, count, size and mode: the label does not take part."""
        return (self.comm, self.op, self.count, self.nbytes, self.mode) == (
            other.comm, other.op, other.count, other.nbytes, other.mode)


@dataclass(frozen=True)
class Collective:
    """A communication kernel on a stream.

    ``index`` numbers it in its pairing channel on this rank (the n-th collective of its
    communicator, or the n-th send/receive between this pair of ranks): ranks match calls of
    equal index. ``order`` numbers it among every call of its communicator on this rank (issue
    order), which is the order the communicator runs them in (H9).
    """

    index: int
    sig: Signature
    order: int = 0

    def __str__(self) -> str:
        return sig_text(self)


def sig_text(kernel: Collective) -> str:
    """``all-reduce #7 on tp (graph decode@8: 73 x 40960 bytes)``."""
    sig = kernel.sig
    peer = f" rank {sig.peer}" if sig.peer is not None else ""
    mode = ", in-graph" if sig.mode == "graph" else ""
    return (f"{sig.op}{peer} #{kernel.index} on {sig.comm} ({sig.label}: {sig.count} x "
            f"{sig.nbytes} bytes{mode})")


def command_text(command) -> str:
    """``command N (Type)``: a protocol command as a report names it."""
    return f"command {command.seq} ({type(command).__name__})"
