"""The router actor and the ingresses' routers on a real local Ray cluster over a real redis-server:
the actor is found by name, the ingresses route without it (also while it is killed), and a client
goes on from its record in Redis at another ingress."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("redis")

from kvflow_ray.router.settings import RouterSettings  # noqa: E402
from kvflow_ray.serve.ingress_router import IngressRouter  # noqa: E402
from kvflow_ray.serve.router_actor import get_router  # noqa: E402

PEER = {"name": "peer", "entry": "planner", "agents": {
    "planner": {"prompt": "You are the Planner.", "after": ["reviewer"]},
    "executor": {"after": ["planner"]},
    "expresser": {"after": ["executor"]},
    "reviewer": {"after": ["expresser"]},
}}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ingresses_route_without_the_router_actor_and_it_comes_back(ray_cluster: None, redis_url: str) -> None:
    """Two ingress routers (as two ingress replicas run them) and the router actor, over Redis: calls are
    routed in the ingress, hints reach the replicas through the actor, an ingress routes on while the
    actor is killed, and a client whose ingress is gone goes on from its record in Redis."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = RouterSettings(store_url=redis_url)
    router = get_router(settings)
    assert get_router(create=False)._actor_id == router._actor_id  # one router, found by name
    ray.get([router.add_replica.remote("r1"), router.add_replica.remote("r2")])
    # a replica's report carries its load (replica.load_report): the fleet's device KV is what they report
    ray.get(router.report.remote("r1", None, {"capacity": 1000, "usage": 0.5, "waiting": 2}))
    assert ray.get(router.stats.remote())["device_kv_tokens"] == 1000
    asyncio.run(_two_ingresses(router, settings))
    ray.kill(router, no_restart=True)


async def _two_ingresses(router: object, settings: RouterSettings) -> None:
    a, b = IngressRouter(settings, "ingress-a"), IngressRouter(settings, "ingress-b")
    await a.ready()
    await a.put_template("acme", PEER)
    route = a.start_call("acme", "c1", "planner", workflow="peer")
    assert route.workflow_key == "acme/c1" and route.replica in ("r1", "r2")
    a.end_call("acme", "c1", "planner", route.replica)
    await a.sync_now()  # the hints go up with the sync; the replica long-polls them
    hints = (await router.exchange.remote(route.replica, 5.0))["hints"]
    assert hints["steps"]["acme/c1"]["executor"] == 1  # next
    route = a.start_call("acme", "c1", "executor")
    finished = a.start_call("acme", "c9", "planner", workflow="peer")  # a client a finishes
    a.end_call("acme", "c9", "planner", finished.replica)
    a.finish_client("acme", "c9")
    await _until(lambda: a.store.pending == 0, "ingress a never flushed its writes")

    before = await router.ping.remote()
    ray.kill(router, no_restart=False)  # the actor dies; Ray restarts it
    a.end_call("acme", "c1", "executor", route.replica)  # routing goes on meanwhile
    assert not a.start_call("acme", "c1", "expresser").deviation

    async def back() -> bool:
        try:
            return await asyncio.wait_for(router.ping.remote(), 5) != before
        except (ray.exceptions.RayActorError, TimeoutError):
            return False
    deadline = time.monotonic() + 60
    while not await back():
        assert time.monotonic() < deadline, "the router did not come back"
        await asyncio.sleep(0.2)
    # the restarted actor: replicas from their heartbeats, templates from Redis; the ingress is new to it
    assert set(await router.replicas.remote()) == {"r1", "r2"}
    assert await a.sync_now()
    stats = await router.stats.remote()
    assert stats["start_calls"] == 4 and stats["calls_in_flight"] == 1 and stats["live_clients"] == 1  # c9 finished

    # ingress a is gone: b recalls c1 from Redis and goes on where a left it
    await _until(lambda: a.store.pending == 0, "ingress a never flushed its writes")
    await b.ready()
    await b.recall("acme", "c1")
    assert b.client_workflow("acme", "c1") == "peer"
    await b.template("acme", "peer")
    b.end_call("acme", "c1", "expresser", None)
    assert not b.start_call("acme", "c1", "reviewer").deviation
    # c9's finish sent again through b, which never held it (the first answer lost with a): Redis keeps
    # c9's record as finished, so it is answered as the first was, and c9 is not live here
    await b.recall("acme", "c9")
    b.finish_client("acme", "c9")
    with pytest.raises(ValueError, match="unknown client"):
        b.client_workflow("acme", "c9")
    # errors keep their type across Ray (a bad request is a ValueError)
    with pytest.raises(ValueError, match="unknown workflow 'nope'"):
        await b.template("acme", "nope")
    with pytest.raises(ValueError, match="unknown client"):
        b.finish_client("globex", "c1")
    text = (await b.metrics_text()).decode()
    assert 'kvflow_workflows_active{ingress="ingress-b",tenant="acme"} 1.0' in text
    assert "kvflow_router_replicas 2.0" in text and 'kvflow_store_up{backend="redis"} 1.0' in text
    await b.remove_replica("r2")  # what the ingress does when a call to it fails
    assert set(b.core.loads) == {"r1"}
    text = (await router.metrics_text.remote()).decode()
    assert "kvflow_router_replicas 1.0" in text and "kvflow_router_replicas_lost_total 1.0" in text


async def _until(ready: Callable[[], bool], message: str) -> None:
    deadline = time.monotonic() + 10
    while not ready():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_a_prompt_one_ingress_places_ends_the_others_held_sync(ray_cluster: None) -> None:
    """The actor holds an ingress's sync until news comes for it: a prompt another ingress just sent
    to a replica ends it (so the ingresses follow each other's placements within a round trip), and so
    does the ingress itself when it has something to send or must not wait."""
    router = _fresh_router()
    ray.get([router.add_replica.remote("r1"), router.add_replica.remote("r2")])
    try:
        asyncio.run(_held_syncs(router))
    finally:
        ray.kill(router, no_restart=True)


def _fresh_router() -> object:
    deadline = time.monotonic() + 30
    while True:  # the previous test's actor is gone for good: its name frees a moment later
        try:
            get_router(create=False)
        except ValueError:
            break
        assert time.monotonic() < deadline, "the previous router actor's name was never freed"
        time.sleep(0.2)
    return get_router(RouterSettings())


def test_what_a_replica_sent_before_it_died_does_not_bring_it_back(ray_cluster: None) -> None:
    """An ingress saw r1 die under a call; a heartbeat, events or a hint poll r1 sent just before
    reach the actor after that: r1 stays forgotten (a replacement replica has a new name)."""
    router = _fresh_router()
    try:
        ray.get([router.add_replica.remote("r1"), router.add_replica.remote("r2")])
        ray.get(router.remove_replica.remote("r1"))
        ray.get([router.report.remote("r1"), router.cache_events.remote("r1", []),
                 router.exchange.remote("r1", 0.01, ([], [("acme/c1", "planner", 1)], 1), (None, None)),
                 router.report.remote("r3")])
        assert sorted(ray.get(router.replicas.remote())) == ["r2", "r3"]
    finally:
        ray.kill(router, no_restart=True)


def test_a_replicas_exchange_brings_its_feed_and_report_and_takes_its_hints(ray_cluster: None) -> None:
    """One `exchange` does what a replica's event batch, report and hint poll did apart, in that
    order: the batch's events place the prefix there, the report's load is read, a gap in the feed
    asks for a snapshot in the same answer, and the poll is held for hints until its timeout."""
    router = _fresh_router()
    try:
        ray.get(router.add_replica.remote("r1"))
        load = {"capacity": 1000, "usage": 0.5, "waiting": 0}
        stored = [("stored", "gpu", "h1", 400, (11, 12))]
        started = time.monotonic()
        assert ray.get(router.exchange.remote("r1", 0.3, (stored, [], 1), (None, load))) == {
            "hints": None, "snapshot": False}
        assert time.monotonic() - started >= 0.3  # held: no hints for r1
        stats = ray.get(router.stats.remote())
        assert stats["device_kv_tokens"] == 1000 and stats["locations"] == 1
        assert stats["actor_calls"]["exchange"] == 1 and "report" not in stats["actor_calls"]
        removed = [("removed", "gpu", "h1", 400, (11, 12))]
        assert ray.get(router.exchange.remote("r1", 0.01, (removed, [], 3), (None, load)))["snapshot"]  # 2 is lost
        assert ray.get(router.stats.remote())["locations"] == 0
        assert not ray.get(router.exchange.remote("r1", 0.01))["snapshot"]  # no report: not asked
    finally:
        ray.kill(router, no_restart=True)


async def _held_syncs(router: object) -> None:
    settings = RouterSettings()
    a, b = IngressRouter(settings, "ingress-a"), IngressRouter(settings, "ingress-b")
    await a.put_template("acme", PEER)
    assert await a.sync_now() and await b.sync_now()  # both known to the actor, the holdings sent

    async def held(count: int) -> None:
        await _until_async(lambda: router.stats.remote(), lambda s: s["held_syncs"].get("held", 0) == count,
                           "the actor never held the sync")

    waiting = asyncio.ensure_future(b.sync_now(wait_s=5.0))
    await held(1)
    route = a.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="hp", prefix_tokens=512)
    assert await a.sync_now()  # its news goes up: the actor answers b now, not in 5 s
    assert await waiting
    assert b.core.holdings.holders("hp") == {route.replica: "gpu"}
    assert (await router.stats.remote())["held_syncs"] == {"held": 1, "news": 1}

    waiting = asyncio.ensure_future(b.sync_now(wait_s=5.0))
    await held(2)
    assert await b.sync_now()  # one that must not wait ends the held one first
    assert await waiting
    assert (await router.stats.remote())["held_syncs"] == {"held": 2, "news": 2}


async def _until_async(ask: Callable[[], object], ready: Callable[[dict], bool], message: str) -> None:
    deadline = time.monotonic() + 10
    while not ready(await ask()):
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.02)
