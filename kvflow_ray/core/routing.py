"""Which replica serves an agent's call (DESIGN.md §5). Pure: the workflow router feeds it what it
knows (where the agent's fixed prefix is cached, how loaded each replica is) and gets a decision.

- affinity: a replica holding the prefix, device tier before host tier, unless its queue is longer
  than the least loaded replica's by more than `balance_threshold` requests;
- balanced: the prefix is held, but its holders are overloaded: the cheapest replica instead;
- cold: nobody holds the prefix: the workflow's home replica (where its previous agent ran, which
  holds the context that agent produced and the prompt preamble agents of one application share)
  while it is within the balance threshold, else the cheapest replica.
"Cheapest" prices the queue ahead of the call and the prefix work it would need there: nothing on
the device tier, a copy from the host tier, a full recompute elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from kvflow_ray.core.registry import PolicyContext, Registry

TIER_RANK = {"gpu": 0, "cpu": 1}


@dataclass(frozen=True)
class RouteDecision:
    replica: str
    outcome: str  # "affinity" | "balanced" | "cold"
    tier: str | None  # where the chosen replica holds the prefix (None: it does not)


class RoutingPolicy(Protocol):
    def route(self, holders: Mapping[str, str], loads: Mapping[str, int], prefix_tokens: int,
              home: str | None = None) -> RouteDecision:
        """`holders`: replica -> tier holding the agent's fixed prefix; `loads`: queued + running
        requests of every live replica (the candidates); `home`: where the workflow's previous agent
        ran, if anywhere."""
        ...


@dataclass(frozen=True)
class PrefixAffinityRouter:
    balance_threshold: int = 4  # extra queued requests a holder may have before the call goes elsewhere
    queued_request_cost: float = 1.0  # cost of one request queued ahead (the unit of cost)
    host_token_cost: float = 0.0002  # per prefix token loaded from the host tier
    miss_token_cost: float = 0.001  # per prefix token recomputed

    def __post_init__(self) -> None:
        if self.balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {self.balance_threshold}")

    def cost(self, load: int, tier: str | None, prefix_tokens: int) -> float:
        per_token = 0.0 if tier == "gpu" else self.host_token_cost if tier == "cpu" else self.miss_token_cost
        return load * self.queued_request_cost + prefix_tokens * per_token

    def route(self, holders: Mapping[str, str], loads: Mapping[str, int], prefix_tokens: int,
              home: str | None = None) -> RouteDecision:
        """`holders`: replica -> tier holding the agent's fixed prefix; `loads`: queued + running
        requests of every live replica (the candidates); `home`: where the workflow's previous
        agent ran, if anywhere. Ties break by replica name (stable)."""
        if not loads:
            raise ValueError("no live replica to route to")
        live_holders = {r: t for r, t in holders.items() if r in loads}
        least = min(loads.values())
        if live_holders:
            # the best tier among the holders within the threshold (a device holder that is too busy
            # does not hide a host holder that is not)
            within = [r for r in live_holders if loads[r] - least <= self.balance_threshold]
            if within:
                best = min(within, key=lambda r: (TIER_RANK.get(live_holders[r], 2), loads[r], r))
                return RouteDecision(best, "affinity", live_holders[best])
        elif home in loads and loads[home] - least <= self.balance_threshold:
            return RouteDecision(home, "cold", None)
        cheapest = min(loads, key=lambda r: (self.cost(loads[r], live_holders.get(r), prefix_tokens), r))
        outcome = "balanced" if live_holders else "cold"
        if cheapest in live_holders:  # overloaded holders can still be the cheapest choice
            outcome = "affinity"
        return RouteDecision(cheapest, outcome, live_holders.get(cheapest))


ROUTING: Registry[RoutingPolicy] = Registry("routing")


@partial(ROUTING.register, "prefix-affinity")
def _prefix_affinity(context: PolicyContext, *, balance_threshold: int = 4, queued_request_cost: float = 1.0,
                     host_token_cost: float = 0.0002, miss_token_cost: float = 0.001) -> RoutingPolicy:
    """the replica holding the prefix unless it is overloaded, else the cheapest (workflow router)"""
    return PrefixAffinityRouter(balance_threshold, queued_request_cost, host_token_cost, miss_token_cost)
