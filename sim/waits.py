"""The wait-for graph of a stuck world, and the cycle that explains a deadlock.

Nodes are actors (``rank<r>`` host threads, ``device<r>``, ``controller``); an edge a -> b means
a cannot progress until b does. Each edge carries the sentence a counterexample prints, so a
deadlock reads as a short story: "rank 1's instantiate waits for device 0 to go idle; device 0
spins in all-reduce #7 waiting for rank 1 to launch its matching collective". Each edge also
names the hazard whose mechanism it is (H2, then H3 in that story; `cycle_hazards`).
"""

from __future__ import annotations

import networkx as nx

from protocol.backend import (
    AllocateKVCache,
    AwaitStep,
    DestroyCommunicator,
    FreeGraphs,
    Instantiate,
    LaunchGraph,
    Synchronize,
    Upload,
    WarmupCollective,
)
from sim.common import FOREVER, sig_text
from sim.ops import LOCKING_OPS


def _op_text(world, r: int) -> str:
    op = world.hosts[r].op
    if op is None:
        return "idle"
    arg = f" {op.args[0]}" if op.args and isinstance(op, LOCKING_OPS + (WarmupCollective,)) else ""
    return f"{op.name}{arg}"


def needs_quiesce(world, r: int, op) -> bool:
    """True if ``op`` on rank ``r`` waits for devices to go idle (H2, under its calls set)."""
    hz = world.hz
    match op:
        case Instantiate() | Upload() | AllocateKVCache():
            return hz.h2_waits(True, False)
        case FreeGraphs():
            return hz.h2_waits(False, True)
        case LaunchGraph(key):
            graph = world.graphs[r].get(key)
            return graph is not None and not graph.uploaded and hz.h2_waits(True, False)
    return getattr(op, "frees", False) and hz.h2_waits(False, True)


def wait_edges(world) -> list[tuple[str, str, str, str | None]]:
    """(waiter, waited-on, sentence, hazard) for every blocked actor; ``hazard`` names the rule
    (``"h1"``..``"h8"``, `sim.hazards.RULES`) whose mechanism the edge is, or None for a wait
    that is no hazard (a synchronize on busy work, the controller waiting for a reply)."""
    edges = []
    enabled = set(world.enabled())
    hz = world.hz
    for r, host in enumerate(world.hosts):
        me = f"rank{r}"
        if me in enabled or host.run is None:
            continue
        op = host.op
        what = _op_text(world, r)
        p = host.proc
        if host.fault_armed is not None and host.ready_at is not None:
            continue  # wedged (injected hang) or slow (waits on the clock): no actor to wait on
        holder = world.locks[p]
        if (hz.h1_driver_lock and holder not in (None, r)
                and (isinstance(op, LOCKING_OPS) or getattr(op, "takes_driver_lock", False)
                     # a variant's own op that waits in `locked` (a user who forgot the flag
                     # read a deadlock as the watchdog's abort); reset before each of its probes
                     or (host.lock_blocked and type(op) in world.variant.sim_ops))):
            edges.append((me, f"rank{holder}",
                          f"rank {r}'s {what} waits for process {p}'s driver lock, held by "
                          f"rank {holder}'s {_op_text(world, holder)}", "h1"))
            continue
        if isinstance(op, Synchronize) or (hz.h2_quiesce and (needs_quiesce(world, r, op)
                                                               or host.holding)):
            busy = [d for d in hz.quiesce_devices(r, world.procs[p], world.ws)
                    if world.devices[d].busy()]
            if isinstance(op, Synchronize):
                busy = [r] if world.devices[r].busy() else []
                for d in busy:
                    edges.append((me, f"device{d}", f"rank {r}'s synchronize waits for device {d} "
                                                    "to finish its work", None))
                continue
            for d in busy:  # H2; the lock it may hold is on the cycle only via another edge (H1)
                edges.append((me, f"device{d}", f"rank {r}'s {what} waits for device {d} "
                                                "to go idle", "h2"))
            if busy:
                continue
        if isinstance(op, AwaitStep) and world.devices[r].busy():
            edges.append((me, f"device{r}", f"rank {r}'s await_step waits for device {r} to "
                                            f"finish command {op.seq}'s work", None))
            continue
        if isinstance(op, DestroyCommunicator):
            edges.append((me, me, f"rank {r}'s destroy_communicator waits until every graph that "
                                  f"captured the communicator is freed, but rank {r} frees its "
                                  "graphs only after this call returns", "h5"))
    for r, dev in enumerate(world.devices):
        me = f"device{r}"
        if me in enabled:
            continue
        stream = dev.collective_head()
        if stream is None:
            continue
        kernel = stream[0]
        sig = kernel.sig
        members = (world.comm(sig.comm).members(world.ws) if sig.peer is None else (sig.peer,))
        for q, peer in enumerate(world.devices):
            if q == r or q not in members:
                continue
            if any(h[0].sig.comm == sig.comm and h[0].index == kernel.index
                   for h in peer.collective_heads()):
                continue
            head = peer.collective_head()
            if peer.busy() and head is None:
                target, why = f"device{q}", f"device {q} to reach it"
            else:
                target, why = f"rank{q}", f"rank {q} to enqueue its matching collective"
            edges.append((me, target, f"device {r} spins in {sig_text(kernel)} waiting for {why}",
                          "h3"))
    for (comm, index), arrived in world.host_arrivals.items():
        members = world.comm(comm).members(world.ws)
        left = world.host_left.get((comm, index), set())
        for r in arrived:
            if r in left or f"rank{r}" in enabled:
                continue
            for q in members:
                if q not in arrived:
                    edges.append((f"rank{r}", f"rank{q}",
                                  f"rank {r} waits in host collective #{index} on {comm} for "
                                  f"rank {q} to join it", None))
    ctrl = world.ctrl
    if ctrl.current is not None:
        for r in ctrl.uncollected():
            edges.append(("controller", f"rank{r}",
                          f"the controller waits for rank {r}'s reply to command {ctrl.current.seq} "
                          f"({type(ctrl.current).__name__})", None))
    return edges


def wait_graph(world) -> nx.DiGraph:
    """The wait-for graph as a networkx DiGraph with a ``why`` sentence on each edge."""
    graph = nx.DiGraph()
    for a, b, why, hazard in wait_edges(world):
        graph.add_edge(a, b, why=why, hazard=hazard)
    return graph


def wait_cycle(world) -> list[tuple[str, str]] | None:
    """The first wait-for cycle as (node, sentence) pairs, starting at a host thread, or None."""
    graph = wait_graph(world)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return None
    start = next((i for i, (a, _) in enumerate(cycle) if a.startswith("rank")), 0)
    cycle = cycle[start:] + cycle[:start]
    return [(a, graph.edges[a, b]["why"]) for a, b in cycle]


def cycle_hazards(world) -> frozenset[str]:
    """The hazards (`sim.hazards.RULES` names) whose mechanisms are edges of the first wait-for
    cycle of a stuck ``world``; empty if there is no cycle."""
    graph = wait_graph(world)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return frozenset()
    return frozenset(h for a, b in cycle if (h := graph.edges[a, b]["hazard"]) is not None)


def explain_blocked(world) -> str:
    """Every blocked actor and what it waits for, for hangs without a cycle."""
    lines = [why for _, _, why, _ in wait_edges(world)]
    for r, host in enumerate(world.hosts):
        if host.fault_armed is not None and host.ready_at == FOREVER:
            lines.insert(0, f"rank {r} is wedged in {_op_text(world, r)} (injected hang)")
    return "; ".join(lines) + "." if lines else "every actor is idle but the run did not finish."
