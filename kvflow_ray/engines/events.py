"""What an engine tells the router about its cache: `CacheEvent`s as prefixes enter and leave a tier.
One log for every engine (the CPU engine, the serving simulator), fed by the same tree hooks."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvflow_ray.core.radix import GpuState, RadixNode
from kvflow_ray.core.routing import BLOCK_TOKENS, block_hashes
from kvflow_ray.engines.base import CacheEvent, prefix_hash


class CacheEventLog:
    """Bounded: a consumer that never drains loses the oldest events, not memory."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self._events: deque[CacheEvent] = deque(maxlen=maxlen)

    def record(self, kind: str, tier: str, node: RadixNode) -> None:
        if node.parent is not None:
            self._events.append(self._event(kind, tier, node))

    def _event(self, kind: str, tier: str, node: RadixNode) -> CacheEvent:
        if node.route_ids is None:
            # the namespace is part of the prefix's identity: a router never sends one tenant's
            # request to a replica for KV that only another tenant may use
            sequence = node.sequence()
            node.route_ids = (prefix_hash(sequence, node.namespace),
                              block_hashes(sequence, node.namespace, BLOCK_TOKENS), len(sequence))
        name, blocks, end = node.route_ids
        first = -(-(end - len(node.key) + 1) // BLOCK_TOKENS) - 1  # the first block ending inside the node
        return CacheEvent(kind, tier, name, len(node.key), blocks[max(first, 0):end // BLOCK_TOKENS])

    def on_free(self, node: RadixNode, tier: str) -> None:
        """The tree dropped `node`'s copy in `tier` (its `on_free` hook)."""
        self.record("removed", tier, node)

    def committed(self, last: RadixNode | None, end: int, adopted: list[tuple[int, int]]) -> None:
        """A committed prompt (path ending at `last`, `end` tokens): report the nodes whose KV the
        request computed (the ranges the tree adopted), so a router learns what the replica holds."""
        if not adopted or last is None:
            return
        for node in reversed(last.path()):
            start = end - len(node.key)
            if any(lo <= start and end <= hi for lo, hi in adopted):
                self.record("stored", "gpu", node)
            end = start

    def snapshot(self, nodes: Iterable[RadixNode]) -> list[CacheEvent]:
        """Everything the cache holds now, as events: "stored" for each device copy that is ready and
        each host copy of `nodes` (a tree's `nodes()`), for a consumer that lost track of the feed.
        The events not drained yet are dropped: their effect is in it. Call it where the tree cannot
        change meanwhile (the engine's own thread, or under its lock)."""
        self._events.clear()
        out = []
        for node in nodes:
            if node.gpu is GpuState.READY:
                out.append(self._event("stored", "gpu", node))
            if node.cpu:
                out.append(self._event("stored", "cpu", node))
        return out

    def drain(self) -> list[CacheEvent]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out
