"""Live workflow clients: each one's record (template, version, step-graph state, where its agents ran),
which of them are live per tenant (bounded by the tenant's limit, expired when idle), and the calls
each has in flight."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from kvflow_ray.core.routing import RouteRequest
from kvflow_ray.router.errors import TenantLimitError
from kvflow_ray.router.limits import TenantLimits
from kvflow_ray.router.store import BufferedStore

Client = tuple[str, str]  # (tenant, client id)
FINISHED_REMEMBERED = 65_536  # finished clients remembered, so a finish sent again is answered as the first
# A finished client's record in the store is this key alone (when it finished, seconds since the epoch); it
# expires as every record does. Another ingress that recalls it knows the client was finished: a finish
# sent again there (its answer lost with the ingress that took the first) is answered as the first was.
FINISHED_AT = "finished_at"
Routed = tuple[str, str, RouteRequest]  # (agent, replica, the request as the policy saw it)


class Clients:
    def __init__(self, store: BufferedStore, limits: TenantLimits) -> None:
        self.store = store
        self.limits = limits  # read at each admission: `max_live_clients` per tenant
        # per tenant: live clients other owners hold (as they last said), counted against the limit
        self.elsewhere: Counter[str] = Counter()
        self.records: dict[Client, dict[str, Any]] = {}  # live clients' records (the store's copy, in memory)
        # per tenant: live clients, least recently called first (expired ones leave from the front, so
        # counting them is O(what expired))
        self._live: dict[str, OrderedDict[str, float]] = {}
        # calls started and not yet ended, per client; a client finished meanwhile retires when its
        # last call ends, so the call still returns its answer
        self.calls: Counter[Client] = Counter()
        self.finishing: set[Client] = set()
        self._routed: dict[Client, list[Routed]] = {}  # the calls in flight as the policy saw them
        # clients finished within the state TTL, oldest first: a finish retried (its answer was lost
        # with the ingress that sent it) succeeds again instead of naming an unknown client
        self._finished: OrderedDict[Client, float] = OrderedDict()

    def load(self) -> None:
        """What the store holds, once, at (re)start."""
        now = time.monotonic()
        for tenant, client_id, record in self.store.clients():
            if FINISHED_AT in record:
                self.finished((tenant, client_id))
                continue
            self._live.setdefault(tenant, OrderedDict())[client_id] = now
            self.records[(tenant, client_id)] = record

    def reconcile(self) -> int:
        for (tenant, client_id), record in self.records.items():
            self.store.put_client(tenant, client_id, record)
        return len(self.records)

    def get(self, tenant: str, client_id: str) -> dict[str, Any] | None:
        return self.records.get((tenant, client_id))

    def adopt(self, tenant: str, client_id: str, record: dict[str, Any]) -> bool:
        """A client whose record another owner wrote (an ingress replica that is gone): live here now,
        unless it is known here already or was finished, here or by that owner. Whether it was taken."""
        client = (tenant, client_id)
        if client in self.records or self.was_finished(client):
            return False
        if FINISHED_AT in record:
            self.finished(client)
            return False
        self.records[client] = record
        self._live.setdefault(tenant, OrderedDict())[client_id] = time.monotonic()
        return True

    def save(self, tenant: str, client_id: str, record: dict[str, Any]) -> None:
        self.store.put_client(tenant, client_id, record)
        self.records[(tenant, client_id)] = record

    def touch(self, tenant: str, client_id: str, admit: bool, expired: Callable[[str, str], object]) -> None:
        """Count activity of a live client; with `admit`, a new one must fit within the tenant's limit
        (after the tenant's idle clients expire: `expired(tenant, client_id)` forgets each)."""
        live = self._live.setdefault(tenant, OrderedDict())
        if admit and client_id not in live:
            self._finished.pop((tenant, client_id), None)  # a new instance under the id
            self.expire(tenant, expired)
            count = len(live) + self.elsewhere[tenant]
            if count >= self.limits.max_live_clients:
                raise TenantLimitError("max_live_clients", f"tenant has {count} live workflow clients, the most "
                                                           "allowed; finish some (POST /v1/clients/{id}/finish)")
        live[client_id] = time.monotonic()
        live.move_to_end(client_id)

    def expire(self, tenant: str, expired: Callable[[str, str], object]) -> int:
        """The tenant's clients idle past the store's TTL, oldest first, none with a call in flight:
        `expired(tenant, client_id)` forgets each (it must `forget` the client). How many there were."""
        live = self._live.get(tenant)
        horizon = time.monotonic() - self.store.ttl_s
        count = 0
        while live:
            client_id, at = next(iter(live.items()))
            if at > horizon or (tenant, client_id) in self.calls:
                break
            expired(tenant, client_id)
            count += 1
        return count

    def expire_all(self, expired: Callable[[str, str], object]) -> int:
        return sum(self.expire(tenant, expired) for tenant in list(self._live))

    def active(self, expired: Callable[[str, str], object]) -> Counter[str]:
        """Live clients per tenant, from memory: O(tenants + what expired since the last count)."""
        self.expire_all(expired)
        return Counter({tenant: len(live) for tenant, live in self._live.items() if live})

    def close(self, tenant: str, client_id: str) -> None:
        """The client is finished: remembered here, and its record in the store replaced by a finished one."""
        self.finishing.discard((tenant, client_id))
        self.finished((tenant, client_id))
        self.store.put_client(tenant, client_id, {FINISHED_AT: time.time()})

    def finished(self, client: Client) -> None:
        self._finished[client] = time.monotonic()
        self._finished.move_to_end(client)
        horizon = time.monotonic() - self.store.ttl_s
        while self._finished and (len(self._finished) > FINISHED_REMEMBERED
                                  or next(iter(self._finished.values())) < horizon):
            self._finished.popitem(last=False)

    def was_finished(self, client: Client) -> bool:
        at = self._finished.get(client)
        return at is not None and at > time.monotonic() - self.store.ttl_s

    def forget(self, tenant: str, client_id: str) -> None:
        self.records.pop((tenant, client_id), None)
        self._routed.pop((tenant, client_id), None)
        live = self._live.get(tenant)
        if live is not None:
            live.pop(client_id, None)

    # ------------------------------------------------------------------ calls in flight
    def started(self, client: Client, routed: Routed, again: bool = False) -> None:
        """A call was routed. `again`: a call already counted, routed anew after its engine replica died
        under it (its earlier entry already taken): no new call."""
        if not again:
            self.calls[client] += 1
        self._routed.setdefault(client, []).append(routed)

    def ended(self, client: Client) -> None:
        if self.calls[client] > 1:
            self.calls[client] -= 1
        else:
            self.calls.pop(client, None)

    def in_flight(self, client: Client, agent: str, replica: str) -> Routed | None:
        """The oldest call of `agent` on `replica` still in flight, or None."""
        for entry in self._routed.get(client, ()):
            if entry[0] == agent and entry[1] == replica:
                return entry
        return None

    def take_routed(self, client: Client, agent: str, replica: str | None) -> Routed | None:
        """The oldest call in flight of `agent` (on `replica` when given), no longer in flight."""
        routed = self._routed.get(client)
        if not routed:
            return None
        for i, entry in enumerate(routed):
            if entry[0] == agent and (replica is None or entry[1] == replica):
                del routed[i]
                if not routed:
                    del self._routed[client]
                return entry
        return None
