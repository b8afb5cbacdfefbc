"""Paged radix tree over token ids with per-node tier state.

The tree only knows *where* each cached prefix lives (device tier, host tier, a copy in flight) and
*who* uses it (agent tags); it never decides what to evict or load — that is `cache.TieredCache`
driving a policy from `policies.py`. Engines attach their own payload (page indices, tensors) to
`gpu_value` / `cpu_value`; the tree slices it on node splits, so any sliceable payload works.

Invariants (checked by `check_invariants`, exercised by property tests):
- every key length is a multiple of `page_size`; children are keyed by their first page, the
  root's children by (namespace, *first page) (`child_key`);
- namespaces: every node carries the cache namespace of its sequence (`cache_namespace`: SGLang's
  `RadixKey` pair of `cache_salt`, a tenant's salt, and `extra_key`; "" by default); a node's
  namespace is its parent's, so the same tokens under two namespaces are two disjoint subtrees and a
  look-up in one never reaches the other's KV;
- a node is in the tree only while it holds KV somewhere (device, host or a load in flight);
- device residency is prefix-closed: a node that is on (or loading to) the device has a parent that is;
- `gpu_tokens` / `cpu_tokens` equal the sums over nodes; a locked node's ancestors are locked.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

Tag = tuple[str, str]
"""(workflow key, agent): the node is part of that agent's fixed prompt in that workflow instance."""

Namespace = str | tuple[str, str]
"""A cache namespace (`cache_namespace`): a cache salt alone, or (extra key, cache salt)."""


def cache_namespace(cache_salt: str | None = None, extra_key: str | None = None) -> Namespace:
    """The namespace SGLang 0.5.23's `RadixKey` keys a sequence by: its `cache_salt` (a tenant's salt
    here; None and "" are the default namespace, as `RadixKey` normalises them) and its `extra_key`
    (SGLang's LoRA adapter id; "" is a key, None is none). Sequences whose salt or extra key differ
    never share a node, there and here. A salt alone is the namespace itself, so the default is ""."""
    salt = cache_salt or ""
    return salt if extra_key is None else (extra_key, salt)


ChildKey = tuple[int | str | tuple[str, str], ...]
"""A node's key in its parent's `children`: its first page, led by its namespace under the root."""


class GpuState(enum.Enum):
    NONE = 0  # no device copy
    LOADING = 1  # host -> device copy in flight; device space is already reserved
    READY = 2  # usable on the device


class Tier(enum.Enum):
    """The tier a node shows to metrics and tests (docs/design.md §3)."""

    GPU = "GPU"
    CPU = "CPU"
    LOADING = "LOADING"
    OFFLOADING = "OFFLOADING"


_ids = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]
    parent: RadixNode | None
    children: dict[ChildKey, RadixNode] = field(default_factory=dict)
    # the cache namespace of the sequence this node completes (same as its parent's below the root)
    namespace: Namespace = ""
    gpu: GpuState = GpuState.NONE
    cpu: bool = False  # holds a host-tier copy
    offloading: bool = False  # device -> host copy in flight
    evict_pending: bool = False  # device copy is freed once the offload completes (write-back eviction)
    lock_ref: int = 0
    last_access: int = 0
    tags: set[Tag] = field(default_factory=set)
    gpu_value: object = None
    cpu_value: object = None
    # children whose gpu state is not NONE; a READY node with none of them is a device leaf
    n_gpu_children: int = 0
    id: int = field(default_factory=lambda: next(_ids))
    loaded_at: float = 0.0  # engine clock when its latest host -> device load landed (stall accounting)
    # cached min-distance for the eviction policy: (policy version, value)
    prio_cache: tuple[int, float] = (-1, 0.0)
    rank_stamp: int = 0  # the device eviction index's entry for this node is current iff it carries this stamp
    host_stamp: int = 0  # the same, for the host-copy eviction index
    # on a child of the root: bumped by every change of structure or tier in its subtree, so a look-up
    # that starts here can be reused while it stays the same
    subtree_version: int = 0
    # queued requests whose cached prefix reaches this node (`pending.PendingTree.walk`): what a
    # demand-aware eviction policy protects
    demand: int = 0
    # what a router's indexes call this node's sequence (its hash, its block hashes, its length),
    # computed at its first cache event (a node's sequence and namespace never change: a split gives
    # the upper part to a new node)
    route_ids: tuple[str, tuple[int, ...], int] | None = None

    @property
    def tier(self) -> Tier:
        if self.gpu is GpuState.LOADING:
            return Tier.LOADING
        if self.offloading:
            return Tier.OFFLOADING
        return Tier.GPU if self.gpu is GpuState.READY else Tier.CPU

    def path(self) -> list[RadixNode]:
        """The nodes from the root's child down to this one (the root itself excluded)."""
        out = []
        node: RadixNode = self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def sequence(self) -> tuple[int, ...]:
        """The tokens from the root to the end of this node: the prefix whose KV it completes."""
        return tuple(itertools.chain.from_iterable(node.key for node in self.path()))

    def end(self) -> int:
        """The length of `sequence()`, without building it: where this node ends, in tokens."""
        return sum(len(node.key) for node in self.path())

    @property
    def in_flight(self) -> bool:
        return self.gpu is GpuState.LOADING or self.offloading

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        ns = f", ns={self.namespace!r}" if self.namespace else ""
        return (f"RadixNode(id={self.id}, len={len(self.key)}, tier={self.tier.value}, cpu={self.cpu}, "
                f"lock={self.lock_ref}, tags={sorted(self.tags)}{ns})")


@dataclass
class Match:
    """Result of a prefix lookup: the node path from the root (root excluded) and its token length."""

    path: list[RadixNode]
    length: int
    # the node the look-up ended inside: after a split, its unmatched lower part (SGLang refreshes it
    # with the path, `RadixTree.touch_match`); None when the look-up ended on a node boundary
    partial: RadixNode | None = None

    @property
    def last(self) -> RadixNode | None:
        return self.path[-1] if self.path else None

    def gpu_length(self) -> int:
        """Tokens usable on the device right now (leading READY nodes)."""
        n = 0
        for node in self.path:
            if node.gpu is not GpuState.READY:
                break
            n += len(node.key)
        return n

    def split_by_tier(self) -> tuple[int, list[RadixNode], list[RadixNode]]:
        """(ready device tokens, nodes loading now, host-only nodes) along the path, in path order.

        Device residency is prefix-closed, so the path is READY*, then LOADING/host-only nodes."""
        ready = 0
        loading: list[RadixNode] = []
        host: list[RadixNode] = []
        for node in self.path:
            if node.gpu is GpuState.READY and not loading:
                ready += len(node.key)
            elif node.gpu is GpuState.LOADING:
                loading.append(node)
            elif node.gpu is GpuState.NONE:
                host.append(node)
        return ready, loading, host


def _common_length(key: tuple[int, ...], tokens: tuple[int, ...], start: int, page: int) -> int:
    """Length of the common prefix of `key` and tokens[start:], rounded down to whole pages."""
    n = len(key)
    if tokens[start:start + n] == key:
        return n
    limit = min(n, len(tokens) - start)
    i = 0
    while i + 64 <= limit and key[i:i + 64] == tokens[start + i:start + i + 64]:  # in blocks (C speed)
        i += 64
    while i < limit and key[i] == tokens[start + i]:
        i += 1
    return i - i % page


@dataclass
class TopWatch:
    """What changed under the root since its reader last cleared it: the root's children whose subtree
    changed (structure or tiers), and the child keys under the root that gained a node. A look-up of
    tokens is a function of the subtree it starts in, so its answer can differ only for these."""

    changed: dict[RadixNode, None] = field(default_factory=dict)
    new_keys: dict[ChildKey, None] = field(default_factory=dict)

    def clear(self) -> None:
        self.changed.clear()
        self.new_keys.clear()


class RadixTree:
    """Paged radix tree; token accounting per tier; tag index per workflow for cheap retirement."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = RadixNode(key=(), parent=None, gpu=GpuState.READY, lock_ref=1)
        self.gpu_tokens = 0  # device tokens held by nodes (READY or LOADING)
        self.cpu_tokens = 0  # host tokens held by nodes
        self.cpu_nodes = 0  # nodes holding a host copy
        self.locked_gpu_tokens = 0  # device tokens (READY or LOADING) in locked nodes: never evictable
        self.clock = 0  # logical time for LRU
        # bumped by every change of structure or tier state, so callers can reuse a look-up while
        # nothing changed (a decode step, the most common event, changes nothing here)
        self.version = 0
        self.gpu_leaves: set[RadixNode] = set()  # READY nodes without device children
        # called as (node, "gpu" | "cpu", payload) when a tier's copy of a node is freed, so an engine
        # can return its pages (TieredCache frees nodes deep inside eviction)
        self.on_free: Callable[[RadixNode, str, object], None] | None = None
        self._by_workflow: dict[str, set[RadixNode]] = {}
        # nodes whose eviction rank may have changed (last access, tags) or that became device leaves
        # since the eviction index last looked: it re-ranks exactly these (insertion-ordered set)
        self.rank_dirty: dict[RadixNode, None] = {}
        # readers of what changed under the root (`watch_tops`): prefetch planning, the waiting queue
        self._watches: list[TopWatch] = []
        # agents each workflow has tagged, so retiring it discards exactly its tags: a node shared by
        # thousands of workflows is never rebuilt tag by tag
        self._agents_by_workflow: dict[str, set[str]] = {}
        # nodes with a settled copy on both tiers, in the order they became so (SGLang 0.5.23's
        # `full_host_duplicates`, which its HiCache reclaims first under write_back): a node joins when
        # a load lands, when fresh KV revives its device copy, or when a copy to the host lands (an
        # eviction's too: its device copy goes just after), and leaves when it leaves the tree. Entries
        # go lazily: a node that lost a copy keeps its place until a reader drops it, and one that is a
        # duplicate again keeps that place. None: nobody reads them, so none are kept
        # (`track_host_duplicates`).
        self.host_duplicates: dict[RadixNode, None] | None = None

    def track_host_duplicates(self) -> None:
        """Keep `host_duplicates` (a cache that makes host room SGLang's way reads them); from the
        start, so that their order is the order they came in."""
        assert not self.root.children, "track host duplicates from an empty tree"
        self.host_duplicates = {}

    # ------------------------------------------------------------------ lookup
    def page_aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        n = len(tokens) - len(tokens) % self.page_size
        return tuple(tokens[:n])

    def child_key(self, parent: RadixNode, key: Sequence[int], namespace: Namespace = "") -> ChildKey:
        """The key under which a node whose tokens start with `key` sits in `parent.children`: its first
        page, led by the namespace under the root (below it, the parent fixes the namespace)."""
        page = tuple(key[:self.page_size])
        return (namespace, *page) if parent is self.root else page

    def child(self, parent: RadixNode, key: Sequence[int], namespace: Namespace = "") -> RadixNode | None:
        """The child of `parent` whose tokens start with `key`'s first page (in `namespace` under the
        root), or None."""
        return parent.children.get(self.child_key(parent, key, namespace))

    def _key_of(self, node: RadixNode) -> ChildKey:
        assert node.parent is not None
        return self.child_key(node.parent, node.key, node.namespace)

    def match_prefix(self, tokens: Sequence[int], split: bool = True, namespace: Namespace = "") -> Match:
        """Longest cached prefix of `tokens` (whole pages) in `namespace`. With `split`, a partially
        matched node is split so the match ends on a node boundary; nodes with a copy in flight are
        never split (their copy callbacks hold the node), so a match stops before them instead."""
        key = self.page_aligned(tokens)
        page = self.page_size
        node = self.root
        path: list[RadixNode] = []
        i = 0
        partial = None
        while i < len(key):
            # only the root's children are keyed by namespace: below them, the path fixes it
            child = node.children.get((namespace, *key[:page]) if i == 0 else key[i:i + page])
            if child is None:
                break
            n = _common_length(child.key, key, i, page)
            if n < len(child.key):
                partial = child
                if split and n > 0 and not child.in_flight:
                    path.append(self.split(child, n))
                    i += n
                break
            path.append(child)
            i += n
            node = child
        return Match(path, i, partial)

    def touch(self, path: Iterable[RadixNode]) -> None:
        self.clock += 1
        dirty = self.rank_dirty
        for node in path:
            node.last_access = self.clock
            dirty[node] = None

    def touch_match(self, match: Match) -> None:
        """Mark a look-up's nodes used, by SGLang 0.5.23's rule: the node the look-up ended inside is
        refreshed too, so the unmatched tail of a split node is as recent as the path above it
        (`RadixCache._match_prefix_helper` and `_insert_helper` stamp the child before splitting it;
        the unified tree re-stamps it in `_split_node`). The tail is stamped first, as the unified
        tree does: it goes before the path's new leaf, and the legacy tree agrees (its new nodes are
        stamped after the walk)."""
        if match.partial is not None:
            self.touch((match.partial,))
        self.touch(match.path)

    def top_of(self, tokens: Sequence[int], namespace: Namespace = "") -> tuple[ChildKey, RadixNode | None]:
        """The root's child a look-up of `tokens` in `namespace` starts at (None: no such child yet),
        with its key."""
        key = self.child_key(self.root, tokens, namespace)
        return key, self.root.children.get(key)

    def watch_tops(self) -> TopWatch:
        """A new reader of the root's children whose subtree changes from now on."""
        watch = TopWatch()
        self._watches.append(watch)
        return watch

    def _subtree_changed(self, node: RadixNode) -> None:
        """`node` changed structure or tier: bump the root's child above it and tell the watches."""
        while node.parent is not None and node.parent is not self.root:
            node = node.parent
        if node.parent is self.root:
            node.subtree_version += 1
            for watch in self._watches:
                watch.changed[node] = None

    # ------------------------------------------------------------------ structure
    def split(self, node: RadixNode, at: int) -> RadixNode:
        """Split `node` after `at` tokens; returns the new upper node. Tags, locks, tiers and payloads
        carry over: the upper part is a prefix of the same KV, used by the same agents."""
        assert 0 < at < len(node.key) and at % self.page_size == 0, (at, len(node.key))
        assert not node.in_flight, "never split a node with a copy in flight"
        parent = node.parent
        assert parent is not None
        self.version += 1
        self._subtree_changed(node)
        upper = RadixNode(
            key=node.key[:at], parent=parent, gpu=node.gpu, cpu=node.cpu, lock_ref=node.lock_ref,
            last_access=node.last_access, tags=set(node.tags), namespace=node.namespace,
            gpu_value=_head(node.gpu_value, at), cpu_value=_head(node.cpu_value, at),
            # a deferred eviction (TieredCache counted the whole node in `pending_free`) covers both
            # halves, so `pending_free` still equals the pending nodes' tokens
            evict_pending=node.evict_pending,
        )
        parent.children[self._key_of(upper)] = upper  # replaces `node` there: same first page
        node.key = node.key[at:]
        node.gpu_value = _tail(node.gpu_value, at)
        node.cpu_value = _tail(node.cpu_value, at)
        node.parent = upper
        upper.children[self._key_of(node)] = node
        upper.n_gpu_children = 1 if node.gpu is not GpuState.NONE else 0
        for wf, _agent in upper.tags:
            self._by_workflow.setdefault(wf, set()).add(upper)
        if upper.cpu:
            self.cpu_nodes += 1
            self.rank_dirty[upper] = None  # a new host copy to rank
            self._note_duplicate(upper)
        return upper

    def insert(self, tokens: Sequence[int], gpu_value: object = None,
               adopted: list[tuple[int, int]] | None = None, namespace: Namespace = "") -> tuple[list[RadixNode], int]:
        """Insert freshly computed KV for `tokens` (whole pages) on the device, in `namespace`.

        Returns (path, newly device-resident tokens). Nodes that existed host-only become device-resident
        again (the engine recomputed them), so the count covers both new nodes and revived ones;
        `gpu_value` (if any) is the payload for the whole sequence and is sliced per node. The ranges of
        `tokens` whose payload the tree took are appended to `adopted`: the engine frees the rest (KV
        that was already cached when it was computed)."""
        key = self.page_aligned(tokens)
        match = self.match_prefix(key, namespace=namespace)
        new_tokens = 0
        offset = 0
        for node in match.path:
            if node.gpu is GpuState.NONE:
                node.gpu_value = _slice(gpu_value, offset, offset + len(node.key))
                self._set_gpu(node, GpuState.READY)
                new_tokens += len(node.key)
                if adopted is not None:
                    adopted.append((offset, offset + len(node.key)))
            offset += len(node.key)
        path = match.path
        parent = path[-1] if path else self.root
        # A match that stopped at a partially matching node with a copy in flight (never split) leaves
        # the rest uncached: a sibling with the same first page cannot be added.
        rest = key[match.length:]
        if rest and self.child_key(parent, rest, namespace) not in parent.children:
            child = RadixNode(key=rest, parent=parent, namespace=namespace,
                              gpu_value=_slice(gpu_value, match.length, len(key)))
            parent.children[self._key_of(child)] = child
            if parent is self.root:
                for watch in self._watches:
                    watch.new_keys[self._key_of(child)] = None
            self._set_gpu(child, GpuState.READY)
            new_tokens += len(child.key)
            if adopted is not None:
                adopted.append((match.length, len(key)))
            path = [*path, child]
        self.touch_match(Match(path, len(key), match.partial))
        return path, new_tokens

    def remove(self, node: RadixNode) -> None:
        """Drop a node that holds no KV anywhere (and has no children)."""
        assert node.gpu is GpuState.NONE and not node.cpu and not node.children, node
        assert node.parent is not None
        self.version += 1
        self._subtree_changed(node)
        del node.parent.children[self._key_of(node)]
        if self.host_duplicates is not None:
            self.host_duplicates.pop(node, None)
        for wf, _agent in node.tags:
            nodes = self._by_workflow.get(wf)
            if nodes is not None:
                nodes.discard(node)
        self.rank_dirty.pop(node, None)
        node.parent = None

    # ------------------------------------------------------------------ tiers
    def _set_gpu(self, node: RadixNode, state: GpuState) -> None:
        """Every device-state change goes through here so accounting and the leaf set never drift."""
        old = node.gpu
        if old is state:
            return
        self.version += 1
        self._subtree_changed(node)
        parent = node.parent
        assert parent is not None
        if node.lock_ref and (old is GpuState.NONE or state is GpuState.NONE):
            self.locked_gpu_tokens += len(node.key) if old is GpuState.NONE else -len(node.key)
        if old is GpuState.NONE:
            self.gpu_tokens += len(node.key)
            parent.n_gpu_children += 1
            self.gpu_leaves.discard(parent)
        elif state is GpuState.NONE:
            self.gpu_tokens -= len(node.key)
            parent.n_gpu_children -= 1
            if parent.n_gpu_children == 0 and parent.gpu is GpuState.READY and parent is not self.root:
                self.gpu_leaves.add(parent)
                self.rank_dirty[parent] = None
        node.gpu = state
        if state is GpuState.READY and node.cpu:  # a load landed, or fresh KV revived a host-only node
            self._note_duplicate(node)
        if state is GpuState.READY and node.n_gpu_children == 0:
            self.gpu_leaves.add(node)
            self.rank_dirty[node] = None
        else:
            self.gpu_leaves.discard(node)

    def set_cpu(self, node: RadixNode, present: bool, value: object = None) -> None:
        was = node.cpu
        if was != present:
            self.version += 1
            self._subtree_changed(node)
            self.cpu_tokens += len(node.key) if present else -len(node.key)
            self.cpu_nodes += 1 if present else -1
            if present:
                self.rank_dirty[node] = None  # a new host copy to rank
        old, node.cpu = node.cpu_value, present
        node.cpu_value = value if present else None
        if present and not was:  # a backup or an eviction's write-back landed (the device copy is still there)
            self._note_duplicate(node)
        # every host copy that goes is reported, with or without a buffer (a simulator's has none):
        # the router's location index learns of it through this hook
        if was and not present and self.on_free is not None:
            self.on_free(node, "cpu", old)

    def _note_duplicate(self, node: RadixNode) -> None:
        if (self.host_duplicates is not None and node.gpu is GpuState.READY and node.cpu
                and not node.in_flight):
            self.host_duplicates.setdefault(node, None)

    def begin_load(self, node: RadixNode) -> None:
        assert node.gpu is GpuState.NONE and node.cpu and not node.offloading, node
        assert node.parent is self.root or node.parent.gpu is not GpuState.NONE, "load parents first"
        self._set_gpu(node, GpuState.LOADING)

    def finish_load(self, node: RadixNode, gpu_value: object = None) -> None:
        assert node.gpu is GpuState.LOADING, node
        node.gpu_value = gpu_value
        self._set_gpu(node, GpuState.READY)

    def drop_gpu(self, node: RadixNode) -> None:
        """Free the device copy; the node leaves the tree when no host copy remains."""
        assert node.gpu is GpuState.READY and node.n_gpu_children == 0 and node.lock_ref == 0, node
        # the last copy of a node must not go while host-only descendants build on it (they would hang
        # off a node holding no KV): TieredCache frees them first
        assert node.cpu or not node.children, f"drop the host-only descendants of {node} first"
        value, node.gpu_value = node.gpu_value, None
        self._set_gpu(node, GpuState.NONE)
        if self.on_free is not None:
            self.on_free(node, "gpu", value)
        if not node.cpu:
            self._prune(node)

    def drop_cpu(self, node: RadixNode) -> None:
        assert node.cpu and not node.in_flight and node.lock_ref == 0, node
        self.set_cpu(node, False)
        if node.gpu is GpuState.NONE:
            self._prune(node)

    def _prune(self, node: RadixNode) -> None:
        """Remove `node` and any ancestors left holding nothing (host-only ancestors stay)."""
        while (node is not self.root and node.gpu is GpuState.NONE and not node.cpu
               and not node.children):
            parent = node.parent
            self.remove(node)
            assert parent is not None
            node = parent

    # ------------------------------------------------------------------ locks
    def lock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0 and node.gpu is not GpuState.NONE:
                self.locked_gpu_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, node
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.gpu is not GpuState.NONE:
                self.locked_gpu_tokens -= len(node.key)
            node = node.parent

    # ------------------------------------------------------------------ tags
    def tag_prefix(self, tokens: Sequence[int], tag: Tag, split: bool = True,
                   namespace: Namespace = "") -> list[RadixNode]:
        """Tag the cached nodes that lie entirely within `tokens` (an agent's fixed prompt) in `namespace`.

        A node straddling the fixed-prompt boundary is split so the dynamic remainder stays untagged."""
        match = self.match_prefix(tokens, split=split, namespace=namespace)
        self.tag_path(match.path, tag)
        return match.path

    def tag_path(self, path: Sequence[RadixNode], tag: Tag) -> None:
        """Tag the nodes of `path` (a fixed prompt's, from `tag_prefix`) with `tag` too."""
        wf_nodes = self._by_workflow.setdefault(tag[0], set())
        self._agents_by_workflow.setdefault(tag[0], set()).add(tag[1])
        for node in path:
            if tag not in node.tags:
                node.tags.add(tag)
                node.prio_cache = (-1, 0.0)  # its distance may change: recompute on next use
                self.rank_dirty[node] = None
                wf_nodes.add(node)

    def untag_workflow(self, workflow: str) -> int:
        """Drop every tag of a retired workflow instance; returns the number of nodes touched."""
        nodes = self._by_workflow.pop(workflow, set())
        agents = self._agents_by_workflow.pop(workflow, set())
        for node in nodes:
            for agent in agents:
                node.tags.discard((workflow, agent))
            node.prio_cache = (-1, 0.0)
            self.rank_dirty[node] = None
        return len(nodes)

    # ------------------------------------------------------------------ inspection
    def workflow_nodes(self, workflow: str) -> set[RadixNode]:
        """Nodes that carry a tag of `workflow` (what retiring it will untag)."""
        return self._by_workflow.get(workflow, set())

    def nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def token_sequences(self, tier: Tier | None = None, namespace: Namespace | None = None) -> list[tuple[int, ...]]:
        """Every root-to-node token sequence whose last node is in `tier` (all nodes if None), in
        `namespace` (every namespace if None)."""
        out: list[tuple[int, ...]] = []
        stack: list[tuple[RadixNode, tuple[int, ...]]] = [
            (c, c.key) for c in self.root.children.values() if namespace is None or c.namespace == namespace]
        while stack:
            node, seq = stack.pop()
            if tier is None or node.tier is tier:
                out.append(seq)
            stack.extend((c, seq + c.key) for c in node.children.values())
        return out

    def check_invariants(self) -> None:
        gpu = cpu = 0
        leaves: set[RadixNode] = set()
        for node in self.nodes():
            assert node.parent is not None and node.parent.children[self._key_of(node)] is node
            assert node.parent is self.root or node.namespace == node.parent.namespace, node
            assert len(node.key) > 0 and len(node.key) % self.page_size == 0, node
            assert node.gpu is not GpuState.NONE or node.cpu, f"node holds no KV: {node}"
            if node.gpu is not GpuState.NONE:
                gpu += len(node.key)
                assert node.parent is self.root or node.parent.gpu is not GpuState.NONE, "device not prefix-closed"
            cpu += len(node.key) if node.cpu else 0
            n_dev = sum(1 for c in node.children.values() if c.gpu is not GpuState.NONE)
            assert node.n_gpu_children == n_dev, node
            if node.gpu is GpuState.READY and n_dev == 0:
                leaves.add(node)
            if node.lock_ref > 0 and node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref, node
            assert not (node.offloading and node.gpu is not GpuState.READY), node
            for wf, _agent in node.tags:
                assert node in self._by_workflow.get(wf, ()), node
        assert gpu == self.gpu_tokens, (gpu, self.gpu_tokens)
        locked = sum(len(n.key) for n in self.nodes() if n.lock_ref and n.gpu is not GpuState.NONE)
        assert locked == self.locked_gpu_tokens, (locked, self.locked_gpu_tokens)
        assert cpu == self.cpu_tokens, (cpu, self.cpu_tokens)
        assert sum(1 for n in self.nodes() if n.cpu) == self.cpu_nodes
        assert leaves == self.gpu_leaves, (leaves ^ self.gpu_leaves)


def _slice(value: object, start: int, stop: int) -> object:
    return None if value is None else value[start:stop]  # type: ignore[index]


def _head(value: object, at: int) -> object:
    return None if value is None else value[:at]  # type: ignore[index]


def _tail(value: object, at: int) -> object:
    return None if value is None else value[at:]  # type: ignore[index]
