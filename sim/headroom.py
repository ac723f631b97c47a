"""The most memory headroom a scenario's memory allows, which judges a refusal at startup.

`ProtocolConfig.memory_headroom_bytes` is what the protocol promises to leave free on every rank
once its graphs and KV cache are in place (an engine's ``gpu_memory_utilization`` share left to
other tenants, non-torch allocations and fragmentation: vLLM sizes its KV cache from
``gpu_memory_utilization x total`` less the profiled peak, and an engine that fills the whole
device instead OOMs later, at serving time). A headroom of 0, the only one the check runs,
makes a protocol that ignores it, counts it twice or takes it off the wrong rank's report read
exactly as the correct one. The simulator holds the protocol to its promise from both sides:

- a run that serves must have left the headroom free on every rank (`sim.world`'s direct I9
  check when serving starts);
- a run refused at startup must be one whose memory cannot hold even the smallest plan with
  that headroom (`refusal_expected`): refusing a configuration that fits is as wrong as
  serving one that does not.

The bound (`largest_headroom`) is computed from the modelled memory (`sim.scenario.MemoryModel`)
and the one graph plan (`protocol.eligibility.GraphPlan`, I7), not from the controller's fit:
the smallest plan keeps the graphs of the smallest bucket and one full-length sequence of KV
pages beside the reserved padding page (`protocol.memory.plan_memory`), on the tightest rank.
"""

from __future__ import annotations

from protocol.eligibility import GraphPlan
from sim.scenario import Scenario


def largest_headroom(scenario: Scenario) -> int:
    """The largest ``memory_headroom_bytes`` with which ``scenario``'s memory still holds the
    smallest plan a correct protocol can start with (negative: none, not even 0): the tightest
    rank's room (`room`) less the smallest plan's need (`smallest_need`). The scenario's own
    headroom plays no part."""
    return room(scenario) - smallest_need(scenario)


def room(scenario: Scenario) -> int:
    """Bytes the tightest rank has for graphs, KV cache and headroom: what each rank reports
    before any graph exists, its free bytes less the eager profile's peak (a forward over the
    largest planned bucket, whose activations stay allocated), least over the ranks."""
    cfg, mem = scenario.config, scenario.memory
    peak = GraphPlan.from_config(cfg).buckets[-1] * mem.activation_per_row
    return min(mem.capacity - mem.weights - mem.overhead(r) - peak for r in range(cfg.world_size))


def smallest_need(scenario: Scenario) -> int:
    """Bytes of the smallest plan: the graphs of the smallest bucket -- every path the plan
    captures for it, in one pool -- and the KV pages of one full-length sequence plus the
    padding page (`protocol.memory.plan_memory`)."""
    cfg = scenario.config
    plan = GraphPlan.from_config(cfg)
    smallest = plan.fitted(plan.buckets[0]).keys()
    return (scenario.memory.graph_set_bytes(k.bucket for k in smallest)
            + (scenario.pages_per_seq + 1) * cfg.kv_page_bytes)


def refusal_expected(scenario: Scenario) -> bool:
    """Whether a correct protocol must refuse ``scenario`` at startup: its headroom is more
    than its memory leaves beside the smallest plan (`largest_headroom`)."""
    return scenario.config.memory_headroom_bytes > largest_headroom(scenario)
