"""Queue-aware prefix scheduling: the pending tree and its paired walk, the `queue-aware` and `lpm`
admission orders, demand-first eviction, and what they do on the simulator and the CPU engine.
(SGLang's own `lpm` against the core rebuild: tests/sglang/test_plugin_queue_aware.py.)"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow_ray.core.admission import ADMISSION, LongestPrefixAdmission, QueueAwareAdmission
from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.pending import PendingTree, cluster_of
from kvflow_ray.core.policies import EVICTION, KVFlowPolicy, StepBook
from kvflow_ray.core.radix import RadixTree
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import run_policies

rng = random.Random(3)


def fresh(n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10_000, 1_000_000) for _ in range(n))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------- pending tree
def test_pending_tree_counts_what_its_requests_share_and_forgets_them() -> None:
    tree: PendingTree[str] = PendingTree()
    system = fresh(100)
    tree.add("a", "", system + fresh(10))
    tree.add("b", "", system + fresh(10))
    tree.add("c", "", fresh(50))
    tree.add("d", "t2", system + fresh(5))  # another namespace: shares nothing with a and b
    cluster = cluster_of(tree.leaves["a"])
    assert cluster is not None and cluster is cluster_of(tree.leaves["b"]) and cluster.depth == 100
    assert cluster.count == 2
    assert cluster_of(tree.leaves["c"]) is None and cluster_of(tree.leaves["d"]) is None
    tree.admitted("a")
    assert cluster.inflight == 1 and cluster.count == 2  # in flight: still shares, until its prefill is done
    tree.discard("a")
    tree.discard("b")
    assert cluster_of(tree.leaves["c"]) is None and len(tree) == 2
    assert set(tree.root.children) == {("", tree.leaves["c"].key[0]), ("t2", system[0])}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "discard", "cache", "evict"]), st.integers(0, 7),
                          st.integers(0, 40)), max_size=60))
def test_paired_walk_gives_every_request_its_cached_prefix(ops: list[tuple[str, int, int]]) -> None:
    """Against matching each waiting request on its own, after any mix of arrivals, departures, cache
    inserts and evictions (the walk redoes only what changed)."""
    r = random.Random(len(ops))
    bases = [tuple(r.randrange(1, 6) for _ in range(30)) for _ in range(3)]
    cache = TieredCache(10_000, EVICTION.create("lru"))
    pending: PendingTree[int] = PendingTree()
    prompts: dict[int, tuple[int, ...]] = {}
    for i, (op, which, cut) in enumerate(ops):
        prompt = bases[which % 3][:cut] + tuple(r.randrange(1, 4) for _ in range(which))
        if op == "add" and prompt:
            pending.add(i, "", prompt)
            prompts[i] = prompt
        elif op == "discard" and prompts:
            pending.discard(r.choice(sorted(prompts)))
            prompts = {k: v for k, v in prompts.items() if k in pending}
        elif op == "cache" and prompt:
            cache.alloc(len(prompt))
            cache.commit(prompt, len(prompt))
        elif op == "evict":
            cache.make_room(cache.free_tokens + cut)
        if i % 3 == 0:
            pending.check(cache.tree)
    pending.check(cache.tree)


def test_the_walk_leaves_the_queues_demand_on_cache_nodes() -> None:
    cache = TieredCache(10_000, EVICTION.create("lru"))
    system = fresh(64)
    cache.alloc(64)
    node = cache.commit(system, 64)[-1]
    pending: PendingTree[str] = PendingTree()
    pending.add("a", "", system + fresh(8))
    pending.add("b", "", system + fresh(8))
    pending.walk(cache.tree)
    assert node.demand == 2
    pending.discard("a")
    pending.walk(cache.tree)
    assert node.demand == 1
    pending.discard("b")
    pending.walk(cache.tree)
    assert node.demand == 0


# ---------------------------------------------------------------------------------------------- eviction
@pytest.mark.parametrize("name", ["demand-lru", "demand-kvflow"])
def test_demand_first_eviction_keeps_what_queued_requests_need(name: str) -> None:
    """The least recently used prompt goes last when a queued request needs it (plain lru: first)."""
    book = StepBook()
    cache = TieredCache(300, EVICTION.create(name, PolicyContext(book=book)))
    old, new = fresh(100), fresh(100)
    for prompt in (old, new):
        cache.alloc(100)
        cache.commit(prompt, 100)
    pending: PendingTree[str] = PendingTree()
    pending.add("waiting", "", old + fresh(5))
    pending.walk(cache.tree)
    ok, _ = cache.make_room(cache.free_tokens + 1)
    assert ok
    assert cache.tree.match_prefix(old).gpu_length() == 100 and cache.tree.match_prefix(new).gpu_length() == 0


def test_demand_kvflow_ranks_by_workflow_distance_after_demand() -> None:
    book = StepBook()
    policy = EVICTION.create("demand-kvflow", PolicyContext(book=book))
    assert isinstance(policy.base, KVFlowPolicy)  # type: ignore[attr-defined]
    assert policy.needed_by(2) == (0, *policy.base.needed_by(2))  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- orders
def queue_aware(tree: RadixTree, **options: object) -> QueueAwareAdmission:
    policy = ADMISSION.create("queue-aware", PolicyContext(tree=tree, clock=Clock()), **options)
    assert isinstance(policy, QueueAwareAdmission)
    return policy


def test_queue_aware_sends_one_pioneer_per_cold_prefix_and_holds_its_siblings() -> None:
    cache = TieredCache(100_000, EVICTION.create("lru"))
    warm_prompt, cold_prompt = fresh(500), fresh(500)
    cache.alloc(500)
    cache.commit(warm_prompt, 500)
    policy = queue_aware(cache.tree)
    reqs = {"pioneer": cold_prompt + fresh(10), "sibling": cold_prompt + fresh(10), "warm": warm_prompt + fresh(10),
            "lone": fresh(300)}
    for name, prompt in reqs.items():
        policy.arrived(name, "", prompt)
    order = list(policy.order(list(reqs), list(reqs)))
    assert order[0] == "warm" and "sibling" not in order and set(order) == {"warm", "pioneer", "lone"}
    policy.admitted("pioneer")  # its prefill runs: the sibling still waits
    assert "sibling" not in list(policy.order(["sibling", "warm", "lone"], ["sibling", "warm", "lone"]))
    cache.alloc(510)
    cache.commit(reqs["pioneer"], 510)  # the pioneer's prompt is cached now
    policy.done("pioneer")
    assert "sibling" in list(policy.order(["sibling", "warm", "lone"], ["sibling", "warm", "lone"]))


def test_queue_aware_bounds_the_pioneers_computing_at_once() -> None:
    tree = RadixTree()
    policy = queue_aware(tree, pioneer_tokens=600)
    a, b = fresh(500), fresh(500)
    for name, prompt in {"a1": a + fresh(5), "a2": a + fresh(5), "b1": b + fresh(5), "b2": b + fresh(5)}.items():
        policy.arrived(name, "", prompt)
    waiting = ["a1", "a2", "b1", "b2"]
    assert list(policy.order(waiting, waiting)) == ["a1"]  # b's pioneer would put 1,000 cold tokens in flight
    policy.admitted("a1")
    assert list(policy.order(waiting[1:], waiting[1:])) == []
    policy.done("a1")  # a1's prefill is done: b's pioneer may go (a2, alone now, shares nothing)
    assert set(policy.order(waiting[1:], waiting[1:])) == {"a2", "b1"}


def test_queue_aware_lets_the_oldest_request_through_within_its_floor_share() -> None:
    """However many warm requests keep coming, the oldest (a cold lone one) is among the first
    1 / oldest_floor of every order: lane B is strict arrival order."""
    cache = TieredCache(100_000, EVICTION.create("lru"))
    hot = fresh(200)
    cache.alloc(200)
    cache.commit(hot, 200)
    policy = queue_aware(cache.tree)
    waiting = ["oldest"] + [f"warm{i}" for i in range(200)]
    policy.arrived("oldest", "", fresh(300))
    for name in waiting[1:]:
        policy.arrived(name, "", hot + fresh(20))
    for _ in range(20):  # the lane share settles
        order = list(policy.order(waiting, waiting))
    assert order.index("oldest") < round(1 / policy.floor) + 1


def test_queue_aware_without_sharing_is_arrival_order() -> None:
    policy = queue_aware(RadixTree())
    waiting = [f"r{i}" for i in range(50)]
    for name in waiting:
        policy.arrived(name, "", fresh(100))
    assert list(policy.order(waiting, waiting)) == waiting


def test_lpm_orders_by_cached_prefix_with_sglangs_in_batch_check_and_fcfs_above_128() -> None:
    cache = TieredCache(100_000, EVICTION.create("lru"))
    long, short, cold = fresh(300), fresh(100), fresh(64)
    for prompt in (long, short):
        cache.alloc(len(prompt))
        cache.commit(prompt, len(prompt))
    policy = ADMISSION.create("lpm", PolicyContext(tree=cache.tree, clock=Clock()))
    assert isinstance(policy, LongestPrefixAdmission)
    queue = {"cold1": cold + fresh(3), "short": short + fresh(3), "cold2": cold + fresh(4), "long": long + fresh(3),
             "lone": fresh(40)}
    for name, prompt in queue.items():
        policy.arrived(name, "", prompt)
    assert list(policy.order(list(queue), [])) == ["long", "short", "cold1", "lone", "cold2"]
    policy.admitted("long")
    assert list(policy.order([], [])) == ["short", "cold1", "lone", "cold2"]
    many = LongestPrefixAdmission(cache.tree, Clock())
    names = [f"r{i}" for i in range(129)]
    for name in reversed(names):
        many.arrived(name, "", short + fresh(2) if name == "r0" else fresh(40))
    assert list(many.order([], [])) == list(reversed(names))  # above 128 waiting: the queue's own order


def test_lpm_status_aware_orders_as_lpm_and_loads_as_kvflow() -> None:
    """`lpm-status-aware`: SGLang's order, exactly (the same queue gives the same order as `lpm`),
    with KVFlow's loading: queued loads start at once and a batch never waits for a member's load.
    It is kvflow's admission; `kvflow-fcfs`, the ablation of its order, keeps kvflow's eviction and
    prefetch with status-aware admission in arrival order."""
    from kvflow_ray.core.scheduler import resolve_policy

    cache = TieredCache(100_000, EVICTION.create("lru"))
    long, short, cold = fresh(300), fresh(100), fresh(64)
    for prompt in (long, short):
        cache.alloc(len(prompt))
        cache.commit(prompt, len(prompt))
    queue = {"cold1": cold + fresh(3), "short": short + fresh(3), "cold2": cold + fresh(4), "long": long + fresh(3),
             "lone": fresh(40)}
    orders = []
    for name in ("lpm", "lpm-status-aware"):
        policy = ADMISSION.create(name, PolicyContext(tree=cache.tree, clock=Clock()))
        for request, prompt in queue.items():
            policy.arrived(request, "", prompt)
        orders.append(list(policy.order(list(queue), [])))
    assert orders[0] == orders[1] == ["long", "short", "cold1", "lone", "cold2"]
    assert policy.loads_while_queued and not policy.batch_waits_for_loads
    kvflow, kvflow_fcfs = resolve_policy("kvflow"), resolve_policy("kvflow-fcfs")
    assert (kvflow_fcfs.eviction, kvflow_fcfs.prefetch, kvflow_fcfs.host_tier) == (
        kvflow.eviction, kvflow.prefetch, kvflow.host_tier)
    assert (kvflow.admission, kvflow_fcfs.admission) == ("lpm-status-aware", "status-aware")


def test_an_order_over_a_thousand_queued_requests_names_each_once() -> None:
    """The order is a generator the scheduler stops early (what a decision costs is measured in
    benchmarks/queue_aware.py); read whole, it names every request once, deferred siblings aside."""
    cache = TieredCache(1_000_000, EVICTION.create("lru"))
    systems = [fresh(256) for _ in range(20)]
    for prompt in systems[:10]:
        cache.alloc(256)
        cache.commit(prompt, 256)
    policy = queue_aware(cache.tree)
    waiting = list(range(1000))
    for i in waiting:
        policy.arrived(i, "", systems[i % 20] + fresh(16))
    order = policy.order(waiting, waiting)
    first = next(iter(order))
    assert first in waiting
    rest = list(order)
    assert len(rest) == len(set(rest)) and first not in rest
    # the ten uncached prompts' siblings wait for their pioneers: 10 x 49 of them
    assert len(rest) + 1 == 1000 - 10 * 49


# ---------------------------------------------------------------------------------------------- simulator
@pytest.fixture(scope="module")
def burst() -> dict:
    scenario = workload.burst(requests=96, prompts=12, system=4096, question=64, output=16)
    return run_policies(scenario, load_profile("a10g-llama3.1-8b"), ["hicache", "lpm", "queue-aware"])["results"]


def test_queue_aware_computes_each_shared_prompt_once_in_a_burst(burst: dict) -> None:
    scenario_floor = 12 * 4096 + 96 * 64  # every system prompt once, every question once
    assert burst["queue-aware"]["recomputed_tokens"] == scenario_floor
    assert burst["hicache"]["recomputed_tokens"] > scenario_floor
    assert burst["queue-aware"]["ttft_p50_s"] < burst["lpm"]["ttft_p50_s"] < burst["hicache"]["ttft_p50_s"] * 1.0001
    for result in burst.values():
        assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]
        assert result["wait_p99_s"] <= result["max_wait_s"]


def test_kvflow_computes_shared_prompts_less_than_in_arrival_order_and_keeps_what_the_queue_needs() -> None:
    """A burst of 96 requests over 12 uncached 4k-token prompts (more than the device holds): in
    arrival order (`kvflow-fcfs`) kvflow computes a prompt again for requests that arrive before its
    first copy is cached; lpm's order (its in-batch prefix check, up to 128 waiting) sends one request
    per uncached prompt ahead of its peers, so kvflow computes less, and the queue moves sooner. Its
    eviction keeps the prompts that queued requests share (their agents are at step 0), so it loads
    none back where lpm's LRU loads some, and the queue moves sooner than under lpm too."""
    scenario = workload.burst(requests=96, prompts=12, system=4096, question=64, output=16)
    results = run_policies(scenario, load_profile("a10g-llama3.1-8b"), ["lpm", "kvflow", "kvflow-fcfs"])["results"]
    kvflow, lpm, fcfs = results["kvflow"], results["lpm"], results["kvflow-fcfs"]
    assert kvflow["recomputed_tokens"] < fcfs["recomputed_tokens"]
    assert kvflow["ttft_p50_s"] < fcfs["ttft_p50_s"]
    assert kvflow["loaded_tokens"] < lpm["loaded_tokens"]
    assert kvflow["ttft_p50_s"] < lpm["ttft_p50_s"] and kvflow["latency_s"] < lpm["latency_s"]


def test_without_sharing_queue_aware_is_fcfs() -> None:
    scenario = workload.burst(requests=40, prompts=40, system=1024, question=32, output=16)
    out = run_policies(scenario, load_profile("h100-qwen2.5-32b"), ["hicache", "queue-aware", "kvflow-qa"])["results"]
    assert out["queue-aware"] == out["hicache"] and out["kvflow-qa"]["latency_s"] == out["hicache"]["latency_s"]


def test_fanout_workers_hit_the_prompt_their_pioneer_computed() -> None:
    scenario = workload.fanout(workers=8, clients=4, fixed=2048, dynamic=64, output=16, iterations=1)
    out = run_policies(scenario, load_profile("a10g-llama3.1-8b"), ["kvflow", "kvflow-qa"])["results"]
    assert out["kvflow-qa"]["recomputed_tokens"] < out["kvflow"]["recomputed_tokens"]
    assert out["kvflow-qa"]["latency_s"] < out["kvflow"]["latency_s"]


# ---------------------------------------------------------------------------------------------- CLI
def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_runs_the_burst_and_fanout_scenarios_with_the_new_fields() -> None:
    proc = run_cli("--scenario", "burst", "--requests", "24", "--prompts", "3", "--system", "512", "--seed", "2",
                   "--policies", "hicache,lpm,queue-aware,kvflow-qa", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["params"]["seed"] == 2 and out["params"]["prompts"] == 3
    for result in out["results"].values():
        assert {"ttft_p50_s", "ttft_p99_s", "max_wait_s", "wait_p99_s"} <= set(result)
    proc = run_cli("--scenario", "fanout", "--workers", "4", "--clients", "2", "--fixed", "256",
                   "--policies", "kvflow,kvflow-qa")
    assert proc.returncode == 0, proc.stderr
    assert "ttft p50" in proc.stdout and "kvflow-qa" in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--scenario", "burst", "--window", "-1"], "--window and --skew must be >= 0"),
    (["--scenario", "burst", "--prompts", "0"], "--prompts must be at least 1"),
    (["--scenario", "fanout", "--workers", "0"], "--workers must be at least 1"),
])
def test_cli_refuses_bad_queue_scenarios_with_a_message(args: list[str], message: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_queue_aware_ranks_the_oldest_window_of_the_queue_and_moves_it_up() -> None:
    policy = queue_aware(RadixTree(), window=2)
    waiting = ["a", "b", "c", "d"]
    for name in waiting:
        policy.arrived(name, "", fresh(40))
    assert len(policy.pending) == 2 and list(policy.overflow) == ["c", "d"]
    assert list(policy.order(waiting, waiting)) == ["a", "b"]
    policy.admitted("a")  # in flight (still in the tree); the window takes the next oldest
    assert list(policy.order(waiting[1:], waiting[1:])) == ["b", "c"]
    policy.done("d")  # cancelled while outside the window
    policy.done("b")
    assert list(policy.order(["c"], ["c"])) == ["c"] and not policy.overflow
    policy.done("a")
    assert len(policy.pending) == 1 and policy.queued == 1
