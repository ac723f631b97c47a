"""Schedulers: how a run picks the next actor among the enabled ones.

Each strategy is deterministic given its seed or recording. One file holds them all because each
is a few lines: a seeded random walk; PCT (probabilistic concurrency testing: random priorities
with d-1 priority change points, which finds a bug of depth d with probability at least
1/(n k^(d-1))); a replay of recorded choices; and a "sticky" scheduler that keeps running one
actor until it blocks and switches only at listed points, which the domain reducer uses to
remove context switches from a counterexample.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from lockstep.args import one_line_repr
from protocol.errors import ConfigError
from sim.scenario import is_integer


def _integer(name: str, value, least: int | None = None) -> int:
    """``value`` as an int; raises ConfigError unless it is an integer of any kind (numpy's
    too, as `sim.search.check_budget` takes them; not a bool) of at least ``least``."""
    if not is_integer(value) or (least is not None and value < least):
        raise ConfigError(f"{name} = {one_line_repr(value)}: expected an integer"
                          + ("" if least is None else f" >= {least}"))
    return int(value)


class NondeterminismError(Exception):
    """A replayed run departed from its recording: the recorded actor was not enabled."""


class RandomWalk:
    """Uniform choice among enabled actors from a seeded generator."""

    name = "random"

    def __init__(self, seed: int):
        # None seeded from the OS: a run no one could repeat
        self.rng = random.Random(_integer("seed", seed))
        self._bits = self.rng.getrandbits

    def choose(self, enabled: list[str], step: int) -> str:
        # randrange(n) for n > 0 is `Random._randbelow_with_getrandbits(n)`, written out here:
        # the same draws, without a Python frame per choice
        n = len(enabled)
        k = n.bit_length()
        r = self._bits(k)
        while r >= n:
            r = self._bits(k)
        return enabled[r]


class PCT:
    """Probabilistic concurrency testing (Burckhardt et al., ASPLOS 2010).

    Args:
        seed: random seed.
        depth: bug depth d; d-1 priority change points are drawn in [0, max_steps).
        max_steps: expected run length in actions (for placing change points).
    """

    name = "pct"

    def __init__(self, seed: int, depth: int = 3, max_steps: int = 2000):
        seed = _integer("seed", seed)
        depth = _integer("depth", depth, 1)
        max_steps = _integer("max_steps", max_steps, 1)  # 0 failed at its first choice
        self.rng = random.Random(seed)
        self.priority: dict[str, float] = {}
        self.change_points = sorted(self.rng.randrange(max_steps) for _ in range(max(0, depth - 1)))
        self.low = 0.0

    def choose(self, enabled: list[str], step: int) -> str:
        for actor in enabled:
            if actor not in self.priority:
                self.priority[actor] = 1.0 + self.rng.random()
        best = max(enabled, key=self.priority.__getitem__)
        while self.change_points and step >= self.change_points[0]:
            self.change_points.pop(0)
            self.low -= 1.0
            self.priority[best] = self.low
        return best


class Replay:
    """Follows recorded choices; raises NondeterminismError where the run departs from them: a
    recorded actor not enabled, or, at an action where only one actor is enabled (no choice is
    asked for), another actor recorded there (`on_forced`)."""

    name = "replay"

    def __init__(self, choices: list[str]):
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not all(
                isinstance(c, str) for c in choices):
            raise ConfigError(f"choices = {one_line_repr(choices, 60)}: expected a list of actor "
                              "names")
        self.choices = choices

    def choose(self, enabled: list[str], step: int) -> str:
        if step >= len(self.choices):
            return enabled[0]
        actor = self.choices[step]
        if actor not in enabled:
            raise NondeterminismError(f"replay departed from its recording at action {step}: "
                                      f"{actor} is not enabled (enabled: {', '.join(enabled)})")
        return actor

    def on_forced(self, actor: str, step: int) -> None:
        """The run took ``actor``, the only one enabled, at action ``step``: an edited
        recording that names another there was followed silently before."""
        if step < len(self.choices) and self.choices[step] != actor:
            raise NondeterminismError(f"replay departed from its recording at action {step}: "
                                      f"it took {actor!r}, the only actor enabled, where the "
                                      f"recording has {self.choices[step]!r}")


class Sticky:
    """Runs the current actor while it is enabled; switches to ``switches[step]`` when listed.

    When the current actor blocks and no switch is listed, takes the first enabled actor. A run
    asks for no choice where only one actor is enabled, so a switch listed at such a step
    applies at the next choice instead (unless a later one is listed by then): the switch
    points of any run's choices (`sim.reduce.switch_points`) replay that run exactly.
    ``effective`` collects, at the step of each choice a listed switch changed, the actor it
    chose: the run's switches that are choices (not forced by a block), which replayed alone
    give the same run. It depends on the run only, not on how its switches were listed.

    Raises:
        ConfigError: ``switches`` is not a dict of step (an integer >= 0) -> actor name
            (`sim.world.ACTOR`: ``controller``, ``collectives``, ``rank<n>``, ``device<n>``,
            ``link<n>``), naming the first bad entry; ``{0: 'bogus'}`` never applied and the
            run went on as if it were not listed.
    """

    name = "sticky"

    def __init__(self, switches: dict[int, str]):
        from sim.world import ACTOR

        if not isinstance(switches, Mapping):
            raise ConfigError(f"switches = {one_line_repr(switches)}: expected a dict of step -> "
                              "actor name")
        for step, actor in switches.items():
            _integer("switches step", step, 0)
            if not isinstance(actor, str) or not ACTOR.fullmatch(actor):
                raise ConfigError(f"switches[{step}] = {one_line_repr(actor)}: expected an actor "
                                  "name: controller, collectives, rank<n>, device<n> or link<n>")
        self.switches = switches
        self.current: str | None = None
        self.effective: dict[int, str] = {}
        self._pending = sorted(switches)  # listed steps not yet reached, in order
        self._next = 0

    def choose(self, enabled: list[str], step: int) -> str:
        listed = None
        pending, n = self._pending, len(self._pending)
        while self._next < n and pending[self._next] <= step:
            listed = pending[self._next]
            self._next += 1
        default = self.current if self.current in enabled else enabled[0]
        wanted = self.switches[listed] if listed is not None else None
        if wanted in enabled and wanted != default:
            self.effective[step] = wanted
            self.current = wanted
        else:
            self.current = default
        return self.current


class Drawn:
    """Choices drawn from a callback (Hypothesis's ``data.draw``), for shrinking.

    Args:
        draw_index: n -> an integer, read modulo n as the index of the enabled actor chosen
            among n.

    Raises:
        ConfigError: ``draw_index`` is not callable (it failed only at the first choice).
    """

    name = "hypothesis"

    def __init__(self, draw_index):
        if not callable(draw_index):
            raise ConfigError(f"draw_index = {one_line_repr(draw_index)}: expected a function of "
                              "the number of enabled actors returning an index")
        self.draw_index = draw_index

    def choose(self, enabled: list[str], step: int) -> str:
        return enabled[self.draw_index(len(enabled)) % len(enabled)]


STRATEGIES = ("random", "pct", "exhaustive", "hypothesis")
