"""The router's state store: one contract, run against the embedded store and a real redis-server."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from redis_proc import RedisProcess

from kvflow_ray.router.store import (
    SWEEP_MIN_KEYS,
    BufferedStore,
    MemoryStore,
    RedisStore,
    Store,
    StoreUnavailableError,
    open_store,
)

pytest.importorskip("redis")


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore(ttl_s=60)
        return
    url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushdb()
    yield RedisStore(url, ttl_s=60)


SPEC = {"name": "peer", "entry": "planner", "agents": {"planner": {"after": []}}}


def test_templates_are_per_tenant(store: Store) -> None:
    store.put_template("acme", "peer", SPEC)
    store.put_template("globex", "peer", {**SPEC, "entry": "other"})
    assert store.get_template("acme", "peer") == SPEC
    assert store.get_template("globex", "peer")["entry"] == "other"
    assert store.get_template("initech", "peer") is None
    assert store.templates("acme") == ["peer"] and store.templates("initech") == []


def test_client_state_is_per_tenant_and_restorable(store: Store) -> None:
    state = {"workflow": "peer", "running": ["planner"], "arrived": {}}
    store.put_client("acme", "c1", state)
    store.put_client("globex", "c1", {**state, "running": []})
    assert store.get_client("acme", "c1") == state
    assert store.get_client("globex", "c1")["running"] == []
    assert store.get_client("initech", "c1") is None
    # what an ingress recalls in one batch (one MGET from Redis), in the order asked, each per tenant
    assert store.get_clients([("globex", "c1"), ("initech", "c1"), ("acme", "c1")]) == [
        {**state, "running": []}, None, state]
    assert store.get_clients([]) == []
    # what a restarted router reloads: every tenant's clients, each under its own tenant
    assert sorted((t, c) for t, c, _s in store.clients()) == [("acme", "c1"), ("globex", "c1")]
    assert store.delete_client("acme", "c1") is True
    assert store.delete_client("acme", "c1") is False
    assert store.get_client("globex", "c1") is not None


@pytest.mark.parametrize("bad", ["", "a b", "a:b", "*", "x" * 129, "tenant/../other"])
def test_names_cannot_reach_other_namespaces(store: Store, bad: str) -> None:
    with pytest.raises(ValueError, match="not a valid name"):
        store.put_client(bad, "c1", {})
    with pytest.raises(ValueError, match="not a valid name"):
        store.get_client("acme", bad)
    with pytest.raises(ValueError, match="not a valid name"):
        store.put_template("acme", bad, SPEC)


def test_idle_client_state_expires(store: Store) -> None:
    store.ttl_s = 0.2
    store.put_client("acme", "idle", {"workflow": "peer"})
    store.put_client("acme", "busy", {"workflow": "peer"})
    deadline = time.monotonic() + 5
    while store.get_client("acme", "idle") is not None:
        store.put_client("acme", "busy", {"workflow": "peer"})  # a write keeps a client alive
        assert time.monotonic() < deadline, "idle client state never expired"
        time.sleep(0.05)
    assert store.get_client("acme", "busy") is not None
    store.put_template("acme", "peer", SPEC)
    time.sleep(0.3)
    assert store.get_template("acme", "peer") == SPEC  # templates do not expire


def test_the_embedded_store_drops_expired_keys_nobody_reads() -> None:
    """Finished and abandoned clients' records expire unread: the dict keeps at most twice the live
    keys (and SWEEP_MIN_KEYS), as Redis's own expiry keeps its memory to the live keys."""
    now = [0.0]
    store = MemoryStore(ttl_s=10, clock=lambda: now[0])
    store.put_template("acme", "peer", SPEC)  # never expires
    for i in range(20_000):
        store.put_client("acme", f"c{i}", {"finished_at": i})
        if i % 1000 == 999:
            now[0] += 11  # the last thousand records are past their TTL
    assert len(store._data) <= max(SWEEP_MIN_KEYS, 2 * 1001)
    assert store.get_template("acme", "peer") == SPEC
    assert [c for _tenant, c, _record in store.clients()] == []  # all expired: now[0] is past the last
    store.put_client("acme", "live", {"workflow": "peer"})
    assert store.get_client("acme", "live") == {"workflow": "peer"}


def test_prefix_locations_and_replica_loss(store: Store) -> None:
    store.set_location("h1", "replica-a", "gpu")
    store.set_location("h1", "replica-b", "cpu")
    store.set_location("h2", "replica-a", "cpu")
    assert store.locations("h1") == {"replica-a": "gpu", "replica-b": "cpu"}
    store.set_location("h1", "replica-a", "cpu")  # a tier change overwrites
    assert store.locations("h1")["replica-a"] == "cpu"
    store.set_location("h1", "replica-b", None)
    assert store.locations("h1") == {"replica-a": "cpu"}
    with pytest.raises(ValueError, match="tier"):
        store.set_location("h1", "replica-a", "disk")
    store.heartbeat("replica-a", {"load": 3})
    store.heartbeat("replica-b", {"load": 1})
    assert set(store.replicas(max_age_s=60)) == {"replica-a", "replica-b"}
    assert store.replicas(max_age_s=60)["replica-a"]["load"] == 3
    store.drop_replica("replica-a", ["h1", "h2"])  # the router names what the replica held
    assert store.locations("h1") == {} and store.locations("h2") == {}
    assert set(store.replicas(max_age_s=60)) == {"replica-b"}


def test_location_keys_expire_with_the_cache_entries_they_describe(store: Store) -> None:
    """A location whose removal is never reported (a replica lost with its cache) does not stay: the key
    expires `ttl_s` after its last write, while one still written to stays."""
    store.ttl_s = 0.3
    store.set_location("lost", "replica-a", "gpu")
    deadline = time.monotonic() + 5
    while store.locations("lost"):
        store.set_location("kept", "replica-b", "gpu")
        assert time.monotonic() < deadline, "an unrefreshed location key never expired"
        time.sleep(0.05)
    assert store.locations("kept") == {"replica-b": "gpu"}
    assert dict(store.location_items()) == {"kept": {"replica-b": "gpu"}}


def test_everything_a_restarted_router_loads_and_writes_back(store: Store) -> None:
    """The bulk reads of a (re)start and the batched writes of the router: one `apply` of several writes
    in order (a later write of a key wins), templates with an idle TTL, and the marker whose absence
    tells the router that the store lost its data."""
    assert store.get_marker() is None
    store.apply([("put_template", ("acme", "peer", SPEC, None)), ("put_template", ("acme", "gone", SPEC, 0.2)),
                 ("put_client", ("acme", "c1", {"workflow": "peer"})), ("set_location", ("h1", "r1", "gpu")),
                 ("set_location", ("h1", "r1", "cpu")), ("set_marker", ("kvflow-router",)),
                 ("put_client", ("globex", "c1", {"workflow": "x"})), ("delete_client", ("globex", "c1"))])
    assert store.get_marker() == "kvflow-router"
    assert sorted((t, n) for t, n, _s in store.template_items()) == [("acme", "gone"), ("acme", "peer")]
    assert [(t, c) for t, c, _r in store.clients()] == [("acme", "c1")]
    assert dict(store.location_items()) == {"h1": {"r1": "cpu"}}
    time.sleep(0.3)
    assert [(t, n) for t, n, _s in store.template_items()] == [("acme", "peer")]  # idle TTL
    store.delete_template("acme", "peer")
    assert store.get_template("acme", "peer") is None
    with pytest.raises(ValueError, match="not a store write"):
        store.apply([("get_template", ("acme", "peer"))])


def test_open_store(redis_url: str) -> None:
    assert isinstance(open_store(None), MemoryStore)
    assert isinstance(open_store(redis_url), RedisStore)
    with pytest.raises(ValueError, match="redis://"):
        open_store("http://localhost:6379")
    with pytest.raises(ConnectionError, match="cannot reach Redis"):
        open_store("redis://127.0.0.1:1/0")


def test_the_probe_says_whether_the_store_answers(free_port: Callable[[], int], tmp_path: object) -> None:
    """`kvflow_store_up` (and the KVFlowRedisUnreachable alert) reads what the router's probe saw: a
    private redis-server, stopped under the store's feet."""
    memory = BufferedStore(MemoryStore())
    memory.set_marker("kvflow-router")
    assert memory.flush() is None and memory.probe() is None
    server = RedisProcess(free_port(), tmp_path, aof=False).start()  # type: ignore[arg-type]
    try:
        store = BufferedStore(RedisStore(server.url))
        store.set_marker("kvflow-router")
        assert store.flush() is None and store.probe() is None
    finally:
        server.stop()
    assert store.probe() == "down"


@pytest.mark.parametrize("aof", [True, False], ids=["aof", "no-persistence"])
def test_buffered_writes_survive_an_outage(free_port: Callable[[], int], tmp_path: object, aof: bool) -> None:
    """The router's store through a real outage: a private redis-server killed under it and started
    again, with its data (AOF) or empty. Writes queue (latest per key) while it is down; state changes
    pass `check()` for the grace period, then get StoreUnavailableError; once it answers, the queue
    drains, and the probe says why the router must write its state back."""
    now = [0.0]
    server = RedisProcess(free_port(), tmp_path, aof=aof).start()  # type: ignore[arg-type]
    try:
        store = BufferedStore(RedisStore(server.url), grace_s=10, max_pending=3, clock=lambda: now[0])
        store.set_marker("kvflow-router")
        store.put_client("acme", "c1", {"n": 1})
        assert store.flush() is None and store.probe() is None and store.up
        assert store.get_client("acme", "c1") == {"n": 1}
        time.sleep(1.2)  # an AOF fsyncs every second
        server.kill()
        store.put_client("acme", "c2", {"n": 1})
        assert store.flush() is not None and not store.up and store.pending == 1  # kept, not lost
        store.put_client("acme", "c2", {"n": 2})  # the latest write of a key replaces the queued one
        store.put_client("acme", "c3", {"n": 1})
        assert store.pending == 2
        now[0] = 9.0
        store.check()  # within the grace period: calls go on
        assert store.probed(store.probe()) is None and not store.up
        now[0] = 11.0
        with pytest.raises(StoreUnavailableError, match="unreachable for more than 10 s"):
            store.check()
        server.start()
        reason = store.probed(store.probe())
        assert reason == ("reconnect" if aof else "data_loss") and store.up
        assert store.reconciles == {reason: 1}
        assert store.flush() is None and store.pending == 0
        assert store.get_client("acme", "c2") == {"n": 2} and store.get_client("acme", "c3") == {"n": 1}
        assert (store.get_client("acme", "c1") is not None) == aof  # the router's reconcile restores the rest
        store.check()
        for i in range(3):  # a bounded queue: past `max_pending` waiting writes, state changes wait too
            store.sent(store.take(), ConnectionError("down"))
            store.put_client("acme", f"q{i}", {})
        with pytest.raises(StoreUnavailableError, match="3 state writes wait"):
            store.check()
    finally:
        server.stop()
