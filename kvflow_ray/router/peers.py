"""The router actor and the ingress replicas, without Ray: what each side keeps, and what one `sync`
carries between them (docs/dev/ingress-routing.md).

Each ingress replica routes the calls of its own clients (Serve's consistent-hash router sends a
client's calls, keyed by its session header, to one ingress) with its own `RouterCore`
(`owner=False`), so no actor call sits on a call's path. What its decisions need from the fleet
comes from the router actor, which hears from the engine replicas; what the replicas need from the
ingresses (hints) goes through the actor, which they long-poll. One sync, every `sync_s` while the
ingress is busy (`RouterSettings.sync_s`, serving's `ingress_sync_s`) and `IDLE_SYNC_S` otherwise,
carries both ways:

- up (`HubLink.outbound`, taken in by `Peers.heard`): the hints its calls made since (per replica;
  the actor merges them into the replicas' outboxes), its calls in flight per replica, its routing
  policy's work in flight (`RoutingPolicy.shared`), the prompts it just sent to replicas (foreseen
  holders, until their cache events come), its live clients per tenant, the templates it used,
  clients it took over, its stats and, about once a second, its metrics;
- down (`Peers.reply`): what the replicas reported since its last sync, in order (cache events,
  snapshots, first tokens), or the actor's whole holdings when the ingress is new to it (a new
  ingress, a restarted actor, a queue that overflowed); every live replica with its last load
  report; the other ingresses' calls in flight per replica, policy work and live clients per
  tenant; templates that changed.

The actor holds a sync (up to `sync_s` while busy) until something urgent is queued for its
ingress: a prompt another ingress just sent to a replica (foreseen), a client another took over, a
template that changed. The ingress that has such news wakes its own held sync (`wake`), so it goes up
at once and reaches the other ingresses within a round trip: they follow each other's new placements
instead of computing a second copy of a prompt. Everything else rides the next sync: an ingress's
view of the cache events lags the actor's by at most `sync_s`, and the loads and live-client counts
of the other ingresses by one sync of theirs.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvflow_ray.engines.base import CacheEvent
from kvflow_ray.router.core import RouterCore
from kvflow_ray.router.hints import HintBatch

IDLE_SYNC_S = 0.5  # an idle ingress syncs this often (new replicas and templates reach it within this)
SYNC_GAP_S = 0.01  # the least time between two syncs of one ingress (bounds the rate news can cause)
PEER_SILENT_S = 5.0  # an ingress this long without a sync is gone: its loads and clients stop counting
MAX_QUEUED = 20_000  # updates waiting for one ingress; past this it gets the whole holdings instead
METRICS_EVERY_S = 1.0  # how often an ingress sends its metrics exposition up
FINISHES_KEPT = 10_000  # recent finish_client latencies the actor keeps (a soak reads them)

# ("events", replica, [event tuples]) | ("snapshot", replica, [event tuples] | None)
# | ("first", replica, [[workflow key, agent]]) | ("template", tenant, name)
# | ("claimed", the claiming ingress, [tenant, client id])
# | ("foreseen", the sending ingress, [[prefix hash, replica]])
# (an ingress's own claims and foreseen prompts are not queued for it)
Update = tuple[Any, ...]
URGENT = frozenset({"foreseen", "claimed", "template"})  # kinds that end a held sync at once
SUMMED = ("start_calls", "end_calls", "live_clients", "calls_in_flight", "told", "pending_writes", "cpu_s")


@dataclass
class Peer:
    """What the router actor knows of one ingress replica."""

    instance: str  # changes when the ingress process restarts
    seen: float  # its last sync (monotonic)
    updates: list[Update] = field(default_factory=list)  # to send with its next sync
    owes_snapshot: bool = True  # new (or its queue overflowed): the next sync sends the whole holdings
    urgent: bool = False  # an update of an `URGENT` kind waits in `updates`
    loads: dict[str, int] = field(default_factory=dict)  # its calls in flight per replica
    live: dict[str, int] = field(default_factory=dict)  # its live clients per tenant
    shared: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # its policy's `shared()`
    stats: dict[str, Any] = field(default_factory=dict)
    metrics: bytes | None = None


class Peers:
    """The router actor's side: each ingress's queue of updates and what it last said."""

    def __init__(self, silent_s: float = PEER_SILENT_S, max_queued: int = MAX_QUEUED) -> None:
        self.silent_s = silent_s
        self.max_queued = max_queued
        self.peers: dict[str, Peer] = {}
        # the ingresses' recent finish_client latencies (wall, CPU), as they send them
        self.finish_seconds: deque[float] = deque(maxlen=FINISHES_KEPT)
        self.finish_cpu_seconds: deque[float] = deque(maxlen=FINISHES_KEPT)

    def publish(self, update: Update, *, besides: str | None = None) -> list[str]:
        """Something every ingress (but `besides`, whose news it is) must hear of, in order; the
        ingresses whose held sync it should end (an urgent update). O(ingresses)."""
        urgent = update[0] in URGENT
        woken = []
        for name, peer in self.peers.items():
            if peer.owes_snapshot or name == besides:  # the snapshot it gets next includes this
                continue
            peer.updates.append(update)
            if len(peer.updates) > self.max_queued:
                peer.updates = []
                peer.owes_snapshot = True
            if urgent or peer.owes_snapshot:
                peer.urgent = True
                woken.append(name)
        return woken

    def news(self, name: str) -> bool:
        """Whether ingress `name` has something urgent waiting (a held sync of its returns at once)."""
        peer = self.peers.get(name)
        return peer is None or peer.urgent or peer.owes_snapshot

    def heard(self, hub: RouterCore, name: str, outbound: Mapping[str, Any]) -> list[str]:
        """Ingress `name` synced (`HubLink.outbound`) with the actor whose core is `hub`: its hints go
        into the replicas' outboxes, the templates it used stay alive, what it said is kept. Returns
        the other ingresses that have urgent news now (its foreseen prompts, clients it took)."""
        for replica, batch in outbound["hints"].items():
            if replica in hub.loads:  # hints for a replica gone since are dropped with it
                hub.outbox.merge(replica, batch)
        hub.templates.touch(outbound["used"])
        woken: set[str] = set()
        for tenant, client_id in outbound["claimed"]:  # the ingress that routed them before lets go
            woken.update(self.publish(("claimed", name, [tenant, client_id]), besides=name))
        if outbound["foreseen"]:  # prompts just sent to replicas: the others follow them there too
            woken.update(self.publish(("foreseen", name, outbound["foreseen"]), besides=name))
        peer = self.peers.get(name)
        if peer is None or peer.instance != outbound["instance"]:
            peer = self.peers[name] = Peer(outbound["instance"], time.monotonic())
        peer.seen = time.monotonic()
        peer.loads = dict(outbound["loads"])
        peer.live = dict(outbound["live"])
        peer.shared = outbound["shared"]
        stats = dict(outbound["stats"])
        self.finish_seconds.extend(stats.pop("finish_seconds", ()))
        self.finish_cpu_seconds.extend(stats.pop("finish_cpu_seconds", ()))
        peer.stats = stats
        if outbound.get("metrics") is not None:
            peer.metrics = outbound["metrics"]
        return sorted(woken)

    def reply(self, hub: RouterCore, instance: str, name: str) -> dict[str, Any]:
        """What changed in the fleet since ingress `name`'s last sync (`HubLink.apply`), from the actor
        whose core is `hub` (incarnation `instance`). `heard` came first."""
        peer = self.peers[name]
        snapshot, updates = peer.owes_snapshot, peer.updates
        peer.owes_snapshot, peer.updates, peer.urgent = False, [], False
        loads, live = self.elsewhere(name)
        fleet = hub.fleet
        return {"hub": instance, "holdings": hub.holdings.export() if snapshot else None,
                "updates": [] if snapshot else updates, "loads": dict(loads), "live": dict(live),
                "shared": _summed(peer.shared for other, peer in self.peers.items() if other != name),
                "replicas": {r: (fleet.usage.get(r, 0.0), fleet.waiting.get(r, 0), fleet.capacity.get(r))
                             for r in fleet.loads}}

    def load(self, replica: str) -> int:
        """Every ingress's calls in flight on `replica`, as they last said. O(ingresses)."""
        return sum(peer.loads.get(replica, 0) for peer in self.peers.values())

    def elsewhere(self, name: str) -> tuple[Counter[str], Counter[str]]:
        """The other ingresses' (calls in flight per replica, live clients per tenant)."""
        loads: Counter[str] = Counter()
        live: Counter[str] = Counter()
        for other, peer in self.peers.items():
            if other != name:
                loads.update(peer.loads)
                live.update(peer.live)
        return loads, live

    def prune(self) -> dict[str, Peer]:
        """Forget the ingresses silent for `silent_s` (killed, or scaled down); returns them."""
        horizon = time.monotonic() - self.silent_s
        gone = {name: peer for name, peer in self.peers.items() if peer.seen < horizon}
        for name in gone:
            del self.peers[name]
        return gone

    def totals(self) -> dict[str, Any]:
        """The ingresses' stats together: counts summed, the store healthy only if every one's is."""
        out: dict[str, Any] = dict.fromkeys(SUMMED, 0)
        reconciles: Counter[str] = Counter()
        out["store_up"] = True
        out["calls_by_ingress"] = {}
        for name, peer in self.peers.items():
            for key in SUMMED:
                out[key] += peer.stats.get(key, 0)
            reconciles.update(peer.stats.get("reconciles", {}))
            out["store_up"] = out["store_up"] and bool(peer.stats.get("store_up", True))
            if peer.stats.get("calls_in_flight"):
                out["calls_by_ingress"][name] = peer.stats["calls_in_flight"]
        out["reconciles"] = dict(reconciles)
        return out

    def expositions(self) -> list[tuple[bytes, dict[str, str]]]:
        """Each ingress's latest metrics, with the label that tells them apart."""
        return [(peer.metrics, {"ingress": name}) for name, peer in self.peers.items() if peer.metrics is not None]


class HubLink:
    """An ingress replica's side: its `RouterCore`, kept in step with the fleet the router actor sees.

    `core.loads` counts every ingress's calls in flight, as the router's decisions need: this ingress's
    own (its core counts them as they start and end) plus the others' as of the last sync."""

    def __init__(self, core: RouterCore, stats: Callable[[], dict[str, Any]] = dict) -> None:
        self.core = core
        self.instance = uuid.uuid4().hex  # this process: a restarted ingress is new to the actor
        self.extra_stats = stats  # what the caller adds to its stats (its process's CPU)
        self.hub: str | None = None  # the router actor's instance as of the last sync
        self._elsewhere: dict[str, int] = {}  # replica -> the other ingresses' calls there (in core.loads)
        self._metrics_at = 0.0
        self.claimed: list[tuple[str, str]] = []  # clients recalled from the store since the last sync

    def claim(self, tenant: str, client_id: str) -> None:
        """A client recalled from the store (the ingress that routed it before may be alive: the
        consistent-hash ring changed): every other ingress forgets it with its next sync."""
        self.claimed.append((tenant, client_id))

    def news(self) -> bool:
        """Whether this ingress has something the others should hear of at once (`URGENT`): prompts
        it just sent to replicas that were not known to hold them, or clients it took over."""
        return bool(self.claimed) or self.core.holdings.has_foreseen()

    def outbound(self, metrics: Callable[[], bytes] | None = None) -> dict[str, Any]:
        """What the next sync carries up. The hints leave the core's outboxes: `unsent` puts them
        back should the sync fail."""
        core = self.core
        live = dict(core.active_clients())  # first: clients that expire now retire with these hints
        hints: dict[str, HintBatch] = {}  # plain data: it pickles as is
        for replica in core.pending_hints():
            batch = core.take_hints(replica)
            if batch is not None:
                hints[replica] = batch
        out: dict[str, Any] = {
            "instance": self.instance, "hints": hints, "loads": self.own_loads(),
            "live": live, "used": core.templates.take_used(), "stats": self.stats(),
            "claimed": self.claimed, "shared": core.policy.shared(),
            "foreseen": core.holdings.take_foreseen()}
        self.claimed = []
        if metrics is not None and time.monotonic() - self._metrics_at >= METRICS_EVERY_S:
            self._metrics_at = time.monotonic()
            out["metrics"] = metrics()
        return out

    def metrics_due(self) -> None:
        """The next sync carries the metrics whenever they were last sent."""
        self._metrics_at = 0.0

    def unsent(self, outbound: Mapping[str, Any]) -> None:
        """A sync that failed: its hints wait for the next one (merged under what came since)."""
        for replica, batch in outbound["hints"].items():
            waiting = self.core.take_hints(replica)
            self.core.outbox.merge(replica, batch)
            if waiting is not None:
                self.core.outbox.merge(replica, waiting)
        self.core.templates.untake_used(outbound["used"])
        self.claimed[:0] = outbound["claimed"]
        self._metrics_at = 0.0

    def own_loads(self) -> dict[str, int]:
        """This ingress's own calls in flight per replica (`core.loads` less the others')."""
        own = ((r, n - self._elsewhere.get(r, 0)) for r, n in self.core.loads.items())
        return {r: n for r, n in own if n > 0}

    def stats(self) -> dict[str, Any]:
        core = self.core
        sizes = core.sizes()
        return {"start_calls": core.calls["start_call"], "end_calls": core.calls["end_call"],
                "live_clients": sizes["live_clients"], "calls_in_flight": sizes["calls_in_flight"],
                "told": sizes["told"], "pending_writes": core.store.pending, "store_up": core.store.up,
                "reconciles": dict(core.store.reconciles), **self.extra_stats()}

    def apply(self, reply: Mapping[str, Any]) -> list[tuple[str, str]]:
        """The actor's answer to a sync; the templates that changed ((tenant, name) each)."""
        core = self.core
        if reply.get("holdings") is not None:
            core.holdings.restore(reply["holdings"])
        replicas: Mapping[str, Any] = reply["replicas"]
        for replica in [r for r in core.loads if r not in replicas]:
            core.remove_replica(replica)
            self._elsewhere.pop(replica, None)
        for replica, (usage, waiting, capacity) in replicas.items():
            core.add_replica(replica)
            core.fleet.report(replica, usage=usage, waiting=waiting, capacity=capacity)
        changed = []
        for update in reply["updates"]:
            kind, about, data = update
            if kind == "events":
                core.cache_events(about, _events(data))
            elif kind == "snapshot":
                if data is not None:
                    core.holdings.replace(about, 0, _events(data))
            elif kind == "first":
                core.first_tokens(about, [tuple(call) for call in data])
            elif kind == "template":
                changed.append((about, data))
            elif kind == "claimed":
                core.release(*data)
            elif kind == "foreseen":
                for prefix_hash, replica in data:
                    if replica in core.loads:
                        core.holdings.foresee(prefix_hash, replica, share=False)
        elsewhere: Mapping[str, int] = reply["loads"]
        for replica in core.loads:
            now = elsewhere.get(replica, 0)
            core.loads[replica] += now - self._elsewhere.get(replica, 0)
            self._elsewhere[replica] = now
        core.clients.elsewhere = Counter(reply["live"])
        core.policy.absorb(reply["shared"], core.fleet)
        self.hub = reply["hub"]
        return changed


def _summed(states: Iterable[Mapping[str, Mapping[str, list[float]]]]) -> dict[str, dict[str, list[float]]]:
    """Routing policies' `shared()` states, summed per name and replica, element by element."""
    out: dict[str, dict[str, list[float]]] = {}
    for state in states:
        for name, per_replica in state.items():
            into = out.setdefault(name, {})
            for replica, values in per_replica.items():
                have = into.get(replica)
                into[replica] = list(values) if have is None else [a + b for a, b in zip(have, values, strict=True)]
    return out


def _events(data: Iterable[Iterable[Any]]) -> list[CacheEvent]:
    return [CacheEvent(*e) for e in data]
