"""How a router is made, as one record: serving's config builds it (`AppConfig.router_settings`), the
router actor takes it, and `RouterCore.from_settings` reads it, so each setting is named once."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow_ray.core.routing import DEFAULT_ROUTING, RoutingPolicy, create_routing
from kvflow_ray.router.limits import TenantLimits

# how often an ingress replica with calls in flight syncs with the router actor (`router/peers.py`):
# the other ingresses' loads and work in flight are this old
SYNC_S = 0.2


@dataclass(frozen=True)
class RouterSettings:
    routing: str = DEFAULT_ROUTING  # a routing policy, as `kvflow-ray sim --routing` names it (options too)
    balance_threshold: int = 2  # offered to the policy (prefix-affinity takes it)
    seed: int = 0  # for a policy that draws at random
    prefetch_horizon: int = 1  # the engines prefetch agents this many steps ahead
    prediction: str = "graph"  # how agents are ranked in the hints (`core.predict.PREDICTION`)
    limits: TenantLimits = field(default_factory=TenantLimits)
    store_url: str | None = None  # redis://...; None: the in-process store
    state_ttl_s: float = 3600.0  # an idle client's state expires after this long
    template_ttl_s: float | None = None  # an unused template is dropped after this long (at least state_ttl_s)
    store_grace_s: float = 30.0  # a store outage this long is served from memory
    store_max_pending: int = 100_000  # writes queued for an unreachable store before state changes are refused
    sync_s: float = SYNC_S  # a busy ingress replica's sync period (`router/peers.py`)

    def policy(self) -> RoutingPolicy:
        return create_routing(self.routing, self.seed, {"balance_threshold": self.balance_threshold})
