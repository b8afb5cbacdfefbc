"""The router actor, `WorkflowRouterActor`: one named Ray actor, the hub between the engine replicas
and the ingress replicas (docs/design.md §1, §5; docs/dev/ingress-routing.md).

The routing decisions are not made here: each ingress replica routes its own clients' calls with its
own `RouterCore` (`router/peers.py`), so no call waits on this actor. The actor keeps what is shared:
- the fleet: the replicas' reports (heartbeat, load, metrics) and cache events, in a `RouterCore`
  that owns the holdings (they persist in the store) and the templates;
- the templates, as their one authority (registration, versions, rate limits): the ingresses keep
  copies and say which they use, so the ones in use stay alive;
- the replicas' hint outboxes, which the ingresses' hints are merged into and which the replicas
  long-poll (`exchange`, which also brings their event feeds and reports);
- each ingress's queue of what changed in the fleet, sent with its next `sync`, and what each
  ingress last said (its calls and clients, stats and metrics), which `stats` and `/metrics` sum.

Everything it must not lose lives in the store (Redis in a deployment), so the actor is declared
restartable: when it dies, Ray starts it again, `__init__` reopens the same store, the replicas come
back with their heartbeats (and a snapshot of their caches: their event feeds show it a gap), and
each ingress, new to it, gets the whole holdings with its next sync. Meanwhile the ingresses go on
routing with what they hold. Methods return plain data, so callers need nothing but this module.

It is an async actor so that replicas can long-poll it for hints: a replica's call waits until the
actor has something for it. `RouterCore` is synchronous and runs on the actor's one event loop, so
no two calls interleave inside it. The store's keeper (`router/keeper.py`) runs on the same loop:
it writes the store behind the calls, probes it once a second, and each probe also forgets replicas
and ingresses that stopped reporting and templates nobody uses (`_prune`).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from kvflow_ray.router.peers import Peers
from kvflow_ray.router.settings import RouterSettings
from kvflow_ray.router.store import BufferedStore, RedisStore, open_store
from kvflow_ray.serve.metrics import HubMetrics, merge_expositions

ROUTER_NAME = "kvflow-router"
ROUTER_NAMESPACE = "kvflow"
HEARTBEAT_MAX_AGE_S = 60.0  # replicas a restarted router trusts
STALE_REPLICA_S = 15.0  # a live replica reports every second; this long without a word means it is gone
# Reports and events a replica sent just before it died can reach the actor after an ingress said it
# died; for this long they are not taken for signs of life (a Serve replica's name never comes back:
# its replacement has a new one).
DEAD_QUIET_S = 5.0
logger = logging.getLogger(__name__)
# a batch of a replica's event feed: (cache events as tuples, first tokens, its number in the feed)
EventBatch = tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int]
ReplicaReport = tuple[bytes | None, dict[str, float]]  # (its metrics exposition, `replica.load_report`)


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
        self.metrics = HubMetrics()
        self.expositions: dict[str, bytes] = {}  # replica -> its latest metrics
        self.peers = Peers()  # the ingress replicas
        self._wakeups: dict[str, asyncio.Event] = {}  # replica -> its long poll for hints
        self._waiting_syncs: dict[str, asyncio.Event] = {}  # ingress -> its sync waiting for news
        self.keeper = StoreKeeper(store, threaded=self.backend == "redis", reconcile=self.core.reconcile,
                                  every_probe=self._prune)
        self._reported: dict[str, float] = {}  # replica -> when it last said something (monotonic)
        self._died: dict[str, float] = {}  # replica -> when an ingress saw it die (monotonic)
        self.calls: Counter[str] = Counter()  # calls made to this actor, by method (what they cost)
        self.held_syncs: Counter[str] = Counter()  # syncs held; ended by news or by their wait running out
        self.ingresses_lost = 0
        now = time.monotonic()
        for replica in inner.replicas(HEARTBEAT_MAX_AGE_S):  # a restart: who was serving
            self.core.add_replica(replica)
            self._reported[replica] = now
            # the store's copy of its holdings may lag what it holds: its next report asks for a snapshot
            self.core.holdings.distrust(replica)

    # ------------------------------------------------------------------ replicas
    async def add_replica(self, name: str) -> None:
        self.calls["add_replica"] += 1
        if self._heard_from(name):
            self._report(name, None, None)

    async def remove_replica(self, name: str) -> None:
        """A replica that failed a call (an ingress saw it die): forgotten, by every ingress at its
        next sync."""
        self._died[name] = time.monotonic()
        self._forget(name)

    async def replicas(self) -> dict[str, int]:
        """The live replicas and the calls in flight on each (all the ingresses' as they last said)."""
        self.keeper.start()
        return {replica: self.peers.load(replica) for replica in self.core.loads}

    async def report(self, name: str, exposition: bytes | None = None,
                     load: dict[str, float] | None = None) -> dict[str, bool]:
        """A replica's report on its own (a replica's `exchange` carries it once a second)."""
        self.calls["report"] += 1
        return {"snapshot": self._heard_from(name) and self._report(name, exposition, load)}

    async def cache_events(self, replica: str, events: list[tuple[Any, ...]],
                           first_tokens: Sequence[Sequence[Any]] = (), seq: int | None = None) -> None:
        """A batch of a replica's event feed on its own (when no `exchange` is on its way to carry it)."""
        self.calls["cache_events"] += 1
        if self._heard_from(replica):  # a restarted router learns of it here too
            self._cache_events(replica, events, first_tokens, seq)

    async def cache_snapshot(self, replica: str, seq: int, events: list[tuple[Any, ...]] | None) -> None:
        """What `replica` holds as of batch `seq`, asked for by the answer to its report after a gap in its feed."""
        self.calls["cache_snapshot"] += 1
        if not self._heard_from(replica):
            return
        self.core.cache_snapshot(replica, seq, None if events is None else [CacheEvent(*e) for e in events])
        self._release(self.peers.publish(("snapshot", replica, events)))

    async def exchange(self, replica: str, timeout_s: float = 1.0, feed: EventBatch | None = None,
                       report: ReplicaReport | None = None) -> dict[str, Any]:
        """A replica's one round trip with the hub (a long poll): what it has to say goes in at once
        (`feed`: the next batch of its event feed, as `cache_events` takes it; `report`: exposition
        and load, as `report` takes them); then its hints come back, at once when some wait, else as
        soon as an ingress's sync brings some (None after `timeout_s` without any). So a busy
        replica's events and reports ride the polls its hints need anyway: each actor call costs
        both processes CPU. Returns {"hints": batch or None, "snapshot": whether to send a snapshot
        of its cache (its feed had a gap)}."""
        self.calls["exchange"] += 1
        if not self._heard_from(replica):  # one an ingress just saw die: what it says was sent before
            return {"hints": None, "snapshot": False}
        if feed is not None:  # before the report: a gap in this batch asks for the snapshot at once
            self._cache_events(replica, *feed)
        snapshot = self._report(replica, *report) if report is not None else False
        return {"hints": await self._hints(replica, timeout_s), "snapshot": snapshot}

    # ------------------------------------------------------------------ templates and ingresses
    async def put_template(self, tenant: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Register a template (the one place that checks tenants' template limits and write rates);
        the ingresses that hold another version hear of it with their next sync. Returns it with its
        version, for the caller's copy."""
        self.calls["put_template"] += 1
        name = spec.get("name")
        held = self.core.templates.current.get(tenant, {}).get(name) if isinstance(name, str) else None
        parsed = self.core.put_template(tenant, spec)
        exported = self.core.templates.exported(tenant, parsed.name)
        if held is not None and held.version != exported["version"]:
            self._release(self.peers.publish(("template", tenant, parsed.name)))
        return exported

    async def get_template(self, tenant: str, name: str) -> dict[str, Any]:
        """The current template and its version (`Templates.adopt` takes both)."""
        self.calls["get_template"] += 1
        return self.core.templates.exported(tenant, name)

    async def sync(self, ingress: str, outbound: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
        """An ingress replica's periodic exchange (`router/peers.py`): its hints go to the replicas,
        and it gets what changed in the fleet since its last sync, after up to `wait_s` unless
        something urgent for it comes sooner or it `wake`s it. (A sync is held for less than half the
        time after which a silent ingress counts as gone.)"""
        self.calls["sync"] += 1
        self.keeper.start()
        self._release(self.peers.heard(self.core, ingress, outbound))
        if outbound["hints"]:
            self._wake_replicas()
        if wait_s > 0 and not self.peers.news(ingress):
            held = self._waiting_syncs[ingress] = asyncio.Event()
            self.held_syncs["held"] += 1
            try:
                await asyncio.wait_for(held.wait(), min(wait_s, self.peers.silent_s / 2))
                self.held_syncs["news"] += 1
            except TimeoutError:
                self.held_syncs["timeout"] += 1
            if self._waiting_syncs.get(ingress) is held:
                del self._waiting_syncs[ingress]
        return self.peers.reply(self.core, self.instance, ingress)

    async def wake(self, ingress: str) -> None:
        """The ingress has news to send: its held sync returns now, so the next one carries them."""
        self.calls["wake"] += 1
        self._release([ingress])

    # ------------------------------------------------------------------ observability
    async def metrics_text(self) -> bytes:
        """The router's metrics, every ingress's (labelled `ingress`) and every live replica's, as one
        Prometheus exposition, built from what the actor holds in memory (no store round trip, no
        call to the ingresses), so a scrape costs next to nothing."""
        self.keeper.start()
        self.metrics.replicas.set(len(self.core.loads))
        self.metrics.store.set(self.backend, self.store.up, self.store.pending, self.store.reconciles)
        live = [text for name, text in self.expositions.items() if name in self.core.loads]
        return merge_expositions([self.metrics.exposition(), *self.peers.expositions(), *live])

    async def stats(self) -> dict[str, Any]:
        """What a soak or an operator watches: this process's CPU time and call counts, the ingresses'
        calls and clients (summed, as of their last sync), recent finish_client latencies, the sizes
        of the shared state, and the stores' health."""
        ingresses = self.peers.totals()
        sizes = self.core.sizes()
        return {"pid": os.getpid(), "cpu_s": time.process_time(), "ingress_cpu_s": ingresses["cpu_s"],
                "start_calls": ingresses["start_calls"], "end_calls": ingresses["end_calls"],
                "first_tokens": self.core.calls["first_token"], "routing": type(self.core.policy).__name__,
                "actor_calls": dict(self.calls), "held_syncs": dict(self.held_syncs),
                "ingresses": len(self.peers.peers),
                "ingresses_lost": self.ingresses_lost, "calls_by_ingress": ingresses["calls_by_ingress"],
                "finish_seconds": list(self.peers.finish_seconds),
                "finish_cpu_seconds": list(self.peers.finish_cpu_seconds),
                "live_clients": ingresses["live_clients"], "calls_in_flight": ingresses["calls_in_flight"],
                "templates": sizes["templates"], "old_versions": sizes["old_versions"],
                "locations": sizes["locations"], "told": ingresses["told"], "outbox": sizes["outbox"],
                "store_up": self.store.up and ingresses["store_up"],
                "pending_writes": self.store.pending + ingresses["pending_writes"],
                "reconciles": dict(Counter(self.store.reconciles) + Counter(ingresses["reconciles"])),
                "device_kv_tokens": self.core.fleet.device_capacity()}

    async def ping(self) -> str:
        """This incarnation's id: it changes when Ray restarts the actor."""
        return self.instance

    # ------------------------------------------------------------------ helpers
    def _report(self, name: str, exposition: bytes | None, load: dict[str, float] | None) -> bool:
        """A replica's periodic report: its heartbeat (which also re-registers it with a restarted
        router), its metrics, which `/metrics` serves merged with the router's, and its load
        (`replica.load_report`: device KV pool, usage, waiting queue), which routing policies read.
        Whether to ask it for a snapshot of its cache (its event feed had a gap). The callers below
        take it for live first (`_heard_from`), as they do for `_cache_events` and `_hints`."""
        self.store.heartbeat(name, {"load": self.peers.load(name)})
        if exposition is not None:
            self.expositions[name] = exposition
        if load is not None:
            self.core.fleet.report(name, usage=float(load["usage"]), waiting=int(load["waiting"]),
                                   capacity=int(load["capacity"]))
        return self.core.snapshot_due(name)

    def _cache_events(self, replica: str, events: list[tuple[Any, ...]], first_tokens: Sequence[Sequence[Any]],
                      seq: int | None) -> None:
        """What `replica` did since its last batch (batch `seq` of its feed): cache events, and the calls
        ((workflow key, agent, call number)) whose first token it produced (their prompts are computed:
        prefill work in flight ends). Every ingress hears of both with its next sync."""
        self.core.cache_events(replica, [CacheEvent(*e) for e in events], seq)
        self.core.first_tokens(replica, first_tokens)
        if events:
            self._release(self.peers.publish(("events", replica, events)))
        if first_tokens:
            self._release(self.peers.publish(("first", replica, list(first_tokens))))

    async def _hints(self, replica: str, timeout_s: float) -> dict[str, Any] | None:
        if not self.core.has_hints(replica):
            wakeup = self._wakeups.setdefault(replica, asyncio.Event())
            wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout_s)
        batch = self.core.take_hints(replica)
        # its fields as they are (taken from the outbox: nobody else holds them); `asdict` would copy each
        return None if batch is None else vars(batch)

    def _wake_replicas(self) -> None:
        """Wake the replicas that have hints waiting (an ingress's sync brings a period's worth)."""
        for replica in self.core.pending_hints():
            wakeup = self._wakeups.get(replica)
            if wakeup is not None:
                wakeup.set()

    def _release(self, ingresses: Sequence[str]) -> None:
        """End the held syncs of `ingresses` (they have urgent news waiting)."""
        for name in ingresses:
            held = self._waiting_syncs.get(name)
            if held is not None:
                held.set()

    def _heard_from(self, replica: str) -> bool:
        """`replica` said something: it is live (added if new). False for one an ingress just saw die
        (what it says was sent before)."""
        now = time.monotonic()
        died = self._died.get(replica)
        if died is not None:
            if now - died < DEAD_QUIET_S:
                return False
            del self._died[replica]
        self.core.add_replica(replica)  # idempotent
        self._reported[replica] = now
        self.keeper.start()
        return True

    def _prune(self) -> None:
        """Forget replicas that stopped reporting (killed without a goodbye), ingresses that stopped
        syncing (their calls and clients stop counting), and templates nobody used for their TTL."""
        now = time.monotonic()
        self._died = {name: at for name, at in self._died.items() if now - at < DEAD_QUIET_S}
        horizon = now - STALE_REPLICA_S
        for name in [r for r in self.core.loads if self._reported.get(r, 0.0) < horizon]:
            self._forget(name)
        for name, peer in self.peers.prune().items():
            if peer.stats.get("calls_in_flight"):
                logger.warning("ingress %s went silent with %d calls in flight", name, peer.stats["calls_in_flight"])
                self.ingresses_lost += 1
        self.core.expire()

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


