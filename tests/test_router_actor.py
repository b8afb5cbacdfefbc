"""The WorkflowRouterActor on a real local Ray cluster over a real redis-server: it is found by
name, keeps routing, and comes back from Redis with every client's state after it is killed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("redis")

from kvflow_ray.router.settings import RouterSettings  # noqa: E402
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
def test_router_actor_survives_a_kill(ray_cluster: None, redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    router = get_router(RouterSettings(store_url=redis_url))
    assert get_router(create=False)._actor_id == router._actor_id  # one router, found by name
    ray.get([router.add_replica.remote("r1"), router.add_replica.remote("r2")])
    # a replica's report carries its load (replica.load_report): the fleet's device KV is what they report
    ray.get(router.report.remote("r1", None, {"capacity": 1000, "usage": 0.5, "waiting": 2}))
    assert ray.get(router.stats.remote())["device_kv_tokens"] == 1000
    ray.get(router.put_template.remote("acme", PEER))
    route = ray.get(router.start_call.remote("acme", "c1", "planner", workflow="peer"))
    assert route["workflow_key"] == "acme/c1" and route["replica"] in ("r1", "r2")
    ray.get(router.end_call.remote("acme", "c1", "planner", route["replica"]))
    route = ray.get(router.start_call.remote("acme", "c1", "executor"))
    # the store is written behind the calls, within milliseconds (FLUSH_PERIOD_S): what it has survives
    deadline = time.monotonic() + 10
    while ray.get(router.stats.remote())["pending_writes"]:
        assert time.monotonic() < deadline, "the router never flushed its writes"
        time.sleep(0.02)

    before = ray.get(router.ping.remote())
    ray.kill(router, no_restart=False)  # the actor dies; Ray restarts it
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(router.ping.remote(), timeout=5) != before:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # dead, or restarting
        assert time.monotonic() < deadline, "the router did not come back"
        time.sleep(0.2)
    # the restarted actor: replicas from their heartbeats, templates and client state from Redis
    assert set(ray.get(router.replicas.remote())) == {"r1", "r2"}
    ray.get(router.end_call.remote("acme", "c1", "executor", route["replica"]))
    hints = ray.get(router.pull_hints.remote(route["replica"], 5.0))
    assert hints["steps"]["acme/c1"] == {"planner": 3, "executor": 4, "expresser": 1, "reviewer": 2}
    route = ray.get(router.start_call.remote("acme", "c1", "expresser"))
    assert not route["deviation"]
    # errors keep their type across Ray (a bad request is a ValueError)
    with pytest.raises(ValueError, match="unknown workflow 'nope'"):
        ray.get(router.start_call.remote("acme", "c2", "planner", workflow="nope"))
    with pytest.raises(ValueError, match="unknown client"):
        ray.get(router.finish_client.remote("globex", "c1"))
    text = ray.get(router.metrics_text.remote()).decode()
    assert 'kvflow_workflows_active{tenant="acme"} 1.0' in text
    assert "kvflow_router_replicas 2.0" in text and 'kvflow_store_up{backend="redis"} 1.0' in text
    ray.get(router.remove_replica.remote("r2"))  # what the ingress does when a call to it fails
    text = ray.get(router.metrics_text.remote()).decode()
    assert "kvflow_router_replicas 1.0" in text and "kvflow_router_replicas_lost_total 1.0" in text
    ray.kill(router, no_restart=True)
