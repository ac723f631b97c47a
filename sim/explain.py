"""Hazard attribution: which modelled hazards a counterexample needs (`lockstep check --explain`).

A verdict "rests on" a hazard when switching that hazard off changes it. `attribute` reruns the
same search (same seed, same schedule family, same fault search) once with each hazard off,
then once with every hazard outside the needed set off, to confirm that the needed set alone
still gives the verdict. It also reruns the search under each H2 scope
(`sim.hazards.H2_SCOPES`), since which devices a quiescing call waits for is an assumption.

The story shown for a counterexample names only mechanisms in the needed set: the hazards on a
stuck run's wait-for cycle (`sim.waits.cycle_hazards`, plus H1 and H8 for a hang at exit) are
compared with it, and when the full model's counterexample went through a hazard the verdict
does not need, the story shown is the one found with only the needed hazards on.

A needed hazard is one the verdict needs, not always one the check needs to catch the design: a
design with more than one harm (`sim.variants.Variant.also_expected`) may give another verdict
with a hazard off that `lockstep check` passes just the same (`sim.check.catches`), and the
line says so, as the check's own row under ``--hazard-off`` does (``split-eligibility``: its
divergence needs H3; with H3 off its ranks' different graph sets run out of memory, its other
harm, and the check still catches it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sim.check import CheckSpec, Row, catches, check_bad, is_other_harm
from sim.guard import Stalled, locate
from sim.hazards import H2_SCOPES, RULES, HazardModel
from sim.reduce import reduce_schedule
from sim.run import RunResult

NAMES = {f.split("_")[0]: " ".join(f.split("_")[1:]) for f in HazardModel.__dataclass_fields__
         if f[:1] == "h" and f.split("_")[0] in RULES and f not in ("h4_mode", "h2_scope", "h2_calls")}
"""h1 -> "driver lock", h2 -> "quiesce", ..."""


@dataclass
class Attribution:
    """What one bad variant's verdict in one topology rests on.

    Attributes:
        verdict: the verdict with every hazard on.
        without: hazard -> verdict with that hazard off.
        needed: hazards whose removal changes the verdict (sorted).
        sufficient: True if the verdict holds with every hazard outside ``needed`` off.
        scopes: H2 scope -> verdict under that scope.
        errors: hazard (or ``"scope:NAME"``, or ``"needed-only"``) -> one line naming the
            exception of an ablation run that raised instead of giving a verdict. Such a run
            says nothing about the hazard: it is shown as ``ablation error: ...`` in
            ``without`` (or ``scopes``) and never puts the hazard into ``needed``.
        story: the counterexample whose story to show (its `story_hazards` are all in
            ``needed``), or None if none was given or found.
        story_hazards_off: the hazards switched off in ``story``'s run (empty: the full model).
        configured_off: the hazards the check itself ran with off (``--hazard-off``): every
            ablation keeps them off, and none is ablated, ``without`` or ``needed``.
        still_caught: hazard (or ``"scope:NAME"``) -> ``"other harm"`` or ``"expected"``, for
            each ablation whose verdict differs from ``verdict`` but is one that `lockstep
            check` passes for this design (`sim.check.catches`): one of its other harms
            (`Variant.also_expected`), or its expected verdict where ``verdict`` was not. Such
            a hazard is needed by the verdict, not by the catch.
    """

    verdict: str
    without: dict[str, str] = field(default_factory=dict)
    needed: tuple[str, ...] = ()
    sufficient: bool = False
    scopes: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    story: RunResult | None = None
    story_hazards_off: tuple[str, ...] = ()
    still_caught: dict[str, str] = field(default_factory=dict)
    configured_off: tuple[str, ...] = ()

    def shown(self, key: str, verdict: str) -> str:
        """An ablation's verdict as the line shows it: with why the check still passes it,
        where it does (`still_caught`)."""
        why = self.still_caught.get(key)
        if why == "other harm":
            return f"{verdict}, this design's other harm (also_expected)"
        if why == "expected":
            return f"{verdict}, its expected verdict"
        return verdict

    def line(self) -> str:
        """One sentence: the minimal hazard set, and the verdicts under each H2 scope."""
        unknown = [h for h in RULES if h in self.errors]
        off = ", ".join(h.upper() for h in self.configured_off)
        needs = (", ".join(f"{h.upper()} ({NAMES[h]})" for h in self.needed) if self.needed
                 else "none of the hazards whose ablation gave a verdict" if unknown
                 else "none of the hazards left on (it follows from the variant's own steps)"
                 if self.configured_off
                 else f"none of {RULES[0].upper()}..{RULES[-1].upper()} (it follows from the "
                      "variant's own steps)")
        if self.configured_off:
            needs += f", with {off} off as configured"
        changes = "; ".join(f"{h.upper()} off: {self.shown(h, self.without[h])}"
                            for h in self.needed)
        text = f"{self.verdict} needs {needs}" + (f" [{changes}]" if changes else "")
        caught = [h.upper() for h in self.needed if h in self.still_caught]
        if caught:
            rest = [h.upper() for h in self.needed if h not in self.still_caught]
            text += (f"; the check still catches the design with {' or '.join(caught)} off, so "
                     f"catching it needs {', '.join(rest) if rest else 'none of these hazards'}")
        if unknown:
            text += ("; unknown for " + ", ".join(h.upper() for h in unknown) + " ["
                     + "; ".join(f"{h.upper()} off: {self.without[h]}" for h in unknown) + "]")
        if "needed-only" in self.errors:
            text += f"; the needed set alone: ablation error: {self.errors['needed-only']}"
        elif not self.sufficient:
            text += "; those alone do not give it back (hazards interact)"
        scopes = ", ".join(f"{s}: {self.shown(f'scope:{s}', v)}" for s, v in self.scopes.items())
        return f"{text}; under H2 scope {scopes}"


def story_hazards(result: RunResult) -> frozenset[str]:
    """Hazards whose mechanisms a counterexample's story names: the edges of its wait-for cycle;
    for a hang at exit, the driver lock (H1) that exit's teardown (H8) waits for; for a wedge of
    two calls of one communicator (I16), H9."""
    from sim.waits import cycle_hazards

    world = result.world
    named = set(cycle_hazards(world))
    if world.exiting:
        named |= {"h1", "h8"}
    if result.outcome.invariant == "I16":  # a wedge of one communicator's two calls (H9)
        named.add("h9")
    return frozenset(named)


ABLATION_ERROR = "ablation error"
"""How an ablation run that raised (no verdict) is shown in `Attribution.without`/``scopes``."""


def _row(variant, spec: CheckSpec, topology: str) -> Row | str:
    """The ablation run's row, or one line naming the exception it raised instead."""
    try:
        return check_bad(variant, spec, topology, reduce=False)
    except (Exception, Stalled, SystemExit) as exc:  # noqa: BLE001 - an ablation that errored
        return locate(exc)                             # (or stalled) is its own outcome


def attribute(variant, spec: CheckSpec, topology: str, verdict: str | None = None,
              story: RunResult | None = None, reduce_attempts: int | None = None) -> Attribution:
    """Ablate each hazard for ``variant`` in ``topology`` under ``spec``'s search settings.

    Args:
        verdict: the full-model verdict if already known (else it is searched for).
        story: the full model's counterexample, if known; kept as `Attribution.story` when its
            story names only needed hazards, else replaced by the needed-only run's, reduced
            (in ``reduce_attempts`` re-runs when given, else within the reducer's budget).
    """
    # ablate from the model the check ran (a review found --hazard-off h3 explained with H3
    # back on): hazards the spec already switches off stay off and are not ablated again
    configured = tuple(h for h in RULES if h in spec.hazards_off)
    if verdict is None:
        full = _row(variant, spec, topology)
        if isinstance(full, str):
            raise RuntimeError(f"variant {variant.name!r} / {topology}: the full model's run "
                               f"raised, nothing to attribute: {full}")
        verdict = full.got
    got = verdict
    result = Attribution(got)

    def ablate(key: str, ablated: CheckSpec) -> Row | None:
        row = _row(variant, ablated, topology)
        if isinstance(row, str):
            result.errors[key] = row
            return None
        if key != "needed-only" and row.got != got and catches(variant, topology, row.got):
            result.still_caught[key] = ("other harm" if is_other_harm(variant, topology, row.got)
                                        else "expected")
        return row

    result.configured_off = configured
    ablated = tuple(h for h in RULES if h not in configured)
    for hazard in ablated:
        row = ablate(hazard, replace(spec, hazards_off=configured + (hazard,)))
        result.without[hazard] = (row.got if row is not None
                                  else f"{ABLATION_ERROR}: {result.errors[hazard]}")
    result.needed = tuple(h for h in ablated
                          if h not in result.errors and result.without[h] != got)
    rest = tuple(h for h in RULES if h not in result.needed)
    only_needed = ablate("needed-only", replace(spec, hazards_off=rest))
    result.sufficient = only_needed is not None and only_needed.got == got
    if story is not None and story_hazards(story) <= set(result.needed):
        result.story = story
    elif story is not None and result.sufficient and only_needed.minimal is not None:
        failure = only_needed.minimal
        result.story = reduce_schedule(failure.world.scenario, variant, failure,
                                       max_attempts=reduce_attempts)
        result.story_hazards_off = rest
    for scope in H2_SCOPES:
        if scope == spec.h2_scope:
            result.scopes[scope] = got
            continue
        row = ablate(f"scope:{scope}", replace(spec, h2_scope=scope))
        result.scopes[scope] = (row.got if row is not None
                                else f"{ABLATION_ERROR}: {result.errors[f'scope:{scope}']}")
    return result


def markdown_table(check_json: dict) -> str:
    """The per-verdict hazard table of docs/hazards.md, from ``lockstep check --explain --json``.

    One line per row: the verdict, the hazards it needs (a needed hazard with which off the
    check still catches the design, `Attribution.still_caught`, shows that verdict and "still
    caught"), the verdict with H2 off (what one H200 showed for instantiate, upload and
    allocation, docs/hazard-probes.md) and under each H2 scope. Rows of the correct protocol
    (no counterexample to explain) show their verdict in every column; check them under each
    scope with ``--h2-scope``.
    """
    head = ("| variant | topology | verdict | needs | H2 off | "
            + " | ".join(f"H2 scope {s}" + (" (default)" if s == "process" else "")
                         for s in H2_SCOPES) + " |")
    lines = [head, "|---" * (5 + len(H2_SCOPES)) + "|"]
    for row in check_json["rows"]:
        if row["variant"].endswith("+faults"):
            continue
        a = row.get("explain")
        if a is None:
            lines.append(f"| {row['variant']} | {row['topology']} | {row['got']} | - | - | "
                         + " | ".join("-" for _ in H2_SCOPES) + " |")
            continue
        # a needed hazard whose ablation the check still passes (another harm) is marked
        caught = a.get("still_caught") or {}
        needs = ", ".join(h.upper() + (f" (off: {a['without'][h]}, still caught)"
                                       if h in caught else "")
                          for h in a["needed"]) or "none"
        lines.append(f"| {row['variant']} | {row['topology']} | {row['got']} | {needs} | "
                     f"{a['without']['h2']} | "
                     + " | ".join(a["h2_scopes"][s] for s in H2_SCOPES) + " |")
    return "\n".join(lines)


def check_json_problem(data) -> str | None:
    """Why ``data`` is not the JSON `markdown_table` reads (that of ``lockstep check --explain
    --json``), naming the first bad row and field; None if it is."""
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        return "expected an object with a 'rows' list"
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            return f"row {i} is not an object"
        for key in ("variant", "topology", "got"):
            if not isinstance(row.get(key), str):
                return f"row {i} has no {key!r} string"
        a = row.get("explain")
        if a is None:
            continue
        if (not isinstance(a, dict) or not isinstance(a.get("needed"), list)
                or not isinstance(a.get("without"), dict) or "h2" not in a["without"]
                or not isinstance(a.get("h2_scopes"), dict)
                or any(s not in a["h2_scopes"] for s in H2_SCOPES)):
            return (f"row {i} ({row['variant']} / {row['topology']}): 'explain' needs 'needed', "
                    f"'without' (with h2) and 'h2_scopes' (with {', '.join(H2_SCOPES)})")
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m sim.explain [CHECK.json]``: print `markdown_table` of a check's JSON (from
    the file, else standard input); bad input is one line on stderr and exit status 2."""
    import argparse
    import json
    import sys
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m sim.explain",
                                description="Print the hazard table of docs/hazards.md from the "
                                            "JSON of `lockstep check --explain --json`.")
    p.add_argument("path", nargs="?", help="that JSON file (default: standard input)")
    args = p.parse_args(argv)

    def fail(message: str) -> int:
        sys.stderr.write(f"python -m sim.explain: error: {message}\n")
        return 2

    where = repr(args.path) if args.path is not None else "standard input"
    if args.path is None and sys.stdin.isatty():
        return fail("reads the JSON of `lockstep check --explain --json` from standard input: "
                    "pipe it in (python -m sim.explain < check.json) or name the file")
    try:
        text = (Path(args.path).read_text(encoding="utf-8") if args.path is not None
                else sys.stdin.read())
    except (OSError, UnicodeDecodeError) as exc:
        return fail(f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return fail(f"{where} is not JSON: {exc}")
    except ValueError as exc:  # an integer of thousands of digits (Python's conversion limit)
        return fail(f"{where} is not the JSON of `lockstep check --explain --json`: a value "
                    f"in it cannot be read ({exc})")
    except RecursionError:
        return fail(f"{where} is not the JSON of `lockstep check --explain --json`: it nests "
                    "too deeply")
    problem = check_json_problem(data)
    if problem is not None:
        return fail(f"{where} is not the JSON of `lockstep check --explain --json`: {problem}")
    print(markdown_table(data))
    return 0


__all__ = ["ABLATION_ERROR", "Attribution", "attribute", "NAMES", "markdown_table",
           "check_json_problem"]


if __name__ == "__main__":
    raise SystemExit(main())
