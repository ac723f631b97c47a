"""The variant library: the correct protocol and the known-bad designs real engines shipped.

A variant is a named change to the protocol -- a controller or worker subclass overriding one
hook -- plus the scenario change it needs to show (a fault, a tight memory budget) and the
verdict it must get in each process topology. Each bad variant cites the public bug it comes
from (../shared/design/BACKGROUND.md). Users add their own with `register` or from a Python file
(`load_variant_file`), without editing this package; see docs/variants.md.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar
from pathlib import Path

from lockstep.args import clipped, one_line_repr
from protocol.backend import (
    FreeGraphs,
    GraphMemory,
    Instantiate,
    LaunchGraph,
    Op,
    PrepareReplay,
    ReadTokens,
    Record,
    ReleaseSlot,
    MoveSlot,
    RunEager,
    DestroyCommunicator,
)
from protocol.buckets import select_bucket
from protocol.commands import Command, Reply, Step
from protocol.controller import ABORT_HOWS, Controller
from protocol.errors import ConfigError, StartupRefused
from protocol.keys import GraphKey
from protocol.memory import MemoryPlan, candidate_caps
from protocol.worker import SYNC, Worker
from protocol.eligibility import GraphPlan
from sim.common import EVENTS, FAULT_FIRED_EVENT, FAULT_OP_EVENT, INVARIANTS
from sim.devices import Kernel
from sim.faults import FaultFamily
from sim.headroom import HeadroomDraw
from sim.scenario import TOPOLOGIES, Scenario, WorkloadDraw

EVENT_REACH: dict[str, Callable[[Scenario], str | None]] = {}
"""Event name (a `Variant.reaches` entry) -> scenario -> None, or why no run of that scenario
can reach the event; a clean row leaves such an event out of what it must reach and says why
(`sim.check.check_correct`). Filled by the modules whose variants name the event."""


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A variant name: one table cell, one file name of `--trace-out`."""

VERDICTS = ("clean", "abort", "deadlock", "hang", "hang-at-exit", "divergence", "oom",
            "startup-refused", "livelock") + tuple(f"invariant:{i}" for i in INVARIANTS)
"""Verdicts a variant may expect."""



@dataclass(frozen=True)
class Variant:
    """A protocol variant under test.

    Attributes:
        name: registry name (``lockstep check --variant NAME``).
        summary: what the design does, one sentence (a non-empty string).
        source: the public bug or discussion it comes from (a non-empty string).
        expected: topology -> expected verdict, ``"clean"``, ``"deadlock"``, ``"divergence"``,
            ``"oom"``, ``"hang-at-exit"``, ``"startup-refused"`` or ``"invariant:I<n>"``.
        also_expected: further verdicts that catch a bad variant in a topology whose
            expected verdict is not ``clean``, for a design with more than one harm where which
            one shows first is set by the configuration, not by the bug
            (``split-eligibility``: the graph the capture path keeps and the memory reserve
            leaves out either fits the room the KV cache's page rounding leaves, and the
            captured sets diverge, or it does not, and its capture runs out of memory). A
            topology expected clean stays clean: no verdict here passes it. Empty for most
            variants.
        remedy: how the correct protocol avoids the bug, for the walkthrough `lockstep docs`
            writes (a string; "" for none: the designs expected clean, a user's own).
        controller_cls: the controller class (a `protocol.Controller` subclass).
        worker_cls: the worker class (a `protocol.Worker` subclass).
        adjust: scenario -> scenario, for the fault or memory budget the variant needs.
        sim_ops: the variant's own op types (`protocol.backend.Op` subclasses) ->
            handler(backend, rank, host, op, probe) returning BLOCKED, PROGRESS or DONE (see
            `sim.ops.ModelledBackend`).
        sim_kernels: the variant's own kernel types (`sim.devices.Kernel` subclasses) ->
            handler(world, rank, device, kernel).
        symmetric: False if the variant's code treats ranks 1..n-1 differently (exhaustive
            search then keeps every rank apart instead of reducing by rank symmetry).
        reaches: events a clean run of this variant must reach besides graph replays and
            live compactions, e.g. ``"preemption"``: each one of `sim.common.EVENTS`, of its own
            ``events``, or ``fault_op_<op>`` for an op of its runs (`fault_ops`).
        events: names of events the variant's own handlers count
            (``world.count_event(name)``), so that ``reaches`` may require them: a clean
            counterpart whose own op never ran would otherwise read clean.
        schedules, fault_schedules: caps on the schedules (and faulted schedules; 0: no
            faulted row) `lockstep check` explores for this variant, for a design whose verdict
            does not depend on the schedule (a counterpart that shows a rule's fix is clean);
            None: the check's own numbers.
        fault_search: the kind of fault and the op the bug needs, when it needs one; the
            checker searches every rank and every call of that op (`sim.faults.FaultFamily`),
            so no occurrence is placed by hand.
        unreachable: scenario -> None, or the reason this configuration cannot reach the bug
            (a row then reads "not reachable here", never clean or FAILED).
        strategy: the search strategy `lockstep check` uses for this variant unless one is
            asked for (`sim.strategies.STRATEGIES`), for a bug that needs a rare interleaving
            that random search misses (its failing share is in docs/search-stats.md); None:
            random.
        draw: (scenario, seed) -> (run index -> scenario): a per-run draw of the scenario's
            configuration over the variant's own scenario, for a bug that shows at a
            configuration boundary rather than in an interleaving (serving steps do not depend
            on the schedule); e.g. `sim.scenario.ShortContextDraw`, which draws the short
            path's ``short_context`` from the workload's contexts. The fault-free search and
            the faulted row run run i under draw i (the faulted row's fault drawn over that
            run's op sites); a fault search (``fault_search``) keeps the undrawn scenario.
            None: every run under the one scenario.
    """

    name: str
    summary: str
    source: str
    expected: Mapping[str, str]
    remedy: str = ""
    also_expected: tuple[str, ...] = ()
    controller_cls: type = Controller
    worker_cls: type = Worker
    adjust: Callable[[Scenario], Scenario] | None = None
    sim_ops: Mapping[type, Callable] = field(default_factory=dict)
    sim_kernels: Mapping[type, Callable] = field(default_factory=dict)
    symmetric: bool = True
    reaches: tuple[str, ...] = ()
    schedules: int | None = None
    fault_schedules: int | None = None
    fault_search: FaultFamily | None = None
    unreachable: Callable[[Scenario], str | None] | None = None
    strategy: str | None = None
    draw: Callable[[Scenario, int], Callable[[int], Scenario]] | None = None
    events: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"variant name {self.name!r} must be a non-empty string")
        if not _NAME.fullmatch(self.name):  # a fresh user's name of spaces or a newline broke
            # the verdict table; '+' marks a row's faulted half ("correct+faults")
            raise ConfigError(f"variant name {clipped(repr(self.name))} must be letters, digits, "
                              "'-', '_' and '.', starting with a letter or digit")
        if not isinstance(self.expected, Mapping):
            raise ConfigError(f"variant {self.name!r}: expected is "
                              f"{one_line_repr(self.expected, 80)}; expected a dict of topology "
                              f"({', '.join(map(repr, TOPOLOGIES))}) -> verdict")
        for topology in TOPOLOGIES:
            if topology not in self.expected:
                raise ConfigError(f"variant {self.name!r}: expected has no verdict for topology "
                                  f"{topology!r}; give both, e.g. expected={{'shared': 'clean', "
                                  f"'per-rank': 'clean'}}")
            verdict = self.expected[topology]
            if verdict not in VERDICTS:
                raise ConfigError(f"variant {self.name!r}: expected verdict for topology {topology!r} "
                                  f"is {verdict!r}; use one of {', '.join(VERDICTS)}")
        from sim.strategies import STRATEGIES
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ConfigError(f"variant {self.name!r}: strategy {self.strategy!r} is not one of "
                              f"{', '.join(STRATEGIES)}")
        if not isinstance(self.also_expected, tuple):
            raise ConfigError(f"variant {self.name!r}: also_expected is "
                              f"{one_line_repr(self.also_expected, 80)}; expected a tuple of "
                              "verdicts")
        for verdict in self.also_expected:
            if verdict not in VERDICTS or verdict == "clean":
                raise ConfigError(f"variant {self.name!r}: also_expected verdict {verdict!r} is "
                                  f"not one of the failing verdicts {', '.join(VERDICTS[1:])}")
        if self.also_expected and self.clean_everywhere:
            raise ConfigError(f"variant {self.name!r}: also_expected is "
                              f"{self.also_expected!r}, but the variant is expected clean in "
                              "every topology, where no other verdict passes")
        extra = set(self.expected) - set(TOPOLOGIES)
        if extra:
            raise ConfigError(f"variant {self.name!r}: unknown topology {sorted(extra)[0]!r} in expected")
        self._check_fields()

    def _check_fields(self) -> None:
        """The other fields' types, so that a mistake in a user's variant is reported here,
        naming the variant and the field, not later from inside the simulator (a
        ``'str' object is not callable`` at world.py, or a TypeError traceback)."""
        def bad(field_name: str, value, want: str) -> ConfigError:
            return ConfigError(f"variant {self.name!r}: {field_name} is "
                               f"{one_line_repr(value, 80)}; expected {want}")

        for field_name in ("summary", "source"):  # None and 5 were taken, and printed by --list
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise bad(field_name, value, "a non-empty string")
        if not isinstance(self.remedy, str):
            raise bad("remedy", self.remedy, 'a string ("" for none)')
        for field_name, base in (("controller_cls", Controller), ("worker_cls", Worker)):
            value = getattr(self, field_name)
            if not (isinstance(value, type) and issubclass(value, base)):
                raise bad(field_name, value, f"a subclass of {base.__module__}.{base.__name__}")
        if self.controller_cls.abort_how not in ABORT_HOWS:  # "explode" was taken silently
            raise bad("controller_cls.abort_how", self.controller_cls.abort_how,
                      " or ".join(map(repr, ABORT_HOWS)))
        for field_name in ("adjust", "unreachable", "draw"):
            value = getattr(self, field_name)
            if value is not None and not callable(value):
                raise bad(field_name, value, "None or a function of the scenario")
        for field_name, base in (("sim_ops", Op), ("sim_kernels", Kernel)):
            table = getattr(self, field_name)
            if not isinstance(table, Mapping):
                raise bad(field_name, table, f"a dict {{{base.__name__} subclass: handler}}")
            for key, handler in table.items():
                if not (isinstance(key, type) and issubclass(key, base)):
                    raise bad(f"{field_name} key", key, f"a subclass of {base.__module__}.{base.__name__}")
                if not callable(handler):
                    raise bad(f"{field_name}[{key.__name__}]", handler, "a handler function")
        if not isinstance(self.symmetric, bool):
            raise bad("symmetric", self.symmetric, "True or False")
        if (not isinstance(self.reaches, (tuple, list))
                or not all(isinstance(e, str) and e for e in self.reaches)):
            raise bad("reaches", self.reaches, 'a tuple of event names, e.g. ("preemption",)')
        for field_name, least in (("schedules", 1), ("fault_schedules", 0)):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < least):
                raise bad(field_name, value, f"None or an integer >= {least}")
        if self.fault_search is not None and not isinstance(self.fault_search, FaultFamily):
            raise bad("fault_search", self.fault_search,
                      'None or a sim.faults.FaultFamily, e.g. FaultFamily("die", phase="serving")')
        if (not isinstance(self.events, (tuple, list))
                or not all(isinstance(e, str) and e for e in self.events)):
            raise bad("events", self.events, 'a tuple of event names, e.g. ("scrub",)')
        ops = self.fault_ops()
        for event in self.reaches:  # a name no run records read later as a vacuous clean row
            if event not in EVENTS + tuple(self.events) and not (
                    event.startswith(FAULT_OP_EVENT) and event[len(FAULT_OP_EVENT):] in ops):
                raise bad("reaches entry", event, "an event a run records: "
                          f"{', '.join(EVENTS)}, one of its own events (declared in events), "
                          "or fault_op_<op> for an op of its runs")

    @property
    def clean_everywhere(self) -> bool:
        """Whether the design is expected clean in every topology (a correct protocol)."""
        return all(v == "clean" for v in self.expected.values())

    def scenario(self, base: Scenario) -> Scenario:
        """The scenario this variant runs under, from the base one.

        Raises:
            ConfigError: ``adjust`` returned something other than a Scenario, or one with a
                fault on an op this variant's runs never make (`fault_ops`): it would never
                fire, and the trace written would be refused on replay; or ``reaches`` names a
                fault's event (``fault_op_<op>``, ``fault_fired...``) and the scenario has no
                fault to fire.
        """
        out = self.adjust(base) if self.adjust else base
        if not isinstance(out, Scenario):
            raise ConfigError(f"variant {self.name!r}: adjust returned {one_line_repr(out, 80)}, "
                              "not a Scenario (return the scenario it was given, changed with "
                              ".with_(...))")
        known = self.fault_ops() if out.faults else ()
        for i, fault in enumerate(out.faults):
            if fault.op not in known:
                raise ConfigError(f"variant {self.name!r}: adjust's faults[{i}] is on op "
                                  f"{clipped(repr(fault.op))}, which its runs never make (ops: "
                                  f"{', '.join(known)})")
        faulted = [e for e in self.reaches if e.startswith((FAULT_OP_EVENT, FAULT_FIRED_EVENT))]
        if faulted and not out.faults:  # a review's finding: vacuous always, blamed on the size
            raise ConfigError(f"variant {self.name!r}: reaches {faulted[0]!r}, which a run "
                              "counts only when a fault fires, but its scenario has no faults "
                              "(add them in adjust, or drop it from reaches)")
        return out

    def fault_ops(self) -> tuple[str, ...]:
        """Every op name a fault of this variant's runs can hit, sorted: the protocol's backend
        ops (`protocol.backend.Op` subclasses), the variant's own (`sim_ops`) and its fault
        search's (`fault_search`)."""
        import protocol.backend as backend

        names = {c.name for c in vars(backend).values()
                 if isinstance(c, type) and issubclass(c, backend.Op) and c is not backend.Op}
        names |= {c.name for c in self.sim_ops}
        if self.fault_search is not None and self.fault_search.op is not None:
            names.add(self.fault_search.op)
        return tuple(sorted(names))

    def __reduce__(self):
        """Pickle a variant a fresh process can look up -- a shipped one, or one from a user's
        file -- by name (and that file), else by fields.

        Worker processes of a parallel search rebuild it with `_registered`, so a variant whose
        ``adjust`` is a lambda, or that comes from a user's file, still reaches them. One that
        code registered at run time (`register`) is in no worker's registry -- a worker starts
        from the forkserver, which imports only the shipped ones -- so it goes by fields; by name
        the worker died with "unknown variant" and the search raised ``WorkerError``. If its
        fields do not pickle (a lambda), the search runs in this process
        (`sim.workers.JobNotPicklable`).
        """
        if REGISTRY.get(self.name) is self and (self.name in SHIPPED or self.name in _ORIGIN):
            return _registered, (self.name, _ORIGIN.get(self.name))
        return super().__reduce__()


REGISTRY: dict[str, Variant] = {}
_ORIGIN: dict[str, str] = {}  # variant name -> the user file that defined it


def origin_of(name: str) -> str | None:
    """The resolved path of the user file that defined variant ``name``
    (`load_variant_file`), or None for a shipped variant or an unknown name."""
    return _ORIGIN.get(name)


def _registered(name: str, origin: str | None) -> Variant:
    """The registered variant ``name``, loading ``origin`` first if this process lacks it."""
    if name not in REGISTRY and origin is not None:
        load_variant_file(origin)
    return get_variant(name)


def register(variant: Variant) -> Variant:
    """Add ``variant`` to the registry; raises ConfigError if the name is taken."""
    if variant.name in REGISTRY:
        raise ConfigError(f"variant {variant.name!r} is already registered")
    REGISTRY[variant.name] = variant
    return variant


def get_variant(name: str) -> Variant:
    """The registered variant ``name``.

    Raises:
        ConfigError: no variant has that name; the message names the closest ones and where
            every name is listed (docs/variants.md).
    """
    if not isinstance(name, str):
        raise ConfigError(f"variant name {one_line_repr(name, 60)}: expected a string such as "
                          "'correct'")
    try:
        return REGISTRY[name]
    except KeyError:
        # names are lower case; FUSED-SWEEP got no hint while fused-swep did (a fresh user).
        # Below 0.6 the suggestions were noise: "nonexist" drew "no-liveness" (0.53)
        close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        listed = ("`lockstep check --list` prints them, docs/variants.md describes them"
                  if len(REGISTRY) == len(SHIPPED) else
                  f"`lockstep check --list` prints the {len(SHIPPED)} shipped, `--list` with "
                  f"the same --variant-file options the {len(REGISTRY) - len(SHIPPED)} from "
                  "files")
        raise ConfigError(f"unknown variant {name!r}; {hint}{len(REGISTRY)} are known: "
                          f"{listed}") from None


def load_variant_file(path: str | Path) -> list[Variant]:
    """Import a user's Python file and register the variants it defines.

    The file defines module-level `Variant` objects, or a ``VARIANTS`` list of them. Variants it
    only imports (a shipped one it derives from, say) are not re-registered.

    A file loaded before is not imported again while its bytes are the same; once they
    changed, the variants it registered before are dropped and it is imported again (a
    notebook or a rerun test session checks the edited code; an edit that fails to import
    leaves none of its variants, as a worker process importing the file would find it).

    Raises:
        ConfigError: ``path`` is no path (a str or an os.PathLike of a str), the file is
            missing, cannot be read, not a file or one of lockstep's own modules, fails to
            import (SystemExit included), defines no variant, lists something that is not a
            Variant, or reuses a name.
    """
    try:
        text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    except TypeError:  # an os.PathLike whose __fspath__ gives neither str nor bytes
        text = None
    if not isinstance(text, str):
        # None, 5 or b"/x.py" failed in pathlib with a TypeError naming no argument
        raise ConfigError(f"variant file {one_line_repr(path, 60)}: expected a path (a str or "
                          "an os.PathLike)")
    if not str(path):
        raise ConfigError("variant file '': the path is empty; name a Python file")
    path = Path(path)
    try:
        exists, is_file = path.exists(), path.is_file()
    except OSError as exc:  # a fresh user's finding: a folder it may not enter raised from exists()
        raise ConfigError(f"variant file {str(path)!r} cannot be read: "
                          f"{exc.strerror or exc}") from None
    if not exists:
        raise ConfigError(f"variant file {str(path)!r} does not exist")
    if not is_file:
        raise ConfigError(f"variant file {str(path)!r} is not a file")
    if path.suffix != ".py":
        raise ConfigError(f"variant file {str(path)!r} is not a Python file (.py)")
    own = {Path(m.__file__).resolve() for name, m in list(sys.modules.items())
           if name.split(".")[0] in ("sim", "protocol") and getattr(m, "__file__", None)}
    if path.resolve() in own:
        raise ConfigError(f"variant file {str(path)!r} is one of lockstep's own modules; the "
                          "shipped variants are registered already (`lockstep check --variant "
                          "NAME` runs one)")
    key = str(path.resolve())
    digest = _file_digest(path)
    loaded = _LOADED_FILES.get(key)
    if loaded is not None and loaded[0] == digest:
        return loaded[1]
    earlier = {v.name for v in loaded[1]} if loaded is not None else set()
    if earlier:  # edited since it was loaded: what it defined before goes, whatever it now does
        del _LOADED_FILES[key]
        for name in earlier:
            REGISTRY.pop(name, None)
            _ORIGIN.pop(name, None)
    module = _import_user_file(path, key)
    listed = getattr(module, "VARIANTS", None)
    if listed is not None:
        if not isinstance(listed, (list, tuple)) or not all(isinstance(v, Variant) for v in listed):
            raise ConfigError(f"variant file {str(path)!r}: VARIANTS must be a list of Variant "
                              f"objects, got {one_line_repr(listed, 80)}")
        found = list(listed)
    else:
        found = [v for v in vars(module).values()
                 if isinstance(v, Variant) and REGISTRY.get(v.name) is not v]
    if not found:
        raise ConfigError(f"variant file {str(path)!r} defines no Variant of its own (a "
                          "registered variant it only imports or looks up is not registered "
                          "again; `lockstep check --variant NAME` runs a shipped one)")
    names = [v.name for v in found]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"variant file {str(path)!r} defines variant {name!r} twice")
        if name in REGISTRY:
            raise ConfigError(f"variant file {str(path)!r}: variant name {name!r} is already "
                              "registered (pick another name)")
    for variant in found:
        register(variant)
        _ORIGIN[variant.name] = key
    _LOADED_FILES[key] = (digest, found)
    return found


_LOADED_FILES: dict[str, tuple[str, list[Variant]]] = {}
"""Resolved path of each loaded variant file -> (hash of its bytes when loaded, its variants)."""


def file_digest(path: str | Path) -> str:
    """SHA-256 of a variant file's bytes, in hex: what `load_variant_file` compares to load an
    edited file again, and what a trace records of it (`sim.report.variant_file_fingerprint`).

    Raises:
        OSError: the file cannot be read.
    """
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _file_digest(path: Path) -> str:
    """`file_digest`, for `load_variant_file`.

    Raises:
        ConfigError: the file cannot be read.
    """
    try:
        return file_digest(path)
    except OSError as exc:
        raise ConfigError(f"variant file {str(path)!r} cannot be read: "
                          f"{exc.strerror or exc}") from None


def _import_user_file(path: Path, key: str):
    """Run the user's file ``path`` (resolved: ``key``) as a module, as Python runs a script:
    its folder first on ``sys.path`` while it runs (a helper module beside it imports), and the
    module in ``sys.modules`` under a name unique to the path (a dataclass under ``from
    __future__ import annotations`` looks its module up there; it was an AttributeError).

    Raises:
        ConfigError: the file raises (SystemExit included) or calls ``os._exit``, naming the
            line.
    """
    import hashlib

    name = f"lockstep_user_variants_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(Path(key).parent)
    sys.path.insert(0, folder)
    global _IMPORTING
    importing, _IMPORTING = _IMPORTING, os.getpid()
    os._exit = _exit_refused  # a file calling it ended `lockstep check` silently, with its status
    try:
        spec.loader.exec_module(module)
    except ConfigError as exc:  # a Variant(...) with a bad field: the variant names itself
        del sys.modules[name]
        raise ConfigError(f"variant file {str(path)!r}: {exc}{_line_in(path, exc)}") from None
    except (Exception, SystemExit) as exc:  # a user's file can raise anything; report it
        del sys.modules[name]
        raise ConfigError(f"variant file {str(path)!r} failed to import: {type(exc).__name__}: "
                          f"{exc}{_line_in(path, exc)}") from None
    finally:
        _IMPORTING = importing
        if importing is None:
            os._exit = _REAL_EXIT
        if folder in sys.path:
            sys.path.remove(folder)
    return module


class HardExitRefused(SystemExit):
    """A variant file called ``os._exit`` while it was imported (`_import_user_file`)."""


_REAL_EXIT = os._exit
_IMPORTING: int | None = None
"""The pid of the process importing a variant file (`_import_user_file`), while it does."""


def _exit_refused(status) -> None:
    """``os._exit`` while a variant file is imported: raised as `HardExitRefused` in the
    importing process, which reports it as any other failed import, rather than ending with no
    word. Anywhere else -- a child the file forks, a call after the import through a name the
    file bound meanwhile (``from os import _exit``) -- it is ``os._exit``."""
    if _IMPORTING != os.getpid():
        _REAL_EXIT(status)
    raise HardExitRefused(f"os._exit({status!r}) called")


def _line_in(path: Path, exc: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost traceback frame in the user's file ``path``, or ""."""
    import traceback

    target = str(path.resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename and Path(f.filename).resolve().as_posix() == target]
    return f" (at {path.name}:{frames[-1].lineno})" if frames else ""


BOTH_CLEAN = {"shared": "clean", "per-rank": "clean"}

CORRECT = register(Variant(
    name="correct",
    summary="the protocol as specified: step lock, two-phase capture barrier, warm-up per size, "
            "one eligibility plan, measured reserve, watchdog with abort, graphs freed first",
    source="docs/design.md",
    expected=BOTH_CLEAN,
    reaches=("padded_replay", "mixed_replay"), draw=HeadroomDraw))


def eager_decode(sc: Scenario) -> Scenario:
    """``sc`` served without CUDA graphs (an engine's enforce-eager mode): every decode step
    runs eagerly. With graphs every decode step of the check's workload replays, mixed steps
    too (I21), so the eager decode path is checked under this scenario."""
    return sc.with_(config=replace(sc.config, cuda_graphs=False))


register(Variant(
    name="correct-eager",
    summary="the protocol as specified, served without CUDA graphs: every decode step, mixed "
            "or not, runs eagerly",
    source="docs/design.md",
    expected=BOTH_CLEAN, adjust=eager_decode, schedules=20, fault_schedules=10,
    draw=HeadroomDraw))


# -- fused-sweep -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CaptureAndLaunch(Command):
    """fused-sweep: record, instantiate and launch one key in a single command (no barrier)."""

    key: GraphKey = GraphKey(1)


class FusedSweepController(Controller):
    """Captures and launches each bucket in one command per rank."""

    def sweep_commands(self, seq: int, index: int) -> Command | None:
        keys = self.plan.keys()
        return CaptureAndLaunch(seq, keys[index]) if index < len(keys) else None


class FusedSweepWorker(Worker):
    """Runs record, instantiate and launch back to back; the launch does the implicit upload."""

    def ops_for_other(self, command: Command) -> list[Op]:
        match command:
            case CaptureAndLaunch(key=key):
                self.plan.require_eligible(key, "capture")
                return [Record(key), Instantiate(key), LaunchGraph(key), SYNC]
        return super().ops_for_other(command)

    def reply(self, command, results):
        if isinstance(command, CaptureAndLaunch):
            self.uploaded.add(command.key)
            self.captured.add(command.key)
        return super().reply(command, results)


register(Variant(
    name="fused-sweep",
    summary="each rank captures, instantiates and launches a bucket's graph in one go, with no "
            "cross-rank barrier between upload and launch",
    source="pegainfer TP pre-capture PR (fixes #498); openxla/xla PR #37936 discussion; "
           "meta-pytorch/breakable-cuda-graphs PR #2",
    expected={"shared": "deadlock", "per-rank": "invariant:I4"},
    remedy="The correct sweep splits each bucket into two barriers: every rank records, instantiates and uploads (Capture) and acks only when its stream is idle; only then does any rank launch (Launch). No rank's instantiate or upload then waits for a device whose collective spins for it (I4).",
    controller_cls=FusedSweepController, worker_cls=FusedSweepWorker))


# -- lazy-serving-capture --------------------------------------------------------------------------

class LazyCaptureController(Controller):
    """No startup sweep: graphs are captured the first time serving needs them."""

    def startup_stages(self) -> list[str]:
        return ["warmup", "profile", "measure", "allocate"]


class LazyCaptureWorker(Worker):
    """Captures a bucket on first use during serving, then launches it."""

    def forward_ops(self, step: Step) -> list[Op]:
        if step.key is not None and step.key not in self.captured:
            self.captured.add(step.key)
            return [Record(step.key), Instantiate(step.key), PrepareReplay(step),
                    LaunchGraph(step.key)]
        return super().forward_ops(step)


register(Variant(
    name="lazy-serving-capture",
    summary="a bucket is captured the first time serving needs it",
    source="pegainfer #481, #496, #498",
    expected={"shared": "deadlock", "per-rank": "invariant:I3"},
    remedy='All graphs are captured at startup under the two-phase barrier; a serving step whose key was not captured fails loudly and nothing captures lazily (I3).',
    controller_cls=LazyCaptureController, worker_cls=LazyCaptureWorker))


@dataclass(frozen=True)
class NeedsTwoBuckets:
    """`Variant.unreachable` for a bug that needs the sweep to capture two buckets or more:
    with one, ``why`` (a clause); a record, not a closure, so variants stay picklable."""

    why: str

    def __call__(self, sc: Scenario) -> str | None:
        buckets = _graph_buckets(sc)
        if len(buckets) >= 2:
            return None
        return (f"the sweep captures one bucket ({buckets[0]}) at max batch "
                f"{sc.config.max_batch}: {self.why}")


@dataclass(frozen=True)
class FitHasOneCap:
    """`Variant.unreachable` for a bug in how the memory fit chooses among batch caps: where
    it has one candidate cap (`protocol.memory.candidate_caps`), it keeps every graph the plan
    captures and cannot trade graphs for KV pages, so the correct fit and the variant's act
    alike; ``why`` says what that means for the bug."""

    why: str

    def __call__(self, sc: Scenario) -> str | None:
        plan = GraphPlan.from_config(sc.config)
        if len(candidate_caps(plan.buckets, sc.config.max_batch)) >= 2:
            return None
        return (f"at max batch {sc.config.max_batch} with buckets "
                f"{','.join(map(str, plan.buckets))} the memory fit has one candidate cap, so "
                f"{self.why}")


# -- local-bucket ----------------------------------------------------------------------------------

class LocalBucketWorker(Worker):
    """Picks the graph bucket from the rank's own batch count.

    Ranks learn of retirements at different times: rank 0 samples and drops a finished request
    at once; the others still count it until the retirement reaches them. So the local counts,
    and the buckets, differ across ranks whenever a retirement crosses a bucket boundary.
    Which retirements cross one depends on the workload's mix, not on the schedule, so the
    variant draws its workload per run (`WorkloadDraw`): with the check's own, the last two
    requests retire together and ``--buckets 1,9`` never crossed from 2 rows to 1.
    """

    def forward_ops(self, step: Step) -> list[Op]:
        if step.key is None:
            return super().forward_ops(step)
        local_rows = len(step.rows) + (0 if self.rank == 0 else len(step.retires))
        key = GraphKey(select_bucket(local_rows, self.plan.buckets))
        if key not in self.captured:
            return [RunEager(step)]
        return [PrepareReplay(step), LaunchGraph(key)]


register(Variant(
    name="local-bucket",
    summary="each rank picks its graph bucket from its own batch count",
    source="vLLM PR #25906; SGLang #30242 / PR #30450",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy='The controller picks the bucket and graph key and carries them in the step command; no rank derives them from its own count (I2).',
    worker_cls=LocalBucketWorker, draw=WorkloadDraw,
    unreachable=NeedsTwoBuckets("ranks whose row counts differ still pick the same bucket")))


# -- split-eligibility -------------------------------------------------------------------------------

class SplitEligibilityController(Controller):
    """Serving enforces the numeric policy's cap; the sweep keeps its own filter (no cap)."""

    def warmup_sizes(self) -> tuple[int, ...]:
        keys = replace(self.plan, batch_cap=None).keys()
        return tuple(sorted({self.config.shape.allreduce_bytes(k.bucket) for k in keys}))

    def sweep_commands(self, seq: int, index: int) -> Command | None:
        keys = replace(self.plan, batch_cap=self.memory.batch_cap if self.memory else None).keys()
        if index >= 2 * len(keys):
            return None
        from protocol.commands import Capture, Launch
        key = keys[index // 2]
        return Capture(seq, key) if index % 2 == 0 else Launch(seq, key)


class SplitEligibilityWorker(Worker):
    """Rank 0's capture path applies the numeric cap and turns a disallowed capture into a
    silent successful no-op; the other ranks' capture path does not.

    Rank 0 asks the plan whether the key is eligible. Comparing the bucket with the plan's
    ``batch_cap`` instead, a cap in rows, made rank 0 skip a bucket that holds more rows than
    the cap but is the one a full batch replays (bucket 8 at max batch 5): a divergence with
    no numeric cap at all, the bug of ``row-cap-as-bucket-cap``, not this one (found by a fresh
    helper forcing the variant past its "not reachable here" at ``--buckets 8 --max-batch
    5``).
    """

    def _ops_capture(self, command):
        cap = self.plan.batch_cap
        if self.rank == 0 and not self.plan.is_eligible(command.key):
            return [SYNC]
        self.plan = replace(self.plan, batch_cap=None)
        try:
            return super()._ops_capture(command)
        finally:
            self.plan = replace(self.plan, batch_cap=cap)

    def _ops_launch(self, command):
        if command.key not in self.uploaded:
            return [SYNC]
        return super()._ops_launch(command)

    def reply(self, command, results):
        from protocol.commands import Capture, Launch
        if isinstance(command, (Capture, Launch)) and results == [None]:
            from protocol.commands import Reply
            return Reply(rank=self.rank, seq=command.seq, ok=True)
        return super().reply(command, results)


def _graph_buckets(sc: Scenario) -> tuple[int, ...]:
    """Buckets the plan captures a graph of before memory is known, ascending, each once: with
    the short path on (I22) a bucket holds two graphs, ``decode@b`` and ``decode-short@b``,
    and counting it twice made one bucket read as two (`NeedsTwoBuckets`) and the bucket
    below the largest read as the largest (`_policy_cap_below_largest`)."""
    return tuple(sorted({k.bucket for k in GraphPlan.from_config(sc.config).keys()}))


def _policy_cap_below_largest(sc: Scenario) -> Scenario:
    """A numeric policy cap one bucket below the largest bucket the sweep captures (unless one
    is set), so that the largest such bucket is what the policy forbids. That bucket may hold
    more rows than max batch (``--buckets 16,32 --max-batch 20`` captures 32 for batches of
    17-20); counting only buckets of at most max batch rows called such a configuration "not
    reachable here", though rank 0's silent no-op capture of 32 diverges there too."""
    buckets = _graph_buckets(sc)
    if sc.config.graph_batch_cap is not None or len(buckets) < 2:
        return sc
    return sc.with_(config=replace(sc.config, graph_batch_cap=buckets[-2]))


def _fewer_than_two_graph_buckets(sc: Scenario) -> str | None:
    # judged on the plan before the cap `_policy_cap_below_largest` sets (this check sees the
    # adjusted scenario, whose cap has already removed the bucket it forbids)
    buckets = _graph_buckets(sc.with_(config=replace(sc.config, graph_batch_cap=None)))
    if len(buckets) < 2:
        captured = f"one bucket ({buckets[0]})" if buckets else "no bucket"
        return (f"the sweep captures {captured} at max batch {sc.config.max_batch}; a cap that "
                "forbids some bucket while allowing another needs at least two")
    return None


register(Variant(
    name="split-eligibility",
    summary="the numeric policy's bucket cap is enforced when serving, while the capture and "
            "replay paths keep their own filters and a disallowed capture is a silent no-op",
    source="pegainfer PR #848 review",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy='One GraphPlan answers graph-or-eager for the sweep, the memory profile, serving and the workers; an explicit request for an ineligible key is an error, never a silent no-op (I7), and Finalize checks every rank captured the same set (I3).',
    controller_cls=SplitEligibilityController, worker_cls=SplitEligibilityWorker,
    also_expected=("oom",),
    adjust=_policy_cap_below_largest, unreachable=_fewer_than_two_graph_buckets))


# -- single-warmup -------------------------------------------------------------------------------------

class SingleWarmupController(Controller):
    """Warms up one all-reduce at one message size before capture."""

    def warmup_sizes(self) -> tuple[int, ...]:
        return super().warmup_sizes()[:1]


register(Variant(
    name="single-warmup",
    summary="one warm-up collective before capture, at one message size",
    source="pegainfer TP pre-capture PR; ROCm/rccl #2022",
    expected={"shared": "invariant:I5", "per-rank": "invariant:I5"},
    remedy='Before the first capture every rank runs one eager all-reduce per distinct message size the graphs use (I5).',
    controller_cls=SingleWarmupController,
    unreachable=NeedsTwoBuckets("its one warm-up size is every size the graphs use")))


# -- uncoordinated-profile -------------------------------------------------------------------------

class UncoordinatedProfileWorker(Worker):
    """The memory profile captures each graph and replays it once to measure, with no barrier."""

    def _ops_measuregraphs(self, command):
        ops: list[Op] = [GraphMemory()]
        for key in command.keys:
            ops += [Record(key), Instantiate(key), LaunchGraph(key), GraphMemory()]
        return ops + [FreeGraphs(), SYNC]

    def reply(self, command, results):
        from protocol.commands import MeasureGraphs, Reply
        if isinstance(command, MeasureGraphs):
            # graph_memory answers are the only numbers among the results (read by value, not by
            # position: with H6 off every enqueuing op adds a synchronize's result)
            sizes = [x for x in results if isinstance(x, int) and not isinstance(x, bool)]
            payload = {k: sizes[i + 1] - sizes[i] for i, k in enumerate(command.keys)}
            return Reply(rank=self.rank, seq=command.seq, ok=True, payload=payload)
        return super().reply(command, results)


register(Variant(
    name="uncoordinated-profile",
    summary="the TP memory profile captures and replays graphs on each rank without coordination",
    source="pegainfer TP pre-capture PR",
    expected={"shared": "deadlock", "per-rank": "invariant:I4"},
    remedy='The memory profile records and instantiates graphs without launching them, so no collective runs and no rank waits on a peer (I9).',
    worker_cls=UncoordinatedProfileWorker))


# -- profile-largest-only ----------------------------------------------------------------------------

class LargestOnlyController(Controller):
    """Measures (and so reserves) only the largest graph."""

    def measure_keys(self):
        return self.plan.keys()[:1]


register(Variant(
    name="profile-largest-only",
    summary="the memory profile accounts for the largest graph only, while every allowed bucket "
            "stays resident",
    source="pegainfer #780 / PR #848 review; vLLM PR #30515",
    expected={"shared": "oom", "per-rank": "oom"},
    remedy='MeasureGraphs measures every graph the plan keeps and the reserve is their sum, taken before the KV cache is sized (I9).',
    controller_cls=LargestOnlyController,
    unreachable=NeedsTwoBuckets("the largest graph is the only one")))


# -- reserve-by-requested-batch ----------------------------------------------------------------------

class RequestedBatchReserveController(Controller):
    """Sizes the graph reserve from the requested max batch, then fits the batch to what is left."""

    def fit_memory(self, reports, graph_bytes) -> MemoryPlan:
        cfg = self.config
        tight = min(reports, key=lambda r: reports[r].free_bytes - reports[r].peak_activation_bytes)
        budget = reports[tight].free_bytes - reports[tight].peak_activation_bytes - cfg.memory_headroom_bytes
        reserve = sum(graph_bytes.values())
        pages = (budget - reserve) // cfg.kv_page_bytes - 1
        capacity = min(cfg.max_batch, max(0, pages // self.pages_per_seq))
        if capacity < 1:
            raise StartupRefused(f"startup refused: rank {tight} has effective capacity 0 after "
                              f"reserving {reserve} graph bytes for max batch {cfg.max_batch}")
        return MemoryPlan(batch_cap=capacity, kv_pages=int(pages), graph_reserve_bytes=reserve)


def tight_memory(sc: Scenario) -> Scenario:
    """Rank 1 is tight: after activations it has room for every graph plus 1.5 KV pages.

    The correct fit then keeps a smaller batch cap with its graphs; a reserve sized for the
    requested batch leaves no KV page at all.
    """
    mem = sc.memory
    cfg = sc.config
    # every graph, not every bucket: a bucket with both decode paths (I22) holds two graphs,
    # each with its own graph_base
    all_graphs = mem.graph_set_bytes(k.bucket for k in GraphPlan.from_config(cfg).keys())
    peak = _graph_buckets(sc)[-1] * mem.activation_per_row
    extra = 64 * 1024 * 1024
    capacity = mem.weights + peak + all_graphs + 3 * cfg.kv_page_bytes // 2 + extra
    memory = replace(mem, capacity=capacity, rank_overhead=((1, extra),))
    return sc.with_(memory=memory, config=replace(cfg, kv_page_bytes=cfg.kv_page_bytes))


register(Variant(
    name="reserve-by-requested-batch",
    summary="the graph reserve is sized from the requested max batch, while the state is later "
            "allocated from the effective (fitted) batch",
    source="pegainfer qwen35 TP graph PR (slot reserve fix)",
    expected={"shared": "startup-refused", "per-rank": "startup-refused"},
    remedy='The memory fit searches the largest batch cap whose own graphs plus its KV fit on the tightest rank, reserving graphs for that cap rather than for the requested batch (I9).',
    controller_cls=RequestedBatchReserveController, adjust=tight_memory,
    unreachable=FitHasOneCap("it keeps every graph, and under this memory the correct fit "
                             "refuses startup as the variant does")))


# -- watchdog-armed-on-error -----------------------------------------------------------------------

class ArmedOnErrorController(Controller):
    """Disarms the watchdog only on an explicit success signal."""

    disarm_watchdog_on_error = False


register(Variant(
    name="watchdog-armed-on-error",
    summary="the startup watchdog is disarmed only by an explicit success signal",
    source="pegainfer PR #848 review",
    expected={"shared": "invariant:I6", "per-rank": "invariant:I6"},
    remedy='The controller disarms the watchdog on every path out of the sweep, errors included (I6).',
    controller_cls=ArmedOnErrorController, fault_search=FaultFamily("raise", "instantiate")))


# -- exit-on-timeout --------------------------------------------------------------------------------

class ExitOnTimeoutController(Controller):
    """Ends a wedged sweep with exit() instead of abort()."""

    abort_how = "exit"


register(Variant(
    name="exit-on-timeout",
    summary="the watchdog ends a wedged sweep with exit()",
    source="pegainfer TP pre-capture PR",
    expected={"shared": "hang-at-exit", "per-rank": "hang-at-exit"},
    remedy='On expiry the controller asks the driver to abort, which needs no driver lock; exit() would run driver teardown (I6, H8).',
    controller_cls=ExitOnTimeoutController, fault_search=FaultFamily("hang", "instantiate")))


# -- comm-before-graphs -------------------------------------------------------------------------------

class CommBeforeGraphsWorker(Worker):
    """Destroys the communicator before freeing the graphs that captured it."""

    def _ops_teardown(self, command):
        return [SYNC, DestroyCommunicator(), FreeGraphs()]


register(Variant(
    name="comm-before-graphs",
    summary="teardown destroys the NCCL communicator while graphs that captured it are alive",
    source="pegainfer TP pre-capture PR; PyTorch #115388; vLLM #4263",
    expected={"shared": "hang-at-exit", "per-rank": "hang-at-exit"},
    remedy='Teardown frees every graph before destroying the communicator (I10).',
    worker_cls=CommBeforeGraphsWorker))


# -- async-row-parallel -------------------------------------------------------------------------------

class AsyncRowParallelWorker(Worker):
    """Eager steps return the row-parallel output of an async all-reduce without waiting on it."""

    def forward_ops(self, step: Step) -> list[Op]:
        if step.key is None:
            return [RunEagerAsync(step)]
        return super().forward_ops(step)


@dataclass(frozen=True)
class RunEagerAsync(Op):
    """async-row-parallel: eager decode whose row-parallel all-reduce is not waited on."""

    name: ClassVar[str] = "run_eager_async"
    step: Step


@dataclass(frozen=True)
class ConsumeAsync(Kernel):
    """The consumer of an async all-reduce: needs ``needed`` collectives completed first."""

    label: ClassVar[str] = "consume-async"
    seq: int
    rows: tuple
    needed: int


@dataclass(frozen=True)
class FinishAsync(Kernel):
    """The rest of the step's forward, behind the next layer's all-reduce: its logits."""

    label: ClassVar[str] = "finish-async"
    seq: int
    rows: tuple


def _sim_run_eager_async(backend, r, host, op, probe):
    """Enqueue the all-reduce on the side stream and its consumer on the main stream, unjoined;
    then the next layer's all-reduce and the rest of the forward on the main stream."""
    from sim.common import DONE
    if probe:
        return DONE
    step = op.step
    dev = backend.world.devices[r]
    backend.enqueue(r, backend.eager_sig(len(step.rows), "async all-reduce"), side=True)
    backend.enqueue(r, ConsumeAsync(step.seq, step.rows, dev.enqueued_collectives))
    backend.enqueue(r, replace(backend.eager_sig(len(step.rows), "next layer's all-reduce"),
                               count=1))
    backend.enqueue(r, FinishAsync(step.seq, step.rows))
    return backend.done(host)


def _sim_consume_async(world, r, dev, kernel):
    """The consumer reads the all-reduce output; before the collective completed it is a
    partial sum, and this rank's hidden state for the step is wrong from here on."""
    if dev.completed_collectives < kernel.needed:
        world.variant_state.setdefault("async-partial", set()).add(kernel.seq)


def _sim_finish_async(world, r, dev, kernel):
    """The step's logits, after the next all-reduce: it sums every rank's hidden state, so one
    rank's partial sum makes every rank's logits wrong, not only that rank's. Every rank's
    consumer ran before this (each enqueued it ahead of that all-reduce, which completes only
    once every rank reached it)."""
    from sim.devices import padded_rows
    corrupt = kernel.seq in world.variant_state.get("async-partial", ())
    rows = padded_rows(kernel.rows, len(kernel.rows), world.config.max_batch)
    world.device_model.decode(dev.live("kv"), dev.live("logits"), kernel.seq, rows,
                              corrupt=corrupt)


register(Variant(
    name="async-row-parallel",
    summary="the row-parallel layer returns the output of an asynchronous all-reduce without "
            "waiting for it",
    source="InfiniLM PR #540",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy='Every rank synchronizes before it samples or replies, and a row-parallel output is consumed only after its all-reduce completed (I1, I11).',
    worker_cls=AsyncRowParallelWorker, adjust=eager_decode,
    sim_ops={RunEagerAsync: _sim_run_eager_async},
    sim_kernels={ConsumeAsync: _sim_consume_async, FinishAsync: _sim_finish_async}))


# -- host-frozen-metadata -------------------------------------------------------------------------------

class FrozenMetadataWorker(Worker):
    """Replays without refreshing the replay buffers: the graph keeps what capture saw."""

    def forward_ops(self, step: Step) -> list[Op]:
        ops = super().forward_ops(step)
        return [op for op in ops if not isinstance(op, PrepareReplay)]


register(Variant(
    name="host-frozen-metadata",
    summary="capture reads KV offsets and attention shapes on the host and bakes them into the graph",
    source="InfiniLM PR #540",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy='Before each replay the worker refreshes tokens, positions, lengths and tables in fixed-address buffers the graph reads (I12).',
    worker_cls=FrozenMetadataWorker))


# -- worker-inferred-slots ------------------------------------------------------------------------------

class InferredSlotsWorker(Worker):
    """Compacts slots by its own rule (shift the tail down) instead of the scheduler's moves."""

    def apply_slot_changes(self, step: Step) -> list[Op]:
        ops: list[Op] = []
        order = [self.slots.slots[s] for s in sorted(self.slots.slots)]
        gone = {r.request_id for r in step.retires}
        for retire in step.retires:
            ops.append(ReleaseSlot(retire.slot))
        kept = [req for req in order if req not in gone]
        for i, req in enumerate(kept):
            old = order.index(req)
            if old != i:
                ops.append(MoveSlot(old, i))
        kept += [a.request_id for a in step.admits]
        self.slots.slots = dict(enumerate(kept))
        return ops


register(Variant(
    name="worker-inferred-slots",
    summary="workers decide slot moves from their own view after a retire instead of applying "
            "the scheduler's compaction",
    source="pegainfer qwen35 TP design (scheduler owns slots)",
    expected={"shared": "divergence", "per-rank": "divergence"},
    remedy='The scheduler decides every slot move and carries it in the step; workers apply it with occupancy assertions (I8).',
    worker_cls=InferredSlotsWorker))


# -- early-token-read -----------------------------------------------------------------------------------

class EarlyTokenReadWorker(Worker):
    """Rank 0 reads the sampled token ids right after enqueuing the sampler, before the step's
    synchronize: the host sees whatever the device-to-host copy has delivered so far."""

    def _ops_step(self, step: Step) -> list[Op]:
        ops = super()._ops_step(step)
        if ops and isinstance(ops[-1], ReadTokens):
            read = ops.pop()
            ops.insert(len(ops) - 1, read)  # in front of the synchronize
        return ops

    def reply(self, command: Command, results) -> Reply:
        if (self.rank == 0 and isinstance(command, Step) and (command.rows or command.admits)
                and len(results) >= 2):
            results = (*results[:-2], results[-1], results[-2])  # the read's ids are the payload
        return super().reply(command, results)


register(Variant(
    name="early-token-read",
    summary="rank 0 enqueues sampling behind the forward and reads the token ids before the "
            "step's synchronize (a non-blocking GPU-to-CPU copy read early)",
    source="sgl-project/sglang PR #16493; pytorch/pytorch #86264",
    expected={"shared": "invariant:I11", "per-rank": "invariant:I11"},
    remedy="The sampler is enqueued behind the forward, so its launch overlaps the device, but "
           "its token ids are read only after the step's synchronize (I11).",
    worker_cls=EarlyTokenReadWorker))

import sim.variants_paging  # noqa: E402,F401  (registers the KV-paging variants, I14)
import sim.variants_chunked  # noqa: E402,F401  (chunked prefill: clean and chunk-restarts-at-zero)
import sim.variants_state  # noqa: E402,F401  (data/memory-class variants, registered on import)
import sim.variants_comms  # noqa: E402,F401  (communicators, registrations, per-rank batches, death)
import sim.variants_admission  # noqa: E402,F401  (batch cap and graph reserve: I7, I9)
import sim.variants_rare  # noqa: E402,F401  (bugs that need a rare interleaving; searched with PCT)
import sim.variants_hardware  # noqa: E402,F401  (variants whose route was measured on H200s)
import sim.variants_overlap  # noqa: E402,F401  (overlapped scheduling: clean and known-bad, I20)
import sim.variants_short  # noqa: E402,F401  (the short-context decode path: clean and known-bad, I22)

SHIPPED = tuple(REGISTRY)
"""Names of the shipped variants, the correct protocol first."""
