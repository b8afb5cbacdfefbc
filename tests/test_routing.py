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
    # equal prices: the workflow's home wins, then the application's rendezvous rank, which every
    # router shares (ingress replicas placing a new application at once agree) and which spreads them
    assert router.route(RouteRequest(prefix_tokens=10, home="b"), f).replica == "b"
    groups = [f"t/app{i}" for i in range(8)]
    picks = {g: router.route(RouteRequest(prefix_tokens=10, group=g), f).replica for g in groups}
    assert picks == {g: WorkflowRouter().route(RouteRequest(prefix_tokens=10, group=g), f).replica for g in groups}
    assert set(picks.values()) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="host_credit"):
        WorkflowRouter(host_credit=2)


def test_another_routers_prompts_count_call_by_call_until_their_first_token() -> None:
    """A router shares its named calls' prompts still to prefill one by one (the rest as totals); the
    router that absorbs them counts each until it hears of the call's first token on that replica,
    even when the other's word is older than the news, or the news came before the word."""
    from kvflow_ray.core.routing import WorkInFlight

    mine, theirs = WorkInFlight(), WorkInFlight()
    call = RouteRequest(tokens=tuple(range(32)), name="t/c\x00a\x001")
    unnamed = RouteRequest(tokens=tuple(range(100, 116)))
    theirs.add(call, "r1", 32)
    theirs.add(unnamed, "r1", 16)
    assert theirs.own() == {"r1": [16, 3]} and theirs.own_prefill() == {"r1\x00t/c\x00a\x001": [32.0]}
    mine.absorb(theirs.own(), theirs.own_prefill())
    assert mine.prefill_tokens("r1") == 48 and mine.blocks("r1") == 3
    mine.prefilled(RouteRequest(name=call.name), "r2")  # the same name on another replica: not this call
    assert mine.prefill_tokens("r1") == 48
    mine.prefilled(RouteRequest(name=call.name), "r1")
    assert mine.prefill_tokens("r1") == 16
    mine.absorb(theirs.own(), theirs.own_prefill())  # their word is still from before the first token
    assert mine.prefill_tokens("r1") == 16
    theirs.prefilled(call, "r1")
    assert theirs.own_prefill() == {} and theirs.own() == {"r1": [16, 3]}
    later = RouteRequest(tokens=tuple(range(200, 216)), name="t/c\x00a\x002")
    mine.prefilled(RouteRequest(name=later.name), "r2")  # the news before their word
    theirs.add(later, "r2", 16)
    mine.absorb(theirs.own(), theirs.own_prefill())
    assert mine.prefill_tokens("r2") == 0 and mine.blocks("r2") == 1
    assert mine.own_prefill() == {} and mine.own() == {}  # nothing of theirs is passed on as its own


# ---------------------------------------------------------------------------------------------- application homes
def _pressed_fleet(loads: dict[str, int], capacity: int) -> Fleet:
    """A fleet whose replicas reported `capacity` device KV tokens each."""
    f = Fleet.of(loads)
    for replica in loads:
        f.report(replica, usage=0.0, waiting=0, capacity=capacity)
    return f


def _call(group: str, prefix: str, tokens: int = 1000, home: str | None = None) -> RouteRequest:
    """A call of application `group` whose whole prompt is its fixed prompt `prefix` (fresh tokens)."""
    start = 1 + sum(map(ord, prefix)) * 100_000
    return RouteRequest(tokens=tuple(range(start, start + tokens)), prefix_hash=prefix, prefix_tokens=tokens,
                        group=group, home=home)


def test_applications_keep_their_working_set_and_the_fleets_hot_set() -> None:
    from kvflow_ray.core.routing import Applications

    apps = Applications(max_idle=1)
    f = _pressed_fleet({"a": 0, "b": 0}, capacity=1000)
    first, second = _call("t/app", "p1", 300), _call("t/app", "p2", 200)
    apps.routed(first, "a", rehome=False)
    assert apps.home("t/app") == "a" and apps.hot_tokens == 300 and apps.busy("t/app")
    apps.routed(second, "b", rehome=False)  # a second prompt joins the working set; the home stays
    assert apps.home("t/app") == "a" and apps.hot_tokens == 500
    assert apps.pressure(f) == 500 / 2000
    apps.routed(_call("t/app", "p1", 300), "a", rehome=False)  # a prompt counts once
    assert apps.hot_tokens == 500
    for call, at in ((first, "a"), (second, "b"), (first, "a")):
        apps.ended(call, at)
    assert apps.hot_tokens == 0 and not apps.busy("t/app") and apps.home("t/app") == "a"
    apps.ended(first, "a")  # an end it does not know of changes nothing
    assert apps.hot_tokens == 0
    apps.routed(_call("t/other", "q", 50), "b", rehome=False)
    apps.ended(_call("t/other", "q", 50), "b")  # two idle applications over max_idle=1: the older is forgotten
    assert apps.home("t/app") is None and apps.home("t/other") == "b"
    apps.routed(_call("t/other", "q", 50), "b", rehome=False)
    assert apps.hot_tokens == 50
    apps.removed("b")  # its calls died with it: no home, nothing hot
    assert apps.home("t/other") is None and apps.hot_tokens == 0 and not apps.busy("t/other")
    assert apps.pressure(Fleet.of({"a": 0})) == 0.0  # no pool reported: no pressure


def test_busy_applications_spread_while_a_replica_is_home_to_none() -> None:
    """Two busy applications homed on one replica while another is home to no busy one: the one
    ranked first for the empty replica moves there, the same whatever the order the homes are listed
    in; an idle application neither moves nor fills a replica; a home on a replica that left stays,
    and nothing moves once every replica is some busy application's home."""
    from kvflow_ray.core.routing import _rank, spread

    everyone = {"t/x", "t/y", "t/z", "t/gone", "t/w"} | {f"t/{i}" for i in range(3)}
    homes = {"t/x": "a", "t/y": "a", "t/z": "b", "t/gone": "d", "t/idle": "c"}
    spread(homes, ["a", "b", "c"], everyone)
    mover = min(("t/x", "t/y"), key=lambda g: (_rank(g, "c"), g))
    assert homes[mover] == "c" and homes[({"t/x", "t/y"} - {mover}).pop()] == "a"
    assert homes["t/z"] == "b" and homes["t/gone"] == "d" and homes["t/idle"] == "c"
    reordered = {"t/idle": "c", "t/gone": "d", "t/z": "b", "t/y": "a", "t/x": "a"}
    spread(reordered, ["c", "b", "a"], everyone)
    assert reordered == homes
    crowded = {"t/x": "a", "t/y": "a", "t/z": "b", "t/w": "c"}  # every replica is a busy one's home
    spread(crowded, ["a", "b", "c"], everyone)
    assert crowded == {"t/x": "a", "t/y": "a", "t/z": "b", "t/w": "c"}
    warm = {"t/x": "a", "t/idle": "a"}  # an idle application beside a busy one: its cache stays put
    spread(warm, ["a", "b"], everyone)
    assert warm == {"t/x": "a", "t/idle": "a"}
    three = {f"t/{i}": "a" for i in range(3)}  # three on one replica, two empty: each empty gets one
    spread(three, ["a", "b", "c"], everyone)
    assert sorted(three.values()) == ["a", "b", "c"]


def test_under_pressure_an_application_goes_home_until_its_load_bound() -> None:
    from kvflow_ray.core.routing import WorkflowRouter

    router = WorkflowRouter(load_bound=2.0, sticky_pressure=1.0)
    # 2,000 device tokens in all; b, c, d each run 2 calls of other routers' clients, with their work
    f = _pressed_fleet({"a": 0, "b": 2, "c": 2, "d": 2}, capacity=500)
    router.absorb({"work": {r: [500.0, 0.0] for r in "bcd"}}, f)
    hot = _call("t/hot", "p", 4000)  # its working set alone is 2x the fleet: memory binds
    assert router.route(hot, f).replica == "a"  # first call: the cheapest
    router.routed(hot, "a")
    f.loads["a"] += 1
    assert router.apps.pressure(f) == 2.0
    # b is cheaper for a new prompt of the application (a has work in flight), but the home wins
    nxt = _call("t/hot", "p2", 4000)
    assert router.costs(nxt, f)["b"] < router.costs(nxt, f)["a"]
    assert router.route(nxt, f) == RouteDecision("a", "cold", None)
    # the bound: the home's calls in flight, this one counted, within ceil(2 x the fleet's mean)
    f.loads["a"] = 4  # 5 <= ceil(2 x (10 + 1) / 4) = 6
    assert router.route(nxt, f).replica == "a"
    f.loads["a"] = 6  # 7 <= ceil(2 x (12 + 1) / 4) = 7
    assert router.route(nxt, f).replica == "a"
    f.loads["a"] = 7  # 8 > ceil(2 x (13 + 1) / 4) = 7: the call spills to the cheapest replica
    spill = router.route(nxt, f)
    assert spill.replica in ("b", "c", "d")
    router.routed(nxt, spill.replica)
    assert router.apps.home("t/hot") == "a"  # the home stays while the application is busy


def test_below_pressure_the_price_decides_and_an_idle_application_moves_from_a_busy_home() -> None:
    from kvflow_ray.core.routing import WorkflowRouter

    router = WorkflowRouter(load_bound=2.0, sticky_pressure=1.0, slack=0.0)
    roomy = _pressed_fleet({"a": 0, "b": 0}, capacity=1_000_000)
    router.routed(_call("t/app", "p", 1000), "a")
    roomy.loads["a"] += 1
    # memory does not bind: the cheaper replica (a still prefills the first call) wins over the home
    assert router.route(_call("t/app", "p2", 1000), roomy).replica == "b"

    router = WorkflowRouter(load_bound=2.0, sticky_pressure=1.0)
    tight = _pressed_fleet({"a": 0, "b": 0, "c": 0, "d": 0}, capacity=100)
    first = _call("t/app", "p", 1000)
    router.routed(first, "a")
    router.ended(first, "a")  # the application is idle, at home on a
    for i in range(6):  # another application keeps memory bound and a busy: a is over its bound
        router.routed(_call("t/busy", f"q{i}", 1000), "a")
        tight.loads["a"] += 1
    later = _call("t/app", "p", 1000)
    d = router.route(later, tight)
    assert d.replica != "a"
    router.routed(later, d.replica)
    assert router.apps.home("t/app") == d.replica  # it moved with its call
    with pytest.raises(ValueError, match="load_bound"):
        WorkflowRouter(load_bound=0.5)


def test_a_home_that_left_is_replaced() -> None:
    from kvflow_ray.core.routing import WorkflowRouter

    router = WorkflowRouter()
    f = _pressed_fleet({"a": 0, "b": 0}, capacity=10)
    call = _call("t/app", "p", 1000)
    router.routed(call, "a")
    router.removed("a")
    f.remove("a")
    d = router.route(_call("t/app", "p", 1000), f)
    assert d.replica == "b"
    router.routed(_call("t/app", "p", 1000), "b")
    assert router.apps.home("t/app") == "b"


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 5), st.booleans()), max_size=40))
def test_work_in_flight_counts_new_blocks_as_a_rescan_would(ops: list[tuple[str, int, bool]]) -> None:
    """Each replica's tree of blocks in flight gives a call's new blocks there (alone, and through the
    first-block index for every replica at once) and the blocks held there exactly as counting against
    that replica's in-flight set does, through adds, ends and a dropped replica."""
    from kvflow_ray.core.routing import WorkInFlight

    work = WorkInFlight(block=4)
    base, alt = tuple(range(24)), tuple(range(100, 124))
    # prompts of 1-6 blocks: prefixes of each other, and ones that share a start and part
    prompts = [base[:4], base[:12], base, base[:8] + alt[:8], base[:8] + alt[:4] + base[:4], alt[:12]]
    live: list[tuple[RouteRequest, str]] = []
    for replica, k, end in ops:
        if end and live:
            request, at = live.pop(k % len(live))
            work.ended(request, at)
        else:
            request = RouteRequest(tokens=prompts[k])
            work.add(request, replica, 0)
            live.append((request, replica))
        if replica == "c" and k == 5:
            work.drop("c")
            live = [(r, at) for r, at in live if at != "c"]
        for other in prompts:
            call = RouteRequest(tokens=other)
            held = {at: {h for r, x in live if x == at for h in r.blocks(4)} for at in "abc"}
            shared = work.shared_blocks(call)
            for at in "abc":
                assert work.new_blocks(at, call) == sum(1 for h in call.blocks(4) if h not in held[at])
                assert work.new_blocks(at, call, shared) == work.new_blocks(at, call)
                assert work.blocks(at) == len(held[at])


def test_every_routing_policy_names_the_inputs_it_reads() -> None:
    """A router refuses a policy needing what it does not give (`missing_inputs`); the names are
    those of `ROUTING_INPUTS`, and what the token-level rules read is declared."""
    from kvflow_ray.core.routing import ROUTING, ROUTING_INPUTS, missing_inputs

    needs = {name: ROUTING.create(name).needs for name in ROUTING.names()}
    assert all(n <= set(ROUTING_INPUTS) for n in needs.values())
    assert needs["pow2"] == needs["round-robin"] == frozenset()
    assert {"tokens", "first_token", "load"} <= needs["workflow"]
    assert {"tokens", "blocks"} <= needs["dynamo-kv"] and {"tokens", "blocks", "load"} <= needs["llmd-precise"]
    assert missing_inputs(ROUTING.create("dynamo-kv"), frozenset({"tokens", "first_token"})) == ["blocks"]
    assert missing_inputs(ROUTING.create("pow2"), frozenset()) == []
