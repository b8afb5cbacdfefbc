"""Property and unit tests for the paged radix tree (`kvflow_ray.core.radix`).

The tree is checked against a brute-force model: the list of inserted token sequences (for matches) and
the list of tagged prefixes (for agent tags). Alphabets are tiny so prefixes collide and nodes split often.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow_ray.core.radix import GpuState, Match, RadixNode, RadixTree, Tier

PAGE_SIZES = st.sampled_from([1, 2, 4])
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=14)
LONG_TOKENS = st.lists(st.integers(0, 2), min_size=2, max_size=16)
WORKFLOWS = ("w0", "w1")
AGENTS = ("a", "b")


# ---------------------------------------------------------------------- brute-force helpers
def aligned(tokens: list[int] | tuple[int, ...], page: int) -> tuple[int, ...]:
    return tuple(tokens[: len(tokens) - len(tokens) % page])


def common_pages(a: tuple[int, ...], b: tuple[int, ...], page: int) -> int:
    """Length of the common prefix of a and b, rounded down to whole pages."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n - n % page


def longest_match(query: tuple[int, ...], cached: list[tuple[int, ...]], page: int) -> int:
    q = aligned(query, page)
    return max((common_pages(q, s, page) for s in cached), default=0)


def root_sequence(node: RadixNode) -> tuple[int, ...]:
    """Tokens from the root down to the end of `node`, walking parent links."""
    keys: list[tuple[int, ...]] = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def all_sequences(tree: RadixTree) -> dict[RadixNode, tuple[int, ...]]:
    """Every node with its root-to-node token sequence, by explicit traversal."""
    out: dict[RadixNode, tuple[int, ...]] = {}
    stack = [(child, child.key) for child in tree.root.children.values()]
    while stack:
        node, seq = stack.pop()
        out[node] = seq
        stack.extend((c, seq + c.key) for c in node.children.values())
    return out


def check_path(match: Match, query: tuple[int, ...], tree: RadixTree) -> None:
    """The match path is a chain from the root that spells the first `length` tokens of the query."""
    parent = tree.root
    spelled: tuple[int, ...] = ()
    for node in match.path:
        assert node.parent is parent
        spelled += node.key
        parent = node
    assert len(spelled) == match.length
    assert spelled == tuple(query[: match.length])


def insert_all(tree: RadixTree, sequences: list[list[int]]) -> list[tuple[int, ...]]:
    cached = []
    for seq in sequences:
        key = aligned(seq, tree.page_size)
        before = longest_match(key, cached, tree.page_size)
        path, new = tree.insert(seq, gpu_value=key)
        assert new == len(key) - before  # only the uncached remainder becomes new device KV
        assert sum(len(n) for n in path) == len(key)
        if key:
            cached.append(key)
        tree.check_invariants()
    return cached


# ---------------------------------------------------------------------- properties
@settings(max_examples=200, deadline=None)
@given(page=PAGE_SIZES, sequences=st.lists(TOKENS, max_size=10), queries=st.lists(TOKENS, min_size=1, max_size=8),
       split=st.booleans())
def test_match_is_longest_page_aligned_prefix(page: int, sequences: list[list[int]], queries: list[list[int]],
                                             split: bool) -> None:
    tree = RadixTree(page)
    cached = insert_all(tree, sequences)
    for q in queries:
        m = tree.match_prefix(q, split=split)
        check_path(m, tuple(q), tree)
        expected = longest_match(tuple(q), cached, page)
        if split:
            assert m.length == expected
        else:
            # without splitting, a match ends on the last node boundary at or before the common prefix
            assert m.length <= expected
            parent = m.last or tree.root
            if m.length < expected:
                child = tree.child(parent, q[m.length:m.length + page])
                assert child is not None
                assert m.length + len(child.key) > expected
        assert m.length % page == 0
        tree.check_invariants()
    # the tree holds exactly the prefixes of what was inserted
    seqs = all_sequences(tree)
    for seq in seqs.values():
        assert any(s[: len(seq)] == seq for s in cached)
    for s in cached:
        assert s in seqs.values()


@settings(max_examples=100, deadline=None)
@given(page=PAGE_SIZES, sequences=st.lists(TOKENS, min_size=1, max_size=8), queries=st.lists(TOKENS, max_size=6))
def test_payload_slices_follow_splits(page: int, sequences: list[list[int]], queries: list[list[int]]) -> None:
    """The payload of each node stays the slice of its own tokens through splits (any sliceable value)."""
    tree = RadixTree(page)
    insert_all(tree, sequences)
    for q in queries:
        tree.match_prefix(q)
    for node in tree.nodes():
        assert node.gpu is GpuState.READY
        assert node.gpu_value == node.key


class TagMachine(RuleBasedStateMachine):
    """Tags survive splits: a node carries a tag iff its tokens lie within a prefix tagged with it.

    Model: for each tag, the prefixes (page-aligned matched part of the fixed prompt) tagged so far.
    Nothing is evicted here, so a tagged region stays cached and only gets split further."""

    @initialize(page=PAGE_SIZES)
    def setup(self, page: int) -> None:
        self.tree = RadixTree(page)
        self.page = page
        self.cached: list[tuple[int, ...]] = []
        self.regions: dict[tuple[str, str], list[tuple[int, ...]]] = {}

    @rule(seq=TOKENS)
    def insert(self, seq: list[int]) -> None:
        key = aligned(seq, self.page)
        before = longest_match(key, self.cached, self.page)
        _path, new = self.tree.insert(seq)
        assert new == len(key) - before
        if key:
            self.cached.append(key)

    @rule(seq=TOKENS, split=st.booleans())
    def match(self, seq: list[int], split: bool) -> None:
        m = self.tree.match_prefix(seq, split=split)
        check_path(m, tuple(seq), self.tree)
        if split:
            assert m.length == longest_match(tuple(seq), self.cached, self.page)

    @rule(data=st.data(), wf=st.sampled_from(WORKFLOWS), agent=st.sampled_from(AGENTS))
    def tag(self, data: st.DataObject, wf: str, agent: str) -> None:
        # usually a prefix of something cached (a real fixed prompt), sometimes an arbitrary sequence
        if self.cached and data.draw(st.booleans()):
            base = list(data.draw(st.sampled_from(self.cached)))
            prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(0, 2), max_size=3))
        else:
            prompt = data.draw(TOKENS)
        path = self.tree.tag_prefix(prompt, (wf, agent))
        length = sum(len(n) for n in path)
        assert length == longest_match(tuple(prompt), self.cached, self.page)
        self.regions.setdefault((wf, agent), []).append(tuple(prompt[:length]))
        # the node ending the tagged region ends exactly at the boundary (split there)
        if path:
            assert root_sequence(path[-1]) == tuple(prompt[:length])

    @rule(wf=st.sampled_from(WORKFLOWS))
    def untag(self, wf: str) -> None:
        self.tree.untag_workflow(wf)
        for tag in [t for t in self.regions if t[0] == wf]:
            del self.regions[tag]
        assert not self.tree.workflow_nodes(wf)
        assert all(t[0] != wf for n in self.tree.nodes() for t in n.tags)

    @invariant()
    def invariants(self) -> None:
        self.tree.check_invariants()

    @invariant()
    def tags_match_model(self) -> None:
        for node, seq in all_sequences(self.tree).items():
            expected = {tag for tag, regions in self.regions.items()
                        if any(len(r) >= len(seq) and r[: len(seq)] == seq for r in regions)}
            assert node.tags == expected, (seq, node.tags, expected)
        for wf in WORKFLOWS:
            assert self.tree.workflow_nodes(wf) == {n for n in self.tree.nodes() if any(t[0] == wf for t in n.tags)}


TagMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
test_tags_survive_splits = TagMachine.TestCase


class TierMachine(RuleBasedStateMachine):
    """The tree alone, driven through its tier API (write-back, drop, load), with random locks: the
    accounting in `check_invariants` never drifts and the tree only ever holds prefixes of what was
    inserted. (The eviction *decisions* are tested on `TieredCache` in test_cache_policies.py.)"""

    @initialize(page=PAGE_SIZES, seed=st.lists(LONG_TOKENS, min_size=1, max_size=4))
    def setup(self, page: int, seed: list[list[int]]) -> None:
        self.tree = RadixTree(page)
        self.page = page
        self.cached: list[tuple[int, ...]] = []
        self.locked: list[RadixNode] = []
        for seq in seed:
            self.insert(seq)

    # candidates of each rule (rules only run when they have one, so every step does something)
    def _write_back(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.READY and not n.cpu

    def _drop_device(self, n: RadixNode) -> bool:
        # a node without a host copy must not strand host-only descendants (they could never load again)
        return n in self.tree.gpu_leaves and n.lock_ref == 0 and (n.cpu or not n.children)

    def _drop_host(self, n: RadixNode) -> bool:
        return n.cpu and not n.in_flight and n.lock_ref == 0 and (n.gpu is not GpuState.NONE or not n.children)

    def _load(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.NONE and n.parent is not None and (
            n.parent is self.tree.root or n.parent.gpu is not GpuState.NONE)

    def _loading(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.LOADING

    def _ready(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.READY

    def has(self, cond: Callable[[RadixNode], bool]) -> bool:
        return any(cond(n) for n in self.tree.nodes())

    def pick(self, data: st.DataObject, cond: Callable[[RadixNode], bool]) -> RadixNode:
        return data.draw(st.sampled_from(sorted((n for n in self.tree.nodes() if cond(n)), key=lambda n: n.id)))

    @rule(seq=LONG_TOKENS)
    def insert(self, seq: list[int]) -> None:
        key = aligned(seq, self.page)
        before = longest_match(key, list(all_sequences(self.tree).values()), self.page)
        path, new = self.tree.insert(seq)
        # new device KV = the part no node covered + host-only nodes on the path that were revived
        # (a match stops before a node it may not split: then the rest is not cached)
        assert new <= len(key) - before + sum(len(n) for n in path if n.cpu)
        if key:
            self.cached.append(key)

    @precondition(lambda self: self.has(self._write_back))
    @rule(data=st.data())
    def write_back(self, data: st.DataObject) -> None:
        node = self.pick(data, self._write_back)
        self.tree.set_cpu(node, True, node.key)

    @precondition(lambda self: self.has(self._drop_device))
    @rule(data=st.data())
    def drop_device_leaf(self, data: st.DataObject) -> None:
        node = self.pick(data, self._drop_device)
        had_cpu = node.cpu
        self.tree.drop_gpu(node)
        assert (node.parent is not None) == had_cpu  # pruned unless a host copy remains
        assert node not in self.tree.gpu_leaves

    @precondition(lambda self: self.has(self._drop_host))
    @rule(data=st.data())
    def drop_host_copy(self, data: st.DataObject) -> None:
        self.tree.drop_cpu(self.pick(data, self._drop_host))

    @precondition(lambda self: self.has(self._load))
    @rule(data=st.data())
    def begin_load(self, data: st.DataObject) -> None:
        node = self.pick(data, self._load)
        self.tree.begin_load(node)
        assert node.tier is Tier.LOADING

    @precondition(lambda self: self.has(self._loading))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        node = self.pick(data, self._loading)
        self.tree.finish_load(node, node.key)

    @precondition(lambda self: self.has(self._ready))
    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        node = self.pick(data, self._ready)
        self.tree.lock(node)
        self.locked.append(node)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        self.tree.unlock(self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1))))

    @rule(seq=LONG_TOKENS)
    def match(self, seq: list[int]) -> None:
        m = self.tree.match_prefix(seq)
        check_path(m, tuple(seq), self.tree)
        # nodes with a copy in flight are never split: a match stops before them instead
        expected = longest_match(tuple(seq), list(all_sequences(self.tree).values()), self.page)
        if m.length < expected:
            child = self.tree.child(m.last or self.tree.root, seq[m.length:m.length + self.page])
            assert child is not None and child.in_flight

    @invariant()
    def invariants(self) -> None:
        self.tree.check_invariants()
        seqs = all_sequences(self.tree)
        assert self.tree.gpu_tokens == sum(len(n) for n in seqs if n.gpu is not GpuState.NONE)
        assert self.tree.cpu_tokens == sum(len(n) for n in seqs if n.cpu)
        for node, seq in seqs.items():
            assert any(s[: len(seq)] == seq for s in self.cached)
            if node.cpu:
                assert node.cpu_value == node.key
            if node.gpu is GpuState.READY:
                assert node.gpu_value == node.key or node.gpu_value is None
        for node in seqs:
            assert node.lock_ref == sum(1 for x in self.locked if node in x.path())
        for node in self.locked:
            assert node.parent is not None and node.gpu is GpuState.READY


TierMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_tier_accounting = TierMachine.TestCase


# ---------------------------------------------------------------------- unit tests
def test_node_path_and_sequence_follow_splits() -> None:
    tree = RadixTree(page_size=1)
    for seq in ((1, 2, 3, 4), (1, 2, 9), (1, 5), (7,)):
        tree.insert(seq)
    expected = all_sequences(tree)  # by explicit traversal from the root
    assert len(expected) == 6  # (1) (2) (3, 4) (9) (5) (7): the inserts split (1, 2, 3, 4) twice
    for node, seq in expected.items():
        assert node.sequence() == seq == root_sequence(node)
        path = node.path()
        assert path[-1] is node and path[0].parent is tree.root
        assert all(child.parent is parent for parent, child in itertools.pairwise(path))
    assert tree.root.path() == [] and tree.root.sequence() == ()


def test_page_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        RadixTree(0)


def test_partial_pages_are_ignored() -> None:
    tree = RadixTree(4)
    path, new = tree.insert([1, 2, 3, 4, 5, 6])
    assert new == 4 and [n.key for n in path] == [(1, 2, 3, 4)]
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).length == 4
    assert tree.match_prefix([1, 2, 3]).length == 0


def test_split_carries_tags_locks_tiers_and_payload() -> None:
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4, 5, 6], gpu_value="abcdef")
    tree.tag_prefix([1, 2, 3, 4, 5, 6], ("w", "a"))
    (node,) = tree.root.children.values()
    tree.lock(node)
    m = tree.match_prefix([1, 2, 3, 4, 9, 9])
    upper = m.last
    assert m.length == 4 and upper is not node and node.parent is upper
    assert upper.key == (1, 2, 3, 4) and node.key == (5, 6)
    assert upper.gpu_value == "abcd" and node.gpu_value == "ef"
    assert upper.tags == node.tags == {("w", "a")}
    assert upper.lock_ref == node.lock_ref == 1
    assert tree.workflow_nodes("w") == {upper, node}
    tree.check_invariants()


def test_tag_prefix_splits_at_the_fixed_prompt_boundary() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3, 4, 5, 6])
    path = tree.tag_prefix([1, 2, 3, 9], ("w", "a"))  # prompt diverges after 3 tokens
    assert [n.key for n in path] == [(1, 2, 3)]
    (rest,) = path[0].children.values()
    assert rest.key == (4, 5, 6) and not rest.tags
    assert tree.untag_workflow("w") == 1 and not path[0].tags


def test_match_never_splits_a_node_in_flight() -> None:
    tree = RadixTree(1)
    (node,), _ = tree.insert([1, 2, 3, 4])
    tree.set_cpu(node, True)
    node.offloading = True  # a device -> host copy holds the node
    m = tree.match_prefix([1, 2, 9])
    assert m.length == 0 and node.key == (1, 2, 3, 4)
    # inserting a sequence that diverges inside it caches nothing new (no sibling with the same first page)
    path, new = tree.insert([1, 2, 9])
    assert path == [] and new == 0
    tree.check_invariants()


def test_split_by_tier_and_tiers() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3])
    tree.match_prefix([1])
    tree.match_prefix([1, 2])
    a, b, c = tree.match_prefix([1, 2, 3]).path
    for n in (b, c):
        tree.set_cpu(n, True)
    tree.drop_gpu(c)
    tree.drop_gpu(b)
    assert [n.tier for n in (a, b, c)] == [Tier.GPU, Tier.CPU, Tier.CPU]
    tree.begin_load(b)
    m = tree.match_prefix([1, 2, 3])
    assert m.split_by_tier() == (1, [b], [c])
    assert m.gpu_length() == 1
    assert b.tier is Tier.LOADING
    tree.finish_load(b)
    assert tree.match_prefix([1, 2, 3]).split_by_tier() == (2, [], [c])
    tree.check_invariants()


def test_drop_prunes_empty_ancestors_but_keeps_host_copies() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2])
    tree.match_prefix([1])
    a, b = tree.match_prefix([1, 2]).path
    tree.drop_gpu(b)  # no host copy: the node leaves the tree
    assert b.parent is None and not a.children and a in tree.gpu_leaves
    tree.set_cpu(a, True)
    tree.drop_gpu(a)
    assert a.parent is tree.root and a.tier is Tier.CPU
    tree.drop_cpu(a)
    assert not tree.root.children and tree.gpu_tokens == tree.cpu_tokens == 0
    tree.check_invariants()


def test_split_keeps_a_deferred_eviction_on_both_halves() -> None:
    """Regression: splitting an evict-pending node used to leave the upper half not pending, so the
    cache's `pending_free` (which counted the whole node) kept the upper half's tokens for good."""
    tree = RadixTree(1)
    tree.insert([1, 2, 3, 4])
    (node,) = tree.root.children.values()
    node.evict_pending = True
    upper = tree.match_prefix([1, 2, 9]).last
    assert upper is not node and upper.evict_pending and node.evict_pending
    assert len(upper) + len(node) == 4


# ---------------------------------------------------------------------- namespaces (tenant isolation)
NAMESPACES = ("", "tenant-a", "tenant-b")


@settings(max_examples=150, deadline=None)
@given(page=PAGE_SIZES,
       inserts=st.lists(st.tuples(st.sampled_from(NAMESPACES), TOKENS), max_size=12),
       queries=st.lists(st.tuples(st.sampled_from(NAMESPACES), TOKENS), min_size=1, max_size=8),
       split=st.booleans())
def test_namespaces_are_disjoint_trees(page: int, inserts: list[tuple[str, list[int]]],
                                       queries: list[tuple[str, list[int]]], split: bool) -> None:
    """Each namespace behaves as its own tree: a match only ever sees what was inserted in the same
    namespace, whatever the others hold (same tokens included)."""
    tree = RadixTree(page)
    cached: dict[str, list[tuple[int, ...]]] = {ns: [] for ns in NAMESPACES}
    for ns, seq in inserts:
        key = aligned(seq, page)
        before = longest_match(key, cached[ns], page)
        path, new = tree.insert(seq, gpu_value=key, namespace=ns)
        assert new == len(key) - before  # KV of another namespace is never taken as already cached
        assert all(node.namespace == ns for node in path)
        if key:
            cached[ns].append(key)
        tree.check_invariants()
    for ns, q in queries:
        m = tree.match_prefix(q, split=split, namespace=ns)
        check_path(m, tuple(q), tree)
        assert all(node.namespace == ns for node in m.path)
        expected = longest_match(tuple(q), cached[ns], page)
        assert m.length == expected if split else m.length <= expected
        tree.check_invariants()
    for ns in NAMESPACES:  # each namespace holds exactly the prefixes of what it was given
        seqs = tree.token_sequences(namespace=ns)
        assert all(any(s[:len(seq)] == seq for s in cached[ns]) for seq in seqs)
        assert all(s in seqs for s in cached[ns])
    assert sorted(tree.token_sequences()) == sorted(s for ns in NAMESPACES for s in tree.token_sequences(namespace=ns))


def test_same_tokens_in_two_namespaces_share_nothing() -> None:
    tree = RadixTree(2)
    path_a, new_a = tree.insert([1, 2, 3, 4], gpu_value="abcd", namespace="a")
    assert tree.match_prefix([1, 2, 3, 4]).length == 0  # the default namespace sees none of it
    assert tree.match_prefix([1, 2, 3, 4], namespace="b").length == 0
    path_b, new_b = tree.insert([1, 2, 3, 4], gpu_value="wxyz", namespace="b")
    assert new_a == new_b == 4 and tree.gpu_tokens == 8  # two copies of the KV, one per namespace
    assert path_a[0] is not path_b[0] and path_b[0].gpu_value == "wxyz"
    assert tree.match_prefix([1, 2, 3, 4], namespace="a").path == path_a
    assert tree.child(tree.root, [1, 2], "a") is path_a[0] and tree.child(tree.root, [1, 2], "b") is path_b[0]
    assert tree.child(tree.root, [1, 2]) is None
    # a split inside one namespace leaves the other's node whole; the upper half keeps the namespace
    m = tree.match_prefix([1, 2, 9, 9], namespace="a")
    assert m.length == 2 and m.last is not None and m.last.namespace == "a" and m.last.parent is tree.root
    assert path_b[0].key == (1, 2, 3, 4)
    tree.check_invariants()


def test_eviction_and_tags_stay_in_their_namespace() -> None:
    tree = RadixTree(1)
    (a,), _ = tree.insert([1, 2, 3], namespace="a")
    (d,), _ = tree.insert([1, 2, 3])
    tagged = tree.tag_prefix([1, 2], ("w", "agent"), namespace="a")
    assert [n.key for n in tagged] == [(1, 2)] and tagged[0].namespace == "a"
    assert not d.tags and d.key == (1, 2, 3)  # tagging in "a" neither tags nor splits the default copy
    assert tree.workflow_nodes("w") == {tagged[0]}
    tree.drop_gpu(a)  # the dynamic remainder (3,) of namespace "a"
    tree.drop_gpu(tagged[0])
    assert tree.match_prefix([1, 2, 3], namespace="a").length == 0
    assert tree.match_prefix([1, 2, 3]).path == [d]  # the default namespace's copy is untouched
    assert tree.gpu_tokens == 3 and tree.gpu_leaves == {d}
    tree.check_invariants()


def test_default_namespace_is_the_unsalted_tree() -> None:
    from kvflow_ray.engines.base import prefix_hash
    from kvflow_ray.engines.events import CacheEventLog

    tree = RadixTree(1)
    (d,), _ = tree.insert([5, 6])
    (s,), _ = tree.insert([5, 6], namespace="tenant")
    assert d.namespace == "" and tree.match_prefix([5, 6]).path == tree.match_prefix([5, 6], namespace="").path
    log = CacheEventLog()
    log.record("stored", "gpu", d)
    log.record("stored", "gpu", s)
    default_event, salted_event = log.drain()
    # events keep the unsalted hash in the default namespace; the same tokens elsewhere are another prefix
    assert default_event.prefix_hash == prefix_hash([5, 6])
    assert salted_event.prefix_hash == prefix_hash([5, 6], "tenant") != default_event.prefix_hash


def test_namespaces_are_sglangs_radix_key_pair() -> None:
    """`cache_namespace` names what SGLang's `RadixKey` keys by: the salt alone ("" and None are the
    default), or (extra key, salt) once an extra key is set, even "" (SGLang keeps "" apart from None)."""
    from kvflow_ray.core.radix import cache_namespace
    from kvflow_ray.engines.base import prefix_hash

    assert cache_namespace() == cache_namespace(None) == cache_namespace("") == ""
    assert cache_namespace("t") == "t"
    assert cache_namespace("t", "lora") == ("lora", "t") != cache_namespace("t")
    assert cache_namespace(None, "") == ("", "") != cache_namespace()
    tree = RadixTree(1)
    keyed = [cache_namespace(), cache_namespace("t"), cache_namespace(None, "lora"), cache_namespace("t", "lora")]
    for namespace in keyed:
        tree.insert([1, 2, 3], namespace=namespace)
    assert tree.gpu_tokens == 12 and len(tree.root.children) == 4  # four disjoint copies
    assert all(tree.match_prefix([1, 2], namespace=ns).last.namespace == ns for ns in keyed)
    tree.check_invariants()
    hashes = {prefix_hash([1, 2, 3], ns) for ns in keyed}
    assert len(hashes) == 4 and prefix_hash([1, 2, 3]) in hashes
