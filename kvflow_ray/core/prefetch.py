"""Prefetch: which host-tier prefixes to load onto the device before their agents run.

A policy only chooses *which agents* (nearest first, within a horizon and a concurrency cap);
`plan_prefetch` turns that into loads within a budget: free device tokens plus tokens that can be
evicted without touching anything needed as soon or sooner than the agent being prefetched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.policies import StepBook
from kvflow_ray.core.radix import RadixNode, Tag


@dataclass
class PrefetchOp:
    tag: Tag
    steps: float
    nodes: list[RadixNode]  # host-only nodes now LOADING, in path order
    tokens: int
    writebacks: list[RadixNode] = field(default_factory=list)  # evictions that need a device -> host copy


class PrefetchPolicy(Protocol):
    name: str

    def choose(self, book: StepBook, inflight: int) -> list[tuple[Tag, float]]:
        """Agents to prefetch for, nearest first, given `inflight` prefetches already running."""
        ...


class NoPrefetch:
    name = "none"

    def choose(self, book: StepBook, inflight: int) -> list[tuple[Tag, float]]:
        return []


class StepsAheadPrefetch:
    """KVFlow: agents whose steps-to-execution is at most `horizon` (running agents included: their
    request may not have arrived yet), nearest first, at most `max_inflight` loads at once."""

    name = "steps-ahead"

    def __init__(self, horizon: int = 1, max_inflight: int = 4) -> None:
        if horizon < 0 or max_inflight < 1:
            raise ValueError("prefetch needs horizon >= 0 and max_inflight >= 1")
        self.horizon = horizon
        self.max_inflight = max_inflight

    def choose(self, book: StepBook, inflight: int) -> list[tuple[Tag, float]]:
        room = self.max_inflight - inflight
        if room <= 0:
            return []
        near = sorted((e, tag) for tag, e in book.near.items() if e <= self.horizon)
        return [(tag, e) for e, tag in near]


def plan_prefetch(cache: TieredCache, policy: PrefetchPolicy, book: StepBook, inflight: int,
                  reserved_tokens: int = 0) -> list[PrefetchOp]:
    """Start the loads `policy` asks for that fit the budget; the engine copies the returned nodes.

    `reserved_tokens` is device memory that requests already queued need: a prefetch never takes it,
    because a load for an agent that runs *later* must not delay one that could run *now* (and under
    memory pressure such a load would be evicted again before use)."""
    ops: list[PrefetchOp] = []
    node_distance = getattr(cache.eviction, "node_distance", None)
    for tag, steps in policy.choose(book, inflight):
        if inflight + len(ops) >= getattr(policy, "max_inflight", 0):
            break
        tokens = book.prompt(tag)
        namespace = book.salt(tag[0])  # the prompt is cached where its workflow's requests put it
        if tokens is None or cache.prompt_on_device(tag, namespace):
            continue
        match = cache.tree.match_prefix(tokens, namespace=namespace)
        cache.remember_prompt(tag, tokens, match)
        _ready, _loading, host = match.split_by_tier()
        if not host:
            continue
        need = sum(len(node.key) for node in host)
        if need + reserved_tokens > cache.gpu_capacity:
            break
        # Fix: lock the prompt's path while making room, so eviction never drops the device parent
        # of the nodes about to load (begin_load then failed "load parents first") nor the host
        # copies being loaded; the distance filter alone missed path nodes not (or farther) tagged.
        cache.tree.lock(match.last)
        try:
            if node_distance is not None:
                def farther(node: RadixNode, steps: float = steps) -> bool:
                    return node_distance(node) > steps
                ok, writebacks = cache.make_room(need + reserved_tokens, farther)
            else:
                ok, writebacks = cache.make_room(need + reserved_tokens)
            if not ok:
                if writebacks:  # room comes once these copies finish; the engine must still run them
                    ops.append(PrefetchOp(tag, steps, [], 0, writebacks))
                # Nearest first, strictly: a farther agent's budget is never larger (it may evict
                # fewer nodes), so once the nearest missing prompt does not fit, stop planning.
                break
            cache.tree.touch(match.path)
            ops.append(PrefetchOp(tag, steps, host, cache.start_load(host), writebacks))
        finally:
            cache.tree.unlock(match.last)
    return ops
