"""The workflow router's logic over a real store (embedded and Redis): tenancy, affinity routing from
cache events, advisory hints with deviations counted, restart from the store, replica loss."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis_proc import RedisProcess

from kvflow_ray.core.graph import SpecError, UnknownAgentError
from kvflow_ray.core.policies import StepBook
from kvflow_ray.core.routing import ROUTING
from kvflow_ray.engines.base import CacheEvent, Hints
from kvflow_ray.router.core import NoReplicaError, RouterCore, UnknownClientError, UnknownWorkflowError
from kvflow_ray.router.store import BufferedStore, MemoryStore, RedisStore, Store

PEER = {"name": "peer", "entry": "planner", "agents": {
    "planner": {"prompt": "You are the Planner.", "after": ["reviewer"]},
    "executor": {"after": ["planner"]},
    "expresser": {"after": ["executor"]},
    "reviewer": {"after": ["expresser"]},
}}
OTHER_PEER = {"name": "peer", "agents": {"solo": {}}}  # another tenant's template with the same name


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    pytest.importorskip("redis")
    url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushdb()
    yield RedisStore(url)


@pytest.fixture
def router(store: Store) -> RouterCore:
    # prefix affinity: these tests steer calls through the router's load counts, its input
    core = RouterCore(store, ROUTING.create("prefix-affinity"))
    for name in ("r1", "r2"):
        core.add_replica(name)
    core.put_template("acme", PEER)
    core.put_template("globex", OTHER_PEER)
    return core


def test_tenants_are_isolated(router: RouterCore) -> None:
    route = router.start_call("acme", "c1", "planner", workflow="peer")
    assert route.workflow_key == "acme/c1" and route.fixed_prompt == "You are the Planner."
    # globex's `peer` is a different template; its client c1 is a different instance
    with pytest.raises(UnknownAgentError):
        router.start_call("globex", "c1", "planner", workflow="peer")
    assert router.start_call("globex", "c1", "solo", workflow="peer").workflow_key == "globex/c1"
    assert router.end_call("initech", "c1", "planner") == []  # no such client here: nothing to end
    with pytest.raises(UnknownClientError):
        router.finish_client("initech", "c1")
    with pytest.raises(UnknownWorkflowError):
        router.template("initech", "peer")
    router.finish_client("globex", "c1")  # retires once its call (solo) ends
    router.end_call("globex", "c1", "solo")
    # acme's c1 is untouched by globex finishing its own c1
    router.end_call("acme", "c1", "planner")
    assert router.active_clients() == {"acme": 1}


def test_affinity_follows_cache_events(router: RouterCore) -> None:
    router.cache_events("r2", [CacheEvent("stored", "gpu", "h-planner", 20)])
    route = router.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="h-planner", prefix_tokens=20)
    assert (route.replica, route.outcome) == ("r2", "affinity")
    # written back, then dropped from the device: the host copy still counts
    router.cache_events("r2", [CacheEvent("stored", "cpu", "h-planner", 20),
                               CacheEvent("removed", "gpu", "h-planner", 20)])
    assert router.store.locations("h-planner") == {"r2": "cpu"}
    router.cache_events("r2", [CacheEvent("removed", "cpu", "h-planner", 20)])
    assert router.store.locations("h-planner") == {}
    assert router.decisions["affinity"] == 1


def test_a_cache_event_crosses_the_feed_as_a_tuple_and_back_unchanged() -> None:
    event = CacheEvent("stored", "cpu", "h-planner", 48, (11, 22, 33))
    sent = event.as_tuple()
    assert sent == dataclasses.astuple(event) and CacheEvent(*sent) == event
    assert sent[-1] is event.blocks  # shallow: the block hashes are not copied per event


def test_hints_carry_steps_and_deviations_are_served_and_counted(router: RouterCore) -> None:
    route = router.start_call("acme", "c1", "planner", workflow="peer")
    assert not route.deviation
    # the replica it runs on hears it (its next agent goes there too); r2 holds nothing of it: not told
    replicas = [replica for replica, _h in route.hints]
    assert replicas == [route.replica] and router.take_hints("r2") is None
    steps = route.hints[0][1].steps["acme/c1"]
    assert steps == {"planner": 0, "executor": 1, "expresser": 2, "reviewer": 3}
    router.end_call("acme", "c1", "planner", route.replica)
    # the graph says executor; the client calls reviewer: served, counted, and the state follows it
    route = router.start_call("acme", "c1", "reviewer")
    assert route.deviation and router.deviations == 1
    steps = route.hints[0][1].steps["acme/c1"]
    assert steps["reviewer"] == 0 and steps["planner"] == 1
    hints = router.end_call("acme", "c1", "reviewer", route.replica)
    assert hints[0][1].steps["acme/c1"]["planner"] == 1
    with pytest.raises(UnknownAgentError, match="unknown agent 'ghost'"):
        router.start_call("acme", "c1", "ghost")


def _steps(hints: list[tuple[str, Hints]], key: str) -> dict[str, float]:
    """The instance's steps-to-execution, as the replicas concerned are told them (all the same)."""
    told = [h.steps[key] for _replica, h in hints]
    return {agent: min(steps[agent] for steps in told) for agent in told[0]}


def test_a_restarted_router_resumes_from_the_store(router: RouterCore) -> None:
    route = router.start_call("acme", "c1", "planner", workflow="peer")
    router.end_call("acme", "c1", "planner", route.replica)
    router.start_call("acme", "c1", "executor")
    before = _steps(router.start_call("acme", "c2", "planner", workflow="peer").hints, "acme/c2")
    router.start_call("acme", "c3", "planner", workflow="peer")
    router.end_call("acme", "c3", "planner")
    router.finish_client("acme", "c3")
    restarted = RouterCore(router.store)  # a new actor: nothing in memory but the store
    restarted.add_replica("r1")
    hints = restarted.end_call("acme", "c1", "executor")
    steps = hints[0][1].steps["acme/c1"]
    assert steps == {"planner": 3, "executor": 4, "expresser": 1, "reviewer": 2}
    assert _steps(restarted.start_call("acme", "c2", "planner").hints, "acme/c2") == before
    assert restarted.active_clients() == {"acme": 2}  # c3's record says it finished: not live
    assert restarted.finish_client("acme", "c3") == []  # a finish sent again is answered as the first was
    with pytest.raises(UnknownClientError):
        restarted.finish_client("acme", "c4")


def test_replica_loss_moves_calls_elsewhere(router: RouterCore) -> None:
    router.cache_events("r1", [CacheEvent("stored", "gpu", "h-planner", 20)])
    assert router.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="h-planner").replica == "r1"
    router.remove_replica("r1")
    route = router.start_call("acme", "c2", "planner", workflow="peer", prefix_hash="h-planner")
    assert (route.replica, route.outcome) == ("r2", "cold")
    router.remove_replica("r2")
    with pytest.raises(NoReplicaError, match="no live engine replica"):
        router.start_call("acme", "c3", "planner", workflow="peer")


def test_bad_input(router: RouterCore) -> None:
    with pytest.raises(UnknownClientError, match="must name the workflow"):
        router.start_call("acme", "new", "planner")
    with pytest.raises(UnknownWorkflowError) as info:
        router.start_call("acme", "new", "planner", workflow="nope")
    assert str(info.value) == "unknown workflow 'nope' (register it with POST /v1/workflows)"
    with pytest.raises(ValueError, match="not a valid name"):
        router.start_call("acme", "bad id", "planner", workflow="peer")
    with pytest.raises(SpecError, match="agents"):
        router.put_template("acme", {"name": "empty", "agents": {}})


def test_hints_wait_in_an_outbox_per_replica_with_prompts_sent_once(router: RouterCore) -> None:
    assert router.start_call("acme", "c1", "planner", workflow="peer").replica == "r1"
    batch = router.take_hints("r1")
    assert batch is not None and batch.steps["acme/c1"]["planner"] == 0
    assert batch.prompts == {"acme/c1": {"planner": "You are the Planner."}}  # only agents with a prompt
    assert router.take_hints("r1") is None  # taken
    assert router.take_hints("r2") is None  # r2 holds nothing of it, and nothing of it goes there yet
    router.end_call("acme", "c1", "planner", "r1")
    router.loads["r1"] = 10  # r1 busy: the executor goes to r2, which hears of the instance now
    assert router.start_call("acme", "c1", "executor").replica == "r2"
    router.loads["r1"] = 0
    batch = router.take_hints("r1")
    assert batch is not None and batch.steps["acme/c1"]["executor"] == 0 and not batch.prompts  # told already
    batch = router.take_hints("r2")
    assert batch is not None and batch.steps["acme/c1"]["executor"] == 0 and batch.prompts  # its first time
    router.end_call("acme", "c1", "executor", "r2")
    router.finish_client("acme", "c1")
    for replica in ("r1", "r2"):
        batch = router.take_hints(replica)
        assert batch is not None and batch.retire == ["acme/c1"] and "acme/c1" not in batch.steps
    router.remove_replica("r1")
    assert router.take_hints("r1") is None and router.pending_hints() == []


def test_a_cold_agent_goes_to_its_workflows_home_replica(router: RouterCore) -> None:
    first = router.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="p", prefix_tokens=100)
    router.end_call("acme", "c1", "planner", first.replica)
    other = "r2" if first.replica == "r1" else "r1"
    router.loads[first.replica] += 1  # slightly busier, within the balance threshold: still home
    route = router.start_call("acme", "c1", "executor", prefix_hash="e", prefix_tokens=100)
    assert (route.replica, route.outcome) == (first.replica, "cold")
    assert router.client_workflow("acme", "c1") == "peer"
    with pytest.raises(UnknownClientError):
        router.client_workflow("beta", "c1")
    router.loads[first.replica] += 10  # far busier than the other replica: the cheapest one instead
    router.end_call("acme", "c1", "executor", route.replica)
    assert router.start_call("acme", "c1", "expresser", prefix_hash="x", prefix_tokens=100).replica == other


def test_prefetch_is_hinted_only_where_the_next_agent_will_run(router: RouterCore) -> None:
    """The replicas a workflow ran on hear the same steps (for eviction); those its next agent will not
    be routed to hear that it runs elsewhere, so only the one it will be routed to loads its prompt
    ahead. A replica the workflow never touched hears nothing of it."""
    router.add_replica("r3")
    first = router.start_call("acme", "c1", "planner", workflow="peer")  # on r1 (equal loads: by name)
    assert first.replica == "r1"
    router.end_call("acme", "c1", "planner", "r1")
    router.cache_events("r2", [CacheEvent("stored", "cpu", "h-executor", 20)])  # r2 has it on the host
    router.cache_events("r1", [CacheEvent("stored", "cpu", "h-executor", 20)])  # so has r1 ...
    router.loads["r1"] = 3  # ... but r1 is busy: the executor goes to r2
    route = router.start_call("acme", "c1", "executor", prefix_hash="h-executor", prefix_tokens=20)
    assert route.replica == "r2"
    router.end_call("acme", "c1", "executor", "r2")
    hints = dict(router.start_call("acme", "c1", "planner").hints)  # the executor is next again (E = 1)
    assert set(hints) == {"r1", "r2"}  # r3 holds nothing of it
    assert hints["r2"].steps["acme/c1"]["executor"] == hints["r1"].steps["acme/c1"]["executor"] == 1
    assert "executor" in hints["r1"].elsewhere["acme/c1"] and "executor" not in hints["r2"].elsewhere["acme/c1"]
    assert hints["r1"].steps["acme/c1"]["planner"] == hints["r2"].steps["acme/c1"]["planner"] == 0
    batch = router.take_hints("r1")  # what the replica is sent
    assert batch is not None and "executor" in batch.elsewhere["acme/c1"]
    book = StepBook()
    book.apply(batch.steps, {}, batch.retire, batch.salts, batch.elsewhere)
    assert book.steps(("acme/c1", "executor")) == 1 and ("acme/c1", "executor") not in book.near
    assert router.take_hints("r3") is None
    router.end_call("acme", "c1", "planner", "r2")
    router.take_hints("r1"), router.take_hints("r2")
    router.finish_client("acme", "c1")  # retired where it was heard of
    assert all(router.take_hints(r).retire == ["acme/c1"] for r in ("r1", "r2"))  # type: ignore[union-attr]
    assert router.take_hints("r3") is None


# ---------------------------------------------------------------------------------------------- tenant limits
def _limited(store: Store, **limits: float) -> RouterCore:
    from kvflow_ray.router.limits import TenantLimits

    core = RouterCore(store, limits=TenantLimits(**limits))
    core.add_replica("r1")
    return core


def test_templates_per_tenant_are_bounded_and_an_unchanged_spec_writes_nothing(store: Store) -> None:
    from kvflow_ray.router.core import TenantLimitError

    core = _limited(store, max_templates=2, template_writes_per_s=100)
    core.put_template("acme", {"name": "a", "agents": {"x": {}}})
    core.put_template("acme", {"name": "b", "agents": {"x": {}}})
    with pytest.raises(TenantLimitError, match=r"limits\.max_templates"):
        core.put_template("acme", {"name": "c", "agents": {"x": {}}})
    assert store.get_template("acme", "c") is None  # refused: nothing written
    core.put_template("globex", {"name": "c", "agents": {"x": {}}})  # another tenant's quota is its own

    slow = _limited(store, template_writes_per_s=2, template_write_burst=2)
    slow.put_template("initech", {"name": "a", "agents": {"x": {}}})
    slow.put_template("initech", {"name": "b", "agents": {"x": {}}})
    # the bucket (2/s, burst 2) is spent; re-sending a registered spec as it is still works, without a write
    for _ in range(5):
        assert slow.put_template("initech", {"name": "a", "agents": {"x": {}}}).name == "a"
    with pytest.raises(TenantLimitError, match=r"limits\.template_writes_per_s"):
        slow.put_template("initech", {"name": "a", "agents": {"x": {"prompt": "new"}}})
    assert slow.template("initech", "a").agents["x"].prompt is None  # the refused change wrote nothing


def test_spec_size_limits_apply_to_specs_from_the_network(store: Store) -> None:
    from kvflow_ray.core.graph import SpecLimitError

    core = _limited(store, max_agents_per_spec=3, max_prompt_bytes=10)
    with pytest.raises(SpecLimitError, match="agents"):
        core.put_template("acme", {"name": "big", "agents": {f"a{i}": {} for i in range(4)}})
    with pytest.raises(SpecLimitError):
        core.put_template("acme", {"name": "long", "agents": {"a": {"prompt": "x" * 11}}})
    with pytest.raises(SpecError, match="prompt_file"):
        core.put_template("acme", {"name": "file", "agents": {"a": {"prompt_file": "/etc/hostname"}}})
    assert store.templates("acme") == []


def test_live_clients_per_tenant_are_bounded_and_a_refused_call_changes_nothing(store: Store) -> None:
    from kvflow_ray.router.core import TenantLimitError

    core = _limited(store, max_live_clients=2)
    core.put_template("acme", PEER)
    core.start_call("acme", "c1", "planner", workflow="peer")
    core.start_call("acme", "c2", "planner", workflow="peer")
    with pytest.raises(TenantLimitError, match=r"limits\.max_live_clients"):
        core.start_call("acme", "c3", "planner", workflow="peer")
    assert store.get_client("acme", "c3") is None and core.loads["r1"] == 2
    core.start_call("acme", "c1", "executor")  # a live client still runs
    core.end_call("acme", "c2", "planner", "r1")
    core.finish_client("acme", "c2")  # finishing one makes room
    core.start_call("acme", "c3", "planner", workflow="peer")
    assert core.active_clients() == {"acme": 2}


def test_hints_carry_the_cache_salt_of_each_instance(store: Store) -> None:
    core = RouterCore(store)
    core.add_replica("r1")
    core.put_template("acme", PEER)
    route = core.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="h", prefix_tokens=4,
                            cache_salt="tenant:acme")
    assert all(h.salts == {"acme/c1": "tenant:acme"} for _replica, h in route.hints)
    batch = core.take_hints("r1")
    assert batch is not None and batch.salts == {"acme/c1": "tenant:acme"} and "acme/c1" in batch.prompts


# ---------------------------------------------------------------------------------------------- lifecycles
def test_a_client_finished_during_its_call_returns_the_answer_and_retires_after(router: RouterCore) -> None:
    router.start_call("acme", "c1", "planner", workflow="peer")
    router.take_hints("r1")
    assert router.finish_client("acme", "c1") == []  # the call is still generating: nothing retired yet
    assert router.take_hints("r1") is None
    with pytest.raises(UnknownClientError, match="finished"):
        router.start_call("acme", "c1", "executor")  # no new call of a finished client
    with pytest.raises(UnknownClientError, match="finished"):
        router.client_workflow("acme", "c1")  # nor its workflow, which would start a new instance of it
    assert router.finish_client("acme", "c1") == []  # finishing twice is harmless
    hints = router.end_call("acme", "c1", "planner", "r1")  # the call ends normally, with its answer
    assert {h.retire[0] for _replica, h in hints} == {"acme/c1"}
    batch = router.take_hints("r1")
    assert batch is not None and batch.retire == ["acme/c1"] and "acme/c1" not in batch.steps
    assert sum(router.loads.values()) == 0 and router.active_clients() == {}
    # a finish sent again once it retired (its first answer was lost) is answered as the first was;
    # a client never started is unknown, and an id started again is a new instance
    assert router.finish_client("acme", "c1") == [] and router.take_hints("r1") is None
    with pytest.raises(UnknownClientError):
        router.finish_client("acme", "c2")
    router.start_call("acme", "c1", "planner", workflow="peer")
    router.end_call("acme", "c1", "planner", "r1")
    assert {h.retire[0] for _replica, h in router.finish_client("acme", "c1")} == {"acme/c1"}


def test_an_expired_client_is_forgotten_by_the_router_and_retired_where_it_was_heard_of(
        store: Store, request: pytest.FixtureRequest) -> None:
    if isinstance(store, RedisStore):
        store = RedisStore(request.getfixturevalue("redis_url"), ttl_s=0.3)
    else:
        store = MemoryStore(ttl_s=0.3)
    core = RouterCore(store)
    for name in ("r1", "r2"):
        core.add_replica(name)
    core.put_template("acme", PEER)
    core.start_call("acme", "idle", "planner", workflow="peer")
    core.end_call("acme", "idle", "planner", "r1")
    for name in ("r1", "r2"):
        core.take_hints(name)
    assert core.expire() == 0
    import time

    time.sleep(0.4)
    assert core.expire() == 1 and core.active_clients() == {}
    assert not core.outbox.told("acme/idle") and core.clients.get("acme", "idle") is None
    batch = core.take_hints("r1")
    assert batch is not None and batch.retire == ["acme/idle"]
    assert core.take_hints("r2") is None  # it never ran there, nor was headed there
    # a late end_call of an expired client is no error
    assert core.end_call("acme", "idle", "executor", "r1") == []


def test_a_call_retried_after_its_replica_died_is_one_call(router: RouterCore) -> None:
    first = router.start_call("acme", "c1", "planner", workflow="peer")
    router.remove_replica(first.replica)  # died under the call
    again = router.start_call("acme", "c1", "planner", retry_from=first.replica)
    assert again.replica != first.replica and router.loads[again.replica] == 1
    router.end_call("acme", "c1", "planner", again.replica)
    assert sum(router.loads.values()) == 0
    assert router.finish_client("acme", "c1") != []  # no call left in flight: retired at once


def test_a_call_retried_from_a_live_replica_moves_there_from_it(router: RouterCore) -> None:
    """The replica a call was counted on is alive (Serve ran the call on another one, which died):
    the retry moves the call's count, so no load or entry is left behind on the first."""
    first = router.start_call("acme", "c1", "planner", workflow="peer")
    other = router.start_call("acme", "c2", "planner", workflow="peer")  # a second call in flight
    loads = dict(router.loads)
    again = router.start_call("acme", "c1", "planner", retry_from=first.replica)
    assert sum(router.loads.values()) == sum(loads.values())  # moved, not added
    if again.replica != first.replica:
        assert router.loads[first.replica] == loads[first.replica] - 1
    router.end_call("acme", "c1", "planner", again.replica)
    router.end_call("acme", "c2", "planner", other.replica)
    assert sum(router.loads.values()) == 0
    assert router.clients.take_routed(("acme", "c1"), "planner", None) is None  # no entry left behind
    assert router.finish_client("acme", "c1") != []


def test_a_live_client_keeps_the_template_version_it_started_with(store: Store) -> None:
    core = RouterCore(store)
    core.add_replica("r1")
    core.put_template("acme", PEER)
    core.start_call("acme", "old", "planner", workflow="peer")
    core.end_call("acme", "old", "planner", "r1")
    # the template changes shape while `old` is mid-workflow: no executor any more
    reshaped = {"name": "peer", "entry": "planner", "agents": {
        "planner": {"prompt": "You are the new Planner.", "after": ["reviewer"]},
        "reviewer": {"after": ["planner"]}}}
    core.put_template("acme", reshaped)
    route = core.start_call("acme", "old", "executor")  # its own version still has the executor
    assert not route.deviation and route.fixed_prompt is None
    core.end_call("acme", "old", "executor", "r1")
    # new clients get the new version
    with pytest.raises(UnknownAgentError):
        core.start_call("acme", "new", "executor", workflow="peer")
    assert core.start_call("acme", "new", "planner", workflow="peer").fixed_prompt == "You are the new Planner."
    # a restarted router (same store) still runs `old` on its version, and counts one template
    restarted = RouterCore(store)
    restarted.add_replica("r1")
    assert not restarted.start_call("acme", "old", "expresser").deviation
    assert set(restarted.templates.current["acme"]) == {"peer"}
    restarted.end_call("acme", "old", "expresser", "r1")
    assert restarted.finish_client("acme", "old") != []


def test_templates_unused_for_their_idle_ttl_are_dropped(store: Store) -> None:
    """Templates do not pile up: one unused for the template TTL leaves memory and the store; one a live
    client keeps calling stays, and so does the client's."""
    store.ttl_s = 0.2
    core = RouterCore(store, template_ttl_s=0.4)
    core.add_replica("r1")
    core.put_template("acme", PEER)
    core.put_template("acme", {"name": "once", "agents": {"solo": {"prompt": "x" * 6000}}})
    core.start_call("acme", "busy", "planner", workflow="peer")
    core.put_template("acme", {**PEER, "agents": {**PEER["agents"], "extra": {"after": ["planner"]}}})
    assert len(core.templates.old_versions) == 1  # the version `busy` started on, kept for the state TTL
    deadline = time.monotonic() + 5
    while "once" in core.templates.current["acme"]:
        route = core.start_call("acme", "busy", "planner", workflow="peer")  # `peer` stays in use
        core.end_call("acme", "busy", "planner", route.replica)
        core.expire()
        assert time.monotonic() < deadline, "an unused template never expired"
        time.sleep(0.05)
    assert set(core.templates.current["acme"]) == {"peer"}
    assert not core.templates.old_versions  # past the state TTL, the replaced version is gone too
    assert store.get_template("acme", "once") is None and store.get_template("acme", "peer") is not None
    with pytest.raises(UnknownWorkflowError):
        core.start_call("acme", "late", "solo", workflow="once")


def test_a_lost_replica_is_forgotten_at_once_and_a_returning_one_starts_at_zero(router: RouterCore) -> None:
    router.cache_events("r1", [CacheEvent("stored", "gpu", "h-planner", 16), CacheEvent("stored", "cpu", "h-x", 8)])
    for client in ("c1", "c2", "c3"):
        router.start_call("acme", client, "planner", workflow="peer", prefix_hash="h-planner", prefix_tokens=16)
    assert router.loads["r1"] >= 2
    router.remove_replica("r1")
    assert "r1" not in router.loads and router.holdings.holders("h-x") == {} and not router.has_hints("r1")
    assert router.store.locations("h-planner") == {} and router.store.locations("h-x") == {}
    router.add_replica("r1")  # the same name again (a restarted node): nothing of the old one's counts
    assert router.loads["r1"] == 0 and router.holdings.holders("h-planner") == {}


def test_the_store_lost_its_data_and_the_router_writes_its_state_back(
        free_port: Callable[[], int], tmp_path: Path) -> None:
    """Redis restarted without persistence under a running router (a real redis-server, killed): the
    router keeps routing from memory meanwhile; once Redis answers, empty, the router's reconcile
    writes templates, live clients and locations back, so a router restarted later still serves the
    live client without anyone re-registering."""
    server = RedisProcess(free_port(), tmp_path, aof=False).start()
    try:
        store = BufferedStore(RedisStore(server.url), grace_s=60)
        core = RouterCore(store)
        core.add_replica("r1")
        core.put_template("acme", PEER)
        route = core.start_call("acme", "c1", "planner", workflow="peer", prefix_hash="h-planner", prefix_tokens=8)
        core.cache_events("r1", [CacheEvent("stored", "gpu", "h-planner", 8)])
        assert store.flush() is None and server.keys() >= 4
        server.kill()
        core.end_call("acme", "c1", "planner", route.replica)  # the outage costs no call
        assert core.start_call("acme", "c1", "executor").replica == "r1"
        assert store.flush() is not None and not store.up
        server.start()  # back, and empty
        assert server.keys() == 0
        assert store.probed(store.probe()) == "data_loss"
        assert core.reconcile() >= 3
        assert store.flush() is None
        restarted = RouterCore(BufferedStore(RedisStore(server.url)))
        restarted.add_replica("r1")
        assert restarted.holdings.holders("h-planner") == {"r1": "gpu"}
        route = restarted.start_call("acme", "c1", "executor")  # still running: no re-registration needed
        restarted.end_call("acme", "c1", "executor", route.replica)
        assert not restarted.start_call("acme", "c1", "expresser").deviation
    finally:
        server.stop()


def test_the_default_policy_is_the_workflow_router_and_first_tokens_end_prefill_work(store: Store) -> None:
    """Serving's replicas report each call's first token by its workflow key, agent and the router's
    number for it: the policy stops counting that call's prompt as prefill work in flight on the
    replica (a report without the number still finds this router's own call)."""
    core = RouterCore(store)
    assert type(core.policy).__name__ == "WorkflowRouter"
    for name in ("r1", "r2"):
        core.add_replica(name)
    core.put_template("acme", PEER)
    tokens = list(range(64))
    route = core.start_call("acme", "c1", "planner", workflow="peer", tokens=tokens, max_new=8)
    work = core.policy.work  # type: ignore[attr-defined]
    assert work.prefill_tokens(route.replica) == 64
    core.first_tokens(route.replica, [("acme/c1", "executor"), ("acme/c2", "planner")])  # not these calls
    assert work.prefill_tokens(route.replica) == 64
    other = core.start_call("acme", "c2", "planner", workflow="peer", tokens=list(range(100, 132)), max_new=8)
    before = work.prefill_tokens(other.replica)
    core.first_tokens(other.replica, [(other.workflow_key, "planner")])  # no number: its own call still
    assert work.prefill_tokens(other.replica) == before - 32
    core.first_tokens(route.replica, [(route.workflow_key, "planner", route.call - 1)])  # an earlier call's
    assert work.prefill_tokens(route.replica) == 64
    core.first_tokens(route.replica, [(route.workflow_key, "planner", route.call)])
    assert work.prefill_tokens(route.replica) == 0 and work.blocks(route.replica) == 4  # its KV stays
    core.end_call("acme", "c1", "planner", route.replica)
    assert work.blocks(route.replica) == 0


def test_a_gap_in_a_replicas_event_feed_is_repaired_by_its_snapshot(store: Store) -> None:
    """Batches are numbered: one that does not follow the last applied (lost on its way, or a router
    restarted mid-feed) makes the replica's view stale until its snapshot replaces it, phantom
    holders included; a replica that cannot snapshot keeps its view and the feed goes on."""
    core = RouterCore(store)
    for name in ("r1", "r2"):
        core.add_replica(name)
        store.heartbeat(name, {"load": 0})
    stored = [CacheEvent("stored", "gpu", "p1", 64, (1, 2)), CacheEvent("stored", "gpu", "p2", 64, (3, 4))]
    core.cache_events("r1", stored, seq=1)
    core.cache_events("r1", [], seq=2)
    assert not core.snapshot_due("r1")
    # batch 3, which removed p1, was lost: r1 is a phantom holder of p1 until it is repaired
    core.cache_events("r1", [CacheEvent("stored", "cpu", "p3", 64, (5,))], seq=4)
    assert core.snapshot_due("r1") and core.holdings.holders("p1") == {"r1": "gpu"}
    core.cache_snapshot("r1", 5, [CacheEvent("stored", "gpu", "p2", 64, (3, 4)),
                                  CacheEvent("stored", "cpu", "p3", 64, (5,))])
    assert not core.snapshot_due("r1")
    assert core.holdings.holders("p1") == {} and core.fleet.blocks.overlaps([1, 2]) == {}
    assert core.holdings.holders("p2") == {"r1": "gpu"} and core.holdings.holders("p3") == {"r1": "cpu"}
    core.store.flush()
    assert store.locations("p1") == {} and store.locations("p2") == {"r1": "gpu"}
    # the snapshot replaced what r1 holds, not r1: its heartbeat stays (a restarted router finds it)
    assert set(store.replicas(60)) == {"r1", "r2"}
    core.cache_events("r1", [], seq=6)
    assert not core.snapshot_due("r1")
    core.cache_events("r2", [], seq=9)  # a router that starts mid-feed
    assert core.snapshot_due("r2")
    core.cache_snapshot("r2", 10, None)  # an engine that cannot tell (SGLang): the feed goes on
    core.cache_events("r2", [], seq=11)
    assert not core.snapshot_due("r2")
