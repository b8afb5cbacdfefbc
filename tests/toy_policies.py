"""Toy policies the registry tests add without touching any engine: the same classes run in the
simulator and the CPU engine (tests/test_toy_policies.py) and in the SGLang plugin
(tests/sglang/test_toy_policies.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvflow_ray.core.prefetch import NearAgents
from kvflow_ray.core.radix import Tag


class MostRecentlyUsed:
    """Evict the most recently used node first (the opposite of LRU: on a cyclic access pattern
    that does not fit, it keeps the oldest prompts, which come back next)."""

    name = "toy-mru"

    def priority(self, node: Any) -> tuple[float, ...]:
        return (-node.last_access,)


class NearestOnly:
    """Prefetch only the single nearest agent that will run (E >= 1), one load at a time; `chosen`
    records its choices."""

    name = "toy-nearest-only"
    max_inflight = 1

    def __init__(self) -> None:
        self.chosen: list[Tag] = []

    def choose(self, book: NearAgents) -> Iterable[tuple[Tag, float]]:
        ahead = sorted((e, tag) for tag, e in book.near.items() if e >= 1)
        self.chosen.extend(tag for _e, tag in ahead[:1])
        return [(tag, e) for e, tag in ahead[:1]]
