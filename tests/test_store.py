"""The router's state store: one contract, run against the embedded store and a real redis-server."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from kvflow_ray.serve.store import MemoryStore, RedisStore, Store, open_store

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
    store.drop_replica("replica-a")
    assert store.locations("h1") == {} and store.locations("h2") == {}
    assert set(store.replicas(max_age_s=60)) == {"replica-b"}


def test_open_store(redis_url: str) -> None:
    assert isinstance(open_store(None), MemoryStore)
    assert isinstance(open_store(redis_url), RedisStore)
    with pytest.raises(ValueError, match="redis://"):
        open_store("http://localhost:6379")
    with pytest.raises(ConnectionError, match="cannot reach Redis"):
        open_store("redis://127.0.0.1:1/0")


def test_ping_says_whether_the_store_answers(free_port: Callable[[], int], tmp_path: object) -> None:
    """`kvflow_store_up` (and the KVFlowRedisUnreachable alert) reads this: a private redis-server,
    stopped under the store's feet."""
    import redis

    assert MemoryStore().ping()
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=port).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        store = RedisStore(f"redis://127.0.0.1:{port}/0")
        assert store.ping()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert not store.ping()
