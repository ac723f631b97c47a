"""Test-wide settings: Hypothesis profiles ``ci`` (default, bounded) and ``thorough``; SIGINT
handled even when the suite was started as a background job."""

import os
import signal

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A suite started in the background by a shell without job control (`make test &` in a script)
# inherits SIGINT ignored, and so would every command a test starts: Python then never raises
# KeyboardInterrupt, and the Ctrl-C tests (`lockstep check`, TP 2 `generate`) saw the command
# run to its end. A caught signal is reset to its default in an exec'd child, so handling it
# here restores it there. The suite itself then stops on a Ctrl-C sent to it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
