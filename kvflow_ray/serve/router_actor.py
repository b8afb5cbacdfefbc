"""The router actor, `WorkflowRouterActor`: one named Ray actor around `RouterCore` (DESIGN.md §1, §5).

Everything it must not lose lives in the store (Redis in a deployment), so the actor is declared
restartable: when it dies, Ray starts it again, `__init__` reopens the same store, and the replicas
it knew come back from their heartbeats. Methods return plain data (dicts, lists), so callers in
other processes need nothing but this module.

It is an async actor so that replicas can long-poll it for hints (`pull_hints`): a replica's call
waits until the router has something for it, which is how priorities and prefetch hints are pushed
without the router holding handles to Serve's replica actors. `RouterCore` itself is synchronous and
runs on the actor's one event loop, so no two calls interleave inside it.

The store's keeper (`router/keeper.py`) runs on the same loop: it writes the store behind the calls,
probes it once a second and has the router write its state back when needed; each probe also forgets
replicas that stopped reporting, ends the calls of ingresses that went silent, and retires clients
idle past the state TTL (`_prune`).

Every actor call costs this process about a millisecond of CPU (Ray's own work), more than a routing
decision, so calls are few: the end of an agent call rides on the ingress's next call (`ended`), and
waiting replicas are woken at most every `HINT_BATCH_S`, with all that changed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import ray

from kvflow_ray.engines.base import CacheEvent
from kvflow_ray.router.core import RouterCore
from kvflow_ray.router.keeper import StoreKeeper
from kvflow_ray.router.origins import CallOrigins, Ended
from kvflow_ray.router.settings import RouterSettings
from kvflow_ray.router.store import BufferedStore, RedisStore, open_store
from kvflow_ray.serve.metrics import RouterMetrics, merge_expositions

ROUTER_NAME = "kvflow-router"
ROUTER_NAMESPACE = "kvflow"
HEARTBEAT_MAX_AGE_S = 60.0  # replicas a restarted router trusts
STALE_REPLICA_S = 15.0  # a live replica reports every second; this long without a word means it is gone
# an ingress with calls in flight calls at least every INGRESS_BEAT_S (ingress.py); this long silent, it is gone
INGRESS_SILENT_S = 5.0
HINT_BATCH_S = 0.1  # hints for a replica wait this long for more to go with them
logger = logging.getLogger(__name__)


# no task events: at hundreds of calls a second they would fill the GCS with records nobody reads
@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0, max_concurrency=10_000, enable_task_events=False)
class WorkflowRouterActor:
    def __init__(self, settings: RouterSettings) -> None:
        self.instance = uuid.uuid4().hex  # changes on every (re)start
        inner = open_store(settings.store_url, settings.state_ttl_s)
        self.backend = "redis" if isinstance(inner, RedisStore) else "memory"
        store = BufferedStore(inner, grace_s=settings.store_grace_s, max_pending=settings.store_max_pending)
        self.core = RouterCore.from_settings(store, settings)
        self.store = store
        self.metrics = RouterMetrics()
        self.expositions: dict[str, bytes] = {}  # replica -> its latest metrics
        self._wakeups: dict[str, asyncio.Event] = {}
        self._wake_scheduled = False
        self.keeper = StoreKeeper(store, threaded=self.backend == "redis", reconcile=self.core.reconcile,
                                  every_probe=self._prune)
        self._reported: dict[str, float] = {}  # replica -> when it last said something (monotonic)
        self.other_calls: Counter[str] = Counter()  # calls besides the agent calls, by method (what they cost)
        self.origins = CallOrigins(INGRESS_SILENT_S)  # which ingress each call in flight came through
        self.ingresses_lost = 0
        now = time.monotonic()
        for replica in inner.replicas(HEARTBEAT_MAX_AGE_S):  # a restart: who was serving
            self.core.add_replica(replica)
            self._reported[replica] = now

    # ------------------------------------------------------------------ replicas
    async def add_replica(self, name: str) -> None:
        await self.report(name)

    async def remove_replica(self, name: str) -> None:
        self._forget(name)

    async def replicas(self) -> dict[str, int]:
        self.keeper.start()
        return dict(self.core.loads)

    async def report(self, name: str, exposition: bytes | None = None,
                     load: dict[str, float] | None = None) -> dict[str, bool]:
        """A replica's periodic report: its heartbeat (which also re-registers it with a restarted
        router), its metrics, which `/metrics` serves merged with the router's, and its load
        (`replica.load_report`: device KV pool, usage, waiting queue), which routing policies read.
        The answer asks for a snapshot of its cache when its event feed had a gap."""
        self.other_calls["report"] += 1
        self._heard_from(name)
        self.store.heartbeat(name, {"load": self.core.loads[name]})
        if exposition is not None:
            self.expositions[name] = exposition
        if load is not None:
            self.core.fleet.report(name, usage=float(load["usage"]), waiting=int(load["waiting"]),
                                   capacity=int(load["capacity"]))
        return {"snapshot": self.core.snapshot_due(name)}

    async def cache_events(self, replica: str, events: list[tuple[Any, ...]],
                           first_tokens: Sequence[tuple[str, str]] = (), seq: int | None = None) -> None:
        """What `replica` did since its last report (batch `seq` of its feed): cache events, and the
        calls ((workflow key, agent)) whose first token it produced (their prompts are computed:
        prefill work in flight ends)."""
        self.other_calls["cache_events"] += 1
        self._heard_from(replica)  # a restarted router learns of it here too
        self.core.cache_events(replica, [CacheEvent(*e) for e in events], seq)
        self.core.first_tokens(replica, first_tokens)

    async def cache_snapshot(self, replica: str, seq: int, events: list[tuple[Any, ...]] | None) -> None:
        """What `replica` holds as of batch `seq`, asked for by `report` after a gap in its feed."""
        self.other_calls["cache_snapshot"] += 1
        self._heard_from(replica)
        self.core.cache_snapshot(replica, seq, None if events is None else [CacheEvent(*e) for e in events])

    async def pull_hints(self, replica: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """Long poll: the replica's pending hints, once the next wakeup (at most `HINT_BATCH_S` after
        they came) says so, or at once when that wakeup went while the replica was not waiting; None
        after `timeout_s` without any."""
        self.other_calls["pull_hints"] += 1
        self._heard_from(replica)
        if self._wake_scheduled or not self.core.has_hints(replica):
            wakeup = self._wakeups.setdefault(replica, asyncio.Event())
            wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout_s)
        batch = self.core.take_hints(replica)
        return None if batch is None else dataclasses.asdict(batch)

    # ------------------------------------------------------------------ templates and calls
    async def put_template(self, tenant: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.core.put_template(tenant, spec).to_dict()

    async def get_template(self, tenant: str, name: str) -> dict[str, Any]:
        return self.core.template(tenant, name).to_dict()

    async def client_workflow(self, tenant: str, client_id: str, ended: Sequence[Ended] = (),
                              ingress: str | None = None) -> str:
        self._end_calls(ended, ingress)
        return self.core.client_workflow(tenant, client_id)

    async def start_call(self, tenant: str, client_id: str, agent: str, *, workflow: str | None = None,
                         prefix_hash: str | None = None, prefix_tokens: int = 0, cache_salt: str = "",
                         retry: bool = False, tokens: Sequence[int] = (), max_new: int = 0,
                         ended: Sequence[Ended] = (), ingress: str | None = None) -> dict[str, Any]:
        """Route one agent call (`tokens` / `max_new`: its prompt's token ids and output budget, as the
        simulator gives them). `ended`: calls that ended since the caller's last router call (they are
        ended first, so a client's next call always finds its previous one over). `ingress`: the
        caller, which ends the call (or, should it die first, `_prune` does)."""
        self.keeper.start()
        self._end_calls(ended, ingress)
        route = self.core.start_call(tenant, client_id, agent, workflow=workflow, prefix_hash=prefix_hash,
                                     prefix_tokens=prefix_tokens, cache_salt=cache_salt, retry=retry,
                                     tokens=tokens, max_new=max_new)
        if ingress is not None:
            self.origins.started(ingress, (tenant, client_id, agent, route.replica), retry, self.core.loads)
        self.metrics.observe_decision(route.outcome, self.core.decision_seconds[-1], tenant, route.deviation)
        self._wake()
        # the replicas get the hints through their outboxes; the caller needs only where to go
        return {"replica": route.replica, "outcome": route.outcome, "workflow_key": route.workflow_key,
                "fixed_prompt": route.fixed_prompt, "deviation": route.deviation}

    async def end_call(self, tenant: str, client_id: str, agent: str, replica: str | None = None) -> None:
        """One-way (callers need not wait): the hints it makes reach the replicas through the outbox."""
        self._end_calls([(tenant, client_id, agent, replica)], None)

    async def end_calls(self, ended: list[Ended], ingress: str | None = None) -> None:
        """Several calls' ends at once (what the ingress had not sent with a later call)."""
        self.other_calls["end_calls"] += 1
        self._end_calls(ended, ingress)

    async def ingress_beat(self, ingress: str) -> None:
        """An ingress with calls in flight that made no other router call for a while: it is alive."""
        self.other_calls["ingress_beat"] += 1
        self.origins.heard(ingress)

    async def finish_client(self, tenant: str, client_id: str, ended: Sequence[Ended] = (),
                            ingress: str | None = None) -> None:
        self._end_calls(ended, ingress)
        self.core.finish_client(tenant, client_id)  # its retire hints go out through the outboxes
        self._wake()

    def _end_calls(self, ended: Sequence[Ended], ingress: str | None) -> None:
        if ingress is not None:
            self.origins.heard(ingress)
        for end in ended:
            if not self.origins.ended(ingress, end):
                continue
            tenant, client_id, agent, replica = end
            try:
                self.core.end_call(tenant, client_id, agent, replica)
            except Exception:  # one bad end (an agent its template lost) must not fail the calls it rides on
                logger.exception("ending a call of %s/%s (%s) failed", tenant, client_id, agent)
        if ended:
            self._wake()

    # ------------------------------------------------------------------ observability
    async def metrics_text(self) -> bytes:
        """The router's metrics and every live replica's, as one Prometheus exposition, built from what
        the router holds in memory (live clients per tenant, the store's health as its last flush and
        probe saw it: no store round trip), so a scrape costs the router next to nothing."""
        self.keeper.start()
        self.metrics.set_active(self.core.active_clients())
        self.metrics.set_health(len(self.core.loads), self.backend, self.store.up)
        self.metrics.set_store(self.store.pending, self.store.reconciles)
        self.metrics.set_prediction(self.core.prediction_accuracy())
        live = [text for name, text in self.expositions.items() if name in self.core.loads]
        return merge_expositions([self.metrics.exposition(), *live])

    async def decision_latencies(self) -> list[float]:
        return list(self.core.decision_seconds)

    async def stats(self) -> dict[str, Any]:
        """What a soak or an operator watches: this process's CPU time and call counts (CPU per call),
        recent finish_client latencies, the sizes of the router's state, and the store's health."""
        return {"pid": os.getpid(), "cpu_s": time.process_time(), "start_calls": self.core.calls["start_call"],
                "end_calls": self.core.calls["end_call"], "first_tokens": self.core.calls["first_token"],
                "routing": type(self.core.policy).__name__, "other_calls": dict(self.other_calls),
                "ingresses_lost": self.ingresses_lost, "calls_by_ingress": self.origins.in_flight(),
                "finish_seconds": list(self.core.finish_seconds),
                "finish_cpu_seconds": list(self.core.finish_cpu_seconds),
                **self.core.sizes(), "store_up": self.store.up, "pending_writes": self.store.pending,
                "reconciles": dict(self.store.reconciles), "device_kv_tokens": self.core.fleet.device_capacity()}

    async def ping(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor."""
        return self.instance

    # ------------------------------------------------------------------ helpers
    def _wake(self) -> None:
        """Wake the replicas that have hints waiting, after `HINT_BATCH_S` (one wakeup carries all)."""
        if not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_later(HINT_BATCH_S, self._wake_now)

    def _wake_now(self) -> None:
        self._wake_scheduled = False
        for replica in self.core.pending_hints():
            wakeup = self._wakeups.get(replica)
            if wakeup is not None:
                wakeup.set()

    def _heard_from(self, replica: str) -> None:
        self.core.add_replica(replica)  # idempotent
        self._reported[replica] = time.monotonic()
        self.keeper.start()

    def _prune(self) -> None:
        """Forget replicas that stopped reporting (killed without a goodbye), end the calls of ingresses
        that went silent with calls in flight (killed mid-call), and forget clients idle past the state
        TTL."""
        horizon = time.monotonic() - STALE_REPLICA_S
        for name in [r for r in self.core.loads if self._reported.get(r, 0.0) < horizon]:
            self._forget(name)
        for ingress, calls in self.origins.take_dead().items():
            logger.warning("ingress %s went silent with %d calls in flight: ending them", ingress, len(calls))
            self.ingresses_lost += 1
            self._end_calls(calls, None)
        if self.core.expire():  # idle clients' retire hints go out to the replicas
            self._wake()

    def _forget(self, name: str) -> None:
        if name in self.core.loads:
            self.metrics.replicas_lost.inc()
        self.core.remove_replica(name)
        self.expositions.pop(name, None)
        self._reported.pop(name, None)


def get_router(settings: RouterSettings | None = None, *, create: bool = True) -> Any:
    """The deployment's router actor, created on first use (named, so every process finds the same
    one; the first creator's settings win)."""
    if not create:
        return ray.get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE)
    return WorkflowRouterActor.options(name=ROUTER_NAME, namespace=ROUTER_NAMESPACE, get_if_exists=True,
                                       lifetime="detached").remote(settings or RouterSettings())


def stop_router() -> None:
    """Kill the router actor for good (a redeploy starts a fresh one; its durable state is in the store)."""
    with contextlib.suppress(ValueError):  # ValueError: none running
        ray.kill(ray.get_actor(ROUTER_NAME, namespace=ROUTER_NAMESPACE), no_restart=True)


