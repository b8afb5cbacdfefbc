"""The core's `lru` baseline is SGLang 0.5.23's radix cache: a seeded differential fuzz.

Each sequence drives the core `TieredCache` and SGLang's own `RadixCache` (real pools on CPU) with the
same random operations: insert, match, match-and-lock, unlock and evict, over prompts that share and
split each other's nodes, in four namespaces (the default, a cache salt, an extra key, both). After
every operation the two agree on the match length, the tokens evicted, and the evictable and locked
sizes; after every eviction and at the end, on every cached (namespace, sequence), node by node. The
core runs `lru`, and `kvflow` with no hints (every node untagged: it must order exactly as LRU).

1,000 sequences of 60 operations per page size (1 and 16), per core policy. A failure prints the seed
and the operations that led to it, so `replay(seed, page, policy)` reproduces it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang_caches import TREES, build

from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.policies import StepBook, make_eviction_policy
from kvflow_ray.core.radix import Match, RadixNode, cache_namespace
from kvflow_ray.engines.sglang.state import radix_key

SEQUENCES = 1000
OPERATIONS = 60
KV_TOKENS = 16384  # more than a sequence ever inserts: only explicit evictions free anything
# (cache_salt, extra_key): SGLang's two namespaces of a RadixKey, alone and together
NAMESPACES = ((None, None), ("tenant-a", None), (None, "lora-1"), ("tenant-a", "lora-1"))


@dataclass
class Pair:
    """The same cache twice: SGLang's `RadixCache` and the core's `TieredCache`."""

    page: int
    policy: str
    tree: str = "legacy"  # SGLang's `RadixCache`, or "unified": its `UnifiedRadixCache` (Python tree core)
    sglang: Any = None
    core: TieredCache = None  # type: ignore[assignment]
    locked: list[tuple[Any, Any, Match]] = field(default_factory=list)  # (SGLang node, its lock, core match)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sglang = build(self.tree, "lru", kv_tokens=KV_TOKENS, page_size=self.page)
        self.core = TieredCache(1 << 30, make_eviction_policy(self.policy, StepBook()), page_size=self.page)

    # ------------------------------------------------------------------ operations
    def insert(self, tokens: list[int], salt: str | None, extra: str | None) -> None:
        rig, key = self.sglang, sglang_key(tokens, salt, extra, self.page)
        value = rig.allocator.alloc(len(key))
        assert value is not None, "the SGLang pool ran out: raise KV_TOKENS"
        result = rig.cache.insert(InsertParams(key=key, value=value))
        if self.tree == "legacy":  # KV the tree already held: the caller frees it (the unified tree does)
            rig.allocator.free(value[:result.prefix_len])
        core = self.core
        core.alloc(len(key))
        core.commit(tokens, len(key), namespace=cache_namespace(salt, extra))

    def match(self, tokens: list[int], salt: str | None, extra: str | None) -> tuple[Any, Match]:
        theirs = self.sglang.cache.match_prefix(MatchPrefixParams(key=sglang_key(tokens, salt, extra, self.page)))
        ours = self.core.match(tokens, cache_namespace(salt, extra))
        assert ours.length == theirs.device_prefix_len, (ours.length, theirs.device_prefix_len)
        return theirs.last_device_node, ours

    def lock(self, tokens: list[int], salt: str | None, extra: str | None) -> None:
        node, match = self.match(tokens, salt, extra)
        locked = self.sglang.lock(node)
        self.core.tree.lock(match.last)
        self.locked.append((node, locked, match))

    def unlock(self, index: int) -> None:
        node, locked, match = self.locked.pop(index)
        self.sglang.unlock(node, locked)
        self.core.tree.unlock(match.last)

    def evict(self, n: int) -> None:
        theirs = self.sglang.evict(n)
        ours, _writebacks = self.core.evict(n)  # no host tier: none
        assert ours == theirs, (ours, theirs)

    # ------------------------------------------------------------------ state
    def check_sizes(self) -> None:
        tree, cache = self.core.tree, self.sglang.cache
        assert tree.gpu_tokens - tree.locked_gpu_tokens == cache.evictable_size()
        assert tree.locked_gpu_tokens == cache.protected_size()

    def check_contents(self) -> None:
        assert core_nodes(self.core) == sglang_nodes(self.sglang.cache)


def sglang_key(tokens: list[int], salt: str | None, extra: str | None, page: int) -> RadixKey:
    """SGLang's key for `tokens` in the namespace (salt, extra key), page-aligned as its trees take it."""
    return radix_key(tokens, cache_namespace(salt, extra)).page_aligned(page)


Node = tuple[Any, ...]  # (namespace, root-to-node tokens, *what a caller adds)


def core_nodes(cache: TieredCache, detail: Callable[[RadixNode], tuple[Any, ...]] = lambda node: ()) -> set[Node]:
    """(namespace, root-to-node tokens, *detail(node)) of every node of the core tree."""
    out = set()
    stack = [(node, node.key) for node in cache.tree.root.children.values()]
    while stack:
        node, seq = stack.pop()
        out.add((node.namespace, seq, *detail(node)))
        stack.extend((child, seq + child.key) for child in node.children.values())
    return out


def sglang_nodes(cache: Any, detail: Callable[[Any], tuple[Any, ...]] = lambda node: ()) -> set[Node]:
    """The same of every node of a SGLang tree (legacy or unified)."""
    out = set()
    stack = [(node, tuple(node.key.token_ids)) for node in cache.root_node.children.values()]
    while stack:
        node, seq = stack.pop()
        out.add((cache_namespace(node.key.cache_salt, node.key.extra_key), seq, *detail(node)))
        stack.extend((child, seq + tuple(child.key.token_ids)) for child in node.children.values())
    return out


class Prompts:
    """Prompts that share prefixes the way agents' prompts do: a previous prompt cut anywhere (inside
    a node or a page, so look-ups split nodes) and extended, or fresh blocks from a small library."""

    def __init__(self, rng: random.Random, page: int) -> None:
        self.rng = rng
        scale = max(page, 4)
        self.blocks = [[rng.randrange(1000) for _ in range(rng.randint(1, 3 * scale))] for _ in range(6)]
        self.seen: list[tuple[list[int], tuple[str | None, str | None]]] = []

    def next(self) -> tuple[list[int], str | None, str | None]:
        rng = self.rng
        if self.seen and rng.random() < 0.7:
            base, namespace = rng.choice(self.seen)
            tokens = base[:rng.randint(0, len(base))]
            if rng.random() < 0.2:  # the same tokens in another namespace
                namespace = rng.choice(NAMESPACES)
        else:
            tokens, namespace = [], rng.choice(NAMESPACES)
        for _ in range(rng.randint(0 if tokens else 1, 2)):
            tokens = tokens + rng.choice(self.blocks)
        if rng.random() < 0.3:
            tokens = tokens + [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
        self.seen.append((tokens, namespace))
        return tokens, *namespace


def prompt_op(pair: Any, name: str, prompts: Prompts) -> None:
    """One operation on the next prompt, both sides and logged: `pair.<name>(tokens, salt, extra)`."""
    tokens, salt, extra = prompts.next()
    pair.log.append(f"{name} {tokens} salt={salt} extra={extra}")
    getattr(pair, name)(tokens, salt, extra)


@contextmanager
def first_difference(log: list[str], label: str) -> Iterator[None]:
    """Re-raise a difference with the sequence's label (its seed) and the operations that led to it."""
    try:
        yield
    except AssertionError as exc:
        steps = "\n  ".join(log)
        raise AssertionError(f"{label}: differs after\n  {steps}\n{exc!r}") from exc


def replay(seed: int, page: int, policy: str, tree: str = "legacy") -> Pair:
    """Run one sequence; raises AssertionError with the operations so far at the first difference."""
    rng = random.Random(seed)
    prompts = Prompts(rng, page)
    pair = Pair(page, policy, tree)
    with first_difference(pair.log, f"seed {seed}, page {page}, {policy}, {tree}"):
        for _ in range(OPERATIONS):
            op = rng.random()
            if op < 0.35:
                prompt_op(pair, "insert", prompts)
            elif op < 0.6:
                prompt_op(pair, "match", prompts)
            elif op < 0.7:
                prompt_op(pair, "lock", prompts)
            elif op < 0.8 and pair.locked:
                index = rng.randrange(len(pair.locked))
                pair.log.append(f"unlock #{index}")
                pair.unlock(index)
            else:
                n = rng.randint(1, 4 * max(page, 8))
                pair.log.append(f"evict {n}")
                pair.evict(n)
                pair.check_contents()
            pair.check_sizes()
        pair.check_contents()
    return pair


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "kvflow"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("tree", TREES)
def test_core_cache_matches_sglang_radix_cache(tree: str, page: int, policy: str) -> None:
    torch.manual_seed(0)
    evicted = lookups = 0
    for seed in range(SEQUENCES):
        pair = replay(seed, page, policy, tree)
        evicted += pair.core.counters.evicted_gpu_tokens
        lookups += sum(1 for line in pair.log if line.startswith(("match", "lock")))
    assert evicted > 0 and lookups > 0  # the fuzz reached eviction and look-ups


def test_the_minimal_split_tail_case() -> None:
    """The issue's case: cache [1,2,3,4] and [9,9], match [1,2,7], evict 2 tokens. SGLang refreshes the
    split node's tail [3,4] with the match, so [9,9] is the least recently used and goes."""
    for policy in ("lru", "kvflow"):
        pair = Pair(1, policy)
        pair.insert([1, 2, 3, 4], None, None)
        pair.insert([9, 9], None, None)
        pair.match([1, 2, 7], None, None)
        pair.evict(2)
        assert core_nodes(pair.core) == sglang_nodes(pair.sglang.cache) == {("", (1, 2)), ("", (1, 2, 3, 4))}


def test_evict_takes_what_it_can_and_whole_nodes() -> None:
    """Partial eviction: asked for more than is evictable, both evict every unlocked leaf and report
    what went; asked for less than a node, both evict the whole node (at page 16, whole pages)."""
    pair = Pair(16, "lru")
    pair.insert(list(range(40)), None, None)  # 32 tokens cached: the last 8 are not a whole page
    pair.lock(list(range(16)), None, None)
    pair.insert(list(range(100, 148)), "tenant-a", None)
    pair.evict(1)  # the least recent node, [16, 32), goes whole
    pair.evict(10_000)  # all that is not locked
    pair.check_contents()
    assert core_nodes(pair.core) == {("", tuple(range(16)))}
    pair.check_sizes()
