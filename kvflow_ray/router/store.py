"""Where the router's state lives: workflow templates, live workflow state, prefix locations and
replica heartbeats (docs/design.md §5). Redis is the source of truth in a deployment, so a restarted
router loses nothing; without a Redis URL the embedded default keeps the same data in process.

Both stores implement one contract (tests run it against both):
- templates, client state and learned transition models are namespaced by tenant:
  `kvflow:{tenant}:template:{name}`, `kvflow:{tenant}:client:{client_id}`,
  `kvflow:{tenant}:model:{template}`; one tenant can never name another's keys;
- client state expires after `ttl_s` without a write (an idle workflow is forgotten); a finished
  client's state is replaced by `{"finished_at": t}` (`router.clients.FINISHED_AT`), which expires
  the same way, so any router can tell a finished client from one it never saw;
- prefix locations (`kvflow:loc:{prefix_hash}` -> {replica: tier}) and heartbeats
  (`kvflow:replica:{name}`) are per deployment: they describe replicas, which all tenants share.
Values are JSON documents, so state written by one router version can be read by the next.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from kvflow_ray.core.graph import KEY_PART_RE, is_name

TIERS = ("gpu", "cpu")


def check_name(kind: str, value: str) -> str:
    """Tenants, client ids and template names become key parts: restrict them (`core.graph`'s
    KEY_PART_RE) so none can reach into another namespace (no `:`, `*`, spaces or wildcards)."""
    if not is_name(value, KEY_PART_RE):
        raise ValueError(f"{kind} {value!r} is not a valid name (1-128 of A-Z a-z 0-9 _ . @ -)")
    return value


Write = tuple[str, tuple[Any, ...]]  # a store write: (method name, positional args)
WRITES = frozenset({"put_template", "delete_template", "put_client", "delete_client", "set_location",
                    "drop_replica", "heartbeat", "set_marker", "put_model"})


class Store(Protocol):
    ttl_s: float

    def put_template(self, tenant: str, name: str, spec: dict[str, Any], ttl_s: float | None = None) -> None:
        """`ttl_s`: the copy expires after that long (None: kept until replaced)."""
        ...

    def get_template(self, tenant: str, name: str) -> dict[str, Any] | None: ...

    def delete_template(self, tenant: str, name: str) -> None: ...

    def templates(self, tenant: str) -> list[str]: ...

    def template_items(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """Every template (and kept `name@version` copy) of every tenant: what a restarted router loads."""
        ...

    def put_client(self, tenant: str, client_id: str, state: dict[str, Any]) -> None: ...

    def put_model(self, tenant: str, template: str, model: dict[str, Any], ttl_s: float | None = None) -> None:
        """A template's learned transition model (`core.predict.TransitionModel.to_dict`)."""
        ...

    def get_model(self, tenant: str, template: str) -> dict[str, Any] | None: ...

    def get_client(self, tenant: str, client_id: str) -> dict[str, Any] | None: ...

    def get_clients(self, clients: Sequence[tuple[str, str]]) -> list[dict[str, Any] | None]:
        """Several clients' records at once ((tenant, client id) each; None where there is none)."""
        ...

    def delete_client(self, tenant: str, client_id: str) -> bool: ...

    def clients(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """Every client record of every tenant, finished ones included: what a restarted router reloads."""
        ...

    def set_location(self, prefix_hash: str, replica: str, tier: str | None) -> None:
        """`tier` None: the replica no longer holds the prefix. A location key expires `ttl_s` after its
        last write, so one whose removal was never reported (a replica lost with its cache) still goes."""
        ...

    def locations(self, prefix_hash: str) -> dict[str, str]: ...

    def location_items(self) -> Iterator[tuple[str, dict[str, str]]]:
        """Every known prefix location: what a restarted router loads."""
        ...

    def drop_replica(self, replica: str, prefixes: Iterable[str] = ()) -> None:
        """A dead replica: forget its heartbeat and its holdings of `prefixes` (the router knows what
        it held; anything else it held expires with its location key)."""
        ...

    def heartbeat(self, replica: str, info: dict[str, Any]) -> None: ...

    def replicas(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        """Replicas whose last heartbeat is at most `max_age_s` old."""
        ...

    def get_marker(self) -> str | None:
        """The router's marker key: written once, never expiring, so its absence means the store lost data."""
        ...

    def set_marker(self, value: str) -> None: ...

    def apply(self, writes: Iterable[Write]) -> None:
        """Several writes (`(method name, args)`) in one round trip, in order."""
        ...


def _key(*parts: str) -> str:
    return ":".join(("kvflow", *parts))


def _template_key(tenant: str, name: str) -> str:
    return _key(check_name("tenant", tenant), "template", check_name("workflow", name))


def _templates_prefix(tenant: str) -> str:
    return _key(check_name("tenant", tenant), "template", "")


def _model_key(tenant: str, template: str) -> str:
    return _key(check_name("tenant", tenant), "model", check_name("workflow", template))


def _client_key(tenant: str, client_id: str) -> str:
    return _key(check_name("tenant", tenant), "client", check_name("client_id", client_id))


def _parse_client_key(key: str) -> tuple[str, str] | None:
    """(tenant, client id) of a client-state key; None for any other key."""
    parts = key.split(":")
    return (parts[1], parts[3]) if len(parts) == 4 and parts[2] == "client" else None


def _parse_template_key(key: str) -> tuple[str, str] | None:
    parts = key.split(":")
    return (parts[1], parts[3]) if len(parts) == 4 and parts[2] == "template" else None


def _write_method(name: str) -> str:
    if name not in WRITES:
        raise ValueError(f"{name!r} is not a store write")
    return name


def _location_key(prefix_hash: str) -> str:
    return _key("loc", check_name("prefix hash", prefix_hash))


def _check_tier(tier: str | None) -> None:
    if tier is not None and tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")


SWEEP_MIN_KEYS = 1024  # MemoryStore sweeps expired keys once it holds at least this many


class MemoryStore:
    """The embedded default: the Redis layout in a dict, with the same expiry semantics. As Redis
    does, it drops expired keys nobody reads too (finished and abandoned clients' records): each time
    the dict has doubled since the last sweep, so a write costs O(1) amortized and the dict stays
    within twice the live keys."""

    def __init__(self, ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._data: dict[str, tuple[float | None, Any]] = {}  # key -> (expires at, value)
        self._lock = threading.Lock()
        self._sweep_at = SWEEP_MIN_KEYS

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
        if len(self._data) >= self._sweep_at:
            now = self._clock()
            for expired in [k for k, (at, _) in self._data.items() if at is not None and at <= now]:
                del self._data[expired]
            self._sweep_at = max(SWEEP_MIN_KEYS, 2 * len(self._data))

    def put_template(self, tenant: str, name: str, spec: dict[str, Any], ttl_s: float | None = None) -> None:
        with self._lock:
            self._set(_template_key(tenant, name), json.dumps(spec), ttl_s)

    def get_template(self, tenant: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            raw = self._get(_template_key(tenant, name))
        return None if raw is None else json.loads(raw)

    def delete_template(self, tenant: str, name: str) -> None:
        with self._lock:
            self._data.pop(_template_key(tenant, name), None)

    def templates(self, tenant: str) -> list[str]:
        prefix = _templates_prefix(tenant)
        with self._lock:
            keys = [k for k in list(self._data) if k.startswith(prefix) and self._get(k) is not None]
        return sorted(k[len(prefix):] for k in keys)

    def template_items(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        yield from ((*ids, json.loads(raw)) for ids, raw in self._scan(_parse_template_key))

    def _scan(self, parse: Callable[[str], Any]) -> Iterator[tuple[Any, str]]:
        """(parsed key, value) of every live key `parse` recognises (RedisStore._scan's twin)."""
        with self._lock:
            items = [(k, self._get(k)) for k in list(self._data)]
        for key, raw in items:
            ids = parse(key)
            if raw is not None and ids is not None:
                yield ids, raw

    def put_client(self, tenant: str, client_id: str, state: dict[str, Any]) -> None:
        key = _client_key(tenant, client_id)
        with self._lock:
            self._set(key, json.dumps(state), self.ttl_s)

    def put_model(self, tenant: str, template: str, model: dict[str, Any], ttl_s: float | None = None) -> None:
        with self._lock:
            self._set(_model_key(tenant, template), json.dumps(model), ttl_s)

    def get_model(self, tenant: str, template: str) -> dict[str, Any] | None:
        with self._lock:
            raw = self._get(_model_key(tenant, template))
        return None if raw is None else json.loads(raw)

    def get_client(self, tenant: str, client_id: str) -> dict[str, Any] | None:
        key = _client_key(tenant, client_id)
        with self._lock:
            raw = self._get(key)
        return None if raw is None else json.loads(raw)

    def get_clients(self, clients: Sequence[tuple[str, str]]) -> list[dict[str, Any] | None]:
        return [self.get_client(tenant, client_id) for tenant, client_id in clients]

    def delete_client(self, tenant: str, client_id: str) -> bool:
        key = _client_key(tenant, client_id)
        with self._lock:
            present = self._get(key) is not None
            self._data.pop(key, None)
        return present

    def clients(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        yield from ((*ids, json.loads(raw)) for ids, raw in self._scan(_parse_client_key))

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
                self._set(key, holders, self.ttl_s)
            else:
                self._data.pop(key, None)

    def locations(self, prefix_hash: str) -> dict[str, str]:
        with self._lock:
            return dict(self._get(_location_key(prefix_hash)) or {})

    def location_items(self) -> Iterator[tuple[str, dict[str, str]]]:
        prefix = _key("loc", "")
        with self._lock:
            items = [(k[len(prefix):], self._get(k)) for k in list(self._data) if k.startswith(prefix)]
        yield from ((h, dict(holders)) for h, holders in items if holders)

    def drop_replica(self, replica: str, prefixes: Iterable[str] = ()) -> None:
        with self._lock:
            self._data.pop(_key("replica", replica), None)
        for prefix_hash in prefixes:
            self.set_location(prefix_hash, replica, None)

    def get_marker(self) -> str | None:
        with self._lock:
            return self._get(_key("router"))

    def set_marker(self, value: str) -> None:
        with self._lock:
            self._set(_key("router"), value)

    def apply(self, writes: Iterable[Write]) -> None:
        for name, args in writes:
            getattr(self, _write_method(name))(*args)

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
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.ttl_s = ttl_s
        # short timeouts, no retries inside redis-py: an outage is the caller's to handle (the router
        # queues its writes and serves from memory), not a stall of every call
        self._r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=1.0,
                                       retry=Retry(NoBackoff(), 0))
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

    def delete_template(self, tenant: str, name: str) -> None:
        self._r.delete(_template_key(tenant, name))

    def templates(self, tenant: str) -> list[str]:
        prefix = _templates_prefix(tenant)
        return sorted(k[len(prefix):] for k in self._r.scan_iter(match=prefix + "*", count=500))

    def template_items(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        yield from ((*ids, json.loads(raw)) for ids, raw in self._scan(_key("*", "template", "*"), _parse_template_key))

    def _scan(self, match: str, parse: Callable[[str], Any]) -> Iterator[tuple[Any, str]]:
        """(parsed key, value) of every string key matching `match`, read in pipelined batches."""
        keys = [k for k in self._r.scan_iter(match=match, count=1000) if parse(k) is not None]
        for start in range(0, len(keys), 1000):
            chunk = keys[start:start + 1000]
            for key, raw in zip(chunk, self._r.mget(chunk), strict=True):
                if raw is not None:  # may have expired since the scan
                    yield parse(key), raw

    def put_client(self, tenant: str, client_id: str, state: dict[str, Any]) -> None:
        key = _client_key(tenant, client_id)
        self._r.set(key, json.dumps(state), px=max(1, int(self.ttl_s * 1000)))

    def put_model(self, tenant: str, template: str, model: dict[str, Any], ttl_s: float | None = None) -> None:
        self._r.set(_model_key(tenant, template), json.dumps(model),
                    px=None if ttl_s is None else max(1, int(ttl_s * 1000)))

    def get_model(self, tenant: str, template: str) -> dict[str, Any] | None:
        raw = self._r.get(_model_key(tenant, template))
        return None if raw is None else json.loads(raw)

    def get_client(self, tenant: str, client_id: str) -> dict[str, Any] | None:
        raw = self._r.get(_client_key(tenant, client_id))
        return None if raw is None else json.loads(raw)

    def get_clients(self, clients: Sequence[tuple[str, str]]) -> list[dict[str, Any] | None]:
        """One MGET for them all."""
        if not clients:
            return []
        raws = self._r.mget([_client_key(tenant, client_id) for tenant, client_id in clients])
        return [None if raw is None else json.loads(raw) for raw in raws]

    def delete_client(self, tenant: str, client_id: str) -> bool:
        key = _client_key(tenant, client_id)
        return bool(self._r.delete(key))

    def clients(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        yield from ((*ids, json.loads(raw)) for ids, raw in self._scan(_key("*", "client", "*"), _parse_client_key))

    def set_location(self, prefix_hash: str, replica: str, tier: str | None) -> None:
        _check_tier(tier)
        key = _location_key(prefix_hash)
        if tier is None:
            self._r.hdel(key, replica)  # Redis deletes a hash with no fields left
        else:
            self._r.hset(key, check_name("replica", replica), tier)
            self._r.pexpire(key, max(1, int(self.ttl_s * 1000)))

    def locations(self, prefix_hash: str) -> dict[str, str]:
        return dict(self._r.hgetall(_location_key(prefix_hash)))

    def location_items(self) -> Iterator[tuple[str, dict[str, str]]]:
        prefix = _key("loc", "")
        keys = list(self._r.scan_iter(match=prefix + "*", count=1000))
        for start in range(0, len(keys), 1000):
            pipe = self._r.pipeline(transaction=False)
            chunk = keys[start:start + 1000]
            for key in chunk:
                pipe.hgetall(key)
            for key, holders in zip(chunk, pipe.execute(), strict=True):
                if holders:
                    yield key[len(prefix):], dict(holders)

    def drop_replica(self, replica: str, prefixes: Iterable[str] = ()) -> None:
        self._r.delete(_key("replica", replica))
        for prefix_hash in prefixes:
            self._r.hdel(_location_key(prefix_hash), replica)

    def get_marker(self) -> str | None:
        return self._r.get(_key("router"))

    def set_marker(self, value: str) -> None:
        self._r.set(_key("router"), value)

    def apply(self, writes: Iterable[Write]) -> None:
        batch = copy.copy(self)  # the same methods, queued on one pipeline
        batch._r = self._r.pipeline(transaction=False)  # type: ignore[assignment]
        for name, args in writes:
            getattr(batch, _write_method(name))(*args)
        batch._r.execute()

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


class StoreUnavailableError(RuntimeError):
    """The store has been unreachable for longer than the grace period, or too many writes wait for
    it: state changes are refused (503 with Retry-After) until it answers again."""


READS = frozenset({"get_template", "templates", "template_items", "get_client", "get_clients", "clients", "locations",
                   "location_items", "replicas", "get_marker", "get_model"})


class BufferedStore:
    """The router's store, as the router uses it: its memory is the working state, the store its
    durable copy, read at start and written behind.

    - Writes are queued, the latest per key, and `flush` sends them in one round trip (the router actor
      flushes every few milliseconds; with `sync`, every write flushes at once). So a decision never
      waits on the store, and a store outage only delays writes.
    - A failed flush marks the store down; writes keep queueing. `check()` lets state changes through
      for `grace_s` of an outage; past it, or with `max_pending` writes waiting, it raises
      StoreUnavailableError.
    - `probe()` (once a second) tells when the store is back, and when it lost data (the router's
      marker key is gone). Either way the router then queues its whole state again
      (`RouterCore.reconcile`): a store that came back empty, or older (an AOF that lost its last
      second), ends up with what the router knows.
    Reads pass through to the store (they raise its errors)."""

    def __init__(self, store: Store, grace_s: float = 30.0, max_pending: int = 100_000, sync: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = store
        self.grace_s, self.max_pending, self.sync = grace_s, max_pending, sync
        self._clock = clock
        self._pending: OrderedDict[tuple[str, ...], Write] = OrderedDict()
        self.down_since: float | None = None
        self.reconciles: Counter[str] = Counter()  # reason -> how often the router's state was written back
        self.notify: Callable[[], None] | None = None  # called on every queued write (the flusher's wakeup)

    @property
    def ttl_s(self) -> float:
        return self.inner.ttl_s

    @property
    def up(self) -> bool:
        return self.down_since is None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def __getattr__(self, name: str) -> Any:
        if name in READS:
            return getattr(self.inner, name)
        raise AttributeError(name)

    # ------------------------------------------------------------------ writes (queued)
    def put_template(self, tenant: str, name: str, spec: dict[str, Any], ttl_s: float | None = None) -> None:
        self._queue(("template", tenant, name), "put_template", (tenant, name, spec, ttl_s))

    def delete_template(self, tenant: str, name: str) -> None:
        self._queue(("template", tenant, name), "delete_template", (tenant, name))

    def put_client(self, tenant: str, client_id: str, state: dict[str, Any]) -> None:
        self._queue(("client", tenant, client_id), "put_client", (tenant, client_id, state))

    def delete_client(self, tenant: str, client_id: str) -> None:
        self._queue(("client", tenant, client_id), "delete_client", (tenant, client_id))

    def put_model(self, tenant: str, template: str, model: dict[str, Any], ttl_s: float | None = None) -> None:
        self._queue(("model", tenant, template), "put_model", (tenant, template, model, ttl_s))

    def set_location(self, prefix_hash: str, replica: str, tier: str | None) -> None:
        _check_tier(tier)
        self._queue(("loc", prefix_hash, replica), "set_location", (prefix_hash, replica, tier))

    def drop_replica(self, replica: str, prefixes: Iterable[str] = ()) -> None:
        for prefix_hash in prefixes:  # supersedes what was queued for them
            self._pending.pop(("loc", prefix_hash, replica), None)
        self._queue(("drop", replica), "drop_replica", (replica, list(prefixes)))

    def heartbeat(self, replica: str, info: dict[str, Any]) -> None:
        self._queue(("beat", replica), "heartbeat", (replica, info))

    def set_marker(self, value: str) -> None:
        self._queue(("marker",), "set_marker", (value,))

    def _queue(self, key: tuple[str, ...], name: str, args: tuple[Any, ...]) -> None:
        self._pending[key] = (name, args)
        self._pending.move_to_end(key)  # the order of the latest writes is kept
        if self.sync and self.up:
            self.flush()
        elif self.notify is not None:
            self.notify()

    # ------------------------------------------------------------------ flushing and health
    def check(self) -> None:
        """Raise StoreUnavailableError when state changes must wait for the store."""
        if self.down_since is not None and self._clock() - self.down_since > self.grace_s:
            raise StoreUnavailableError(f"the state store has been unreachable for more than {self.grace_s:g} s; "
                                        "retry shortly")
        if len(self._pending) >= self.max_pending:
            raise StoreUnavailableError(f"{len(self._pending)} state writes wait for the store; retry shortly")

    def take(self) -> OrderedDict[tuple[str, ...], Write]:
        """The queued writes, removed from the queue (to `send`, then `sent`)."""
        batch, self._pending = self._pending, OrderedDict()
        return batch

    def send(self, batch: OrderedDict[tuple[str, ...], Write]) -> BaseException | None:
        """Write `batch` to the store (blocking: the router runs this in a worker thread); the error, if any."""
        try:
            self.inner.apply(batch.values())
        except Exception as exc:  # any store failure: the batch waits for the store to answer again
            return exc
        return None

    def sent(self, batch: OrderedDict[tuple[str, ...], Write], error: BaseException | None) -> None:
        """After `send`: a failed batch goes back in front of what was queued since (newer writes of
        the same key win), and the store is down from now."""
        if error is None:
            return
        if self.down_since is None:
            self.down_since = self._clock()
        restored = OrderedDict((k, w) for k, w in batch.items() if k not in self._pending)
        restored.update(self._pending)
        self._pending = restored

    def flush(self) -> BaseException | None:
        batch = self.take()
        error = self.send(batch) if batch else None
        self.sent(batch, error)
        return error

    def probe(self) -> str | None:
        """Ask the store whether it is there and still has the router's marker (blocking). None: it
        answers and has it; "down": it does not answer; "lost": it answers without the marker."""
        try:
            return None if self.inner.get_marker() is not None else "lost"
        except Exception:  # any store failure: it is down
            return "down"

    def probed(self, seen: str | None) -> str | None:
        """After `probe`: why the router's state must be written back now ("reconnect", "data_loss"),
        or None."""
        if seen == "down":
            if self.down_since is None:
                self.down_since = self._clock()
            return None
        reason = "data_loss" if seen == "lost" else "reconnect" if self.down_since is not None else None
        self.down_since = None
        if reason is not None:
            self.reconciles[reason] += 1
        return reason


def open_store(url: str | None, ttl_s: float = 3600.0) -> MemoryStore | RedisStore:
    """`redis://...` for Redis; None (or "memory") for the embedded store."""
    if url is None or url == "memory":
        return MemoryStore(ttl_s)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"store URL {url!r}: expected redis://host:port[/db] (or none for the embedded store)")
    return RedisStore(url, ttl_s)
