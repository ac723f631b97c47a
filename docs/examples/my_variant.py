"""An example user variant: a worker that forgets to synchronize before replying to a Launch.

Check it with: lockstep check --variant-file docs/examples/my_variant.py --variant no-sync-launch
"""

from protocol.backend import LaunchGraph
from protocol.worker import Worker
from sim.variants import Variant


class NoSyncLaunchWorker(Worker):
    """Acks a Launch as soon as the host call returns (the device may still spin)."""

    def _ops_launch(self, command):
        return [LaunchGraph(command.key)]


NO_SYNC_LAUNCH = Variant(
    name="no-sync-launch",
    summary="Launch acks before the graph's collectives drained",
    source="docs/design.md, I4 and I11: a Launch acks only after its collectives drained",
    expected={"shared": "invariant:I11", "per-rank": "invariant:I11"},
    worker_cls=NoSyncLaunchWorker,
)
