"""Agent tags on SGLang's tree nodes: where they are stamped, and that SGLang's node splits keep them."""

from __future__ import annotations

import pytest
import sglang_caches as sc

from kvflow_ray.core.routing import block_hashes
from kvflow_ray.engines.sglang import hooks, protocol
from kvflow_ray.engines.sglang.state import TAGS_ATTR, NodeView, node_tags, path_to_root, reset_state, state


@pytest.fixture(params=sc.TREES)
def rig(request: pytest.FixtureRequest, sglang_plugin: None) -> sc.CacheRig:
    reset_state()
    return sc.build(request.param, "kvflow")


def tags_at(rig: sc.CacheRig, tokens: list[int]) -> set[tuple[str, str]]:
    match = rig.match(tokens)
    assert match.device_prefix_len == len(tokens)
    return set(node_tags(rig.node(match.last_device_node)))


def test_fixed_prompt_is_tagged_and_the_dynamic_rest_is_not(rig: sc.CacheRig) -> None:
    fixed = list(range(100, 160))
    rig.serve([*fixed, 1, 2, 3, 4], "c1", "planner", fixed=len(fixed))
    assert tags_at(rig, fixed) == {("c1", "planner")}
    assert tags_at(rig, [*fixed, 1, 2, 3, 4]) == set()  # the suffix node, split off at the boundary
    # every node from the root down to the boundary carries the tag (a parent is evicted only after
    # its children, so a shared ancestor must rank by its nearest user)
    node = rig.node(rig.match(fixed).last_device_node)
    assert all(("c1", "planner") in node_tags(n) for n in path_to_root(node))


def test_a_hint_tags_the_cached_prompt_of_an_agent_before_its_first_call(rig: sc.CacheRig) -> None:
    """docs/design.md §3: a new instance of a template finds its agent's prompt cached by a finished
    one; the hint naming the agent tags those nodes at once (as the core engines do)."""
    fixed = list(range(100, 160))
    rig.serve([*fixed, 1, 2], "old", "writer", fixed=len(fixed), cache_salt="t1")
    rig.hints(protocol.encode_hints(retire=["old"]))
    rig.hints(protocol.encode_hints({"new": {"writer": 1}}, {("new", "writer"): fixed}, salts={"new": "t1"}))
    node = rig.node(rig.match(fixed, "t1").last_device_node)
    assert all(("new", "writer") in node_tags(n) for n in path_to_root(node))
    assert state().eviction.node_distance(NodeView(node)) == 1.0
    # the same tokens in another namespace are another prompt: nothing of it is cached, nothing tagged
    rig.hints(protocol.encode_hints({"b": {"writer": 0}}, {("b", "writer"): fixed}, salts={"b": "t2"}))
    assert ("b", "writer") not in node_tags(node)


def test_a_prompt_computed_for_one_instance_carries_its_other_instances_tags(rig: sc.CacheRig) -> None:
    fixed = list(range(100, 160))
    rig.hints(protocol.encode_hints({"first": {"writer": 0}, "second": {"writer": 2}},
                                    {("first", "writer"): fixed, ("second", "writer"): fixed}))
    rig.serve([*fixed, 1, 2], "first", "writer", fixed=len(fixed))
    assert tags_at(rig, fixed) == {("first", "writer"), ("second", "writer")}
    assert tags_at(rig, [*fixed, 1, 2]) == set()


def test_tags_survive_insert_splits(rig: sc.CacheRig) -> None:
    """Agent b's prompt shares a preamble with a's: inserting it splits a's node; SGLang copies
    only the fields it knows onto the new parent, the plugin's hook copies the tags."""
    preamble = list(range(100, 130))
    a = preamble + list(range(200, 240))
    b = preamble + list(range(300, 340))
    rig.serve(a, "c1", "a", fixed=len(a))
    rig.serve(b, "c1", "b", fixed=len(b))
    assert tags_at(rig, preamble) == {("c1", "a"), ("c1", "b")}
    assert tags_at(rig, a) == {("c1", "a")}
    assert tags_at(rig, b) == {("c1", "b")}


def test_tags_survive_lookup_splits(rig: sc.CacheRig) -> None:
    """A look-up that ends inside a node splits it too (SGLang's match_prefix)."""
    a = list(range(100, 180))
    rig.serve(a, "c1", "a", fixed=len(a))
    assert tags_at(rig, a[:33]) == {("c1", "a")}  # split at 33 by this very look-up
    assert tags_at(rig, a) == {("c1", "a")}


def test_untagged_split_stays_untagged(rig: sc.CacheRig) -> None:
    plain = list(range(100, 180))
    rig.serve(plain)
    assert tags_at(rig, plain[:20]) == set()
    assert getattr(rig.node(rig.match(plain[:20]).last_device_node), TAGS_ATTR, None) is None


def test_registered_prompt_sets_the_boundary_without_an_explicit_length(rig: sc.CacheRig) -> None:
    fixed = list(range(100, 150))
    rig.hints(protocol.encode_hints({"c1": {"writer": 1}}, {("c1", "writer"): fixed}))
    rig.serve([*fixed, 7, 8, 9], "c1", "writer")  # no fixed_prefix_tokens: the registered prompt
    assert tags_at(rig, fixed) == {("c1", "writer")}
    assert tags_at(rig, [*fixed, 7, 8, 9]) == set()
    # a call that does not start with the registered prompt has no fixed part
    rig.serve([5, *fixed], "c1", "writer")
    assert tags_at(rig, [5, *fixed]) == set()


def test_malformed_metadata_is_served_untagged_and_logged(rig: sc.CacheRig, caplog: pytest.LogCaptureFixture) -> None:
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    tokens = list(range(100, 140))
    req = Req(rid="bad", origin_input_text="", origin_input_ids=array("q", tokens),
              sampling_params=SamplingParams(max_new_tokens=1, custom_params={"kvflow": {"agent": "a"}}))
    with caplog.at_level("WARNING", logger="kvflow_ray.sglang"):
        hooks.after_checkpoint(None, rig.cache, req, up_to=len(tokens))
    assert "client_id must be a non-empty string" in caplog.text
    rig.serve(tokens)
    assert tags_at(rig, tokens) == set()


def test_fixed_prompt_boundary_is_reported_as_a_cache_event(rig: sc.CacheRig) -> None:
    from kvflow_ray.engines.base import prefix_hash

    fixed = list(range(100, 160))
    rig.serve([*fixed, 1, 2], "c1", "planner", fixed=len(fixed))
    st = state()
    blocks = list(block_hashes(fixed))
    stored = {"kind": "stored", "tier": "gpu", "prefix_hash": prefix_hash(fixed), "tokens": 60, "blocks": blocks}
    assert stored in st.events
    st.events.clear()
    rig.evict(10_000)
    st.check_boundaries(lambda node: hooks.attached(rig.cache, node))
    assert st.events == [{"kind": "removed", "tier": "gpu", "prefix_hash": prefix_hash(fixed), "tokens": 60,
                          "blocks": blocks}]
