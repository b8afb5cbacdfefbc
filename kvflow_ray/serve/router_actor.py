"""The WorkflowRouter: one named Ray actor around `RouterCore` (DESIGN.md §1, §5).

Everything it must not lose lives in the store (Redis in a deployment), so the actor is declared
restartable: when it dies, Ray starts it again, `__init__` reopens the same store, and the replicas
it knew come back from their heartbeats. Methods return plain data (dicts, lists), so callers in
other processes need nothing but this module.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import ray

from kvflow_ray.engines.base import CacheEvent, Hints
from kvflow_ray.serve.metrics import RouterMetrics
from kvflow_ray.serve.router_core import RouterCore
from kvflow_ray.serve.store import open_store

ROUTER_NAME = "kvflow-router"
ROUTER_NAMESPACE = "kvflow"
HEARTBEAT_MAX_AGE_S = 60.0


def _hints(pairs: list[tuple[str, Hints]]) -> list[tuple[str, dict[str, Any]]]:
    return [(replica, dataclasses.asdict(h)) for replica, h in pairs]


@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)
class WorkflowRouterActor:
    def __init__(self, store_url: str | None = None, ttl_s: float = 3600.0) -> None:
        self.instance = uuid.uuid4().hex  # changes on every (re)start
        self.core = RouterCore(open_store(store_url, ttl_s))
        self.metrics = RouterMetrics()
        for replica in self.core.store.replicas(HEARTBEAT_MAX_AGE_S):  # a restart: who was serving
            self.core.add_replica(replica)

    def add_replica(self, name: str) -> None:
        self.core.add_replica(name)
        self.core.store.heartbeat(name, {"load": self.core.loads[name]})

    def remove_replica(self, name: str) -> None:
        self.core.remove_replica(name)

    def replicas(self) -> dict[str, int]:
        return dict(self.core.loads)

    def put_template(self, tenant: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.core.put_template(tenant, spec).to_dict()

    def get_template(self, tenant: str, name: str) -> dict[str, Any]:
        return self.core.template(tenant, name).to_dict()

    def start_call(self, tenant: str, client_id: str, agent: str, *, workflow: str | None = None,
                   prefix_hash: str | None = None, prefix_tokens: int = 0) -> dict[str, Any]:
        route = self.core.start_call(tenant, client_id, agent, workflow=workflow, prefix_hash=prefix_hash,
                                     prefix_tokens=prefix_tokens)
        self.metrics.observe_decision(route.outcome, self.core.decision_seconds[-1], tenant, route.deviation)
        out = dataclasses.asdict(route)
        out["hints"] = _hints(route.hints)
        return out

    def end_call(self, tenant: str, client_id: str, agent: str, replica: str | None = None
                 ) -> list[tuple[str, dict[str, Any]]]:
        return _hints(self.core.end_call(tenant, client_id, agent, replica))

    def finish_client(self, tenant: str, client_id: str) -> list[tuple[str, dict[str, Any]]]:
        return _hints(self.core.finish_client(tenant, client_id))

    def cache_events(self, replica: str, events: list[tuple[str, str, str, int]]) -> None:
        self.core.cache_events(replica, [CacheEvent(*e) for e in events])

    def metrics_text(self) -> bytes:
        self.metrics.set_active(self.core.active_clients())
        return self.metrics.exposition()

    def ping(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor."""
        return self.instance


def get_router(store_url: str | None = None, *, create: bool = True) -> Any:
    """The deployment's router actor, created on first use (named, so every process finds the same one)."""
    if not create:
        return ray.get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE)
    return WorkflowRouterActor.options(name=ROUTER_NAME, namespace=ROUTER_NAMESPACE, get_if_exists=True,
                                       lifetime="detached").remote(store_url)
