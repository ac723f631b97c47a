"""The trace-invariant checkers live in `protocol.invariants` (the protocol ships its own
checks); this module re-exports them for code written against the simulator's name."""

from protocol.invariants import CHECKS, Violation, check_trace  # noqa: F401
