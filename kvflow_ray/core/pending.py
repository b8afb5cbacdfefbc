"""The waiting queue as a radix tree, and its paired walk against the cache tree (PEEK's pending tree
and "dualwalk", github xiexbing/peek `src/tree.rs`, `src/pending.rs`).

Every request an admission policy tracks is a path from the root (its cache namespace, then its prompt
tokens); a node counts the requests whose path runs through it (`count`), and of those the ones
admitted whose prompt has no KV yet (`inflight`: their prefill is computing the node's tokens now).
Insertion and removal cost the request's path, not the queue.

The paired walk descends both trees at once and gives every pending node the longest prefix of its
path that the cache holds (`cached`: any tier; `ready`: usable on the device now). It also leaves on
each cache node it reaches the number of queued requests that reach it (`RadixNode.demand`), which a
demand-aware eviction policy protects. A walk redoes only the subtrees under the root that changed on
either side since the last one (the pending tree's own changes, the cache's `subtree_version`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from kvflow_ray.core.radix import GpuState, Namespace, RadixNode, RadixTree, _common_length

R = TypeVar("R", bound=Hashable)


class PendingNode:
    __slots__ = (
        "cached",
        "children",
        "count",
        "depth",
        "inflight",
        "key",
        "namespace",
        "parent",
        "ready",
    )

    def __init__(self, key: tuple[int, ...], parent: PendingNode | None, depth: int, namespace: Namespace) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[object, PendingNode] = {}
        self.count = 0  # tracked requests whose path runs through this node (queued or in flight)
        self.inflight = 0  # of them, admitted with their prefill not done yet
        self.depth = depth  # tokens from the root to the end of this node
        self.cached = 0  # tokens of the path to here held by the cache, any tier (`PendingTree.walk`)
        self.ready = 0  # the same, usable on the device now
        self.namespace = namespace

    def path(self) -> Iterator[PendingNode]:
        """This node and its ancestors, deepest first (the root excluded)."""
        node: PendingNode | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def __repr__(self) -> str:
        return f"PendingNode(len={len(self.key)}, depth={self.depth}, count={self.count}, inflight={self.inflight})"


def cluster_of(leaf: PendingNode | None) -> PendingNode | None:
    """The deepest node from `leaf` up that two or more tracked requests run through (None: the request
    shares nothing with the others): PEEK's `cluster_info`."""
    node = leaf
    while node is not None and node.count < 2:
        node = node.parent
    return node if node is not None and node.parent is not None else None


class PendingTree(Generic[R]):
    """A radix tree over tracked requests' (namespace, prompt) paths (see the module docstring)."""

    def __init__(self) -> None:
        self.root = PendingNode((), None, 0, "")
        self.leaves: dict[R, PendingNode] = {}  # request -> the node its path ends at
        self._inflight: set[R] = set()
        # the root's children whose subtree changed since the last walk (or that left the tree)
        self._changed: dict[PendingNode, None] = {}
        # per root child: the cache subtree it was last walked against (its top node and version), and
        # the demand it left on cache nodes
        self._walked: dict[PendingNode, tuple[int, int]] = {}
        self._marks: dict[PendingNode, list[tuple[RadixNode, int]]] = {}

    def __len__(self) -> int:
        return len(self.leaves)

    def __contains__(self, req: object) -> bool:
        return req in self.leaves

    @staticmethod
    def _child_key(parent: PendingNode, namespace: Namespace, token: int) -> object:
        return (namespace, token) if parent.parent is None else token

    def add(self, req: R, namespace: Namespace, tokens: Sequence[int]) -> PendingNode:
        """Track `req` (queued), whose prompt is `tokens` in cache namespace `namespace`."""
        if req in self.leaves:
            raise ValueError("request is already in the pending tree")
        tokens = tuple(tokens)
        node, i = self.root, 0
        path: list[PendingNode] = []
        while i < len(tokens):
            key = self._child_key(node, namespace, tokens[i])
            child = node.children.get(key)
            if child is None:
                child = PendingNode(tokens[i:], node, node.depth + len(tokens) - i, namespace)
                node.children[key] = child
                path.append(child)
                node, i = child, len(tokens)
                break
            n = _common_length(child.key, tokens, i, 1)
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            node, i = child, i + n
        for p in path:
            p.count += 1
        self.leaves[req] = node
        if path:
            self._changed[path[0]] = None
        return node

    def _split(self, node: PendingNode, at: int) -> PendingNode:
        """Split `node` after `at` tokens; the new upper node takes its place under its parent."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = PendingNode(node.key[:at], parent, node.depth - len(node.key) + at, node.namespace)
        upper.count, upper.inflight = node.count, node.inflight
        upper.cached, upper.ready = min(node.cached, upper.depth), min(node.ready, upper.depth)
        parent.children[self._child_key(parent, node.namespace, node.key[0])] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        if parent is self.root:  # the top moved: what the old one was walked against goes with it
            self._changed[upper] = None
            self._changed[node] = None
        return upper

    def admitted(self, req: R) -> None:
        """`req` left the queue for the running set; it stays (as in flight) until `discard`."""
        leaf = self.leaves.get(req)
        if leaf is None or req in self._inflight:
            return
        self._inflight.add(req)
        for node in leaf.path():
            node.inflight += 1

    def inflight(self, req: R) -> bool:
        return req in self._inflight

    def discard(self, req: R) -> None:
        """Stop tracking `req` (its prefill is done, or it was cancelled)."""
        leaf = self.leaves.pop(req, None)
        if leaf is None:
            return
        inflight = req in self._inflight
        self._inflight.discard(req)
        top = leaf
        for node in list(leaf.path()):
            node.count -= 1
            node.inflight -= inflight
            top = node
            if node.count == 0:
                assert node.parent is not None
                del node.parent.children[self._child_key(node.parent, node.namespace, node.key[0])]
        self._changed[top] = None

    def set_cached(self, req: R, cached: int, ready: int) -> None:
        """What the cache holds of `req`'s prompt, from an engine that matched it itself (no paired walk)."""
        leaf = self.leaves.get(req)
        if leaf is not None:
            leaf.cached, leaf.ready = cached, ready

    # ------------------------------------------------------------------ the paired walk
    def walk(self, tree: RadixTree) -> None:
        """Give every pending node its cached prefix (`cached`, `ready`) and every cache node the queued
        demand that reaches it (`RadixNode.demand`, marked for re-ranking where it changed). Redoes
        only the root's children whose subtree changed here or in the cache since the last walk."""
        for top in list(self._changed):
            if top.parent is not self.root or self.root.children.get((top.namespace, top.key[0])) is not top:
                self._forget(top, tree)  # it left the tree (emptied, or split under a new top)
        tops = list(self.root.children.values())
        for top in tops:
            _key, ctop = tree.top_of(top.key, top.namespace)
            stamp = (ctop.id, ctop.subtree_version) if ctop is not None else (-1, 0)
            if top not in self._changed and self._walked.get(top) == stamp:
                continue
            self._walked[top] = stamp
            marks: list[tuple[RadixNode, int]] = []
            self._walk_top(top, tree, marks)
            self._remark(top, marks, tree)
        self._changed.clear()

    def _forget(self, top: PendingNode, tree: RadixTree) -> None:
        self._walked.pop(top, None)
        self._remark(top, [], tree)

    def _remark(self, top: PendingNode, marks: list[tuple[RadixNode, int]], tree: RadixTree) -> None:
        dirty = tree.rank_dirty
        for node, n in self._marks.pop(top, ()):
            node.demand -= n
            if node.parent is not None:
                dirty[node] = None
        for node, n in marks:
            node.demand += n
            dirty[node] = None
        if marks:
            self._marks[top] = marks

    def _walk_top(self, top: PendingNode, tree: RadixTree, marks: list[tuple[RadixNode, int]]) -> None:
        page = tree.page_size
        # (pending node, cache node, tokens of it matched so far, still matching, device-ready end)
        stack: list[tuple[PendingNode, RadixNode, int, bool, int | None]] = [(top, tree.root, 0, True, None)]
        while stack:
            pnode, cnode, off, matching, ready_end = stack.pop()
            key, base = pnode.key, pnode.depth - len(pnode.key)
            i = 0
            if matching:
                ns = pnode.namespace
                while i < len(key):
                    if off == len(cnode.key):
                        nxt = tree.child(cnode, key[i:], ns) if len(key) - i >= page else None
                        if nxt is None:
                            matching = False
                            break
                        cnode, off = nxt, 0
                        marks.append((cnode, pnode.count))
                        if ready_end is None and cnode.gpu is not GpuState.READY:
                            ready_end = base + i
                    n = _common_length(cnode.key[off:], key, i, page)
                    i, off = i + n, off + n
                    if n == 0 or (i < len(key) and off < len(cnode.key)):
                        matching = False
                        break
                pnode.cached = base + i
            else:
                pnode.cached = pnode.parent.cached if pnode.parent is not None else 0
            pnode.ready = pnode.cached if ready_end is None else min(ready_end, pnode.cached)
            for child in pnode.children.values():
                stack.append((child, cnode, off, matching and i == len(key), ready_end))

    def check(self, tree: RadixTree) -> None:
        """The walk against matching every tracked request's prompt on its own, as an admission does
        (splitting a node matched in part; tests)."""
        self.walk(tree)
        for req, leaf in self.leaves.items():
            tokens = tuple(t for node in reversed(list(leaf.path())) for t in node.key)
            match = tree.match_prefix(tokens, namespace=leaf.namespace)
            assert leaf.cached == match.length, (req, leaf.cached, match.length)
            assert leaf.ready == match.gpu_length(), (req, leaf.ready, match.gpu_length())
