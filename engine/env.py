"""The engine's on/off switches read from the environment, parsed in one place.

Each switch is the A/B baseline of a benchmark: on when unset or "1", off at "0". Any other
value ("false", "off", " 0", "") is refused with one line naming the variable and its value,
not taken as on: a misspelt "off" that left the feature on would make the baseline measure the
feature. One spelling per state, so that a log line or a docs example reads one way.
"""

from __future__ import annotations

import os

from engine.errors import ParallelConfigError

SWITCHES = {
    "LOCKSTEP_SHORT_DECODE": "the short-context decode path (`EngineConfig.short_decode`)",
    "LOCKSTEP_FUSED_NORM": "the fused layer form (`engine.model`)",
    "LOCKSTEP_PDL": "programmatic dependent launch (`engine.kernels.pdl`)",
}
"""Every switch the engine reads, with what it turns off at "0"."""


def switch(name: str) -> bool:
    """Whether the switch `name` (one of SWITCHES) is on: True when unset or "1", False at "0".

    Raises:
        ParallelConfigError: any other value, named with the variable, in one line.
    """
    value = os.environ.get(name)
    if value is None or value == "1":
        return True
    if value == "0":
        return False
    raise ParallelConfigError(f"{name} = {value!r} in the environment, expected '0' (off) or "
                              "'1' (on, as when unset)")


def check_switches() -> None:
    """Read every switch in SWITCHES once, so that a bad value is refused before any rank
    starts or any device memory is allocated (`EngineConfig.create`, the bench tools), not at
    the first kernel launch that reads it.

    Raises:
        ParallelConfigError: the first switch with a value other than "0" or "1".
    """
    for name in SWITCHES:
        switch(name)
