"""Tests for the tiered cache driver, eviction policies, prefetch planning and admission
(`kvflow_ray.core.cache`, `policies`, `prefetch`, `admission`; docs/design.md §3).

A hypothesis state machine drives `TieredCache` through everything an engine does (insert, match + lock,
make_room, loads, write-backs, tags, retirement) and checks the accounting against brute-force sums
after every step; deterministic tests pin down each policy's eviction order.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow_ray.core.admission import FCFSAdmission, StatusAwareAdmission
from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.graph import WorkflowState, parse_spec
from kvflow_ray.core.policies import (
    BeladyPolicy,
    FutureAccesses,
    KVFlowPolicy,
    LRUPolicy,
    StepBook,
    make_eviction_policy,
)
from kvflow_ray.core.prefetch import NoPrefetch, StepsAheadPrefetch, plan_prefetch
from kvflow_ray.core.radix import GpuState, RadixNode, Tier

INF = math.inf


# ---------------------------------------------------------------------- helpers
def put(cache: TieredCache, tokens: list[int] | tuple[int, ...], namespace: str = "") -> list[RadixNode]:
    """What an engine does for one request: match, lock, make room for the rest, compute, commit."""
    key = cache.tree.page_aligned(tokens)
    m = cache.match(key, namespace)
    cache.tree.lock(m.last)
    try:
        need = len(key) - sum(len(n) for n in m.path if n.gpu is not GpuState.NONE)
        ok, writebacks = cache.make_room(need)
        assert ok and not writebacks, "test setup: not enough device room"
        cache.alloc(need)
        return cache.commit(key, need, gpu_value=key, namespace=namespace)
    finally:
        cache.tree.unlock(m.last)


def device_sequences(cache: TieredCache) -> set[tuple[int, ...]]:
    return set(cache.tree.token_sequences(Tier.GPU))


def eviction_order(cache: TieredCache) -> list[tuple[int, ...]]:
    """Evict one node at a time (make_room for one more token than is free) and record which one went,
    as its root-to-node token sequence. Stops when nothing more can be evicted."""
    order = []
    while True:
        before = device_sequences(cache)
        _ok, writebacks = cache.make_room(cache.free_tokens + 1)
        for node in writebacks:
            cache.finish_offload(node)
        gone = before - device_sequences(cache)
        if not gone:
            return order
        assert len(gone) == 1, gone
        order.append(gone.pop())
        cache.tree.check_invariants()


def tokens_of(text: str, base: int = 0) -> list[int]:
    return [base + b for b in text.encode()]


def to_host(cache: TieredCache, tokens: list[int] | tuple[int, ...], namespace: str = "") -> None:
    """Move the (already split-off) node ending `tokens` and its descendants to the host tier."""
    node = cache.tree.match_prefix(tokens, namespace=namespace).last
    assert node is not None and cache.host_tier
    stack, nodes = [node], []
    while stack:
        n = stack.pop()
        nodes.append(n)
        stack.extend(n.children.values())
    for n in reversed(nodes):  # leaves first
        if not n.cpu:
            assert cache.backup(n)
            cache.finish_offload(n, n.gpu_value)
        cache.tree.drop_gpu(n)
    assert node.tier is Tier.CPU


# ---------------------------------------------------------------------- state machine
# a sequence as page symbols: page i holds `page_size` copies of symbol i, so prefixes collide as often
# at every page size (two symbols); partial pages are exercised by `match_is_longest_prefix`
SEQ = st.lists(st.integers(0, 1), min_size=1, max_size=6)
WFS = ("w0", "w1")
AGENTS = ("a", "b", "c")
STEPS = st.sampled_from([0, 1, 2, 3, INF])


class CacheMachine(RuleBasedStateMachine):
    """Locked or in-flight nodes are never evicted; accounting never drifts; capacity never exceeded;
    matches are longest cached prefixes; every deferred eviction completes once the copies in flight land."""

    @initialize(page=st.sampled_from([1, 2, 4]), host=st.booleans(), policy=st.sampled_from(["lru", "kvflow"]),
                gpu_pages=st.integers(3, 12), cpu_pages=st.integers(1, 8), seed=st.lists(SEQ, max_size=4),
                duplicates_first=st.booleans())
    def setup(self, page: int, host: bool, policy: str, gpu_pages: int, cpu_pages: int,
              seed: list[list[int]], duplicates_first: bool) -> None:
        self.page = page
        self.book = StepBook()
        self.cache = TieredCache(gpu_pages * page, make_eviction_policy(policy, self.book),
                                 cpu_capacity=cpu_pages * page if host else 0, host_tier=host, page_size=page,
                                 host_duplicates_first=duplicates_first)
        self.tree = self.cache.tree
        self.inserted: list[tuple[int, ...]] = []
        self.locks: list[tuple[RadixNode, tuple[int, ...]]] = []
        self.private = 0
        for seq in seed:
            self.insert(seq)

    # -------------------------------------------------------------- helpers
    # candidates of the node-picking rules; a rule runs only when it has one, so every step does something
    def _loadable(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.NONE and (n.parent is self.tree.root or n.parent.gpu is not GpuState.NONE)

    def _loading(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.LOADING

    def _offloading(self, n: RadixNode) -> bool:
        return n.offloading

    def _ready(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.READY

    def _backup(self, n: RadixNode) -> bool:
        return n.gpu is GpuState.READY and not n.cpu and not n.offloading

    def has(self, cond: Callable[[RadixNode], bool]) -> bool:
        return any(cond(n) for n in self.tree.nodes())

    def pick(self, data: st.DataObject, cond: Callable[[RadixNode], bool]) -> RadixNode:
        return data.draw(st.sampled_from(sorted((n for n in self.tree.nodes() if cond(n)), key=lambda n: n.id)))

    def checked_make_room(self, n: int) -> tuple[bool, list[RadixNode]]:
        """make_room, asserting that no locked or in-flight node changed and the result is honest."""
        protected = {node: (node.gpu, node.cpu, node.offloading, node.key, node.evict_pending)
                     for node in self.tree.nodes() if node.lock_ref or node.in_flight}
        locked_seqs = [(node, seq) for node, seq in self.locks]
        # brute-force upper bound on what eviction could free: every unlocked device node
        unlocked = sum(len(node) for node in self.tree.nodes() if node.gpu is not GpuState.NONE and not node.lock_ref)
        hopeless = self.cache.free_tokens + self.cache.pending_free + unlocked < n
        before = (self.tree.gpu_tokens, self.tree.cpu_tokens, self.cache.pending_free)
        ok, writebacks = self.cache.make_room(n)
        for node, (gpu, cpu, offloading, key, pending) in protected.items():
            assert node.parent is not None, f"protected node left the tree: {node}"
            assert (node.gpu, node.cpu, node.offloading, node.key) == (gpu, cpu, offloading, key), node
            assert node.evict_pending <= pending  # a kept node may stop pending, never start
        for node, seq in locked_seqs:
            assert node.gpu is GpuState.READY and node.sequence() == seq
            assert all(n.gpu is not GpuState.NONE for n in node.path())  # its prefix stays on the device
        for node in writebacks:
            assert node not in protected
            assert node.offloading and node.evict_pending and node.gpu is GpuState.READY and not node.cpu
        assert not writebacks or self.cache.host_tier
        assert ok == (self.cache.free_tokens >= n)
        if hopeless:
            # certain failure: nothing is evicted for a request that cannot fit anyway
            assert not ok and not writebacks
            assert (self.tree.gpu_tokens, self.tree.cpu_tokens, self.cache.pending_free) == before
        elif not ok:
            # it stopped because enough is on its way, because nothing evictable was left, or (policies
            # that rank the host by their key) because a leaf's copy in flight makes host room for the
            # next write-back when it lands, and the caller retries then
            leftover = [node for node in self.tree.gpu_leaves
                        if not (node.lock_ref or node.offloading or node.evict_pending)]
            landing = not self.cache.host_duplicates_first and any(
                not node.children for node in self.cache.offloading_nodes)
            assert self.cache.free_tokens + self.cache.pending_free >= n or not leftover or landing, leftover
        return ok, writebacks

    # -------------------------------------------------------------- rules
    def tokens(self, symbols: list[int]) -> tuple[int, ...]:
        return tuple(s for s in symbols for _ in range(self.page))

    @rule(seq=SEQ)
    def insert(self, seq: list[int]) -> None:
        key = self.tokens(seq)
        m = self.cache.match(key)
        self.tree.lock(m.last)
        need = len(key) - sum(len(n) for n in m.path if n.gpu is not GpuState.NONE)
        ok, _ = self.checked_make_room(need)
        if ok:
            self.cache.alloc(need)
            path = self.cache.commit(key, need, gpu_value=key)
            self.inserted.append(key)
            assert all(n.gpu is not GpuState.NONE for n in path)
        self.tree.unlock(m.last)

    @rule(seq=SEQ)
    def match_and_lock(self, seq: list[int]) -> None:
        m = self.cache.match(self.tokens(seq))
        ready = []
        for node in m.path:
            if node.gpu is not GpuState.READY:
                break
            ready.append(node)
        if ready:
            self.tree.lock(ready[-1])
            self.locks.append((ready[-1], ready[-1].sequence()))

    @precondition(lambda self: self.has(self._ready))
    @rule(data=st.data())
    def lock_node(self, data: st.DataObject) -> None:
        """A request whose prompt ends exactly at some device node (often one being written back)."""
        node = self.pick(data, self._ready)
        self.tree.lock(node)
        self.locks.append((node, node.sequence()))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(node)

    @rule(pages=st.integers(1, 6))
    def make_room(self, pages: int) -> None:
        # always more than is free: this rule is about evicting (inserts and loads make room too)
        self.checked_make_room(max(0, self.cache.free_tokens) + pages * self.page)

    @precondition(lambda self: self.has(self._loadable))
    @rule(data=st.data())
    def start_load(self, data: st.DataObject) -> None:
        nodes = [self.pick(data, self._loadable)]
        while data.draw(st.booleans()):  # sometimes a longer host-only path
            children = sorted(nodes[-1].children.values(), key=lambda n: n.id)
            if not children:
                break
            nodes.append(data.draw(st.sampled_from(children)))
        self.tree.lock(nodes[-1])  # an engine holds what it is about to load
        ok, _ = self.checked_make_room(sum(len(n) for n in nodes))
        if ok:
            assert self.cache.start_load(nodes) == sum(len(n) for n in nodes)
            assert all(n.tier is Tier.LOADING for n in nodes)
        self.tree.unlock(nodes[-1])

    @precondition(lambda self: self.has(self._loading))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        node = self.pick(data, self._loading)
        self.cache.finish_load(node, node.key)
        assert node.tier is Tier.GPU and node.cpu

    @precondition(lambda self: self.has(self._offloading))
    @rule(data=st.data())
    def finish_offload(self, data: st.DataObject) -> None:
        node = self.pick(data, self._offloading)
        drop = node.evict_pending and node.lock_ref == 0 and node.n_gpu_children == 0
        parent = node.parent
        self.cache.finish_offload(node, node.gpu_value)
        assert not node.offloading
        if node.parent is None:
            # dropped at once, and so was a pending parent with no host copy (its write-back found no
            # room): then the new host copy extends nothing cached and is freed with it
            assert drop and parent.parent is None
        else:
            assert node.cpu and (node.gpu is GpuState.NONE) == drop

    @precondition(lambda self: self.cache.host_tier and self.has(self._backup))
    @rule(data=st.data())
    def backup(self, data: st.DataObject) -> None:
        node = self.pick(data, self._backup)
        pending = node.evict_pending  # (a node waiting for its children may get its host copy now)
        if self.cache.backup(node):
            assert node.offloading and node.evict_pending == pending and node.gpu is GpuState.READY

    @precondition(lambda self: self.inserted)
    @rule(data=st.data(), wf=st.sampled_from(WFS), agent=st.sampled_from(AGENTS))
    def tag_prefix(self, data: st.DataObject, wf: str, agent: str) -> None:
        base = data.draw(st.sampled_from(self.inserted))
        self.tree.tag_prefix(base[: data.draw(st.integers(1, len(base)))], (wf, agent))

    @rule(wf=st.sampled_from(WFS), steps=st.fixed_dictionaries({a: STEPS for a in AGENTS}))
    def set_steps(self, wf: str, steps: dict[str, float]) -> None:
        self.book.set_steps(wf, steps)

    @rule(wf=st.sampled_from(WFS))
    def untag_workflow(self, wf: str) -> None:
        self.book.retire(wf)
        self.tree.untag_workflow(wf)
        assert all(t[0] != wf for n in self.tree.nodes() for t in n.tags)

    @rule(wf=st.sampled_from(WFS), keep=st.integers(0, 12))
    def free_private(self, wf: str, keep: int) -> None:
        """A session ended: its history's unshared nodes past `keep` tokens leave both tiers at once."""
        history = list(self.tree.workflow_nodes(wf))
        self.book.retire(wf)
        self.tree.untag_workflow(wf)
        before = self.cache.counters.released_tokens
        freed = self.cache.free_private(history, keep)
        assert self.cache.counters.released_tokens - before == freed
        page = self.tree.page_size
        for node in history:
            if node.parent is not None and not node.children and not node.lock_ref and not node.in_flight \
                    and not node.evict_pending and not node.demand and not node.tags:
                assert len(node.sequence()) <= -(-keep // page) * page, node  # what could go went

    @rule(k=st.integers(0, 16))
    def alloc(self, k: int) -> None:
        if k <= self.cache.free_tokens:
            self.cache.alloc(k)
            self.private += k
        else:
            with pytest.raises(MemoryError):
                self.cache.alloc(k)

    @precondition(lambda self: self.private)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, self.private))
        self.cache.release(k)
        self.private -= k

    @rule(seq=SEQ, split=st.booleans(), data=st.data())
    def match_is_longest_prefix(self, seq: list[int], split: bool, data: st.DataObject) -> None:
        q = list(self.tokens(seq))
        if data.draw(st.booleans()):  # diverge (or end) inside a page
            cut = data.draw(st.integers(0, len(q)))
            q = q[:cut] + data.draw(st.lists(st.integers(0, 2), max_size=2))
        cached = self.tree.token_sequences()
        key = self.tree.page_aligned(q)
        expected = 0
        for s in cached:
            n = 0
            while n < min(len(s), len(key)) and s[n] == key[n]:
                n += 1
            expected = max(expected, n - n % self.page)
        m = self.tree.match_prefix(q, split=split)
        assert tuple(t for n in m.path for t in n.key) == key[: m.length]
        assert m.length <= expected
        if m.length < expected:  # stopped before a partially matching node it may not split
            child = self.tree.child(m.last or self.tree.root, key[m.length:m.length + self.page])
            assert child is not None and (not split or child.in_flight)
            assert m.length + len(child) > expected

    # -------------------------------------------------------------- invariants
    @invariant()
    def accounting(self) -> None:
        cache, tree = self.cache, self.tree
        tree.check_invariants()
        cache.check_indexes()  # the incremental eviction orders are a full rescan's
        nodes = list(tree.nodes())
        gpu = sum(len(n) for n in nodes if n.gpu is not GpuState.NONE)
        cpu = sum(len(n) for n in nodes if n.cpu)
        assert tree.gpu_tokens == gpu and tree.cpu_tokens == cpu
        assert cache.private_tokens == self.private
        assert cache.used_tokens == gpu + self.private
        assert cache.free_tokens == cache.gpu_capacity - gpu - self.private
        assert cache.used_tokens <= cache.gpu_capacity
        offloading = sum(len(n) for n in nodes if n.offloading)
        assert cpu + offloading <= cache.cpu_capacity  # a write-back in flight holds its host space
        assert set(cache.offloading_nodes) == {n for n in nodes if n.offloading}
        assert cache.pending_free == sum(len(n) for n in nodes if n.evict_pending)
        for n in nodes:
            if n.evict_pending:  # it leaves once its copy lands and its device children (all leaving) go
                device_children = [c for c in n.children.values() if c.gpu is not GpuState.NONE]
                assert all(c.evict_pending for c in device_children), n
                assert n.offloading or device_children, n
        if not cache.host_tier:
            assert cpu == 0 and not any(n.in_flight for n in nodes)

    @invariant()
    def pending_evictions_complete(self) -> None:
        """Liveness: once every copy in flight lands, every deferred eviction is settled. A node left
        pending would keep `pending_free` counting memory that no event frees, and make_room would then
        stop short while callers wait for that memory."""
        cache = copy.deepcopy(self.cache)
        while True:
            busy = sorted((n for n in cache.tree.nodes() if n.in_flight), key=lambda n: n.id)
            if not busy:
                break
            if busy[0].offloading:
                cache.finish_offload(busy[0], busy[0].gpu_value)
            else:
                cache.finish_load(busy[0], busy[0].key)
        assert cache.pending_free == 0, [n for n in cache.tree.nodes() if n.evict_pending]
        assert cache.offloading_tokens == 0 and not cache.offloading_nodes  # nothing left to wait for
        cache.tree.check_invariants()

    @invariant()
    def locks_and_data(self) -> None:
        nodes = list(self.tree.nodes())
        for node in nodes:
            assert node.lock_ref == sum(1 for x, _ in self.locks if node in x.path()), node
            assert not node.evict_pending or node.gpu is GpuState.READY
            # payloads are the node's own tokens: slicing on splits and copies never mixed them up
            if node.gpu is GpuState.READY:
                assert node.gpu_value == node.key, node
            if node.cpu:
                assert node.cpu_value == node.key, node
            seq = node.sequence()
            assert any(s[: len(seq)] == seq for s in self.inserted)
        for node, seq in self.locks:
            assert node.parent is not None and node.gpu is GpuState.READY and node.sequence() == seq


CacheMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
test_cache_state_machine = CacheMachine.TestCase


# ---------------------------------------------------------------------- LRU
def test_lru_evicts_least_recently_used_leaf_first() -> None:
    cache = TieredCache(12, LRUPolicy())
    a, b, c = (1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)
    for seq in (a, b, c):
        put(cache, seq)
    cache.match(a)  # a is now the most recent
    assert eviction_order(cache) == [b, c, a]


def test_lru_evicts_leaves_before_their_prefix() -> None:
    cache = TieredCache(12, LRUPolicy())
    put(cache, (1, 1, 2, 2))
    put(cache, (1, 1, 3, 3))  # splits: (1, 1) is a shared parent touched by both
    put(cache, (4, 4))
    cache.match((1, 1))  # the parent is the most recent, but its leaves must go before it
    assert eviction_order(cache) == [(1, 1, 2, 2), (1, 1, 3, 3), (4, 4), (1, 1)]


def test_lru_without_host_tier_drops_the_kv() -> None:
    cache = TieredCache(8, LRUPolicy())
    put(cache, (1, 2, 3, 4))
    put(cache, (5, 6, 7, 8))
    assert cache.tree.match_prefix((1, 2, 3, 4)).length == 4
    ok, writebacks = cache.make_room(4)
    assert ok and writebacks == [] and cache.free_tokens == 4
    assert cache.tree.match_prefix((1, 2, 3, 4)).length == 0  # miss: recompute
    assert cache.tree.match_prefix((5, 6, 7, 8)).length == 4
    assert cache.counters.dropped_tokens == cache.counters.evicted_gpu_tokens == 4
    assert cache.tree.cpu_tokens == 0


# ---------------------------------------------------------------------- KVFlow
SEQUENTIAL = {
    "name": "sequential",
    "agents": {
        "planner": {"prompt": "You are the Planner. Break the task into steps."},
        "searcher": {"prompt": "You are the Searcher. Find sources.", "after": ["planner"]},
        "executor": {"prompt": "You are the Executor. Run each step.", "after": ["searcher"]},
        "expresser": {"prompt": "You are the Expresser. Write the answer.", "after": ["executor"]},
    },
}


def test_kvflow_sequential_example_exact_eviction_order() -> None:
    """DESIGN §3: Planner → Searcher → Executor → Expresser with the Planner running: E = 0, 1, 2, 3.
    Dynamic suffixes go first (LRU among them), then fixed prompts from the farthest agent down; the
    shared "You are the " preamble (every agent) and "Ex" (executor, expresser) take the minimum."""
    spec = parse_spec(SEQUENTIAL)
    steps = WorkflowState(spec, running=["planner"]).steps_to_execution()
    assert steps == {"planner": 0, "searcher": 1, "executor": 2, "expresser": 3}
    book = StepBook()
    book.set_steps("wf1", steps)
    # each agent's call = its fixed prompt + a dynamic suffix; expresser ran first, planner last
    names = ["expresser", "executor", "searcher", "planner"]
    prompts = {name: tuple(tokens_of(spec.agents[name].prompt)) for name in names}
    calls = {name: prompts[name] + tuple(tokens_of(f" task {i}: summarise report #{i}", 300))
             for i, name in enumerate(names)}
    distinct = len({c[:i] for c in calls.values() for i in range(1, len(c) + 1)})  # tokens the tree holds
    cache = TieredCache(distinct, KVFlowPolicy(book))
    for name in names:
        put(cache, calls[name])
        cache.tree.tag_prefix(prompts[name], ("wf1", name))
        book.register_prompt(("wf1", name), prompts[name])
    assert cache.free_tokens == 0
    preamble, ex = tuple(tokens_of("You are the ")), tuple(tokens_of("You are the Ex"))
    assert cache.tree.match_prefix(preamble).last.tags == {("wf1", n) for n in names}
    # a new request that needs room for as many tokens as the suffixes hold: exactly they go
    ok, _ = cache.make_room(sum(len(calls[n]) - len(prompts[n]) for n in names))
    assert ok
    assert device_sequences(cache) == {*prompts.values(), preamble, ex}
    # then the fixed prompts, farthest steps-to-execution first; shared nodes at their nearest user
    assert eviction_order(cache) == [prompts["expresser"], prompts["executor"], ex, prompts["searcher"],
                                     prompts["planner"], preamble]


def test_kvflow_dynamic_suffixes_go_first_in_lru_order() -> None:
    book = StepBook()
    book.set_steps("w", {"a": 5, "b": 1})
    cache = TieredCache(100, KVFlowPolicy(book))
    pa, pb = (1, 1, 1), (2, 2, 2)
    put(cache, (*pa, 7, 7))
    put(cache, (*pb, 8, 8))
    cache.tree.tag_prefix(pa, ("w", "a"))
    cache.tree.tag_prefix(pb, ("w", "b"))
    cache.match((*pa, 7, 7))  # the a-suffix is now more recent than the b-suffix
    assert eviction_order(cache) == [(*pb, 8, 8), (*pa, 7, 7), pa, pb]


def test_kvflow_shared_preamble_takes_the_minimum() -> None:
    """A node shared by two agents is kept while the nearer one still needs it."""
    book = StepBook()
    book.set_steps("w", {"near": 1, "mid": 2, "far": 3})
    cache = TieredCache(100, KVFlowPolicy(book))
    pre = (9, 9, 9, 9)
    near, far, mid = (*pre, 1, 1), (*pre, 3, 3), (2, 2, 2)
    for seq, agent in ((near, "near"), (far, "far"), (mid, "mid")):
        put(cache, seq)
        cache.tree.tag_prefix(seq, ("w", agent))
    shared = cache.tree.match_prefix(pre).last
    assert shared.tags == {("w", "near"), ("w", "far")}
    assert cache.eviction.node_distance(shared) == 1
    order = eviction_order(cache)
    assert order == [far, mid, near, pre]  # the preamble outlives the mid agent's prompt (E 2 > 1)


def test_kvflow_ties_break_by_lru() -> None:
    book = StepBook()
    book.set_steps("w", {"a": 2, "b": 2, "c": 2})
    cache = TieredCache(100, KVFlowPolicy(book))
    seqs = {"a": (1, 1), "b": (2, 2), "c": (3, 3)}
    for agent, seq in seqs.items():
        put(cache, seq)
        cache.tree.tag_prefix(seq, ("w", agent))
    cache.match(seqs["a"])
    assert eviction_order(cache) == [seqs["b"], seqs["c"], seqs["a"]]


def test_kvflow_retired_workflow_goes_before_live_ones() -> None:
    book = StepBook()
    book.set_steps("live", {"a": 3})
    book.set_steps("done", {"a": 0, "b": 1})
    cache = TieredCache(100, KVFlowPolicy(book))
    live, done_a, done_b, both = (1, 1), (2, 2), (3, 3), (4, 4)
    put(cache, done_a)
    put(cache, done_b)
    put(cache, both)
    put(cache, live)
    cache.tree.tag_prefix(live, ("live", "a"))
    cache.tree.tag_prefix(done_a, ("done", "a"))
    cache.tree.tag_prefix(done_b, ("done", "b"))
    cache.tree.tag_prefix(both, ("done", "a"))
    cache.tree.tag_prefix(both, ("live", "a"))  # the same template in a live instance: stays at E = 3
    book.retire("done")
    assert cache.tree.untag_workflow("done") == 3
    assert not cache.tree.workflow_nodes("done")
    # done_a and done_b are now dynamic (E = inf), LRU among them; `both` and `live` tie at E = 3, LRU
    assert eviction_order(cache) == [done_a, done_b, both, live]


def test_kvflow_priorities_follow_step_updates() -> None:
    """A new StepBook version invalidates every node's cached distance."""
    book = StepBook()
    book.set_steps("w", {"a": 1, "b": 2})
    cache = TieredCache(100, KVFlowPolicy(book))
    for seq, agent in (((1, 1), "a"), ((2, 2), "b")):
        put(cache, seq)
        cache.tree.tag_prefix(seq, ("w", agent))
    nodes = [cache.tree.match_prefix(s).last for s in ((1, 1), (2, 2))]
    assert [cache.eviction.node_distance(n) for n in nodes] == [1, 2]
    book.set_steps("w", {"a": 3, "b": 0})  # the workflow moved on
    assert [cache.eviction.node_distance(n) for n in nodes] == [3, 0]
    assert eviction_order(cache) == [(1, 1), (2, 2)]


# ---------------------------------------------------------------------- Belady
def test_belady_evicts_the_node_used_farthest_in_the_future() -> None:
    future = FutureAccesses([("w", "a"), ("w", "b"), ("w", "c"), ("w", "a")])
    seqs = {"a": (1, 1), "b": (2, 2), "c": (3, 3), "never": (4, 4)}

    def build() -> TieredCache:
        cache = TieredCache(100, BeladyPolicy(future))
        for agent, seq in seqs.items():
            put(cache, seq)
            cache.tree.tag_prefix(seq, ("w", agent))
        return cache

    assert [future.next_use(("w", a)) for a in "abc"] == [0, 1, 2]
    assert eviction_order(build()) == [seqs["never"], seqs["c"], seqs["b"], seqs["a"]]
    future.advance()  # a ran: next uses are now b 0, c 1, a 2
    assert [future.next_use(("w", a)) for a in "abc"] == [2, 0, 1]
    assert eviction_order(build()) == [seqs["never"], seqs["a"], seqs["c"], seqs["b"]]
    future.advance(4)  # past the end of the trace: nothing is used again
    assert future.next_use(("w", "a")) == INF


# ---------------------------------------------------------------------- host tier
def test_host_tier_writes_back_and_frees_the_device_only_when_the_copy_lands() -> None:
    cache = TieredCache(8, LRUPolicy(), cpu_capacity=16, host_tier=True)
    old, new = (1, 2, 3, 4), (5, 6, 7, 8)
    put(cache, old)
    put(cache, new)
    ok, writebacks = cache.make_room(4)
    node = cache.tree.match_prefix(old).last
    assert not ok and writebacks == [node]
    assert node.offloading and node.evict_pending and node.tier is Tier.OFFLOADING
    assert cache.free_tokens == 0 and cache.pending_free == 4  # still on the device
    assert cache.counters.written_back_tokens == 4 and cache.counters.dropped_tokens == 0
    # asking again does not start a second copy: the room is already on its way
    assert cache.make_room(4) == (False, [])
    cache.finish_offload(node, node.gpu_value)
    assert node.tier is Tier.CPU and node.cpu_value == old
    assert cache.free_tokens == 4 and cache.pending_free == 0 and cache.tree.cpu_tokens == 4
    assert cache.tree.match_prefix(old).length == 4  # still cached, on the host
    # a node that already has a host copy is dropped from the device at once, no copy needed
    (n2,) = cache.tree.match_prefix(new).path
    assert cache.backup(n2)
    cache.finish_offload(n2, n2.gpu_value)
    assert cache.make_room(8) == (True, [])
    assert n2.tier is Tier.CPU and cache.tree.cpu_tokens == 8
    cache.tree.check_invariants()


def test_host_tier_keeps_a_node_a_request_matched_during_its_write_back() -> None:
    cache = TieredCache(4, LRUPolicy(), cpu_capacity=16, host_tier=True)
    put(cache, (1, 2, 3, 4))
    _, (node,) = cache.make_room(4)
    m = cache.match((1, 2, 3, 4))
    cache.tree.lock(m.last)
    cache.finish_offload(node, node.gpu_value)
    assert node.tier is Tier.GPU and node.cpu and not node.evict_pending
    assert cache.pending_free == 0 and cache.free_tokens == 0
    cache.tree.unlock(m.last)


def test_host_capacity_respected_by_concurrent_write_backs() -> None:
    """Regression: each write-back started in one make_room call saw the same free host space (copies in
    flight were not counted), so two 4-token copies both went to a 4-token host tier."""
    cache = TieredCache(8, LRUPolicy(), cpu_capacity=4, host_tier=True)
    put(cache, (1, 2, 3, 4))
    put(cache, (5, 6, 7, 8))
    _ok, writebacks = cache.make_room(8)
    assert len(writebacks) == 1  # only one copy fits; the other node is dropped (recompute later)
    assert cache.counters.dropped_tokens == 4
    for node in writebacks:
        cache.finish_offload(node, node.gpu_value)
    assert cache.tree.cpu_tokens <= cache.cpu_capacity
    assert cache.free_tokens == 8
    cache.tree.check_invariants()


def test_host_tier_evicts_old_host_copies_to_fit_new_write_backs() -> None:
    cache = TieredCache(4, LRUPolicy(), cpu_capacity=8, host_tier=True)
    seqs = [(1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)]
    for seq in seqs:
        put(cache, seq)
        _, writebacks = cache.make_room(4)
        for node in writebacks:
            cache.finish_offload(node, node.gpu_value)
        assert cache.tree.cpu_tokens <= 8
    # the host held two copies; the oldest made way for the third
    assert cache.tree.match_prefix(seqs[0]).length == 0
    assert {s for s in seqs[1:] if cache.tree.match_prefix(s).length == 4} == set(seqs[1:])
    assert cache.counters.evicted_cpu_tokens == 4
    cache.tree.check_invariants()


def test_write_back_of_a_parent_waits_for_its_children() -> None:
    cache = TieredCache(12, LRUPolicy(), cpu_capacity=100, host_tier=True)
    put(cache, (1, 2, 3, 4, 5, 6, 7, 8))
    put(cache, (1, 2, 3, 4, 9, 9, 9, 9))
    ok, writebacks = cache.make_room(12)
    parent = cache.tree.match_prefix((1, 2, 3, 4)).last
    assert not ok and len(writebacks) == 3 and parent in writebacks
    assert cache.pending_free == 12
    cache.finish_offload(parent, parent.gpu_value)
    assert parent.tier is Tier.GPU and parent.evict_pending  # children still on the device
    cache.match((1, 2))  # a match splits the pending parent: both halves stay pending
    assert cache.pending_free == sum(len(n) for n in cache.tree.nodes() if n.evict_pending) == 12
    for node in writebacks:
        if node.offloading:
            cache.finish_offload(node, node.gpu_value)
    assert cache.free_tokens == 12 and cache.pending_free == 0 and cache.tree.gpu_tokens == 0
    assert cache.tree.cpu_tokens == 12
    cache.tree.check_invariants()


def test_dropping_a_node_without_host_copy_frees_its_host_only_descendants() -> None:
    """Regression: with the host tier too small for a parent, the parent was dropped from the device
    while its child's host copy stayed, hanging off a node that held no KV; a match then handed that
    node to start_load, which failed."""
    cache = TieredCache(8, LRUPolicy(), cpu_capacity=2, host_tier=True)
    put(cache, (1, 2, 3, 4, 5, 6, 7, 8))
    cache.match((1, 2, 3, 4, 5, 6))  # split: parent (6 tokens) and child (2 tokens)
    _, (child,) = cache.make_room(1)  # the child is written back
    cache.finish_offload(child, child.gpu_value)
    assert child.tier is Tier.CPU
    ok, writebacks = cache.make_room(6)  # the parent does not fit the host: dropped
    assert ok and writebacks == []
    assert cache.tree.match_prefix((1, 2, 3, 4, 5, 6, 7, 8)).length == 0  # all of it is gone
    assert cache.tree.cpu_tokens == 0 and not cache.tree.root.children
    assert cache.counters.dropped_tokens == 8 and cache.counters.evicted_cpu_tokens == 2
    cache.tree.check_invariants()


def test_a_kept_node_calls_off_pending_ancestors_still_copying() -> None:
    """Regression: a request kept a node whose write-back landed while its parent's write-back was
    still running; the parent stayed pending with a device child when its copy landed, nothing could
    settle it, and make_room returned (False, []) with an evictable leaf on the device."""
    cache = TieredCache(6, LRUPolicy(), cpu_capacity=100, host_tier=True)
    put(cache, (1, 2, 3, 4, 5, 6))
    cache.match((1, 2, 3))
    _, (child, parent) = cache.make_room(6)  # both written back for eviction
    m = cache.match((1, 2, 3, 4, 5, 6))
    cache.tree.lock(m.last)  # a request uses the child while its copy runs
    cache.finish_offload(child, child.gpu_value)  # kept: the parent cannot go either
    assert not parent.evict_pending and parent.offloading
    cache.tree.unlock(m.last)
    cache.finish_offload(parent, parent.gpu_value)  # lands as a plain backup
    assert parent.tier is child.tier is Tier.GPU and parent.cpu and child.cpu
    assert cache.pending_free == 0
    assert cache.make_room(3) == (True, [])  # the child is evicted now (it has a host copy)
    assert child.tier is Tier.CPU
    cache.tree.check_invariants()


def test_new_kv_below_a_pending_node_calls_off_its_eviction() -> None:
    """Regression: a request committed new KV below a node whose eviction was deferred; once the old
    children's copies landed, nothing could ever settle the node, `pending_free` kept counting it, and
    make_room returned (False, []) while an evictable leaf stayed on the device."""
    cache = TieredCache(8, LRUPolicy(), cpu_capacity=2, host_tier=True)
    put(cache, (1, 2, 3, 4, 5, 6))
    cache.match((1, 2, 3, 4))
    ok, writebacks = cache.make_room(8)  # the child is written back; the parent (4) finds no host room
    parent = cache.tree.match_prefix((1, 2, 3, 4)).last
    assert parent.evict_pending and cache.pending_free == 6
    put(cache, (1, 2, 3, 4, 7, 7))  # a request reuses the parent and adds a continuation
    assert not parent.evict_pending and cache.pending_free == 2
    for node in writebacks:
        cache.finish_offload(node, node.gpu_value)
    assert cache.pending_free == 0
    ok, writebacks = cache.make_room(4)
    assert writebacks or ok  # the (7, 7) leaf is evicted (written back) instead of waiting forever
    cache.tree.check_invariants()


def test_a_write_back_never_drops_a_host_copy_needed_sooner_than_the_node_it_saves() -> None:
    """Host full with agent b's prompt only there (b runs in 1 step); the device must make room and
    evicts agent x's prompt (x runs in 8), which has no host copy. Saving x by dropping b would lose
    the sooner of the two: x goes without a backup instead. When the host copy is needed later than
    x (c, in 9 steps), it makes way as before."""
    for host_agent, host_steps, x_saved in (("b", 1, False), ("c", 9, True)):
        book = StepBook()
        book.set_steps("w", {host_agent: host_steps, "x": 8, "y": 0})
        cache = TieredCache(12, KVFlowPolicy(book), cpu_capacity=4, host_tier=True)
        prompts = {host_agent: (1,) * 4, "x": (2,) * 4, "y": (3,) * 4}
        for agent, prompt in prompts.items():
            put(cache, prompt)
            cache.tree.tag_prefix(prompt, ("w", agent))
        to_host(cache, prompts[host_agent])
        ok, writebacks = cache.make_room(8)  # room for y's next call: x goes (y runs now)
        assert ok is not x_saved  # dropped: free at once; saved: free once its write-back lands
        for node in writebacks:
            cache.finish_offload(node, node.gpu_value)
        kept_host = cache.tree.match_prefix(prompts[host_agent]).length == 4
        assert (cache.tree.match_prefix(prompts["x"]).length == 4) is x_saved, host_agent
        assert kept_host is not x_saved, host_agent
        assert cache.counters.dropped_tokens == 4  # one of the two is lost either way
        cache.tree.check_invariants()


def test_a_write_back_waits_for_host_room_that_a_lower_ranked_copy_in_flight_holds() -> None:
    """The host holds agent b's prompt (needed in 1 step) and a call's untagged tail is on its way
    there, taking the last free room. The device must evict agent x's prompt (needed in 8), which
    has no host copy. Dropping b would lose the sooner of the two, and the room the tail holds is
    enough: x waits for the tail to land, which then makes way for it, instead of leaving the device
    without a backup for want of what a small copy holds for a moment."""
    book = StepBook()
    book.set_steps("w", {"b": 1, "x": 8, "y": 0})
    cache = TieredCache(12, KVFlowPolicy(book), cpu_capacity=8, host_tier=True)
    prompts = {"b": (1,) * 4, "x": (2,) * 4, "y": (3,) * 4}
    for agent, prompt in prompts.items():
        put(cache, prompt)
        cache.tree.tag_prefix(prompt, ("w", agent))
    to_host(cache, prompts["b"])
    tail = put(cache, (9, 9))[-1]  # a call's private tail: no agent ranks it
    ok, writebacks = cache.make_room(4)  # the tail goes first, written back into the host's free room
    assert (ok, writebacks) == (False, [tail]) and cache._host_free() == 2
    ok, writebacks = cache.make_room(6)  # x must go too: its write-back waits for the tail's copy
    assert (ok, writebacks) == (False, [])
    x = cache.tree.match_prefix(prompts["x"]).last
    assert x.gpu is GpuState.READY and not x.evict_pending
    cache.finish_offload(tail, tail.gpu_value)
    ok, writebacks = cache.make_room(6)  # the landed tail makes way for x's copy
    assert (ok, writebacks) == (False, [x])
    cache.finish_offload(x, x.gpu_value)
    assert cache.make_room(6) == (True, [])
    assert cache.tree.match_prefix(prompts["x"]).length == 4 and x.cpu and x.gpu is GpuState.NONE
    assert cache.tree.match_prefix(prompts["b"]).length == 4  # b kept its host copy
    assert cache.counters.dropped_tokens == 2  # only the tail is lost
    cache.tree.check_invariants()


# ---------------------------------------------------------------------- prefetch
def prefetch_setup(capacity: int, steps: dict[str, float], cpu_capacity: int = 1000,
                   ) -> tuple[TieredCache, StepBook, dict[str, tuple[int, ...]]]:
    """One workflow; agent i has an 8-token prompt of token i, all on the host tier."""
    book = StepBook()
    book.set_steps("w", steps)
    cache = TieredCache(capacity, KVFlowPolicy(book), cpu_capacity=cpu_capacity, host_tier=True)
    prompts = {agent: (i + 1,) * 8 for i, agent in enumerate(steps)}
    for agent, prompt in prompts.items():
        book.register_prompt(("w", agent), prompt)
        put(cache, prompt)
        cache.tree.tag_prefix(prompt, ("w", agent))
        to_host(cache, prompt)
    assert cache.tree.gpu_tokens == 0
    return cache, book, prompts


def test_prefetch_loads_host_prompts_within_the_horizon_nearest_first() -> None:
    cache, book, prompts = prefetch_setup(100, {"c": 2, "b": 1, "a": 0, "d": 3})
    ops = plan_prefetch(cache, StepsAheadPrefetch(horizon=1, max_inflight=4), book, inflight=0)
    assert [(op.tag, op.steps, op.tokens) for op in ops] == [(("w", "a"), 0, 8), (("w", "b"), 1, 8)]
    for op in ops:
        assert [n.tier for n in op.nodes] == [Tier.LOADING] and op.writebacks == []
        assert sum(len(n) for n in op.nodes) == op.tokens
    assert cache.tree.gpu_tokens == 16
    assert cache.tree.match_prefix(prompts["c"]).last.tier is Tier.CPU
    # loads that are already running or done are not issued again
    assert plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0) == []
    for op in ops:
        for node in op.nodes:
            cache.finish_load(node, prompts[op.tag[1]])
    assert cache.tree.match_prefix(prompts["a"]).gpu_length() == 8
    # horizon 2 reaches c as well
    (op,) = plan_prefetch(cache, StepsAheadPrefetch(horizon=2), book, inflight=0)
    assert op.tag == ("w", "c")
    assert plan_prefetch(cache, NoPrefetch(), book, inflight=0) == []


def test_prefetch_loads_the_prompt_in_its_workflows_namespace() -> None:
    """A workflow's prompt is prefetched where its requests look (its salt), never another tenant's
    copy of the same tokens; and a copy on the device in another namespace does not count as loaded."""
    book = StepBook()
    book.apply({"w": {"a": 0}}, {("w", "a"): (7,) * 8}, [], salts={"w": "tenant"})
    assert book.salt("w") == "tenant" and book.salt("other") == ""
    cache = TieredCache(100, KVFlowPolicy(book), cpu_capacity=100, host_tier=True)
    put(cache, (7,) * 8, "tenant")
    cache.tree.tag_prefix((7,) * 8, ("w", "a"), namespace="tenant")
    to_host(cache, (7,) * 8, "tenant")
    put(cache, (7,) * 8)  # the same tokens on the device in the default namespace
    (op,) = plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0)
    assert op.tag == ("w", "a") and [(n.namespace, n.tier) for n in op.nodes] == [("tenant", Tier.LOADING)]
    assert not cache.prompt_on_device(("w", "a"), "tenant")
    cache.finish_load(op.nodes[0], (7,) * 8)
    assert cache.prompt_on_device(("w", "a"), "tenant") and not cache.prompt_on_device(("w", "a"))
    assert cache.match((7,) * 8, "tenant").path == op.nodes
    # retiring the workflow forgets its namespace with the rest of it
    book.retire("w")
    assert book.salt("w") == ""
    cache.tree.check_invariants()


def test_prefetch_respects_max_inflight() -> None:
    cache, book, _ = prefetch_setup(100, {"a": 0, "b": 1, "c": 1})
    policy = StepsAheadPrefetch(horizon=1, max_inflight=2)
    ops = plan_prefetch(cache, policy, book, inflight=1)
    assert [op.tag for op in ops] == [("w", "a")]
    assert plan_prefetch(cache, policy, book, inflight=2) == []
    ops = plan_prefetch(cache, policy, book, inflight=0)
    assert [op.tag for op in ops] == [("w", "b"), ("w", "c")]


def test_prefetch_evicts_only_nodes_farther_than_the_agent() -> None:
    # device holds 16 tokens: prompts of near (E 1) and far (E 3) agents; b (E 1) waits on the host
    cache, book, prompts = prefetch_setup(16, {"b": 1, "near": 1, "far": 3})
    for agent in ("near", "far"):
        node = cache.tree.match_prefix(prompts[agent]).last
        cache.start_load([node])
        cache.finish_load(node, prompts[agent])
    assert cache.free_tokens == 0
    (op,) = plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0)
    assert op.tag == ("w", "b") and op.tokens == 8
    assert cache.tree.match_prefix(prompts["far"]).last.tier is Tier.CPU  # evicted (it has a host copy)
    assert cache.tree.match_prefix(prompts["near"]).last.tier is Tier.GPU  # E 1 <= 1: untouched
    assert cache.tree.match_prefix(prompts["b"]).last.tier is Tier.LOADING


def test_prefetch_never_evicts_a_node_as_near_as_the_agent() -> None:
    cache, book, prompts = prefetch_setup(8, {"b": 1, "a": 0})
    node = cache.tree.match_prefix(prompts["a"]).last
    cache.start_load([node])
    cache.finish_load(node, prompts["a"])
    assert plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0) == []
    assert node.tier is Tier.GPU
    assert cache.tree.match_prefix(prompts["b"]).last.tier is Tier.CPU


def test_prefetch_write_back_of_a_farther_node_is_returned() -> None:
    """Room that needs a device -> host copy first: the op carries the write-back and no load."""
    book = StepBook()
    book.set_steps("w", {"b": 1, "far": 5})
    cache = TieredCache(8, KVFlowPolicy(book), cpu_capacity=100, host_tier=True)
    pb, pfar = (1,) * 8, (2,) * 8
    book.register_prompt(("w", "b"), pb)
    put(cache, pb)
    cache.tree.tag_prefix(pb, ("w", "b"))
    to_host(cache, pb)
    put(cache, pfar)  # no host copy yet
    cache.tree.tag_prefix(pfar, ("w", "far"))
    (op,) = plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0)
    far = cache.tree.match_prefix(pfar).last
    assert op.nodes == [] and op.tokens == 0 and op.writebacks == [far] and far.offloading
    cache.finish_offload(far, pfar)
    (op,) = plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0)
    assert op.tag == ("w", "b") and op.tokens == 8


def test_prefetch_never_evicts_the_prefix_of_the_prompt_it_loads() -> None:
    """Regression: a new workflow instance reuses a template whose preamble is on the device (tagged by
    nobody near, here by no one) and whose rest is on the host. Making room used to evict the preamble
    itself, and begin_load then failed ("load parents first")."""
    book = StepBook()
    cache = TieredCache(8, KVFlowPolicy(book), cpu_capacity=100, host_tier=True)
    pre, rest = [1, 2, 3, 4], [5, 6, 7, 8]
    put(cache, pre + rest)
    cache.match(pre)  # split at the preamble
    to_host(cache, pre + rest)  # rest -> host only
    preamble = cache.tree.match_prefix(pre).last
    assert cache.backup(preamble)
    cache.finish_offload(preamble, preamble.gpu_value)  # preamble: device + host copy
    cache.alloc(4)  # a running request holds the rest of the device
    book.set_steps("w2", {"a": 1})
    book.register_prompt(("w2", "a"), tuple(pre + rest))
    ops = plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0)
    assert ops == []  # no room without evicting its own preamble
    assert preamble.tier is Tier.GPU and preamble.lock_ref == 0
    cache.release(4)
    (op,) = plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, inflight=0)
    assert [n.key for n in op.nodes] == [tuple(rest)] and preamble.tier is Tier.GPU
    cache.tree.check_invariants()


def test_prefetch_skips_agents_without_a_known_prompt() -> None:
    cache, book, _ = prefetch_setup(100, {"a": 0})
    book.set_steps("w", {"a": 0, "ghost": 0})
    assert [op.tag for op in plan_prefetch(cache, StepsAheadPrefetch(horizon=1), book, 0)] == [("w", "a")]


# ---------------------------------------------------------------------- admission
def test_status_aware_admission_puts_ready_requests_first() -> None:
    waiting = ["r1", "load1", "r2", "load2", "r3"]
    assert StatusAwareAdmission().order(waiting, ["r1", "r2", "r3"]) == ["r1", "r2", "r3"]
    # only loading requests: they are returned, in arrival order (nothing else to run)
    assert StatusAwareAdmission().order(["load2", "load1"], []) == ["load2", "load1"]
    assert StatusAwareAdmission().order([], []) == []


def test_fcfs_admission_keeps_arrival_order() -> None:
    waiting = ["load1", "r1", "load2"]
    assert FCFSAdmission().order(waiting, ["r1"]) == waiting


# ---------------------------------------------------------------------- errors
def test_zero_device_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="device KV capacity must be positive, got 0 tokens"):
        TieredCache(gpu_capacity=0, eviction=LRUPolicy())
    with pytest.raises(ValueError, match="host tier needs a positive cpu_capacity"):
        TieredCache(8, LRUPolicy(), host_tier=True)


def test_alloc_beyond_free_raises_memory_error() -> None:
    cache = TieredCache(8, LRUPolicy())
    put(cache, (1, 2, 3, 4))
    cache.alloc(4)
    with pytest.raises(MemoryError, match=r"alloc\(1\) with only 0 free device tokens"):
        cache.alloc(1)
    assert cache.private_tokens == 4


def test_load_beyond_free_raises_memory_error() -> None:
    cache = TieredCache(4, LRUPolicy(), cpu_capacity=8, host_tier=True)
    put(cache, (1, 2, 3, 4))
    to_host(cache, [1, 2, 3, 4])
    cache.alloc(1)
    with pytest.raises(MemoryError, match="load of 4 tokens with only 3 free"):
        cache.start_load(cache.tree.match_prefix((1, 2, 3, 4)).path)


def test_policy_factory_errors() -> None:
    with pytest.raises(ValueError, match="needs a StepBook"):
        make_eviction_policy("kvflow")
    with pytest.raises(ValueError, match="future access sequence"):
        make_eviction_policy("belady")
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_eviction_policy("mru")
    with pytest.raises(ValueError, match="horizon >= 0 and max_inflight >= 1"):
        StepsAheadPrefetch(horizon=1, max_inflight=0)


@pytest.mark.parametrize("policy", ["lru", "kvflow"])
@pytest.mark.parametrize("seed", range(20))
def test_the_eviction_index_evicts_exactly_what_a_full_rescan_would(policy: str, seed: int) -> None:
    """Differential: the same operations on a cache with its incremental index and on one that ranks
    every device leaf per decision evict the same nodes, with and without a prefetch bound."""
    import random

    rng = random.Random(seed)
    book = StepBook()
    caches = [TieredCache(40, make_eviction_policy(policy, book), cpu_capacity=60, host_tier=True) for _ in range(2)]
    caches[1].index = caches[1].host_index = None
    assert caches[0].index is not None and caches[0].host_index is not None
    prompts = {(f"w{w}", a): tuple(rng.randrange(8) for _ in range(rng.randrange(2, 9)))
               for w in range(3) for a in "abc"}
    for _step in range(120):
        op = rng.random()
        if op < 0.45:
            tag = rng.choice(sorted(prompts))
            seq = prompts[tag] + tuple(rng.randrange(8) for _ in range(rng.randrange(0, 4)))
            results = []
            for cache in caches:
                m = cache.match(seq)
                cache.tree.lock(m.last)
                need = len(seq) - sum(len(n.key) for n in m.path if n.gpu is not GpuState.NONE)
                ok, writebacks = cache.make_room(need)
                for node in writebacks:
                    cache.finish_offload(node)
                if ok and cache.free_tokens >= need:
                    cache.alloc(need)
                    cache.commit(seq, need)
                    cache.tree.tag_prefix(prompts[tag], tag)
                cache.tree.unlock(m.last)
                results.append(ok)
            assert results[0] == results[1]
        elif op < 0.75:
            book.set_steps(f"w{rng.randrange(3)}", {a: rng.choice([0, 1, 2, 3, INF]) for a in "abc"})
        elif op < 0.85:
            workflow = f"w{rng.randrange(3)}"
            book.retire(workflow)
            for cache in caches:
                cache.retire_workflow(workflow)
        else:
            steps, more = rng.choice([0, 1, 2, 5]), rng.randrange(1, 12)
            for cache in caches:
                bound = cache.eviction.needed_by(steps) if policy == "kvflow" else None
                _ok, writebacks = cache.make_room(cache.free_tokens + more, bound)
                for node in writebacks:
                    cache.finish_offload(node)
        assert device_sequences(caches[0]) == device_sequences(caches[1])
        caches[0].check_indexes()


@pytest.mark.parametrize("seed", range(20))
def test_prefetch_candidates_plan_exactly_what_the_whole_book_plans(seed: int) -> None:
    """Differential: planning over `PrefetchCandidates` (agents with nothing to load set aside until
    their workflow or their prompt's subtree changes) starts the same loads, in the same order, as
    planning over the whole step book, through inserts, evictions, loads and step changes."""
    import random

    from kvflow_ray.core.prefetch import PrefetchCandidates

    rng = random.Random(seed)
    book = StepBook()
    caches = [TieredCache(48, make_eviction_policy("kvflow", book), cpu_capacity=200, host_tier=True) for _ in range(2)]
    candidates = PrefetchCandidates(book, caches[1].tree)
    policy = StepsAheadPrefetch(horizon=1, max_inflight=2)
    shared = (7, 7, 7)
    prompts = {(f"w{w}", a): (shared if rng.random() < 0.5 else ()) + tuple(rng.randrange(6) for _ in range(4))
               for w in range(4) for a in "abc"}
    for tag, tokens in prompts.items():
        book.register_prompt(tag, tokens)
    loading: list[list[list[RadixNode]]] = [[], []]
    for _step in range(150):
        op = rng.random()
        if op < 0.35:
            tag = rng.choice(sorted(prompts))
            seq = prompts[tag] + tuple(rng.randrange(6) for _ in range(rng.randrange(0, 3)))
            for cache in caches:
                m = cache.match(seq)
                cache.tree.lock(m.last)
                _ready, pending, host = m.split_by_tier()
                need = len(seq) - m.length
                ok, writebacks = cache.make_room(need + sum(len(n.key) for n in host))
                for node in writebacks:
                    cache.finish_offload(node)
                if ok and not pending:
                    for node in host:
                        cache.start_load([node])
                        cache.finish_load(node)
                    cache.alloc(need)
                    cache.commit(seq, need)
                    cache.tree.tag_prefix(prompts[tag], tag)
                cache.tree.unlock(m.last)
        elif op < 0.6:
            book.set_steps(f"w{rng.randrange(4)}", {a: rng.choice([0, 1, 2, INF]) for a in "abc"})
        elif op < 0.7:
            for i, cache in enumerate(caches):  # loads in flight land
                for nodes in loading[i]:
                    for node in nodes:
                        cache.finish_load(node)
                loading[i] = []
        else:
            candidates.refresh()
            plans = [plan_prefetch(caches[0], policy, book, len(loading[0])),
                     plan_prefetch(caches[1], policy, candidates, len(loading[1]))]
            assert [(op.tag, [n.sequence() for n in op.nodes]) for op in plans[0]] == \
                   [(op.tag, [n.sequence() for n in op.nodes]) for op in plans[1]]
            for i, (cache, plan) in enumerate(zip(caches, plans, strict=True)):
                for op in plan:
                    for node in op.writebacks:
                        cache.finish_offload(node)
                    if op.nodes:
                        loading[i].append(op.nodes)
        assert device_sequences(caches[0]) == device_sequences(caches[1])


# ------------------------------------------------- SGLang's rules (tests/sglang checks them against SGLang)
def test_a_lookup_that_ends_inside_a_node_refreshes_its_tail() -> None:
    """SGLang 0.5.23 stamps the node a look-up ends inside before splitting it, so its unmatched tail is
    as recent as the match: after [1,2,3,4], [9,9], a look-up of [1,2,7] leaves [9,9] least recent."""
    cache = TieredCache(100, LRUPolicy())
    put(cache, [1, 2, 3, 4])
    put(cache, [9, 9])
    match = cache.match([1, 2, 7])
    assert match.length == 2 and match.partial is not None and match.partial.key == (3, 4)
    assert eviction_order(cache)[0] == (9, 9)


def test_evict_takes_whole_nodes_and_what_it_can() -> None:
    """`evict(n)` is SGLang's `RadixCache.evict`: whole nodes in policy order until `n` tokens went,
    and everything unlocked when asked for more; `make_room` for an impossible request evicts nothing."""
    cache = TieredCache(100, LRUPolicy(), page_size=2)
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6, 7, 8, 9])  # 4 tokens cached: the last is not a whole page
    assert cache.evict(1) == (4, [])  # the least recent node, whole
    assert device_sequences(cache) == {(5, 6, 7, 8)}
    locked = cache.match([5, 6])
    cache.tree.lock(locked.last)
    put(cache, [1, 2])
    assert cache.make_room(cache.free_tokens + 7) == (False, [])  # 4 tokens are evictable: nothing goes
    assert cache.evict(1_000) == (4, [])  # all it can: the unlocked nodes [7,8] and [1,2]
    assert device_sequences(cache) == {(5, 6)}
    cache.tree.check_invariants()


def test_full_host_gives_up_device_resident_copies_first() -> None:
    """`host_duplicates_first` (SGLang's HiCache under write_back): to make host room, the host copies
    of nodes still on the device go first, in the order they became so, before any host-only copy, however
    recently used; without it the eviction policy ranks every host copy."""
    for duplicates_first, survivor in ((True, (1, 1)), (False, (2, 2))):
        cache = TieredCache(4, LRUPolicy(), cpu_capacity=4, host_tier=True,
                            host_duplicates_first=duplicates_first)
        put(cache, [1, 1])
        put(cache, [2, 2])
        for node in cache.make_room(4)[1]:  # both written back, then off the device: the host is full
            cache.finish_offload(node)
        put(cache, [2, 2])  # fresh KV revives [2,2]: on both tiers now
        put(cache, [3, 3])
        cache.match([2, 2])  # [2,2] the most recent; [3,3], with no host copy, the least
        ok, writebacks = cache.make_room(cache.free_tokens + 2)  # [3,3] is written back: 2 host tokens must go
        assert not ok and [node.key for node in writebacks] == [(3, 3)]
        cache.finish_offload(writebacks[0])
        hosted = {node.sequence() for node in cache.tree.nodes() if node.cpu}
        assert hosted == {survivor, (3, 3)}, (duplicates_first, hosted)
        cache.tree.check_invariants()
