"""The modelled backend: what each per-rank backend op does to the simulated world.

Each ``_op_<name>(rank, host, *args, probe)`` either tests (``probe=True``) or performs the op,
returning BLOCKED, PROGRESS or DONE. Lock-holding calls go through `World.locked` (H1, H2),
allocations through `World.alloc` (H7), device work through `World.enqueue` (H3, H6).
"""

from __future__ import annotations

from protocol.keys import GraphKey
from sim.common import BLOCKED, DONE, PROGRESS, SimFault


class ModelledBackend:
    """Mixin of `sim.world.World`: the backend ops of every rank."""


    def _op_synchronize(self, r, host, probe):
        if self.devices[r].busy():
            return BLOCKED
        return DONE if probe else self.done(r, host, "synchronize", ())

    def _op_warmup_collective(self, r, host, nbytes, probe):
        if probe:
            return DONE
        self.connected[r].add(nbytes)
        self.enqueue(r, ("c", ("all-reduce", 1, nbytes, "warm-up")))
        return self.done(r, host, "warmup_collective", (nbytes,))

    def _op_profile_memory(self, r, host, rows, probe):
        if probe:
            return DONE
        peak = rows * self.scenario.memory.activation_per_row
        free = self.scenario.memory.capacity - self.used[r]
        self.alloc(r, peak, "eager profile activations (kept as the activation workspace)")
        self.enqueue(r, ("c", self._eager_sig(rows, "profile")))
        return self.done(r, host, "profile_memory", (rows,), (free, peak))

    def _op_graph_memory(self, r, host, probe):
        if probe:
            return DONE
        return self.done(r, host, "graph_memory", (), sum(g["bytes"] for g in self.graphs[r].values()))

    def _op_record(self, r, host, key, probe):
        size = self.config.shape.allreduce_bytes(key.bucket)
        if self.hz.h4_lazy_connect and size not in self.connected[r]:
            if self.hz.h4_mode == "hang":
                return BLOCKED
            if not probe:
                raise SimFault(f"I5: all-reduce of {size} bytes connects lazily inside the capture of "
                               f"{key} on rank {r} (no warm-up at that size)")
            return PROGRESS
        status = self.locked(r, host, quiesce=False, probe=probe)
        if status != DONE or probe:
            return status
        nbytes = self.scenario.memory.graph_bytes(key.bucket)
        self.alloc(r, nbytes, f"graph pool for {key}")
        self.graphs[r][key] = {"bytes": nbytes, "instantiated": False, "uploaded": False}
        return self.done(r, host, "record", (key,))

    def _graph(self, r: int, key: GraphKey) -> dict:
        graph = self.graphs[r].get(key)
        if graph is None:
            raise SimFault(f"rank {r} has no recorded graph {key}")
        return graph

    def _graph_driver_call(self, r, host, key, probe, name: str, flag: str):
        """instantiate / upload: a lock-holding call that waits for quiescence (H1, H2)."""
        status = self.locked(r, host, quiesce=True, probe=probe)
        if status != DONE or probe:
            return status
        self._graph(r, key)[flag] = True
        return self.done(r, host, name, (key,))

    def _op_instantiate(self, r, host, key, probe):
        return self._graph_driver_call(r, host, key, probe, "instantiate", "instantiated")

    def _op_upload(self, r, host, key, probe):
        return self._graph_driver_call(r, host, key, probe, "upload", "uploaded")

    def _op_launch(self, r, host, key, probe):
        graph = self.graphs[r].get(key)
        if graph is not None and not graph["uploaded"]:
            status = self.locked(r, host, quiesce=True, probe=probe)
            if status != DONE or probe:
                return status
            graph["uploaded"] = True
        if probe:
            return DONE
        graph = self._graph(r, key)
        shape = self.config.shape
        self.enqueue(r, ("c", ("all-reduce", shape.allreduces_per_step,
                               shape.allreduce_bytes(key.bucket), f"graph {key}")))
        self.enqueue(r, ("k", "replay", key, host.cmd.seq))
        if self.ctrl.phase == "serving":
            self.events["replay"] += 1
        return self.done(r, host, "launch", (key,))

    def _op_free_graphs(self, r, host, probe):
        if probe:
            return DONE
        self.used[r] -= sum(g["bytes"] for g in self.graphs[r].values())
        self.graphs[r].clear()
        return self.done(r, host, "free_graphs", ())

    def _op_allocate_kv(self, r, host, pages, probe):
        status = self.locked(r, host, quiesce=True, probe=probe)
        if status != DONE or probe:
            return status
        self.alloc(r, (pages + 1) * self.config.kv_page_bytes, f"KV cache of {pages} pages")
        return self.done(r, host, "allocate_kv", (pages,))

    def _op_release_slot(self, r, host, slot, probe):
        return DONE if probe else self.done(r, host, "release_slot", (slot,))

    def _op_assign_pages(self, r, host, slot, first_index, pages, probe):
        return DONE if probe else self.done(r, host, "assign_pages", (slot, first_index, pages))

    def _op_move_slot(self, r, host, src, dst, probe):
        if probe:
            return DONE
        self.enqueue(r, ("k", "copy", src, dst))
        return self.done(r, host, "move_slot", (src, dst))

    def _op_prefill(self, r, host, admits, probe):
        if probe:
            return DONE
        tokens = sum(len(a.prompt) for a in admits)
        self.enqueue(r, ("c", self._eager_sig(tokens, "prefill")))
        self.enqueue(r, ("k", "prefill", admits, host.cmd.seq))
        return self.done(r, host, "prefill", (admits,))

    def _op_prepare_replay(self, r, host, step, probe):
        if probe:
            return DONE
        self.enqueue(r, ("k", "meta", step.seq, step.rows))
        return self.done(r, host, "prepare_replay", (step,))

    def _op_run_eager(self, r, host, step, probe):
        if probe:
            return DONE
        self.enqueue(r, ("c", self._eager_sig(len(step.rows), "eager decode")))
        self.enqueue(r, ("k", "decode", step.seq, step.rows))
        return self.done(r, host, "run_eager", (step,))

    def _op_sample(self, r, host, step, probe):
        if probe:
            return DONE
        out = self.devices[r].out
        tokens = {}
        for req in [a.request_id for a in step.admits] + [row.request_id for row in step.rows]:
            seq, token = out.get(req, (None, -1))
            tokens[req] = token if seq == step.seq else -1
        return self.done(r, host, "sample", (step,), tokens)

    def _op_destroy_communicator(self, r, host, probe):
        if self.hz.h5_comm_refcount and self.graphs[r]:
            return BLOCKED
        return DONE if probe else self.done(r, host, "destroy_communicator", ())

    def _eager_sig(self, rows: int, label: str) -> tuple:
        shape = self.config.shape
        return ("all-reduce", shape.allreduces_per_step, shape.allreduce_bytes(rows), label)

