"""Prefix-affinity routing decisions (core/routing.py)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvflow_ray.core.routing import Fleet, PrefixAffinityRouter, RouteDecision, RouteRequest

ROUTER = PrefixAffinityRouter(balance_threshold=4)


def route(holders: dict[str, str], loads: dict[str, int], tokens: int, home: str | None = None) -> RouteDecision:
    return ROUTER.route(RouteRequest(prefix_tokens=tokens, holders=holders, home=home), Fleet.of(loads))


def test_affinity_prefers_the_device_tier_then_the_host_tier() -> None:
    loads = {"a": 2, "b": 2, "c": 0}
    d = route({"a": "cpu", "b": "gpu"}, loads, 2048)
    assert (d.replica, d.outcome, d.tier) == ("b", "affinity", "gpu")
    d = route({"a": "cpu"}, loads, 2048)
    assert (d.replica, d.outcome, d.tier) == ("a", "affinity", "cpu")


def test_an_overloaded_holder_loses_the_call_to_the_cheapest_replica() -> None:
    d = route({"a": "gpu"}, {"a": 9, "b": 1}, 2048)
    assert (d.replica, d.outcome, d.tier) == ("b", "balanced", None)
    # within the threshold the holder keeps it
    assert route({"a": "gpu"}, {"a": 5, "b": 1}, 2048).replica == "a"


def test_a_cold_agent_goes_where_it_is_cheapest() -> None:
    d = route({}, {"a": 3, "b": 1, "c": 1}, 512)
    assert (d.replica, d.outcome) == ("b", "cold")  # least loaded, ties by name


def test_dead_holders_are_ignored_and_no_replica_is_an_error() -> None:
    d = route({"gone": "gpu"}, {"a": 0}, 100)
    assert (d.replica, d.outcome) == ("a", "cold")
    with pytest.raises(ValueError, match="no live replica"):
        route({"a": "gpu"}, {}, 100)
    with pytest.raises(ValueError, match="balance_threshold"):
        PrefixAffinityRouter(balance_threshold=-1)


@given(st.dictionaries(st.sampled_from("abcde"), st.integers(0, 50), min_size=1),
       st.dictionaries(st.sampled_from("abcdef"), st.sampled_from(["gpu", "cpu"])),
       st.integers(1, 10_000))
@example(loads={"a": 5, "b": 0, "c": 1}, holders={"a": "gpu", "c": "cpu"}, tokens=1)  # a busy device holder
def test_decisions_are_live_and_bounded(loads: dict[str, int], holders: dict[str, str], tokens: int) -> None:
    d = route(holders, loads, tokens)
    assert d.replica in loads
    assert d.tier == holders.get(d.replica)
    live = {r for r in holders if r in loads}
    if d.outcome == "affinity":
        assert d.replica in live
    elif d.outcome == "cold":
        assert not live
    # affinity never waits behind more than the threshold when a holder is within it
    within = [r for r in live if loads[r] - min(loads.values()) <= ROUTER.balance_threshold]
    if within:
        assert d.outcome == "affinity" and loads[d.replica] - min(loads.values()) <= ROUTER.balance_threshold


# ---------------------------------------------------------------------------------------------- the priced router
def test_workflow_router_prices_cached_prompt_against_work_in_flight() -> None:
    from kvflow_ray.core.routing import WorkflowRouter, block_hashes

    router = WorkflowRouter()
    prompt = tuple(range(1024))
    f = Fleet.of({"a": 0, "b": 0})
    f.blocks.stored("b", "gpu", block_hashes(prompt[:768], "", f.blocks.block))
    call = RouteRequest(tokens=prompt)
    costs = router.costs(call, f)
    assert costs["a"] - costs["b"] == 768  # b computes 768 prompt tokens fewer
    assert router.route(call, f).replica == "b"
    router.routed(call, "b")
    assert router.work.prefill_tokens("b") == 256  # what b still computes for it, until its first token
    # a second, unrelated call now waits behind that work on b: a is cheaper
    other = RouteRequest(tokens=tuple(range(5000, 5512)))
    assert router.route(other, f).replica == "a"
    router.prefilled(call, "b")
    router.ended(call, "b")
    assert router.work.prefill_tokens("b") == 0 and router.work.blocks("b") == 0


def test_workflow_router_uses_exact_holders_host_credit_and_home() -> None:
    from kvflow_ray.core.routing import WorkflowRouter

    router = WorkflowRouter(host_credit=0.75)
    f = Fleet.of({"a": 0, "b": 0, "c": 0})
    # no tokens (where would an upcoming agent go): its fixed prompt, priced from the location index
    ask = RouteRequest(prefix_tokens=1000, holders={"b": "cpu", "c": "gpu"})
    assert router.costs(ask, f) == {"a": 1000.0, "b": 250.0, "c": 0.0}
    assert router.route(ask, f) == RouteDecision("c", "affinity", "gpu")
    # equal prices: the workflow's home wins, then the name
    assert router.route(RouteRequest(prefix_tokens=10, home="b"), f).replica == "b"
    assert router.route(RouteRequest(prefix_tokens=10), f).replica == "a"
    with pytest.raises(ValueError, match="host_credit"):
        WorkflowRouter(host_credit=2)
