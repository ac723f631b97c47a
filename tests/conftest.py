"""Test-wide settings: Hypothesis profiles ``ci`` (default, bounded) and ``thorough``."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_unconfigure(config):
    """After the summary: when triton was imported, send what the interpreter prints while it
    shuts down to /dev/null. libtriton's nanobind bindings report the builder functions that
    live until exit as "leaked" (hundreds of lines after the summary); triton silences the
    same report in its own compile workers (`triton._compile_warmup_pool`)."""
    import sys

    if "triton" in sys.modules:
        import atexit

        def silence() -> None:
            sys.stderr.flush()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)

        atexit.register(silence)
