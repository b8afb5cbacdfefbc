"""The waiting queue's indexes: which queued requests have their cached prefix usable now, which
hold host-only prefix nodes (a load to start), and which hold a queued load, each in arrival order.

Kept current by what changed in the tree (`RadixTree.watch_tops`): a request is looked up again only
when the subtree its tokens start in changes or gains its first node, since a look-up's answer is a
function of that subtree alone. An admission pass then costs what changed and how far it gets into
the queue, not the queue's length (hundreds of requests per replica when a fleet is overloaded).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from kvflow_ray.core.radix import ChildKey, RadixNode, RadixTree


class Queued(Protocol):
    seq: int  # arrival order: unique, increasing
    tokens: tuple[int, ...]
    cache_salt: str


Q = TypeVar("Q", bound=Queued)


class ArrivalOrder(Generic[Q]):
    """A set of requests iterated in arrival (`seq`) order."""

    def __init__(self) -> None:
        self._seqs: list[int] = []
        self._items: list[Q] = []

    def add(self, req: Q) -> None:
        i = bisect.bisect_left(self._seqs, req.seq)
        if i == len(self._seqs) or self._seqs[i] != req.seq:
            self._seqs.insert(i, req.seq)
            self._items.insert(i, req)

    def discard(self, req: Q) -> None:
        i = bisect.bisect_left(self._seqs, req.seq)
        if i < len(self._seqs) and self._seqs[i] == req.seq:
            del self._seqs[i]
            del self._items[i]

    def items(self) -> list[Q]:
        return self._items[:]

    def after(self, seq: int) -> Q | None:
        """The first request that arrived after `seq` (None: none)."""
        i = bisect.bisect_right(self._seqs, seq)
        return self._items[i] if i < len(self._items) else None


class WaitingIndex(Generic[Q]):
    """`ready` (cached prefix usable now) and `needs_load` (holds host-only prefix nodes) over the
    queued requests; `prefix_state(req)` is the scheduler's look-up: (usable now, host-only nodes)."""

    def __init__(self, tree: RadixTree, prefix_state: Callable[[Q], tuple[bool, list[RadixNode]]]) -> None:
        self.tree = tree
        self.watch = tree.watch_tops()
        self.prefix_state = prefix_state
        self.ready: ArrivalOrder[Q] = ArrivalOrder()
        self.needs_load: ArrivalOrder[Q] = ArrivalOrder()
        # requests by the root's child their look-up starts in (or its key, while there is no such node)
        self._at_top: dict[RadixNode, dict[Q, None]] = {}
        self._at_key: dict[ChildKey, dict[Q, None]] = {}
        self._group: dict[Q, tuple[dict[Any, dict[Q, None]], Any]] = {}  # request -> (which map, its key there)

    def add(self, req: Q) -> None:
        self._place(req)

    def discard(self, req: Q) -> None:
        where = self._group.pop(req, None)
        if where is not None:
            groups, key = where
            group = groups.get(key)
            if group is not None:
                group.pop(req, None)
                if not group:
                    del groups[key]
        self.ready.discard(req)
        self.needs_load.discard(req)

    def refresh(self) -> None:
        """Look up again the requests whose subtree changed since the last refresh."""
        watch = self.watch
        if not watch.changed and not watch.new_keys:
            return
        stale: dict[Q, None] = {}
        for top in watch.changed:
            stale.update(self._at_top.pop(top, {}))
        for key in watch.new_keys:
            stale.update(self._at_key.pop(key, {}))
        watch.clear()
        for req in stale:
            self._place(req)

    def check(self, waiting: Sequence[Q]) -> None:
        """The index against looking every queued request up again (tests)."""
        self.refresh()
        states = [(req, self.prefix_state(req)) for req in waiting]
        assert self.ready.items() == [req for req, (usable, _host) in states if usable]
        assert self.needs_load.items() == [req for req, (_usable, host) in states if host]

    def _place(self, req: Q) -> None:
        key, top = self.tree.top_of(req.tokens, req.cache_salt)
        groups: dict[Any, dict[Q, None]] = self._at_key if top is None else self._at_top  # type: ignore[assignment]
        where = key if top is None else top
        groups.setdefault(where, {})[req] = None
        self._group[req] = (groups, where)
        usable, host = self.prefix_state(req)
        if usable:
            self.ready.add(req)
        else:
            self.ready.discard(req)
        if host:
            self.needs_load.add(req)
        else:
            self.needs_load.discard(req)
