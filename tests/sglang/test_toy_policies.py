"""A new policy is one class plus one registration, and the SGLang plugin runs it with no plugin change
(the simulator's and the CPU engine's side: tests/test_toy_policies.py). Toy eviction, admission and
prefetch policies are registered through the core registries alone and chosen by
`--radix-eviction-policy-config`, which SGLang itself hands to the plugin's strategy; each then acts
on SGLang 0.5.23's real trees, `SchedulePolicy` and `PrefillAdder`.

HiCache's host pool needs CUDA, so on CPU no prompt is ever on the host tier: the prefetch test
stands in for the load-back alone (as test_plugin_admission marks a load), and everything around it
(the policy's choice, the in-flight cap, the ledger) is the plugin's."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import TypeVar

import pytest
import sglang_caches as sc
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from toy_policies import MostRecentlyUsed, NearestOnly

from kvflow_ray.core.admission import ADMISSION, AdmissionPolicy, ArrivalAdmission
from kvflow_ray.core.policies import EVICTION, EvictionPolicy
from kvflow_ray.core.prefetch import PREFETCH, Load, PrefetchPolicy
from kvflow_ray.core.radix import Tag
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.engines.sglang import hooks, protocol
from kvflow_ray.engines.sglang.state import monotonic, path_to_root, reset_state, state

R = TypeVar("R")


class ShortestFirst(ArrivalAdmission):
    """Admit the shortest prompt first; loads only once admitted; a batch waits for its loads."""

    name = "toy-shortest-first"
    loads_while_queued = False
    batch_waits_for_loads = True

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> list[R]:
        return sorted(waiting, key=lambda req: len(req.origin_input_ids))


def _mru(context: PolicyContext) -> EvictionPolicy:
    """toy: most recently used first"""
    return MostRecentlyUsed()


def _shortest_first(context: PolicyContext) -> AdmissionPolicy:
    """toy: shortest prompt first"""
    return ShortestFirst()


def _nearest_only(context: PolicyContext) -> PrefetchPolicy:
    """toy: the nearest agent only"""
    return NearestOnly()


@pytest.fixture
def toys(sglang_plugin: None) -> Iterator[None]:
    EVICTION.register("toy-mru", _mru)
    ADMISSION.register("toy-shortest-first", _shortest_first)
    PREFETCH.register("toy-nearest-only", _nearest_only)
    yield
    EVICTION.unregister("toy-mru")
    ADMISSION.unregister("toy-shortest-first")
    PREFETCH.unregister("toy-nearest-only")


def tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def waiting_req(rig: sc.CacheRig, prompt: list[int], rid: str) -> Req:
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", prompt),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=4))
    req.init_next_round_input(rig.cache)
    return req


# ------------------------------------------------------------------------------------------ eviction
def gone_after_each_eviction(rig: sc.CacheRig, prompts: dict[str, list[int]]) -> list[str]:
    """Evict one prompt's worth at a time; which prompt left the device each time."""
    gone: list[str] = []
    for _ in prompts:
        rig.evict(len(next(iter(prompts.values()))))
        gone += [name for name, p in prompts.items() if rig.matched(p) == 0 and name not in gone]
    return gone


@pytest.mark.parametrize("tree", sc.TREES)
def test_a_registered_eviction_policy_orders_sglangs_evictions(toys: None, tree: str) -> None:
    prompts = {"a": tokens(40, 1000), "b": tokens(40, 2000), "c": tokens(40, 3000)}  # served a, b, c
    orders = {}
    for eviction in ("toy-mru", "lru"):
        reset_state()
        rig = sc.build(tree, "kvflow", policy_config={"eviction": eviction})
        assert hooks.uses_kvflow(rig.cache)
        for p in prompts.values():
            rig.serve(p)
        if eviction == "toy-mru":  # no distance: a prefetch may count every unlocked device token
            root = rig.cache.tree_core.root_node if tree == "unified" else rig.cache.root_node
            assert state().farther_evictable(root, 0) == rig.evictable() == 120
        orders[eviction] = gone_after_each_eviction(rig, prompts)
    assert orders == {"toy-mru": ["c", "b", "a"], "lru": ["a", "b", "c"]}


# ----------------------------------------------------------------------------------------- admission
@pytest.fixture(params=sc.TREES)
def shortest_first(request: pytest.FixtureRequest, toys: None) -> sc.CacheRig:
    reset_state()
    return sc.build(request.param, "kvflow", policy_config={"admission": "toy-shortest-first"})


def test_a_registered_admission_policy_orders_sglangs_waiting_queue(shortest_first: sc.CacheRig) -> None:
    rig = shortest_first
    queue = [waiting_req(rig, tokens(n, 100 * n), f"r{n}") for n in (30, 10, 20)]
    same = queue
    SchedulePolicy("fcfs", rig.cache, False, False, False).calc_priority(queue)
    assert queue is same, "the scheduler keeps its list: the order changes in place"
    assert [r.rid for r in queue] == ["r10", "r20", "r30"]

    plain = sc.build(rig.tree, "lru")  # not a kvflow cache: SGLang's own order stays
    queue = [waiting_req(plain, tokens(n, 100 * n), f"r{n}") for n in (30, 10, 20)]
    SchedulePolicy("fcfs", plain.cache, False, False, False).calc_priority(queue)
    assert [r.rid for r in queue] == ["r30", "r10", "r20"]


def test_a_batch_that_waits_for_loads_admits_nothing_behind_a_loading_request(shortest_first: sc.CacheRig) -> None:
    rig = shortest_first
    loading = tokens(40, 5000)
    rig.serve(loading)
    first, behind = waiting_req(rig, [*loading, 1], "loading"), waiting_req(rig, tokens(50, 9000), "ready")
    st = state()
    st.loading_ids.update(node.id for node in path_to_root(rig.node(first.last_node)))
    cls = Scheduler.get_prefill_adder_class(SimpleNamespace(tree_cache=rig.cache))
    adder = cls(1, rig.cache, rig.allocator, None, 1.0, 100_000, 100_000)
    results = []
    for req in (first, behind):  # the scheduler's pass: it stops at the first result other than CONTINUE
        results.append(adder.add_one_req(req, False, None))
        if results[-1] != AddReqResult.CONTINUE:
            break
    assert results == [AddReqResult.OTHER] and adder.can_run_list == [] and st.counters.held == 1


# ------------------------------------------------------------------------------------------ prefetch
class HostTierStandIn(hooks.SGLangPrefetchTarget):
    """The plugin's target with HiCache's load-back stood in for: the prompt's nodes in the real tree
    enter the plugin's state as `SGLangPrefetchTarget` puts them there after `load_back`."""

    def __init__(self, rig: sc.CacheRig) -> None:
        super().__init__(rig.cache)
        self.rig = rig
        self.started: list[Tag] = []

    def load_prompt(self, tag: Tag, prompt: Sequence[int], namespace: str, steps: float, reserved: int) -> Load:
        anchor = self.rig.node(self.rig.match(list(prompt), namespace or None).last_device_node)
        nodes = list(path_to_root(anchor))
        if any(node.id in state().loading_ids for node in nodes):
            return Load.NOTHING  # loading already (SGLang's match finds no host-only part)
        state().loading_started(tag, anchor, nodes, sum(len(n.key) for n in nodes), monotonic())
        self.started.append(tag)
        return Load.STARTED


@pytest.mark.parametrize("prefetch", ["toy-nearest-only", "steps-ahead"])
def test_a_registered_prefetch_policy_chooses_what_the_plugin_loads(toys: None, prefetch: str) -> None:
    reset_state()
    rig = sc.build("unified", "kvflow", policy_config={"prefetch": prefetch, "horizon": 2})
    prompts = {("c1", agent): tokens(40, 1000 * (i + 1)) for i, agent in enumerate(("a", "b", "c"))}
    for (client, agent), p in prompts.items():
        rig.serve(p, client, agent, fixed=len(p))
    rig.hints(protocol.encode_hints({"c1": {"a": 0, "b": 1, "c": 2}}, prompts))
    scheduler = SimpleNamespace(tree_cache=rig.cache, waiting_queue=[])
    target = HostTierStandIn(rig)
    first = hooks.start_prefetches(rig.cache, scheduler, target)
    again = hooks.start_prefetches(rig.cache, scheduler, target)  # the loads are still in flight
    st = state()
    if prefetch == "toy-nearest-only":
        assert (first, again, target.started) == (1, 0, [("c1", "b")])  # one at a time: max_inflight 1
    else:
        assert (first, again, target.started) == (3, 0, [("c1", "a"), ("c1", "b"), ("c1", "c")])
    assert len(st.loading) == first and st.counters.ledger.as_dict()["issued"] == first
