"""Fixtures of the simulator tests: `no_simulation` proves a refusal came before any search."""

import pytest


@pytest.fixture
def no_simulation(monkeypatch):
    """Make building a simulated world fail the test.

    Every schedule, the search's and the configuration check's one correct run before it
    (`sim.check.check_coverage_reachable`), starts by building a `sim.world.World` in the
    checking process, so a command refused before any search never builds one. The failure is
    an `AssertionError`, which no ``except ConfigError`` of the command can swallow.
    """
    from sim.world import World

    def built(self, scenario, variant):
        raise AssertionError(f"a simulated world was built for {variant.name!r}: the check "
                             "started instead of refusing")

    monkeypatch.setattr(World, "__init__", built)
