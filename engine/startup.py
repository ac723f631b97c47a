"""The controller side of the startup sweep: a watchdog thread that aborts the process, and the
report of what the sweep did (capture progress bar and time, memory figures).

The protocol's watchdog (`protocol.watchdog`) is checked only when the driver asks the
controller for its next action; a rank wedged inside a driver call or a collective never lets
the driver ask. So the engine arms a real timer over the same deadline, and on expiry kills the
rank processes and aborts (SIGABRT): never exit, whose driver teardown can hang on the lock a
wedged thread holds (I6, H8; pegainfer TP pre-capture PR). It is disarmed on every path out of
the sweep, errors included (pegainfer PR #848 review).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

MIB = 1 << 20
GIB = 1 << 30


class StartupWatchdog:
    """A one-shot timer: `on_expire()` runs on its own thread `timeout_s` seconds after `arm`
    unless `disarm` came first.

    Args:
        timeout_s: seconds (float > 0).
        on_expire: called once on expiry; expected not to return (it aborts the process).
    """

    def __init__(self, timeout_s: float, on_expire: Callable[[], None]):
        self.timeout_s = timeout_s
        self.on_expire = on_expire
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        """Start the deadline now."""
        self.disarm()
        self._timer = threading.Timer(self.timeout_s, self.on_expire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        """Cancel the deadline; safe when not armed."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def armed(self) -> bool:
        """True between `arm` and `disarm` (or expiry)."""
        return self._timer is not None and self._timer.is_alive()


def weight_bytes_per_rank(cfg, world_size: int, dtype_bytes: int) -> int:
    """Parameter bytes one rank holds: every checkpoint tensor split evenly over the ranks
    (norm weights, which are replicated, are counted split: under 0.01% of a Qwen3)."""
    from engine.weights import expected_shapes

    total = 0
    for shape in expected_shapes(cfg).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total * dtype_bytes // world_size


class StartupReport:
    """Follows the startup commands the driver sends and the replies it gets: a tqdm bar over
    the capture sweep (one tick per launched key), its wall time, and the memory figures of
    the ranks (profile, measured graph set, finalized graph bytes)."""

    def __init__(self):
        self.bar = None
        self.capture_start: float | None = None
        self.capture_s: float | None = None
        self.measure_start: float | None = None
        self.measure_s: float | None = None
        self.profile: dict = {}           # rank -> MemoryReport
        self.graph_bytes: dict = {}       # rank -> bytes at Finalize
        self.captured = 0

    def sent(self, command, controller, progress: bool) -> None:
        """A command is about to go to every rank."""
        from protocol.commands import Capture, Finalize, MeasureGraphs

        now = time.monotonic()
        if isinstance(command, MeasureGraphs):
            self.measure_start = now
        elif isinstance(command, Capture) and self.capture_start is None:
            self.capture_start = now
            if progress:
                from tqdm import tqdm

                self.bar = tqdm(total=len(controller.plan.keys()), desc="lockstep: capture",
                                unit="graph", file=sys.stderr, leave=True)
        elif isinstance(command, Finalize):
            self.close()

    def replied(self, command, reply) -> None:
        """One rank's reply to `command` arrived."""
        from protocol.commands import Finalize, Launch, MeasureGraphs, ProfileMemory

        now = time.monotonic()
        if not reply.ok:
            return
        if isinstance(command, ProfileMemory):
            self.profile[reply.rank] = reply.payload
        elif isinstance(command, MeasureGraphs) and self.measure_start is not None:
            self.measure_s = now - self.measure_start
        elif isinstance(command, Launch) and reply.rank == 0:
            self.captured += 1
            if self.bar is not None:
                self.bar.update(1)
        elif isinstance(command, Finalize):
            self.graph_bytes[reply.rank] = reply.payload.graph_bytes
            if self.capture_start is not None:
                self.capture_s = now - self.capture_start

    def close(self) -> None:
        """Close the progress bar (idempotent)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self, controller, settings, cfg) -> str:
        """One paragraph for stderr: capture count and time, and per-rank memory (the
        tightest rank's free bytes; graph bytes the largest over ranks)."""
        lines = []
        if not settings.cuda_graph:
            lines.append("CUDA graphs off: every step runs eager")
        else:
            lines.append(f"captured {self.captured} decode graph(s) in "
                         f"{self.capture_s or 0:.3f} s (capture + launch barriers, all ranks); "
                         f"measuring the graph set took {self.measure_s or 0:.3f} s")
        lines.append("scheduling: overlapped (each step built while the previous one runs)"
                     if settings.decode_overlap else "scheduling: step-locked")
        wb = weight_bytes_per_rank(cfg, settings.world_size, settings.dtype_bytes)
        plan = controller.memory
        graphs = max(self.graph_bytes.values(), default=0)
        page = controller.config.kv_page_bytes
        kv_pages = (plan.kv_pages if plan is not None else 0) + 1  # + the padding page
        kv = kv_pages * page
        if self.profile and plan is not None and settings.device == "cuda":
            tight = min(self.profile.values(), key=lambda r: r.free_bytes - r.peak_activation_bytes)
            headroom = tight.free_bytes - tight.peak_activation_bytes - graphs - kv
            lines.append(
                f"memory per rank: weights {wb / GIB:.2f} GiB, graph pool {graphs / MIB:.1f} MiB "
                f"(reserved {plan.graph_reserve_bytes / MIB:.1f} MiB), KV {kv_pages} pages = "
                f"{kv / GIB:.2f} GiB, activations {tight.peak_activation_bytes / MIB:.1f} MiB, "
                f"headroom {headroom / GIB:.2f} GiB within gpu_memory_utilization "
                f"{settings.gpu_memory_utilization:g}; batch cap {plan.batch_cap}")
        else:
            lines.append(f"memory per rank: weights {wb / GIB:.2f} GiB, KV {kv_pages} pages = "
                         f"{kv / GIB:.2f} GiB (not profiled on CPU)")
        return "\n".join(lines)
