"""A whole engine around lockstep's protocol in about 100 lines, with no GPU and no simulator:
the loop an engine author writes (docs/protocol-api.md).

Every rank has an `EchoBackend`: a model whose next token is the last one plus 1 (mod VOCAB),
so what each request must produce is known without running anything. `serve` drives one
`protocol.Controller` and a `protocol.Worker` per rank through startup, serving and teardown,
delivering every command to every rank in turn (one process, no threads), and returns each
request's tokens and the commands each rank received.
"""

from __future__ import annotations

from protocol import Controller, GraphPlan, ProtocolConfig, Worker
from protocol.backend import Backend
from protocol.controller import Abort, Broadcast, Done, Idle, Wait
from protocol.execution import run_command
from protocol.requests import Request

VOCAB = 1000
GIB = 1 << 30


class EchoBackend(Backend):
    """One rank's fake device: plenty of memory, graphs of 1 MiB each, and tokens that count
    up. What a real backend does at each method is in `protocol.backend.Backend`'s
    docstrings; the return values that matter are `profile_memory`, `graph_memory` and
    `read_tokens`."""

    def __init__(self):
        self.graph_bytes = 0
        self.sampled: tuple[int, ...] = ()

    def warmup_collective(self, nbytes): pass
    def profile_memory(self, rows): return (8 * GIB, 64 << 20)  # (free, peak activation)
    def record(self, key): self.graph_bytes += 1 << 20
    def instantiate(self, key): pass
    def upload(self, key): pass
    def launch(self, key): pass
    def graph_memory(self): return self.graph_bytes
    def free_graphs(self): self.graph_bytes = 0
    def allocate_kv(self, pages): pass
    def move_slot(self, src, dst): pass
    def release_slot(self, slot): pass
    def assign_pages(self, slot, first_index, pages): pass
    def prefill(self, admits, chunk=None): pass
    def prepare_replay(self, step): pass
    def run_eager(self, step): pass
    def synchronize(self): pass

    def enqueue_sample(self, step):
        # slot order: the decode rows (their input tokens), then the admissions (their prompts)
        self.sampled = tuple((t + 1) % VOCAB for t in step.rows.tokens) + tuple(
            (a.prompt[-1] + 1) % VOCAB for a in step.admits)

    def read_tokens(self, step): return self.sampled

    def mark_step(self, seq): raise NotImplementedError("overlapped scheduling only")
    def await_step(self, seq): raise NotImplementedError("overlapped scheduling only")
    def destroy_communicator(self): pass


def expected_tokens(request: Request) -> list[int]:
    """What an echo model generates for ``request``: counting up from its last prompt token,
    ``max_tokens`` tokens or up to its first stop token (kept)."""
    out, last = [], request.prompt[-1]
    while len(out) < request.max_tokens:
        last = (last + 1) % VOCAB
        out.append(last)
        if last in request.stop_token_ids:
            break
    return out


def serve(config: ProtocolConfig, pages_per_seq: int, waves: list[list[Request]],
          backend=lambda rank: EchoBackend(), max_actions: int = 1_000_000
          ) -> tuple[dict[int, list[int]], list[list]]:
    """Start ``config.world_size`` ranks (``backend(rank)`` makes each one's backend), submit
    each wave of requests when the controller is idle, shut down once all are served. Returns
    ({request id: tokens}, the commands each rank received, per rank).

    Raises:
        RuntimeError: the controller aborted the run (its error), or it asked to wait, which
            a driver that delivers every reply at once never sees.
    """
    controller = Controller(config, pages_per_seq=pages_per_seq)
    plan = GraphPlan.from_config(config)
    workers = [Worker(rank, config.world_size, plan, config.max_batch)
               for rank in range(config.world_size)]
    backends = [backend(rank) for rank in range(config.world_size)]
    received: list[list] = [[] for _ in workers]
    outputs: dict[int, list[int]] = {}
    waves = [list(wave) for wave in waves]
    for _ in range(max_actions):
        action = controller.next_action()
        if isinstance(action, Broadcast):  # one command, the same for every rank
            for worker, backend, log in zip(workers, backends, received):
                log.append(action.command)
                controller.on_reply(run_command(worker, backend, action.command))
        elif isinstance(action, Idle):  # nothing to run: submit more, or finish
            for rid in list(controller.finished):
                outputs[rid] = controller.take_finished(rid)
            if waves:
                for request in waves.pop(0):
                    controller.submit(request)
            else:
                controller.shutdown()
        elif isinstance(action, Done):
            return outputs, received
        elif isinstance(action, Abort):
            raise RuntimeError(f"the run aborted: {action.error}")
        elif isinstance(action, Wait):
            raise RuntimeError("the controller waits for replies already delivered")
    raise RuntimeError(f"no end after {max_actions} actions")


if __name__ == "__main__":
    config = ProtocolConfig(world_size=2, buckets=(1, 2, 4), max_batch=4, page_size=16)
    requests = [Request(1, (5, 6, 7), max_tokens=4), Request(2, (998,), max_tokens=5,
                                                            stop_token_ids=frozenset({1}))]
    outputs, received = serve(config, pages_per_seq=4, waves=[requests])
    for request in requests:
        print(request.request_id, outputs[request.request_id], expected_tokens(request))
    print(len(received[0]), "commands to each rank")
