"""A minimal synchronous driver for protocol unit tests: ops are recorded, results are canned."""

from protocol.controller import Abort, Broadcast, Controller, Done, Idle
from protocol.eligibility import GraphPlan
from protocol.errors import ProtocolError
from protocol.worker import Worker


class FakeBackend:
    """Records ops; returns plausible values (bytes, tokens)."""

    def __init__(self, rank, fail_on=None):
        self.rank = rank
        self.log = []
        self.graph_bytes = 0
        self.fail_on = fail_on

    def run(self, op):
        self.log.append(op)
        if self.fail_on and op.name == self.fail_on:
            raise ProtocolError(f"boom in {op.name}")
        if op.name == "profile_memory":
            return (10**12, 10**6)
        if op.name == "record":
            self.graph_bytes += 100
        if op.name == "free_graphs":
            self.graph_bytes = 0
        if op.name == "graph_memory":
            return self.graph_bytes
        if op.name == "sample":
            step = op.args[0]
            return {r.request_id: 7 for r in step.rows} | {a.request_id: 7 for a in step.admits}
        return None


def drive(config, requests=(), fail=None, max_iter=10_000):
    """Run controller + workers to Done or Abort. ``fail`` = (rank, op name)."""
    ctrl = Controller(config)
    workers = [Worker(r, config.world_size, GraphPlan.from_config(config), config.max_batch)
               for r in range(config.world_size)]
    backends = [FakeBackend(r, fail[1] if fail and fail[0] == r else None)
                for r in range(config.world_size)]
    sent = []
    pending = list(requests)
    for _ in range(max_iter):
        action = ctrl.next_action()
        if isinstance(action, (Done, Abort)):
            return ctrl, workers, backends, sent, action
        if isinstance(action, Idle):
            if pending:
                while pending:
                    ctrl.submit(pending.pop(0))
            else:
                ctrl.shutdown()
            continue
        assert isinstance(action, Broadcast)
        sent.append(action.command)
        for w, b in zip(workers, backends):
            try:
                results = [b.run(op) for op in w.ops_for(action.command)]
                reply = w.reply(action.command, results)
            except ProtocolError as exc:
                reply = w.fail(action.command, exc)
            ctrl.on_reply(reply)
    raise AssertionError("driver did not finish")
