"""An ingress replica's router: it routes the calls of the clients Serve sends to this ingress with its
own `RouterCore`, so a call makes no actor call (docs/dev/ingress-routing.md).

The router actor (`router_actor.py`) is the hub: this process syncs with it every `sync_s` while busy,
and at once when it or another ingress has news (`router/peers.py` says what a sync carries and when
the actor answers one). It calls the actor on a call's path only for what the actor holds alone: a
template this ingress has no copy of (or whose copy changed), a template registration, and a
replica that failed a call. The clients' records go to the store (Redis in a deployment) through
this process's own write-behind buffer and keeper, as the actor's did; a client this ingress does
not know is looked up there first, since the ingress that routed it before may be gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from kvflow_ray.core.graph import WorkflowSpec
from kvflow_ray.router.core import Route, RouterCore
from kvflow_ray.router.keeper import StoreKeeper
from kvflow_ray.router.peers import IDLE_SYNC_S, SYNC_GAP_S, HubLink
from kvflow_ray.router.settings import RouterSettings
from kvflow_ray.router.store import BufferedStore, RedisStore, open_store
from kvflow_ray.serve.metrics import RouterMetrics
from kvflow_ray.serve.router_actor import get_router

ROUTER_RETRY_S = 60.0  # how long a call waits for a restarting router actor (the calls it needs it for)
BUSY_S = 1.0  # after its last call, an ingress syncs at the busy pace this long
DEAD = (ActorDiedError, ActorUnavailableError, RayActorError)
logger = logging.getLogger("ray.serve")


class IngressRouter:
    def __init__(self, settings: RouterSettings, name: str) -> None:
        self.name = name  # this ingress replica, towards the router actor
        self.sync_s = settings.sync_s  # while busy: how old the other ingresses' loads may be here
        self.hub = get_router(settings)
        inner = open_store(settings.store_url, settings.state_ttl_s)
        self.backend = "redis" if isinstance(inner, RedisStore) else "memory"
        self.store = BufferedStore(inner, grace_s=settings.store_grace_s, max_pending=settings.store_max_pending)
        self.core = RouterCore.from_settings(self.store, settings, owner=False)
        self.metrics = RouterMetrics()
        self.link = HubLink(self.core, self._process_stats)
        self.keeper = StoreKeeper(self.store, threaded=self.backend == "redis", reconcile=self.core.reconcile,
                                  every_probe=self.core.expire)
        self._stale_templates: set[tuple[str, str]] = set()  # copies another ingress replaced at the actor
        self._busy_at = 0.0  # the last call started or ended here (monotonic)
        self._sync_lock: asyncio.Lock | None = None
        self._syncing: asyncio.Task[None] | None = None
        self._held = False  # a sync is waiting at the actor for news
        self._woken = False  # ... and this ingress asked the actor to answer it now
        self._recalls: dict[tuple[str, str], asyncio.Future[None]] = {}  # look-ups for the next batch
        self._recalling: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the hub
    async def ready(self) -> None:
        """Before a call is routed: the background sync runs, and this ingress knows the fleet (its
        first call waits for one sync; later ones never do)."""
        if self._syncing is None or self._syncing.done():
            self.keeper.start()
            # a fresh context: not a child of the request that happens to start it (Ray cancels those)
            self._syncing = asyncio.get_running_loop().create_task(self._sync_loop(), context=contextvars.Context())
            self._syncing.add_done_callback(_log_failure)
        if self.link.hub is None or not self.core.loads:
            await self.sync_now()

    async def sync_now(self, *, metrics: bool = False, wait_s: float = 0.0) -> bool:
        """One sync with the router actor (one at a time), which answers after up to `wait_s` unless
        news comes sooner (`router/peers.py`); whether it answered. One that must not wait ends the
        held one first."""
        if self._sync_lock is None:
            self._sync_lock = asyncio.Lock()
        if wait_s == 0:
            self._end_held_sync()
        async with self._sync_lock:
            if metrics:
                self.link.metrics_due()
            outbound = self.link.outbound(self._exposition)
            self._held = wait_s > 0
            try:
                reply = await self.hub.sync.remote(self.name, outbound, wait_s)
            except Exception as exc:  # a restarting actor: its hints wait for the next sync
                self.link.unsent(outbound)
                logger.debug("sync with the router actor failed: %s", exc)
                return False
            finally:
                self._held = self._woken = False
            self._stale_templates.update(self.link.apply(reply))
            return True

    async def _sync_loop(self) -> None:
        while True:
            busy = time.monotonic() - self._busy_at < BUSY_S or self.core.clients.calls
            try:
                answered = await self.sync_now(wait_s=self.sync_s if busy else max(self.sync_s, IDLE_SYNC_S))
            except Exception:  # a bug here must not end the loop (the fleet view would freeze)
                logger.exception("syncing with the router actor failed")
                answered = False
            await asyncio.sleep(SYNC_GAP_S if answered else self.sync_s)

    def _end_held_sync(self) -> None:
        """The actor answers the sync it holds now (one wake per held sync), so the next one goes up."""
        if self._held and not self._woken:
            self._woken = True
            asyncio.get_running_loop().create_task(self._wake(), context=contextvars.Context())

    async def _wake(self) -> None:
        with contextlib.suppress(Exception):  # a restarting actor: the held sync fails anyway
            await self.hub.wake.remote(self.name)

    def _send_news(self) -> None:
        """What the other ingresses should hear of at once goes up now (`HubLink.news`)."""
        if self.link.news():
            self._end_held_sync()

    async def _call_hub(self, method: str, *args: Any) -> Any:
        """A call the actor alone can answer, waiting out its restart (Ray restarts it)."""
        deadline = time.monotonic() + ROUTER_RETRY_S
        while True:
            try:
                return await getattr(self.hub, method).remote(*args)
            except DEAD:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)

    # ------------------------------------------------------------------ templates
    def held(self, tenant: str, name: str) -> WorkflowSpec | None:
        """This ingress's copy of the template, if it has a current one."""
        template = self.core.templates.current.get(tenant, {}).get(name)
        return None if template is None or (tenant, name) in self._stale_templates else template.spec

    async def template(self, tenant: str, name: str) -> WorkflowSpec:
        """The tenant's current template (from the actor when this ingress has no current copy)."""
        spec = self.held(tenant, name)
        if spec is not None:
            return spec
        exported = await self._call_hub("get_template", tenant, name)
        return self._adopt(tenant, exported)

    async def put_template(self, tenant: str, body: dict[str, Any]) -> WorkflowSpec:
        """Register a template at the actor (the one authority: limits, versions) and keep a copy."""
        return self._adopt(tenant, await self._call_hub("put_template", tenant, body))

    def _adopt(self, tenant: str, exported: dict[str, Any]) -> WorkflowSpec:
        spec = self.core.templates.adopt(tenant, exported["spec"], exported["version"])
        self._stale_templates.discard((tenant, spec.name))
        return spec

    # ------------------------------------------------------------------ clients and calls
    async def recall(self, tenant: str, client_id: str) -> None:
        """A client this ingress does not know may have been routed by another that is gone (or the
        ring changed): its record is read from a shared store before its call is routed here. The
        look-ups of calls that arrive together go as one batch (one MGET), off the event loop."""
        core = self.core
        client = (tenant, client_id)
        if (self.backend != "redis" or not self.store.up or core.clients.get(tenant, client_id) is not None
                or core.clients.was_finished(client)):
            return
        future = self._recalls.get(client)
        if future is None:
            future = self._recalls[client] = asyncio.get_running_loop().create_future()
            if self._recalling is None or self._recalling.done():
                # a fresh context, as the sync loop's: not a child of the request that starts it
                self._recalling = asyncio.get_running_loop().create_task(self._recall_batches(),
                                                                         context=contextvars.Context())
                self._recalling.add_done_callback(_log_failure)
        await asyncio.shield(future)  # a caller that hangs up leaves the others' look-up alone

    async def _recall_batches(self) -> None:
        while self._recalls:
            batch, self._recalls = self._recalls, {}
            clients = list(batch)
            try:
                records = await asyncio.to_thread(self.store.get_clients, clients)
            except Exception:  # the store is failing: the clients are unknown here
                records = [None] * len(clients)
            for client, record in zip(clients, records, strict=True):
                if record is not None and self.core.clients.adopt(*client, record):
                    self.link.claim(*client)
                if not batch[client].done():
                    batch[client].set_result(None)
            self._send_news()

    def client_workflow(self, tenant: str, client_id: str) -> str:
        return self.core.client_workflow(tenant, client_id)

    def start_call(self, tenant: str, client_id: str, agent: str, **call: Any) -> Route:
        """Route one agent call (`RouterCore.start_call`'s arguments), here and now."""
        self._busy_at = time.monotonic()
        route = self.core.start_call(tenant, client_id, agent, **call)
        self.metrics.observe_decision(route.outcome, self.core.decision_seconds[-1], tenant, route.deviation)
        self._send_news()
        return route

    def end_call(self, tenant: str, client_id: str, agent: str, replica: str | None) -> None:
        self._busy_at = time.monotonic()
        try:
            self.core.end_call(tenant, client_id, agent, replica)
        except Exception:  # one bad end (an agent its template lost) must not fail the call's answer
            logger.exception("ending a call of %s/%s (%s) failed", tenant, client_id, agent)

    def finish_client(self, tenant: str, client_id: str) -> None:
        self._busy_at = time.monotonic()
        self.core.finish_client(tenant, client_id)

    async def remove_replica(self, replica: str) -> None:
        """A replica died under a call: forgotten here at once, and at the actor (for everyone)."""
        self.core.remove_replica(replica)
        await self._call_hub("remove_replica", replica)

    async def fleet(self) -> dict[str, int] | None:
        """The live replicas after a fresh sync (None: the router actor does not answer)."""
        if not await self.sync_now():
            return None
        return dict(self.core.loads)

    async def metrics_text(self) -> bytes:
        """Everyone's metrics, this ingress's as of now."""
        await self.sync_now(metrics=True)
        return await self._call_hub("metrics_text")

    # ------------------------------------------------------------------ what goes up with a sync
    def _exposition(self) -> bytes:
        core = self.core
        self.metrics.set_active(core.active_clients())
        self.metrics.set_prediction(core.prediction_accuracy())
        self.metrics.store.set(self.backend, self.store.up, self.store.pending, self.store.reconciles)
        return self.metrics.exposition()

    def _process_stats(self) -> dict[str, Any]:
        """This process's CPU and the finish latencies since the last sync (the actor keeps them)."""
        core = self.core
        finish, finish_cpu = list(core.finish_seconds), list(core.finish_cpu_seconds)
        core.finish_seconds.clear()
        core.finish_cpu_seconds.clear()
        return {"cpu_s": time.process_time(), "finish_seconds": finish, "finish_cpu_seconds": finish_cpu}


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("a background task of the ingress's router (sync loop, recall batches) failed",
                     exc_info=task.exception())

