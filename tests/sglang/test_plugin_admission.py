"""Status-aware admission through SGLang's own `PrefillAdder` (the plugin's subclass, chosen by the
hooked `Scheduler.get_prefill_adder_class`) and `SchedulePolicy.calc_priority` (hooked to order the
waiting queue), on a real cache and real `Req`s; prefetch outcomes in the plugin's `PrefetchLedger`.

A prefetch in flight cannot be started on CPU (HiCache's host pool needs CUDA), so the test marks
the nodes of one prompt as loading in the plugin's state, exactly as `SGLangPrefetchTarget` does after
`UnifiedRadixCache.load_back`; everything else is SGLang's admission code."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import sglang_caches as sc
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams

from kvflow_ray.engines.sglang.hooks import KVFlowPrefillAdder
from kvflow_ray.engines.sglang.state import path_to_root, reset_state, state

A = list(range(100, 300))
B = list(range(500, 700))


def waiting_req(rig: sc.CacheRig, tokens: list[int], rid: str) -> Req:
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=4))
    req.init_next_round_input(rig.cache)  # what the scheduler does before offering it to the adder
    return req


def adder_for(rig: sc.CacheRig) -> PrefillAdder:
    scheduler = SimpleNamespace(tree_cache=rig.cache)  # the hooked method reads only the cache
    cls = Scheduler.get_prefill_adder_class(scheduler)
    return cls(1, rig.cache, rig.allocator, None, 1.0, 100_000, 100_000)


def serving_rig(tree: str, policy_config: dict[str, str] | None = None) -> sc.CacheRig:
    """A kvflow cache (the plugin's config `policy_config`) holding prompts A and B."""
    reset_state()
    rig = sc.build(tree, "kvflow", policy_config=policy_config)
    rig.serve(A, "c1", "a", fixed=len(A))
    rig.serve(B, "c1", "b", fixed=len(B))
    return rig


@pytest.fixture(params=sc.TREES)
def rig(request: pytest.FixtureRequest, sglang_plugin: None) -> sc.CacheRig:
    return serving_rig(request.param)


def test_kvflow_cache_gets_the_status_aware_adder_and_lru_the_plain_one(rig: sc.CacheRig) -> None:
    assert type(adder_for(rig)) is KVFlowPrefillAdder
    plain = sc.build(rig.tree, "lru")
    assert type(adder_for(plain)) is PrefillAdder


def test_gate_skips_a_loading_request_and_admits_a_ready_one(rig: sc.CacheRig) -> None:
    ra, rb = waiting_req(rig, [*A, 1, 2, 3], "ra"), waiting_req(rig, [*B, 4, 5, 6], "rb")
    assert ra.prefix_len == len(A) and rb.prefix_len == len(B)
    st = state()
    st.loading_ids.update(node.id for node in path_to_root(rig.node(ra.last_node)))  # A's prompt is loading

    adder = adder_for(rig)
    # skipped with CONTINUE, so the scheduler goes on to the next request in the queue
    assert adder.add_one_req(ra, False, None) == AddReqResult.CONTINUE
    assert adder.can_run_list == []
    assert adder.add_one_req(rb, False, None) == AddReqResult.CONTINUE
    assert [r.rid for r in adder.can_run_list] == ["rb"]
    assert st.counters.held == 1
    assert st.counters.prompt_tokens == {"gpu": len(B), "cpu": 0, "miss": 3}

    # the copy lands: the next pass admits the held request and counts the time it waited
    st.loading_ids.clear()
    adder = adder_for(rig)
    assert adder.add_one_req(ra, False, None) == AddReqResult.CONTINUE
    assert [r.rid for r in adder.can_run_list] == ["ra"]
    assert st.counters.stall_s > 0
    assert "ra" not in st.held_since


@pytest.mark.parametrize("tree", sc.TREES)
def test_sglangs_queue_order_puts_loading_requests_behind_ready_ones(tree: str, sglang_plugin: None) -> None:
    """Status-aware admission orders the waiting queue through the hooked `SchedulePolicy.calc_priority`
    (in place, the scheduler's own list): ready requests first, in SGLang's order."""
    rig = serving_rig(tree, {"admission": "status-aware"})
    ra, rb = waiting_req(rig, [*A, 1], "ra"), waiting_req(rig, [*B, 2], "rb")
    state().loading_ids.update(node.id for node in path_to_root(rig.node(ra.last_node)))
    queue = [ra, rb]
    SchedulePolicy("fcfs", rig.cache, False, False, False).calc_priority(queue)
    assert [r.rid for r in queue] == ["rb", "ra"]
    state().loading_ids.clear()
    SchedulePolicy("fcfs", rig.cache, False, False, False).calc_priority(queue)
    assert [r.rid for r in queue] == ["rb", "ra"], "nothing loading: SGLang's order is kept"


def test_kvflows_queue_order_is_the_longest_cached_prefix_first(rig: sc.CacheRig) -> None:
    """kvflow's default admission (`lpm-status-aware`) orders the queue through the same hook by
    cached prefix, a loading request included: the adder passes over it while it loads."""
    assert type(state().admission).__name__ == "LongestPrefixStatusAware"
    ra, rb = waiting_req(rig, [*B[:120], 3], "ra"), waiting_req(rig, [*A, 1], "rb")
    assert (ra.prefix_len, rb.prefix_len) == (120, len(A))
    state().loading_ids.update(node.id for node in path_to_root(rig.node(rb.last_node)))
    queue = [ra, rb]
    SchedulePolicy("fcfs", rig.cache, False, False, False).calc_priority(queue)
    assert [r.rid for r in queue] == ["rb", "ra"]
    adder = adder_for(rig)
    assert adder.add_one_req(rb, False, None) == AddReqResult.CONTINUE  # loading: passed over
    assert adder.add_one_req(ra, False, None) == AddReqResult.CONTINUE and ra in adder.can_run_list


def test_a_loading_request_is_held_even_alone(rig: sc.CacheRig) -> None:
    """SGLang's batch waits only on loads it queued itself, and a prefetched node shows device
    indices before its copy ends: admitting it would read KV still being written."""
    ra = waiting_req(rig, [*A, 1], "alone")
    state().loading_ids.add(rig.node(ra.last_node).id)
    adder = adder_for(rig)
    assert adder.add_one_req(ra, False, None) == AddReqResult.CONTINUE
    assert adder.can_run_list == []


def test_a_request_sharing_only_a_ready_ancestor_is_not_held(rig: sc.CacheRig) -> None:
    """Loading is a property of the nodes a request needs: a prompt that shares only an ancestor of
    a loading node is ready."""
    shared = A[:50] + list(range(900, 950))
    rig.serve(shared)
    ra = waiting_req(rig, [*A, 1], "ra")
    rs = waiting_req(rig, [*shared, 2], "rs")
    loading_tail = rig.node(ra.last_node)  # A's own part below the split at 50
    state().loading_ids.add(loading_tail.id)
    adder = adder_for(rig)
    adder.add_one_req(ra, False, None)
    adder.add_one_req(rs, False, None)
    assert [r.rid for r in adder.can_run_list] == ["rs"]


def test_a_prefetched_prompt_is_counted_used_when_a_request_reads_it(rig: sc.CacheRig) -> None:
    st = state()
    anchor = rig.node(rig.match(A).last_device_node)
    st.loading_started(("c1", "a"), anchor, [anchor], len(anchor.key), now=0.0)
    assert st.counters.ledger.as_dict()["issued"] == 1
    st.reap(still_loading=set(), attached=lambda node: True)  # SGLang acked the copy
    assert st.counters.ledger.as_dict()["completed"] == 1 and not st.loading_ids
    adder = adder_for(rig)
    adder.add_one_req(waiting_req(rig, [*A, 7], "user"), False, None)
    assert st.counters.ledger.as_dict() == {"issued": 1, "completed": 1, "used": 1, "wasted": 0}


def prefetch_two_nodes(rig: sc.CacheRig) -> list[object]:
    """A's prompt split in two nodes (another prompt shares its first 50 tokens), both loaded by one
    prefetch, landed."""
    rig.serve(A[:50] + list(range(900, 950)))
    head = rig.node(rig.match(A[:50]).last_device_node)
    tail = rig.node(rig.match(A).last_device_node)
    assert tail.parent is head
    st = state()
    st.loading_started(("c1", "a"), tail, [head, tail], len(A), now=0.0)
    st.reap(still_loading=set(), attached=lambda node: True)
    return [head, tail]


def test_a_prefetch_is_used_when_a_request_reads_any_of_its_nodes(rig: sc.CacheRig) -> None:
    """One definition for every engine (core.prefetch.PrefetchLedger): a request whose cached prefix
    holds only the first of the loaded nodes used the prefetch too."""
    prefetch_two_nodes(rig)
    adder = adder_for(rig)
    adder.add_one_req(waiting_req(rig, [*A[:50], 1, 2], "head-only"), False, None)
    assert state().counters.ledger.as_dict()["used"] == 1


def test_a_prefetch_is_wasted_once_all_its_nodes_left_the_device_unused(rig: sc.CacheRig) -> None:
    st = state()
    head, tail = prefetch_two_nodes(rig)
    gone: set[int] = set()

    def attached(node: object) -> bool:
        return id(node) not in gone

    gone.add(id(tail))  # the tail left the tree: the head still holds part of the load
    st.reap(still_loading=set(), attached=attached)
    assert st.counters.ledger.as_dict()["wasted"] == 0 and st.counters.ledger.tracked() == [head.id]
    gone.add(id(head))
    st.reap(still_loading=set(), attached=attached)
    assert st.counters.ledger.as_dict()["wasted"] == 1 and not st.prefetched
