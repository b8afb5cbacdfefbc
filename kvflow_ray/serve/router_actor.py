"""The WorkflowRouter: one named Ray actor around `RouterCore` (DESIGN.md §1, §5).

Everything it must not lose lives in the store (Redis in a deployment), so the actor is declared
restartable: when it dies, Ray starts it again, `__init__` reopens the same store, and the replicas
it knew come back from their heartbeats. Methods return plain data (dicts, lists), so callers in
other processes need nothing but this module.

It is an async actor so that replicas can long-poll it for hints (`pull_hints`): a replica's call
waits until the router has something for it, which is how priorities and prefetch hints are pushed
without the router holding handles to Serve's replica actors. `RouterCore` itself is synchronous and
runs on the actor's one event loop, so no two calls interleave inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import Any

import ray

from kvflow_ray.core.routing import PrefixAffinityRouter
from kvflow_ray.engines.base import CacheEvent, Hints
from kvflow_ray.serve.config import TenantLimits
from kvflow_ray.serve.metrics import RouterMetrics, merge_expositions
from kvflow_ray.serve.router_core import RouterCore
from kvflow_ray.serve.store import RedisStore, open_store

ROUTER_NAME = "kvflow-router"
ROUTER_NAMESPACE = "kvflow"
HEARTBEAT_MAX_AGE_S = 60.0  # replicas a restarted router trusts
STALE_REPLICA_S = 15.0  # a live replica reports every second; this long without a word means it is gone


def _hints(pairs: list[tuple[str, Hints]]) -> list[tuple[str, dict[str, Any]]]:
    return [(replica, dataclasses.asdict(h)) for replica, h in pairs]


@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0, max_concurrency=10_000)
class WorkflowRouterActor:
    def __init__(self, store_url: str | None = None, ttl_s: float = 3600.0, balance_threshold: int = 2,
                 prefetch_horizon: int = 1, limits: dict[str, Any] | None = None) -> None:
        self.instance = uuid.uuid4().hex  # changes on every (re)start
        self.core = RouterCore(open_store(store_url, ttl_s), PrefixAffinityRouter(balance_threshold=balance_threshold),
                               prefetch_horizon=prefetch_horizon, limits=TenantLimits(**(limits or {})))
        self.metrics = RouterMetrics()
        self.expositions: dict[str, bytes] = {}  # replica -> its latest metrics
        self._wakeups: dict[str, asyncio.Event] = {}
        self._pruned_at = time.monotonic()
        for replica in self.core.store.replicas(HEARTBEAT_MAX_AGE_S):  # a restart: who was serving
            self.core.add_replica(replica)

    # ------------------------------------------------------------------ replicas
    async def add_replica(self, name: str) -> None:
        await self.report(name)

    async def remove_replica(self, name: str) -> None:
        self._forget(name)

    async def replicas(self) -> dict[str, int]:
        return dict(self.core.loads)

    async def report(self, name: str, exposition: bytes | None = None) -> None:
        """A replica's periodic report: its heartbeat (which also re-registers it with a restarted
        router) and its metrics, which `/metrics` serves merged with the router's."""
        self.core.add_replica(name)  # idempotent
        self.core.store.heartbeat(name, {"load": self.core.loads[name]})
        if exposition is not None:
            self.expositions[name] = exposition
        self._prune()

    async def cache_events(self, replica: str, events: list[tuple[str, str, str, int]]) -> None:
        self.core.add_replica(replica)  # idempotent: a restarted router learns of it here too
        self.core.cache_events(replica, [CacheEvent(*e) for e in events])

    async def pull_hints(self, replica: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """Long poll: the replica's pending hints, waiting up to `timeout_s` for some to arrive."""
        self.core.add_replica(replica)  # idempotent
        batch = self.core.take_hints(replica)
        if batch is None:
            wakeup = self._wakeups.setdefault(replica, asyncio.Event())
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), timeout_s)
            except TimeoutError:
                return None
            batch = self.core.take_hints(replica)
        return None if batch is None else dataclasses.asdict(batch)

    # ------------------------------------------------------------------ templates and calls
    async def put_template(self, tenant: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.core.put_template(tenant, spec).to_dict()

    async def get_template(self, tenant: str, name: str) -> dict[str, Any]:
        return self.core.template(tenant, name).to_dict()

    async def client_workflow(self, tenant: str, client_id: str) -> str:
        return self.core.client_workflow(tenant, client_id)

    async def start_call(self, tenant: str, client_id: str, agent: str, *, workflow: str | None = None,
                         prefix_hash: str | None = None, prefix_tokens: int = 0, cache_salt: str = "",
                         retry: bool = False) -> dict[str, Any]:
        self._prune()
        route = self.core.start_call(tenant, client_id, agent, workflow=workflow, prefix_hash=prefix_hash,
                                     prefix_tokens=prefix_tokens, cache_salt=cache_salt, retry=retry)
        self.metrics.observe_decision(route.outcome, self.core.decision_seconds[-1], tenant, route.deviation)
        self._wake()
        out = dataclasses.asdict(route)
        out["hints"] = _hints(route.hints)
        return out

    async def end_call(self, tenant: str, client_id: str, agent: str, replica: str | None = None
                       ) -> list[tuple[str, dict[str, Any]]]:
        hints = _hints(self.core.end_call(tenant, client_id, agent, replica))
        self._wake()
        return hints

    async def finish_client(self, tenant: str, client_id: str) -> list[tuple[str, dict[str, Any]]]:
        hints = _hints(self.core.finish_client(tenant, client_id))
        self._wake()
        return hints

    # ------------------------------------------------------------------ observability
    async def metrics_text(self) -> bytes:
        """The router's metrics and every live replica's, as one Prometheus exposition, built from what
        the router holds in memory (live clients per tenant included: no store scan; a store ping is
        the only round trip), so a scrape costs the router next to nothing."""
        self.metrics.set_active(self.core.active_clients())
        store = self.core.store
        self.metrics.set_health(len(self.core.loads), "redis" if isinstance(store, RedisStore) else "memory",
                                store.ping())
        live = [text for name, text in self.expositions.items() if name in self.core.loads]
        return merge_expositions([self.metrics.exposition(), *live])

    async def decision_latencies(self) -> list[float]:
        return list(self.core.decision_seconds)

    async def ping(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor."""
        return self.instance

    # ------------------------------------------------------------------ helpers
    def _wake(self) -> None:
        for replica in self.core.pending_hints():
            wakeup = self._wakeups.get(replica)
            if wakeup is not None:
                wakeup.set()

    def _prune(self) -> None:
        """Forget replicas that stopped reporting (killed without a goodbye) and clients idle past the
        state TTL, at most once a second."""
        now = time.monotonic()
        if now - self._pruned_at < 1.0:
            return
        self._pruned_at = now
        alive = self.core.store.replicas(STALE_REPLICA_S)
        for name in [r for r in self.core.loads if r not in alive]:
            self._forget(name)
        if self.core.expire_clients():  # idle clients' retire hints go out to the replicas
            self._wake()

    def _forget(self, name: str) -> None:
        if name in self.core.loads:
            self.metrics.replicas_lost.inc()
        self.core.remove_replica(name)
        self.expositions.pop(name, None)


def get_router(store_url: str | None = None, *, create: bool = True, ttl_s: float = 3600.0,
               balance_threshold: int = 2, prefetch_horizon: int = 1, limits: dict[str, Any] | None = None) -> Any:
    """The deployment's router actor, created on first use (named, so every process finds the same
    one; the first creator's settings win)."""
    if not create:
        return ray.get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE)
    return WorkflowRouterActor.options(name=ROUTER_NAME, namespace=ROUTER_NAMESPACE, get_if_exists=True,
                                       lifetime="detached").remote(store_url, ttl_s, balance_threshold,
                                                                             prefetch_horizon, limits)


def stop_router() -> None:
    """Kill the router actor for good (a redeploy starts a fresh one; its durable state is in the store)."""
    with contextlib.suppress(ValueError):  # ValueError: none running
        ray.kill(ray.get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE), no_restart=True)


