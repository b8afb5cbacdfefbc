"""Tenant isolation on SGLang's real trees: the adapter's `cache_salt` is SGLang's own request field, SGLang
keys its radix tree by it, and the plugin names prefixes (cache events for the router), tags and prefetches
per namespace."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import sglang_caches as sc

from kvflow_ray.core.prefetch import Load
from kvflow_ray.engines.base import prefix_hash
from kvflow_ray.engines.sglang import hooks, protocol
from kvflow_ray.engines.sglang.engine import SglangRequest, generate_kwargs
from kvflow_ray.engines.sglang.state import node_namespace, node_tags, reset_state, state


@pytest.fixture(params=sc.TREES)
def rig(request: pytest.FixtureRequest, sglang_plugin: None) -> sc.CacheRig:
    reset_state()
    return sc.build(request.param, "kvflow")


def test_the_adapters_cache_salt_is_sglangs_request_field() -> None:
    """What the adapter passes to `Engine.async_generate` binds to its signature, and SGLang's request
    object keeps the salt (it reaches the scheduler's `Req.cache_salt`, which keys the tree)."""
    import sglang
    from sglang.srt.managers.io_struct import GenerateReqInput

    req = SglangRequest(rid="kvflow-1", tokens=(5, 6, 7), params={"max_new_tokens": 1}, cache_salt="tenant-a")
    kwargs = generate_kwargs(req)
    inspect.signature(sglang.Engine.async_generate).bind(None, **kwargs)  # raises on an unknown argument
    obj = GenerateReqInput(**kwargs)
    obj.normalize_batch_and_arguments()
    assert obj.cache_salt == "tenant-a" and obj.input_ids == [5, 6, 7]


def test_two_salts_share_no_prefix(rig: sc.CacheRig) -> None:
    tokens = list(range(100, 164))
    rig.serve(tokens, cache_salt="a")
    assert rig.matched(tokens, "a") == len(tokens)
    assert rig.matched(tokens, "b") == 0 and rig.matched(tokens) == 0  # neither another salt nor none
    before = rig.evictable()
    rig.serve(tokens, cache_salt="b")  # the same tokens again: computed and stored a second time
    assert rig.evictable() == before + len(tokens)
    assert rig.matched(tokens, "b") == len(tokens)
    node_a = rig.node(rig.match(tokens, "a").last_device_node)
    node_b = rig.node(rig.match(tokens, "b").last_device_node)
    assert node_a is not node_b and (node_namespace(node_a), node_namespace(node_b)) == ("a", "b")


def test_tags_and_event_hashes_are_per_namespace(rig: sc.CacheRig) -> None:
    """The same fixed prompt in two tenants' workflows: each copy carries only its own workflow's tag, and
    the router hears of two prefixes, each under its salted hash (the default namespace: unsalted)."""
    fixed = list(range(100, 150))
    rig.serve([*fixed, 1, 2], "t1/c1", "planner", fixed=len(fixed), cache_salt="t1")
    rig.serve([*fixed, 3, 4], "t2/c1", "planner", fixed=len(fixed), cache_salt="t2")
    rig.serve([*fixed, 5, 6], "c0", "planner", fixed=len(fixed))
    for salt, tag in (("t1", ("t1/c1", "planner")), ("t2", ("t2/c1", "planner")), (None, ("c0", "planner"))):
        match = rig.match(fixed, salt)
        assert match.device_prefix_len == len(fixed)
        assert set(node_tags(rig.node(match.last_device_node))) == {tag}
    stored = {(e["kind"], e["tier"], e["prefix_hash"], e["tokens"]) for e in state().events}
    hashes = [prefix_hash(fixed, "t1"), prefix_hash(fixed, "t2"), prefix_hash(fixed)]
    assert {("stored", "gpu", h, len(fixed)) for h in hashes} <= stored and len(set(hashes)) == 3


def test_hints_give_prefetch_the_workflows_namespace(rig: sc.CacheRig) -> None:
    """The plugin's prefetch step asks the cache for each agent's prompt in its workflow's namespace,
    nearest first; on a real tree (no host tier on CPU) there is nothing to load."""
    st = state()
    fixed = list(range(100, 140))
    rig.hints(protocol.encode_hints(
        {"t1/c1": {"planner": 0}, "c0": {"planner": 1}},
        {("t1/c1", "planner"): fixed, ("c0", "planner"): fixed}, salts={"t1/c1": "t1"}))
    asked: list[tuple[tuple[str, str], str, float]] = []

    class Recording(hooks.SGLangPrefetchTarget):
        def load_prompt(self, tag: tuple[str, str], tokens: Sequence[int], namespace: str, steps: float,
                        reserved: int) -> Load:
            asked.append((tag, namespace, steps))
            return super().load_prompt(tag, tokens, namespace, steps, reserved)

    scheduler = SimpleNamespace(tree_cache=rig.cache, waiting_queue=[])
    assert hooks.start_prefetches(rig.cache, scheduler, Recording(rig.cache)) == 0
    assert asked == [(("t1/c1", "planner"), "t1", 0.0), (("c0", "planner"), "", 1.0)]
    rig.hints(protocol.encode_hints(retire=["t1/c1"]))
    assert st.book.salt("t1/c1") == ""
