"""The peers' routing rules (core/peer_routers.py, core/routing.py) do what their sources and tests
document: each case below is one of Ray Serve LLM's, the SGLang gateway's, Dynamo's or llm-d's own
examples, on token ids where they use characters."""

from __future__ import annotations

import pytest

from kvflow_ray.core.peer_routers import (
    DynamoKvRouter,
    HistoryTree,
    LlmdPreciseRouter,
    RayPrefixRouter,
    SGLangCacheAwareRouter,
    dynamo_cost,
)
from kvflow_ray.core.routing import (
    ROUTING,
    BlockIndex,
    Fleet,
    PowerOfTwoRouter,
    RoundRobinRouter,
    RouteRequest,
    RoutingPolicy,
    block_hashes,
)


def text(s: str) -> tuple[int, ...]:
    return tuple(map(ord, s))


def fleet(**loads: int) -> Fleet:
    return Fleet.of(loads)


def send(policy: RoutingPolicy, f: Fleet, prompt: str) -> str:
    """Route one call and tell the policy it went there (as the router does)."""
    request = RouteRequest(tokens=text(prompt))
    replica = policy.route(request, f).replica
    policy.routed(request, replica)
    return replica


def insert(policy: RayPrefixRouter | SGLangCacheAwareRouter, replica: str, prompt: str) -> None:
    policy.routed(RouteRequest(tokens=text(prompt)), replica)


# ---------------------------------------------------------------------------------------------- history tree
def test_history_tree_matches_like_rays_prefix_tree() -> None:
    tree = HistoryTree()
    for t in ("t1", "t2"):
        tree.add_tenant(t, 0)
    tree.insert(text("apple"), "t1", 1)
    tree.insert(text("apricot"), "t2", 2)
    matched, node = tree.walk(text("application"), {"t1", "t2"})
    assert (matched, set(node.owners)) == (4, {"t1"})  # "appl"
    matched, node = tree.walk(text("application"), {"t2"})
    assert matched == 2 and "t2" in node.owners  # "ap": only through nodes t2 owns
    assert tree.size == {"t1": 5, "t2": 7}  # ancestors shared: "ap" counted for both


def test_history_tree_trims_a_tenant_by_lru_leaves_like_the_sglang_gateway() -> None:
    tree = HistoryTree()
    tree.add_tenant("t1", 0)
    tree.add_tenant("t2", 0)
    tree.insert(text("hello"), "t1", 1)
    tree.insert(text("hello"), "t2", 2)
    tree.insert(text("world"), "t2", 3)
    assert tree.size == {"t1": 5, "t2": 10}
    tree.evict_lru_leaves("t2", 5)
    assert tree.size == {"t1": 5, "t2": 5}  # t2's older "hello" went; t1 keeps it
    _matched, node = tree.walk(text("world"))
    assert list(node.owners) == ["t2"]
    _matched, node = tree.walk(text("hello"))
    assert list(node.owners) == ["t1"]
    tree.remove_tenant("t1")
    assert tree.walk(text("hello"))[0] == 0 and "t1" not in tree.size


# ---------------------------------------------------------------------------------------------- Ray Serve LLM
def test_ray_prefix_imbalanced_load_uses_power_of_two() -> None:
    policy = RayPrefixRouter(imbalanced_threshold=2)
    f = fleet(r1=0, r2=10)
    insert(policy, "r2", "hello world")
    for _ in range(10):
        assert send(policy, f, "hello world") == "r1"


def test_ray_prefix_high_match_goes_to_the_matched_replica() -> None:
    policy = RayPrefixRouter()
    f = fleet(r1=0, r2=0)
    insert(policy, "r2", "Hello")
    assert all(policy.route(RouteRequest(tokens=text("Hello world")), f).replica == "r2" for _ in range(5))


def test_ray_prefix_low_match_goes_to_the_smallest_tree_then_the_shortest_queue() -> None:
    policy = RayPrefixRouter()
    f = fleet(r1=0, r2=0)
    insert(policy, "r1", "hi")
    insert(policy, "r2", "longtext")
    assert policy.route(RouteRequest(tokens=text("z")), f).replica == "r1"  # rate 0 < 0.1: fewest tokens
    fresh = RayPrefixRouter()
    assert fresh.route(RouteRequest(tokens=text("z")), fleet(r1=3, r2=1)).replica == "r2"  # all tie: shorter queue


def test_ray_prefix_defaults_and_a_removed_replica() -> None:
    entry = ROUTING.get("ray-prefix")
    assert entry.options["match_rate_threshold"] == 0.1
    assert entry.options["imbalanced_threshold"] == float("inf")  # prefix-only since ray PR #59390
    policy = RayPrefixRouter()
    f = fleet(r1=0, r2=0)
    insert(policy, "r2", "hello world")
    policy.removed("r2")
    f.remove("r2")
    assert policy.route(RouteRequest(tokens=text("hello world")), f).replica == "r1"


# ---------------------------------------------------------------------------------------------- SGLang gateway
def test_sglang_cache_aware_keeps_a_prompt_and_its_prefixes_on_one_worker() -> None:
    policy = SGLangCacheAwareRouter()
    f = fleet(w1=0, w2=0)
    first = send(policy, f, "hello world")
    assert send(policy, f, "hello world") == first
    assert send(policy, f, "hello") == first  # 5/5 matched > 0.3


def test_sglang_cache_aware_imbalanced_goes_to_the_least_loaded() -> None:
    policy = SGLangCacheAwareRouter(cache_threshold=0.5, balance_abs_threshold=5, balance_rel_threshold=2.0)
    f = fleet(w1=20, w2=0)
    insert(policy, "w1", "test")
    assert [send(policy, f, "test") for _ in range(5)] == ["w2"] * 5
    # a gap equal to the absolute threshold is not imbalanced: the match wins
    f.loads.update(w1=5, w2=0)
    policy = SGLangCacheAwareRouter(cache_threshold=0.5, balance_abs_threshold=5, balance_rel_threshold=2.0)
    insert(policy, "w1", "test")
    assert policy.route(RouteRequest(tokens=text("test")), f).replica == "w1"


def test_sglang_cache_aware_miss_goes_to_the_least_loaded_and_the_threshold_is_strict() -> None:
    policy = SGLangCacheAwareRouter(cache_threshold=0.5)
    f = fleet(w1=0, w2=3, w3=1)
    insert(policy, "w2", "abcd")
    # "abzz": 2 of 4 matched = 0.5, not above the threshold: a miss, the least loaded worker
    assert policy.route(RouteRequest(tokens=text("abzz")), f).replica == "w1"
    assert policy.route(RouteRequest(tokens=text("abcz")), f).replica == "w2"  # 0.75 > 0.5


def test_sglang_cache_aware_removed_worker_is_not_chosen() -> None:
    policy = SGLangCacheAwareRouter()
    f = fleet(w1=0, w2=0)
    where = send(policy, f, "test1")
    other = "w2" if where == "w1" else "w1"
    policy.removed(where)
    f.remove(where)
    assert policy.route(RouteRequest(tokens=text("test1")), f).replica == other


def test_sglang_cache_aware_defaults_are_the_gateways() -> None:
    options = ROUTING.get("sglang-cache-aware").options
    assert (options["cache_threshold"], options["balance_abs_threshold"], options["balance_rel_threshold"],
            options["max_tree_size"]) == (0.3, 64, 1.5, 1 << 26)


# ---------------------------------------------------------------------------------------------- Dynamo
def test_dynamo_cost_matches_its_documented_examples() -> None:
    # docs/architecture/kv_cache_routing.md: (prefill, decode) blocks (8, 10), (5, 5), (2, 9) -> 18, 10, 11
    costs = [dynamo_cost(prefill * 16, 16, 0, 0, 0, decode) for prefill, decode in ((8, 10), (5, 5), (2, 9))]
    assert costs == [18.0, 10.0, 11.0]
    # selector tests: the prefill scale applies after the overlap credit
    assert dynamo_cost(64, 16, 0, 2, 0, 3, prefill_load_scale=2) == 7.0
    assert dynamo_cost(64, 16, 0, 0, 0, 0, prefill_load_scale=2) == 8.0
    # credit 1: warm 4 + 5 = 9 loses to cold 8; credit 1.5: warm 2 + 5 = 7 wins
    assert dynamo_cost(128, 16, 0, 4, 0, 5) == 9.0
    assert dynamo_cost(128, 16, 0, 4, 0, 5, overlap_score_credit=1.5) == 7.0
    # host blocks earn 0.75 of a device block's credit
    assert dynamo_cost(128, 16, 0, 0, 4, 0) == 8 - 3.0


def _holding(replica: str, tokens: tuple[int, ...], tier: str = "gpu", f: Fleet | None = None) -> Fleet:
    f = f or fleet(a=0, b=0)
    f.blocks.stored(replica, tier, block_hashes(tokens, "", f.blocks.block))
    return f


def test_dynamo_routes_to_the_holder_and_counts_prefill_in_flight() -> None:
    prompt = tuple(range(256))
    f = _holding("b", prompt)
    policy = DynamoKvRouter()
    request = RouteRequest(tokens=prompt)
    costs = policy.costs(request, f)
    assert costs["b"] < costs["a"]
    assert policy.route(request, f).replica == "b"
    policy.routed(request, "b")
    assert policy.work.prefill_tokens("b") == 0  # all cached on b: nothing to prefill
    cold = RouteRequest(tokens=tuple(range(1000, 1256)))
    policy.route(cold, f)
    policy.routed(cold, "a")
    assert policy.work.prefill_tokens("a") == 256 and policy.work.blocks("a") == 16
    policy.prefilled(cold, "a")
    assert policy.work.prefill_tokens("a") == 0 and policy.work.blocks("a") == 16
    policy.ended(cold, "a")
    assert policy.work.blocks("a") == 0


# ---------------------------------------------------------------------------------------------- llm-d
def test_llmd_precise_scores_prefix_min_max_plus_load() -> None:
    prompt = tuple(range(512))
    f = fleet(a=0, b=0, c=0)
    _holding("a", prompt[:256], f=f)  # 4 blocks of 64
    _holding("b", prompt[:128], f=f)  # 2 blocks
    policy = LlmdPreciseRouter()
    scores = policy.scores(RouteRequest(tokens=prompt), f)
    assert scores == {"a": 2 * 1.0 + 1 + 1, "b": 2 * 0.0 + 1 + 1, "c": 2.0}  # min-max: the shallower hit gets 0
    assert policy.route(RouteRequest(tokens=prompt), f).replica == "a"


def test_llmd_precise_load_scorers_and_random_ties() -> None:
    prompt = tuple(range(128))
    f = fleet(a=0, b=0)
    _holding("a", prompt, f=f)
    f.report("a", usage=1.0, waiting=4)  # the hit pod is full with the longest queue ...
    f.report("b", usage=0.0, waiting=0)
    scores = LlmdPreciseRouter().scores(RouteRequest(tokens=prompt), f)
    assert scores == {"a": 2.0, "b": 2.0}  # ... and ties with an idle pod (2:1:1)
    picks = {LlmdPreciseRouter(seed=s).route(RouteRequest(tokens=prompt), f).replica for s in range(20)}
    assert picks == {"a", "b"}


# ---------------------------------------------------------------------------------------------- load only
def test_round_robin_and_power_of_two() -> None:
    f = fleet(a=5, b=0, c=0)
    rr = RoundRobinRouter()
    assert [send(rr, f, "x") for _ in range(4)] == ["a", "b", "c", "a"]
    pow2 = PowerOfTwoRouter(seed=1)
    two = fleet(a=5, b=0)
    assert {send(pow2, two, "x") for _ in range(10)} == {"b"}  # of two, the shorter queue
    # asking where a call would go draws nothing: the answer stays until a call is routed
    ask = RouteRequest()
    assert len({pow2.route(ask, f).replica for _ in range(5)}) == 1


def test_block_index_overlaps_count_leading_blocks_per_tier() -> None:
    index = BlockIndex(block=4)
    seq = tuple(range(16))
    blocks = block_hashes(seq, "", 4)
    index.stored("a", "gpu", blocks[:2])
    index.stored("a", "cpu", blocks[2:3])
    index.stored("b", "cpu", blocks[:4])
    index.stored("c", "gpu", blocks[1:])  # not the first block: no leading overlap
    assert index.overlaps(blocks) == {"a": (2, 3), "b": (0, 4)}
    index.removed("a", "gpu", blocks[1:2])
    assert index.overlaps(blocks)["a"] == (1, 1)
    assert block_hashes(seq, "tenant-x", 4) != blocks  # namespaces never share blocks
    index.drop("b")
    assert "b" not in index.overlaps(blocks)


@pytest.mark.parametrize("name", ["workflow", "round-robin", "pow2", "ray-prefix", "sglang-cache-aware",
                                  "dynamo-kv", "llmd-precise"])
def test_every_policy_routes_only_to_live_replicas(name: str) -> None:
    policy = ROUTING.create(name)
    f = fleet(a=1, b=0, c=2)
    for i in range(20):
        request = RouteRequest(tokens=tuple(range(i % 3 * 100, i % 3 * 100 + 64)))
        replica = policy.route(request, f).replica
        assert replica in f.loads
        policy.routed(request, replica)
    policy.removed("a")
    f.remove("a")
    assert policy.route(RouteRequest(tokens=tuple(range(64))), f).replica in {"b", "c"}
    with pytest.raises(ValueError, match="no live replica"):
        policy.route(RouteRequest(), Fleet())
