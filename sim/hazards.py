"""The hazard model H1..H9: what the CUDA driver and NCCL do that makes TP graph capture unsafe.

Each rule is a switch so that a check can show which hazard a bad design depends on. What is
public and what is assumed is spelled out per rule; docs/hazards.md is the long form.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class HazardModel:
    """Switches for the modelled hazards; all on by default.

    Attributes:
        h1_driver_lock: one driver lock per process, held by end-of-capture, instantiate,
            upload, the implicit upload of a never-uploaded graph's first launch, and
            allocations. Source: pegainfer TP pre-capture PR (fixes #498); openxla/xla PR #37936
            discussion; meta-pytorch/breakable-cuda-graphs PR #2.
        h2_quiesce: lock-holding calls that allocate or load modules (instantiate, upload,
            implicit upload, KV allocation) wait until the devices in ``h2_scope`` are idle.
            Assumed from the same sources: the observed wedge needs a lock holder that waits on
            a device that spins. docs/hazard-probes.md: on one H200 these calls did not wait
            even for their own device (frees and module loads did).
        h2_calls: which calls H2 makes wait: ``"assumed"`` (the literature's: instantiate,
            upload, the implicit upload, KV allocation), ``"measured"`` (what the H200 probes
            showed waiting while holding the lock: frees of device memory -- freeing graphs,
            re-allocating the KV cache, releasing cached blocks as ``torch.cuda.graph()`` and
            ``empty_cache`` do -- and not the calls above; docs/hazard-probes.md), or ``"both"``
            (the default: the union, so a design must be safe under either).
        h2_scope: which devices an H2 call waits for, an assumption with alternatives:
            ``"device"`` (its own device only), ``"process"`` (every device its process drives;
            the default), ``"peers"`` (every device it has peer access to: all ranks).
        h3_spinning_collectives: a collective kernel occupies its stream and spins until every
            rank's matching collective runs; there is no device-side timeout. Source: NCCL
            semantics; pegainfer #498.
        h4_lazy_connect: the first collective of a message-size class connects lazily; inside
            capture that is an error (``h4_mode="error"``) or a hang (``"hang"``). Source:
            NCCL >= 2.22 per-size algorithm connect; ROCm/rccl #2022.
        h5_comm_refcount: destroying a communicator waits until every graph that captured it is
            freed. Source: NCCL >= 2.26; PyTorch #115388; vLLM #4263.
        h6_async_host: host calls return before their device work completes. Source: CUDA
            stream semantics.
        h7_memory: instantiated graphs and allocations take memory from a per-rank budget;
            going past it is an OOM on that rank. Source: pegainfer #780; vLLM PR #30515.
        h8_exit_teardown: process exit runs driver teardown that needs the driver lock (abort
            does not). Source: pegainfer TP pre-capture PR.
        h9_one_in_flight: a communicator runs one collective at a time. Two of its collectives
            at the heads of two streams of one device wedge when either is inside a CUDA graph
            or the communicator is a one-in-flight kind (custom all-reduce) -- even in the same
            order on every rank; an eager NCCL collective instead waits for the earlier one.
            Sources: sgl-project/sglang #31117 (custom all-reduce, one communicator, two
            streams: permanent hang); ROCm/rccl #2179 (CUDA graph, shared communicator across
            streams: hang; one group per stream: done); NVIDIA/nccl #574 (eager NCCL serializes
            a communicator's collectives). Off: every communicator serializes.
    """

    h1_driver_lock: bool = True
    h2_quiesce: bool = True
    h2_calls: str = "both"
    h2_scope: str = "process"
    h3_spinning_collectives: bool = True
    h4_lazy_connect: bool = True
    h4_mode: str = "error"
    h5_comm_refcount: bool = True
    h6_async_host: bool = True
    h7_memory: bool = True
    h8_exit_teardown: bool = True
    h9_one_in_flight: bool = True

    def __post_init__(self) -> None:
        if self.h2_scope not in H2_SCOPES:
            raise ValueError(f"H2 scope {self.h2_scope!r} is not one of {', '.join(H2_SCOPES)}")
        if self.h2_calls not in H2_CALLS:
            raise ValueError(f"H2 calls {self.h2_calls!r} is not one of {', '.join(H2_CALLS)}")

    def h2_waits(self, assumed: bool, frees: bool) -> bool:
        """Whether H2 makes a lock-holding call wait for quiescence: ``assumed`` if the call is
        in the literature's set (instantiate, upload, implicit upload, KV allocation),
        ``frees`` if it frees device memory (the measured set)."""
        if not self.h2_quiesce:
            return False
        return ((assumed and self.h2_calls != "measured")
                or (frees and self.h2_calls != "assumed"))

    def quiesce_devices(self, rank: int, process_ranks: tuple[int, ...],
                        world_size: int) -> tuple[int, ...]:
        """Devices an H2 call on ``rank`` waits for, under ``h2_scope``."""
        if self.h2_scope == "device":
            return (rank,)
        if self.h2_scope == "peers":
            return tuple(range(world_size))
        return tuple(process_ranks)

    def without(self, *names: str) -> "HazardModel":
        """A copy with the named rules (e.g. ``"h1"`` or ``"h1_driver_lock"``) switched off."""
        changes = {}
        for name in names:
            matches = [f.name for f in fields(self) if f.name == name or f.name.startswith(name + "_")
                       and f.type in (bool, "bool")]
            if not matches:
                raise ValueError(f"unknown hazard {name!r}; known: {', '.join(RULES)}")
            changes[matches[0]] = False
        return replace(self, **changes)


RULES = ("h1", "h2", "h3", "h4", "h5", "h6", "h7", "h8", "h9")

H2_SCOPES = ("device", "process", "peers")
"""Values of `HazardModel.h2_scope`."""

H2_CALLS = ("assumed", "measured", "both")
"""Values of `HazardModel.h2_calls`."""
