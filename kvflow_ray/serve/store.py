"""Where the router's state lives: workflow templates, live workflow state, prefix locations and
replica heartbeats (DESIGN.md §5). Redis is the source of truth in a deployment, so a restarted
router loses nothing; without a Redis URL the embedded default keeps the same data in process.

Both stores implement one contract (tests run it against both):
- templates and client state are namespaced by tenant: `kvflow:{tenant}:template:{name}`,
  `kvflow:{tenant}:client:{client_id}`; one tenant can never name another's keys;
- client state expires after `ttl_s` without a write (an idle workflow is forgotten);
- prefix locations (`kvflow:loc:{prefix_hash}` -> {replica: tier}) and heartbeats
  (`kvflow:replica:{name}`) are per deployment: they describe replicas, which all tenants share.
Values are JSON documents, so state written by one router version can be read by the next.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

NAME = re.compile(r"[A-Za-z0-9_.@-]{1,128}")
TIERS = ("gpu", "cpu")


def check_name(kind: str, value: str) -> str:
    """Tenants, client ids and template names become key parts: restrict them so none can reach
    into another namespace (no `*`, spaces or wildcards)."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r} is not a valid name (1-128 of A-Z a-z 0-9 _ . @ -)")
    return value


class Store(Protocol):
    ttl_s: float

    def put_template(self, tenant: str, name: str, spec: dict[str, Any], ttl_s: float | None = None) -> None:
        """`ttl_s`: the copy expires after that long (None: kept until replaced)."""
        ...

    def get_template(self, tenant: str, name: str) -> dict[str, Any] | None: ...

    def templates(self, tenant: str) -> list[str]: ...

    def put_client(self, tenant: str, client_id: str, state: dict[str, Any]) -> None: ...

    def get_client(self, tenant: str, client_id: str) -> dict[str, Any] | None: ...

    def delete_client(self, tenant: str, client_id: str) -> bool: ...

    def clients(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """Every live client of every tenant: what a restarted router reloads."""
        ...

    def set_location(self, prefix_hash: str, replica: str, tier: str | None) -> None:
        """`tier` None: the replica no longer holds the prefix."""
        ...

    def locations(self, prefix_hash: str) -> dict[str, str]: ...

    def drop_replica(self, replica: str) -> None:
        """A dead replica: forget its heartbeat and every location it held."""
        ...

    def heartbeat(self, replica: str, info: dict[str, Any]) -> None: ...

    def replicas(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        """Replicas whose last heartbeat is at most `max_age_s` old."""
        ...

    def ping(self) -> bool:
        """Whether the backing store answers now (exported as `kvflow_store_up`)."""
        ...


def _key(*parts: str) -> str:
    return ":".join(("kvflow", *parts))


def _template_key(tenant: str, name: str) -> str:
    return _key(check_name("tenant", tenant), "template", check_name("workflow", name))


def _templates_prefix(tenant: str) -> str:
    return _key(check_name("tenant", tenant), "template", "")


def _client_key(tenant: str, client_id: str) -> str:
    return _key(check_name("tenant", tenant), "client", check_name("client_id", client_id))


def _parse_client_key(key: str) -> tuple[str, str] | None:
    """(tenant, client id) of a client-state key; None for any other key."""
    parts = key.split(":")
    return (parts[1], parts[3]) if len(parts) == 4 and parts[2] == "client" else None


def _location_key(prefix_hash: str) -> str:
    return _key("loc", check_name("prefix hash", prefix_hash))


def _check_tier(tier: str | None) -> None:
    if tier is not None and tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")


class MemoryStore:
    """The embedded default: the Redis layout in a dict, with the same expiry semantics."""

    def __init__(self, ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._data: dict[str, tuple[float | None, Any]] = {}  # key -> (expires at, value)
        self._lock = threading.Lock()

    def _get(self, key: str) -> Any:
        item = self._data.get(key)
        if item is None:
            return None
        expires, value = item
        if expires is not None and expires <= self._clock():
            del self._data[key]
            return None
        return value

    def _set(self, key: str, value: Any, ttl: float | None = None) -> None:
        self._data[key] = (None if ttl is None else self._clock() + ttl, value)

    def put_template(self, tenant: str, name: str, spec: dict[str, Any], ttl_s: float | None = None) -> None:
        with self._lock:
            self._set(_template_key(tenant, name), json.dumps(spec), ttl_s)

    def get_template(self, tenant: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            raw = self._get(_template_key(tenant, name))
        return None if raw is None else json.loads(raw)

    def templates(self, tenant: str) -> list[str]:
        prefix = _templates_prefix(tenant)
        with self._lock:
            keys = [k for k in list(self._data) if k.startswith(prefix) and self._get(k) is not None]
        return sorted(k[len(prefix):] for k in keys)

    def put_client(self, tenant: str, client_id: str, state: dict[str, Any]) -> None:
        key = _client_key(tenant, client_id)
        with self._lock:
            self._set(key, json.dumps(state), self.ttl_s)

    def get_client(self, tenant: str, client_id: str) -> dict[str, Any] | None:
        key = _client_key(tenant, client_id)
        with self._lock:
            raw = self._get(key)
        return None if raw is None else json.loads(raw)

    def delete_client(self, tenant: str, client_id: str) -> bool:
        key = _client_key(tenant, client_id)
        with self._lock:
            present = self._get(key) is not None
            self._data.pop(key, None)
        return present

    def clients(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        with self._lock:
            items = [(k, self._get(k)) for k in list(self._data)]
        for key, raw in items:
            ids = _parse_client_key(key)
            if raw is not None and ids is not None:
                yield *ids, json.loads(raw)

    def set_location(self, prefix_hash: str, replica: str, tier: str | None) -> None:
        _check_tier(tier)
        key = _location_key(prefix_hash)
        with self._lock:
            holders: dict[str, str] = dict(self._get(key) or {})
            if tier is None:
                holders.pop(replica, None)
            else:
                holders[check_name("replica", replica)] = tier
            if holders:
                self._set(key, holders)
            else:
                self._data.pop(key, None)

    def locations(self, prefix_hash: str) -> dict[str, str]:
        with self._lock:
            return dict(self._get(_location_key(prefix_hash)) or {})

    def drop_replica(self, replica: str) -> None:
        with self._lock:
            self._data.pop(_key("replica", replica), None)
            for key in [k for k in self._data if k.startswith(_key("loc", ""))]:
                holders = self._data[key][1]
                if replica in holders:
                    holders = {r: t for r, t in holders.items() if r != replica}
                    if holders:
                        self._data[key] = (None, holders)
                    else:
                        del self._data[key]

    def ping(self) -> bool:
        return True  # in process: it is up while the router is

    def heartbeat(self, replica: str, info: dict[str, Any]) -> None:
        with self._lock:
            self._set(_key("replica", check_name("replica", replica)), {**info, "at": time.time()})

    def replicas(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        now = time.time()
        prefix = _key("replica", "")
        with self._lock:
            beats = {k[len(prefix):]: self._get(k) for k in list(self._data) if k.startswith(prefix)}
        return {name: info for name, info in beats.items() if info is not None and now - info["at"] <= max_age_s}


class RedisStore:
    """The same contract over Redis (`redis://host:port/db`). Client state uses Redis expiry, so
    idle workflows vanish even while no router runs."""

    def __init__(self, url: str, ttl_s: float = 3600.0) -> None:
        import redis

        self.ttl_s = ttl_s
        self._r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)
        try:
            self._r.ping()
        except redis.RedisError as exc:
            raise ConnectionError(f"cannot reach Redis at {url}: {exc}") from exc

    def put_template(self, tenant: str, name: str, spec: dict[str, Any], ttl_s: float | None = None) -> None:
        self._r.set(_template_key(tenant, name), json.dumps(spec),
                    px=None if ttl_s is None else max(1, int(ttl_s * 1000)))

    def get_template(self, tenant: str, name: str) -> dict[str, Any] | None:
        raw = self._r.get(_template_key(tenant, name))
        return None if raw is None else json.loads(raw)

    def templates(self, tenant: str) -> list[str]:
        prefix = _templates_prefix(tenant)
        return sorted(k[len(prefix):] for k in self._r.scan_iter(match=prefix + "*", count=500))

    def put_client(self, tenant: str, client_id: str, state: dict[str, Any]) -> None:
        key = _client_key(tenant, client_id)
        self._r.set(key, json.dumps(state), px=max(1, int(self.ttl_s * 1000)))

    def get_client(self, tenant: str, client_id: str) -> dict[str, Any] | None:
        raw = self._r.get(_client_key(tenant, client_id))
        return None if raw is None else json.loads(raw)

    def delete_client(self, tenant: str, client_id: str) -> bool:
        key = _client_key(tenant, client_id)
        return bool(self._r.delete(key))

    def clients(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        for key in self._r.scan_iter(match=_key("*", "client", "*"), count=500):
            ids = _parse_client_key(key)
            raw = self._r.get(key) if ids is not None else None
            if ids is not None and raw is not None:  # may have expired since the scan
                yield *ids, json.loads(raw)

    def set_location(self, prefix_hash: str, replica: str, tier: str | None) -> None:
        _check_tier(tier)
        key = _location_key(prefix_hash)
        if tier is None:
            self._r.hdel(key, replica)
        else:
            self._r.hset(key, check_name("replica", replica), tier)

    def locations(self, prefix_hash: str) -> dict[str, str]:
        return dict(self._r.hgetall(_location_key(prefix_hash)))

    def drop_replica(self, replica: str) -> None:
        self._r.delete(_key("replica", replica))
        for key in self._r.scan_iter(match=_key("loc", "*"), count=1000):
            self._r.hdel(key, replica)

    def ping(self) -> bool:
        import redis

        try:
            return bool(self._r.ping())
        except redis.RedisError:
            return False

    def heartbeat(self, replica: str, info: dict[str, Any]) -> None:
        self._r.set(_key("replica", check_name("replica", replica)), json.dumps({**info, "at": time.time()}))

    def replicas(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        now = time.time()
        prefix = _key("replica", "")
        out = {}
        for key in self._r.scan_iter(match=prefix + "*", count=500):
            raw = self._r.get(key)
            if raw is None:
                continue
            info = json.loads(raw)
            if now - info["at"] <= max_age_s:
                out[key[len(prefix):]] = info
        return out


def open_store(url: str | None, ttl_s: float = 3600.0) -> MemoryStore | RedisStore:
    """`redis://...` for Redis; None (or "memory") for the embedded store."""
    if url is None or url == "memory":
        return MemoryStore(ttl_s)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"store URL {url!r}: expected redis://host:port[/db] (or none for the embedded store)")
    return RedisStore(url, ttl_s)
