"""Queue-aware prefix scheduling on SGLang 0.5.23's own classes: the `lpm` rebuild in core against
SGLang's `SchedulePolicy("lpm").calc_priority` (a differential test on the same cached prompts and the
same waiting queue), and the plugin's `queue-aware` admission through the hooked `calc_priority` and
`PrefillAdder` (pioneers first, their siblings held until the prefix is computed, queued demand on
the tree's nodes for the eviction strategy)."""

from __future__ import annotations

import random
import time
from array import array
from types import SimpleNamespace

import pytest
import sglang_caches as sc
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams

from kvflow_ray.core.admission import LongestPrefixAdmission
from kvflow_ray.core.radix import RadixTree
from kvflow_ray.engines.sglang.state import DEMAND_ATTR, reset_state, state

rng = random.Random(7)


def tokens(n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


P1, P2, P3 = tokens(300), tokens(100), tokens(20)  # prompts cached before the queue forms
X, Y = tokens(64), tokens(48)  # prefixes only the queue shares


def waiting_req(tokens: list[int], rid: str) -> Req:
    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=4))


def queue_shapes() -> list[tuple[str, list[int]]]:
    """Warm requests of different cached lengths, two cold ones sharing a 64-token prefix (the later
    one is SGLang's in-batch duplicate), a short-prefix pair sharing 32 tokens, a lone cold one."""
    s = tokens(20)
    return [("warm-100", [*P2, *tokens(5)]), ("cold-x1", [*X, *tokens(10)]), ("warm-300", [*P1, *tokens(5)]),
            ("cold-x2", [*X, *tokens(12)]), ("short-a", [*P3, *s, 1, 2]), ("short-b", [*P3, *s, 3, 4]),
            ("lone", [*Y, *tokens(8)]), ("tiny", tokens(10))]


@pytest.mark.parametrize("tree", sc.TREES)
def test_lpm_rebuild_orders_the_queue_as_sglangs_own_lpm(tree: str, sglang_plugin: None) -> None:
    reset_state()
    rig = sc.build(tree, "lru")  # stock SGLang: the plugin stays out of an lru cache
    core_tree = RadixTree()
    for prompt in (P1, P2, P3):
        rig.serve(prompt)
        core_tree.insert(prompt)
    shapes = queue_shapes()
    queue = [waiting_req(t, rid) for rid, t in shapes]
    SchedulePolicy("lpm", rig.cache, False, False, False).calc_priority(queue)

    ours = LongestPrefixAdmission(core_tree, time.monotonic)
    for rid, t in shapes:
        ours.arrived(rid, "", t)
    assert list(ours.order([rid for rid, _t in shapes], [])) == [r.rid for r in queue]
    # the documented behaviour itself: longest cached prefix first, the in-batch duplicates last
    assert [r.rid for r in queue][:2] == ["warm-300", "warm-100"]
    assert [r.rid for r in queue][-2:] == ["cold-x2", "short-b"]


@pytest.mark.parametrize("tree", sc.TREES)
def test_lpm_rebuild_keeps_the_queue_order_above_128_waiting_as_sglang_does(tree: str, sglang_plugin: None) -> None:
    reset_state()
    rig = sc.build(tree, "lru")
    core_tree = RadixTree()
    rig.serve(P1)
    core_tree.insert(P1)
    shapes = [(f"r{i}", [*P1, *tokens(3)] if i % 3 == 0 else tokens(40)) for i in range(130)]
    queue = [waiting_req(t, rid) for rid, t in shapes]
    SchedulePolicy("lpm", rig.cache, False, False, False).calc_priority(queue)
    ours = LongestPrefixAdmission(core_tree, time.monotonic)
    for rid, t in shapes:
        ours.arrived(rid, "", t)
    assert list(ours.order([rid for rid, _t in shapes], [])) == [r.rid for r in queue] == [rid for rid, _t in shapes]


QUEUE_AWARE = {"eviction": "demand-lru", "prefetch": "none", "admission": "queue-aware"}


@pytest.fixture(params=sc.TREES)
def rig(request: pytest.FixtureRequest, sglang_plugin: None) -> sc.CacheRig:
    reset_state()
    rig = sc.build(request.param, "kvflow", policy_config=QUEUE_AWARE)
    rig.serve(P1)
    return rig


def adder_for(rig: sc.CacheRig) -> object:
    return Scheduler.get_prefill_adder_class(SimpleNamespace(tree_cache=rig.cache))(
        1, rig.cache, rig.allocator, None, 1.0, 100_000, 100_000)


def rank(rig: sc.CacheRig, queue: list[Req]) -> list[str]:
    SchedulePolicy("fcfs", rig.cache, False, False, False).calc_priority(queue)
    return [r.rid for r in queue]


def test_queue_aware_runs_one_pioneer_per_cold_prefix_and_its_siblings_once_it_is_cached(rig: sc.CacheRig) -> None:
    assert type(state().admission).__name__ == "QueueAwareAdmission"
    pioneer, sibling = waiting_req([*X, *tokens(10)], "pioneer"), waiting_req([*X, *tokens(10)], "sibling")
    warm = waiting_req([*P1, *tokens(5)], "warm")
    queue = [pioneer, sibling, warm]
    order = rank(rig, queue)
    assert order[0] == "warm", "a request with its prefix cached goes first"
    assert order[-1] == "sibling", "the sibling waits behind its pioneer"

    # the pioneer enters a batch: while its prefill runs the sibling stays held back
    pioneer.init_next_round_input(rig.cache)
    adder = adder_for(rig)
    adder.add_one_req(pioneer, False, None)
    assert [r.rid for r in adder.can_run_list] == ["pioneer"]
    queue.remove(pioneer)
    assert rank(rig, queue) == ["warm", "sibling"]
    assert "pioneer" in state().prefilling

    # its prompt is computed and cached: the sibling is warm now, and ranked with the warm requests
    rig.serve(list(pioneer.origin_input_ids))
    pioneer.output_ids = array("q", [1])
    state().settle_prefills()
    assert "pioneer" not in state().prefilling
    assert set(rank(rig, queue)) == {"warm", "sibling"}
    assert sibling.num_matched_prefix_tokens >= len(X)


def test_queued_demand_ranks_a_node_after_one_no_queued_request_needs(rig: sc.CacheRig) -> None:
    rig.serve(P2)
    queue = [waiting_req([*P1, *tokens(5)], "a"), waiting_req([*P1, *tokens(6)], "b"), waiting_req(tokens(40), "c")]
    rank(rig, queue)
    demanded = rig.node(rig.match(P1).last_device_node)
    idle = rig.node(rig.match(P2).last_device_node)
    assert getattr(demanded, DEMAND_ATTR) == 2 and getattr(idle, DEMAND_ATTR, 0) == 0
    assert state().priority(idle) < state().priority(demanded)  # the smaller key is evicted first
    # once nobody waits for it, its mark goes
    rank(rig, [queue[2]])
    assert getattr(demanded, DEMAND_ATTR) == 0


def test_a_request_that_leaves_the_queue_unadmitted_is_forgotten(rig: sc.CacheRig) -> None:
    queue = [waiting_req(tokens(40), "stays"), waiting_req(tokens(40), "aborted")]
    rank(rig, queue)
    assert set(state().queued) == {"stays", "aborted"}
    rank(rig, queue[:1])
    assert set(state().queued) == {"stays"}
    assert len(state().admission.pending) == 1
