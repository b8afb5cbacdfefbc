"""The tiered cache driver: device/host capacity, eviction, write-back and loads over a `RadixTree`.

Engine-agnostic: it decides, the engine moves bytes. Every method that starts a copy returns the
nodes to copy; the engine calls `finish_load` / `finish_offload` when its copy completes (a simulated
stream, a CPU thread, or SGLang's HiCache controller).

Device memory = tokens held by tree nodes (READY or LOADING) + `private_tokens` that running
requests hold for KV not yet in the tree (their uncached prompt part and output).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from kvflow_ray.core.policies import EvictionPolicy
from kvflow_ray.core.prefetch import PrefetchLedger
from kvflow_ray.core.radix import GpuState, Match, Namespace, RadixNode, RadixTree, Tag

Rank = tuple[float, ...]  # an eviction key (`EvictionPolicy.priority`): smallest goes first


class HostRoom(Enum):
    """What a write-back finds on the host (`TieredCache._host_room_for`)."""

    FREE = "free"  # room now: the copy starts
    LANDING = "landing"  # room once lower-ranked copies in flight land: the eviction waits
    NONE = "none"  # the node leaves the device without a backup


@dataclass
class EvictionCounters:
    evicted_gpu_tokens: int = 0  # device copies freed
    written_back_tokens: int = 0  # device -> host copies started by eviction
    dropped_tokens: int = 0  # KV that left both tiers (recompute on next use)
    evicted_cpu_tokens: int = 0  # host copies freed to make room on the host
    released_tokens: int = 0  # KV freed from both tiers because its owner ended (`free_private`)


class TieredCache:
    def __init__(self, gpu_capacity: int, eviction: EvictionPolicy, *, cpu_capacity: int = 0,
                 host_tier: bool = False, page_size: int = 1, host_duplicates_first: bool = False) -> None:
        if gpu_capacity <= 0:
            raise ValueError(f"device KV capacity must be positive, got {gpu_capacity} tokens")
        if host_tier and cpu_capacity <= 0:
            raise ValueError("a host tier needs a positive cpu_capacity")
        self.tree = RadixTree(page_size)
        self.gpu_capacity = gpu_capacity
        self.cpu_capacity = cpu_capacity if host_tier else 0
        self.host_tier = host_tier
        # host room: SGLang's order (`_make_host_room`), or the eviction policy's over every copy
        self.host_duplicates_first = host_duplicates_first
        if host_duplicates_first:
            self.tree.track_host_duplicates()
        self.eviction = eviction
        self.private_tokens = 0
        self.pending_free = 0  # device tokens freed once in-flight write-backs complete
        # host space reserved by device -> host copies in flight (they count in `tree.cpu_tokens` only
        # once they land): host use = tree.cpu_tokens + offloading_tokens <= cpu_capacity, always
        self.offloading_tokens = 0
        self.offloading_nodes: dict[RadixNode, None] = {}  # the nodes of those copies
        self.counters = EvictionCounters()
        self.prefetches = PrefetchLedger()
        # last node of each agent's fixed prompt once fully cached: device residency is prefix-closed,
        # so "this node is READY" answers "is the whole prompt on the device?" without a tree walk
        # (workflow -> agent -> node, so retiring a workflow touches only its own)
        self.prompt_tails: dict[str, dict[str, RadixNode]] = {}
        # Policies whose keys change only with a node's last access, tags and workflows' steps
        # (`incremental`) get indexes kept current by what changed: device leaves, and host copies.
        # Others rank every candidate per decision (`index` / `host_index` None).
        self.index: RankIndex | None = None
        self.host_index: RankIndex | None = None
        if getattr(eviction, "incremental", False):
            tree = self.tree
            self.index = RankIndex(eviction.priority, lambda: tree.gpu_leaves,
                                   lambda node: node in tree.gpu_leaves, "rank_stamp")
            self.host_index = RankIndex(eviction.priority, lambda: (n for n in tree.nodes() if n.cpu),
                                        lambda node: node.cpu and node.parent is not None, "host_stamp")
        self._book = getattr(eviction, "book", None)
        self._book_seen = -1  # the book version the indexes are re-ranked up to
        # the host copies one decision may drop, in eviction order: built at its first need for host room
        self._host_candidates: Iterator[RadixNode] | None = None
        # the parents that one decision's host drops make droppable, offered in key order with the rest
        self._host_heap: list[tuple[Rank, int, RadixNode]] = []

    # ------------------------------------------------------------------ capacity
    @property
    def used_tokens(self) -> int:
        return self.tree.gpu_tokens + self.private_tokens

    @property
    def free_tokens(self) -> int:
        return self.gpu_capacity - self.used_tokens

    def alloc(self, n: int) -> None:
        """Take `n` private device tokens; the caller made room first."""
        if n > self.free_tokens:
            raise MemoryError(f"alloc({n}) with only {self.free_tokens} free device tokens")
        self.private_tokens += n

    def release(self, n: int) -> None:
        assert 0 <= n <= self.private_tokens, (n, self.private_tokens)
        self.private_tokens -= n

    # ------------------------------------------------------------------ lookup / insert
    def match(self, tokens: Sequence[int], namespace: Namespace = "") -> Match:
        """Longest cached prefix of `tokens` in `namespace` (a request's cache salt), marked used."""
        m = self.tree.match_prefix(tokens, namespace=namespace)
        self.tree.touch_match(m)
        return m

    def commit(self, tokens: Sequence[int], private_tokens: int, gpu_value: object = None,
               adopted: list[tuple[int, int]] | None = None, keep_uncovered: bool = False,
               namespace: Namespace = "") -> list[RadixNode]:
        """Hand a request's freshly computed KV to the tree: `private_tokens` of its private
        allocation covered `tokens` past what it matched; KV someone else inserted meanwhile is freed
        (`adopted` receives the ranges of `tokens` the tree took, see `RadixTree.insert`).

        The tree may cover less than `tokens`: a sequence that diverges inside a node with a copy in
        flight cannot split it. With `keep_uncovered` (a prompt whose request goes on decoding), the
        uncovered tail stays allocated to the request; otherwise it is released with the rest. The KV
        joins `namespace` (the request's cache salt): only look-ups in that namespace reuse it."""
        path, new = self.tree.insert(tokens, gpu_value, adopted, namespace)
        uncovered = min(private_tokens, len(tokens) - sum(len(node.key) for node in path)) if keep_uncovered else 0
        assert new <= private_tokens - uncovered, (new, private_tokens, uncovered)
        self.release(private_tokens - uncovered)
        self._keep_pending(path)
        # keep used accounting: the tree now owns `new` tokens that were private
        return path

    def prompt_on_device(self, tag: Tag, namespace: Namespace = "") -> bool:
        """Whether the agent's whole fixed prompt is on the device in `namespace` (its workflow's)."""
        tail = self.prompt_tails.get(tag[0], {}).get(tag[1])
        return (tail is not None and tail.parent is not None and tail.gpu is GpuState.READY
                and tail.namespace == namespace)

    def remember_prompt(self, tag: Tag, tokens: Sequence[int], match: Match) -> None:
        """`match` is the look-up of the agent's fixed prompt `tokens` in its workflow's namespace."""
        if match.last is not None and match.length == len(tokens) - len(tokens) % self.tree.page_size:
            self.prompt_tails.setdefault(tag[0], {})[tag[1]] = match.last

    def retire_workflow(self, workflow: str) -> None:
        """A finished workflow instance: its prompts lose their tags (they go before live ones)."""
        self.tree.untag_workflow(workflow)
        self.prompt_tails.pop(workflow, None)

    def free_private(self, nodes: Iterable[RadixNode], keep: int) -> int:
        """Free at once, from both tiers and with no write-back, the KV among `nodes` (a finished
        session's history) that nothing else uses: a node goes when it is a leaf (nothing builds on
        it), untagged, unlocked, with no copy in flight and no queued request reaching it, as far as
        it lies past the first `keep` tokens of its sequence (the prompt its session began with, which
        holds what its application's sessions share: that stays cached, ranked as any untagged
        prefix; a node across that boundary is split there, at a page). Deepest first, so a freed
        leaf's parent may go next. Returns the tokens freed."""
        depth = {node: node.end() for node in nodes if node.parent is not None}
        freed = 0
        for node in sorted(depth, key=depth.__getitem__, reverse=True):
            if (node.parent is None or node.children or node.tags or node.lock_ref or node.in_flight
                    or node.evict_pending or node.demand):
                continue
            start = depth[node] - len(node.key)
            if start < keep:
                page = self.tree.page_size
                at = -(-(keep - start) // page) * page
                if at >= len(node.key):
                    continue
                self.tree.split(node, at)  # `node` keeps the part past `keep`
            n = len(node.key)
            if node.cpu:
                self.tree.drop_cpu(node)  # a node with a device copy stays in the tree until that goes
            if node.gpu is GpuState.READY:
                self._free_gpu(node)
            self.counters.released_tokens += n
            freed += n
        return freed

    # ------------------------------------------------------------------ eviction
    def _evictable(self, node: RadixNode) -> bool:
        """A device leaf, or a node whose device children are all already being evicted (their
        write-backs in flight): evicting it now keeps the policy's order instead of skipping to a
        worse leaf while those copies run."""
        if (node.gpu is not GpuState.READY or node.lock_ref or node.offloading or node.evict_pending
                or node is self.tree.root):
            return False
        return node.n_gpu_children == 0 or all(
            c.evict_pending or c.gpu is GpuState.NONE for c in node.children.values())

    def make_room(self, n: int, below: Rank | None = None) -> tuple[bool, list[RadixNode]]:
        """Evict until `n` device tokens are free. Returns (free now, write-backs started).
        `below`: evict only nodes whose eviction key is below it (a prefetch leaves alone what is
        needed as soon as the agent it loads for: `needed_by(steps)` of a distance policy).

        With a host tier, a node without a host copy is written back first and its device copy freed
        when the engine reports the copy done; callers wait for that (free now = False) and retry. A
        write-back whose host room a lower-ranked copy in flight holds stops the eviction there
        (`_host_room_for`): callers retry when that copy lands.
        A node above such a node is evicted in policy order too: it is freed as soon as its last
        device child is (the device tier stays prefix-closed)."""
        if self.free_tokens >= n:
            return True, []
        # Certain failure: even evicting every unlocked device node would not free enough. Evict
        # nothing then — emptying the cache for a request that cannot run yet only destroys prefixes
        # that others (or this request, later) will need. This is SGLang's scheduler too: its
        # `PrefillAdder` refuses a request beyond `rem_total_tokens` (free + evictable) before any
        # eviction; only the bare tree call (`evict` here, `RadixCache.evict` there) evicts what it
        # can. (Pending frees are still on the device, so this bound over-counts them: it never
        # refuses a feasible request.)
        if self.free_tokens + self.pending_free + self.tree.gpu_tokens - self.tree.locked_gpu_tokens < n:
            return False, []
        if self.free_tokens + self.pending_free >= n:  # write-backs under way free enough: wait for them
            return False, []
        writebacks = self._evict(lambda: self.free_tokens + self.pending_free >= n, below)
        return self.free_tokens >= n, writebacks

    def evict(self, n: int) -> tuple[int, list[RadixNode]]:
        """SGLang's `RadixCache.evict(num_tokens)`: evict whole nodes in policy order until `n` device
        tokens went (freed now, or on their way out behind a write-back) or no candidate is left, so
        it evicts what it can and may go past `n` by part of a node. Returns (tokens evicted,
        write-backs started: the engine copies them and calls `finish_offload`)."""
        start = self.counters.evicted_gpu_tokens + self.pending_free
        writebacks = self._evict(lambda: self.counters.evicted_gpu_tokens + self.pending_free - start >= n, None)
        return self.counters.evicted_gpu_tokens + self.pending_free - start, writebacks

    def _evict(self, enough: Callable[[], bool], below: Rank | None) -> list[RadixNode]:
        """Evict in policy order (only keys below `below`) until `enough()`; returns the write-backs
        started."""
        writebacks: list[RadixNode] = []
        self._host_candidates = None  # host-eviction candidates, ranked at most once per call
        pri = self.eviction.priority
        if self.index is not None:
            self.refresh_indexes()
            candidates = self.index.candidates(below)
        else:  # a policy whose keys may all change between decisions: rank every device leaf now
            candidates = _ranked([(pri(node), node.id, node) for node in self.tree.gpu_leaves
                                  if self._evictable(node) and (below is None or pri(node) < below)])
        # nodes that become evictable meanwhile (their device children went), in key order with the rest
        raised: list[tuple[Rank, int, RadixNode]] = []
        for node in _merged(candidates, raised):
            if enough():
                break
            if not self._evictable(node):
                continue
            parent = node.parent
            # Dropping `node` can complete the deferred evictions of pending ancestors in a chain
            # (`_settle_pending`), exposing a device leaf above them: it is offered too, so make_room
            # never gives up while an evictable leaf remains (with nothing pending, no later event
            # would free memory for a caller waiting on it).
            above = parent
            while above is not None and above.evict_pending and not above.offloading:
                above = above.parent
            backup = self.host_tier and not node.cpu
            room = self._host_room_for(node, pri(node), writebacks) if backup else HostRoom.NONE
            if room is HostRoom.LANDING:
                break  # copies in flight make the room when they land: the caller retries then
            if room is HostRoom.FREE:
                self._offload_starts(node)
                node.evict_pending = True
                self.pending_free += len(node.key)
                self.counters.written_back_tokens += len(node.key)
                writebacks.append(node)
            elif node.n_gpu_children:
                node.evict_pending = True  # freed when its children's write-backs land
                self.pending_free += len(node.key)
            else:
                self._drop_gpu(node)
            for up in (parent, above) if above is not parent else (parent,):
                if up is not None and self._evictable(up):
                    key = pri(up)
                    if below is None or key < below:
                        heapq.heappush(raised, (key, up.id, up))
        if self.index is not None:
            self.index.done()
        self._end_host_round()
        return writebacks

    def refresh_indexes(self) -> None:
        """Re-rank what changed since the last decision: nodes the tree marked, and the nodes of
        workflows whose steps changed (all of them when too far behind the book to tell)."""
        assert self.index is not None and self.host_index is not None
        tree, dirty, book = self.tree, self.tree.rank_dirty, self._book
        indexes = (self.index, self.host_index)
        if book is not None and book.version != self._book_seen:
            changed = book.changed_since(self._book_seen)
            self._book_seen = book.version
            if changed is None:
                dirty.clear()
                for index in indexes:
                    index.rebuild()
                return
            for workflow in changed:
                for node in tree.workflow_nodes(workflow):
                    dirty[node] = None
        for node in dirty:
            for index in indexes:
                index.rerank(node)
        dirty.clear()
        if self.index.bloated(len(tree.gpu_leaves)):
            self.index.rebuild()
        if self.host_index.bloated(tree.cpu_nodes):
            self.host_index.rebuild()

    def check_indexes(self) -> None:
        """The indexes against a full rescan (tests)."""
        if self.index is not None and self.host_index is not None:
            self.refresh_indexes()
            self.index.check()
            self.host_index.check()

    def _drop_gpu(self, node: RadixNode) -> None:
        self.counters.evicted_gpu_tokens += len(node.key)
        if not node.cpu:
            self.counters.dropped_tokens += len(node.key)
            # Host-only descendants (written back earlier) extend this node's KV; with no copy of the
            # node left anywhere they can never be loaded again, so they go too (a node stays in the
            # tree only while it holds KV somewhere).
            self._drop_host_subtree(node)
        self._free_gpu(node)

    def _free_gpu(self, node: RadixNode) -> None:
        """Free the device copy of `node`, a device leaf with nothing host-only below it."""
        self.prefetches.left_device(node)
        parent = node.parent
        self.tree.drop_gpu(node)
        # an ancestor waiting for this child to go is freed now (or kept, if a request locked it)
        if parent is not None and parent.evict_pending and not parent.offloading and parent.n_gpu_children == 0:
            self._settle_pending(parent)

    def _drop_host_subtree(self, node: RadixNode) -> None:
        """Free the host copies below `node`, a device leaf: all host-only, unlocked, none in flight."""
        below: list[RadixNode] = []
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            below.append(child)
            stack.extend(child.children.values())
        for child in reversed(below):  # descendants before their ancestors
            self.counters.evicted_cpu_tokens += len(child.key)
            self.counters.dropped_tokens += len(child.key)
            self.tree.drop_cpu(child)

    def _settle_pending(self, node: RadixNode) -> None:
        """Complete (or cancel) a deferred eviction whose blockers are gone."""
        self._unpend(node)
        if node.lock_ref == 0 and node.n_gpu_children == 0:
            self._drop_gpu(node)
        else:
            self._cancel_pending_ancestors(node.parent)

    def _cancel_pending_ancestors(self, node: RadixNode | None) -> None:
        """A kept node blocks its pending ancestors for good: give their space back to the books."""
        # Ancestors whose own write-back is still in flight are called off too (their copy lands as a
        # plain backup): a pending node with a kept device child could never be settled, and
        # `pending_free` would count it for good.
        while node is not None and node.evict_pending:
            self._unpend(node)
            node = node.parent

    def _unpend(self, node: RadixNode) -> None:
        """The node's deferred eviction is over (done or called off): its tokens no longer count as
        on their way to free."""
        node.evict_pending = False
        self.pending_free -= len(node.key)

    def _host_droppable(self, node: RadixNode) -> bool:
        """A host copy that can go: of a device-resident node (the device copy stays), or of a
        host-only leaf."""
        return (node.cpu and not node.in_flight and node.lock_ref == 0 and not node.evict_pending
                and (node.gpu is GpuState.READY or not node.children))

    def _make_host_room(self, n: int, saving: Rank | None = None) -> bool:
        """Drop host copies until `n` host tokens are free, in policy order. The candidates are the
        copies droppable when the decision first needed host room (within one decision, only
        dropping a child makes another copy droppable: its parent, offered then).

        `saving`: the key of the device node whose write-back needs the room. Only copies the policy
        ranks below that node go: a copy needed sooner is worth more than the node it would make room
        for, which then leaves the device without a backup (the copy is offered again to a later
        write-back of the same decision, whose node ranks higher). O(1) beyond the drops.

        With `host_duplicates_first` (SGLang 0.5.23's HiCache under write_back, `evict_host`), each
        call first reclaims the host copies of nodes still on the device, then drops host-only leaves
        in policy order, ranked afresh; and, as SGLang does, it frees what it can even for a node
        larger than the whole host pool."""
        only_host_leaves = self.host_duplicates_first
        if n > self.cpu_capacity and not only_host_leaves:
            return False
        if self._host_free() >= n:
            return True
        if only_host_leaves:
            self._reclaim_duplicates(n)
            self._end_host_round()
        if self._host_candidates is None:
            self._host_candidates = self._host_order()
        kept: list[tuple[Rank, int, RadixNode]] = []
        while self._host_free() < n:
            node = next(self._host_candidates, None)
            if node is None:
                break
            if node.parent is None or not self._host_droppable(node):
                continue  # not droppable (now, or when the decision began)
            if only_host_leaves and node.gpu is not GpuState.NONE:
                continue  # a duplicate the first pass kept
            if saving is not None and not only_host_leaves:
                key = self.eviction.priority(node)
                if key >= saving:  # this copy and every later one rank above the node: none goes for it
                    kept.append((key, node.id, node))
                    break
            parent = node.parent
            self.counters.evicted_cpu_tokens += len(node.key)
            if node.gpu is GpuState.NONE:
                self.counters.dropped_tokens += len(node.key)
            self.tree.drop_cpu(node)
            # a host-only parent left without children may go next, in policy order
            if parent is not self.tree.root and parent.parent is not None and self._host_droppable(parent):
                heapq.heappush(self._host_heap, (self.eviction.priority(parent), parent.id, parent))
        for entry in kept:  # offered again to a later write-back of this decision, whose node ranks higher
            heapq.heappush(self._host_heap, entry)
        return self._host_free() >= n

    def _host_room_for(self, node: RadixNode, key: Rank, planned: list[RadixNode]) -> HostRoom:
        """Host room for `node`'s write-back (`key`: its eviction key; `planned`: the write-backs this
        decision chose so far, none started). Host copies ranked below it go first
        (`_make_host_room`). If they are not enough, the copies of nodes ranked below it still give
        way, under the policies that rank the host by their key (not SGLang's order,
        `host_duplicates_first`):
        - write-backs planned in this decision are called off, lowest first (those nodes leave the
          device without a backup, as they would have had this node been evicted first): host room
          goes to the evicted nodes the policy values most, not to those it evicts first;
        - leaves whose copies are in flight are dropped once they land: the node waits for them
          (LANDING) rather than leave the device without a backup for want of the room a small copy
          holds for a moment.
        O(copies in flight)."""
        n = len(node.key)
        if self._make_host_room(n, saving=key):
            return HostRoom.FREE
        if self.host_duplicates_first or n > self.cpu_capacity:
            return HostRoom.NONE
        pri = self.eviction.priority
        chosen = sorted((w for w in planned if pri(w) < key), key=pri)
        free = self._host_free()
        if free + sum(len(w.key) for w in chosen) >= n:
            for w in chosen:
                if self._host_free() >= n:
                    break
                planned.remove(w)
                self._call_off_write_back(w)
            return HostRoom.FREE
        started = self.offloading_nodes.keys() - set(planned)
        landing = sum(len(w.key) for w in started if not w.children and pri(w) < key)
        return HostRoom.LANDING if landing and free + landing >= n else HostRoom.NONE

    def _call_off_write_back(self, node: RadixNode) -> None:
        """A write-back planned in this decision (its copy not started) is not made: the node leaves the
        device without a backup, now, or once its device children are gone."""
        self._offload_ends(node)
        self.counters.written_back_tokens -= len(node.key)
        if node.n_gpu_children == 0 and node.lock_ref == 0:
            self._unpend(node)
            self._drop_gpu(node)

    def _reclaim_duplicates(self, n: int) -> None:
        """SGLang's `_reclaim_full_host_duplicates`: free the host copies of nodes on both tiers, in
        the order they became so (`RadixTree.host_duplicates`), until `n` host tokens are free; a
        first pass spares evictable device leaves (their device copy may go next, and the host copy
        with it would be lost), a second takes them. A locked node keeps both copies (one lock covers
        both tiers here; SGLang's host copy has its own)."""
        duplicates, gone = self.tree.host_duplicates, []
        assert duplicates is not None, "built with host_duplicates_first, the tree tracks them"
        for spare_device_leaves in (True, False):
            for node in duplicates:
                if self._host_free() >= n:
                    break
                if node.parent is None or node.gpu is not GpuState.READY or not node.cpu:
                    gone.append(node)  # no longer on both tiers
                    continue
                if node.in_flight or node.lock_ref or (spare_device_leaves and node.n_gpu_children == 0):
                    continue
                self.counters.evicted_cpu_tokens += len(node.key)
                self.tree.drop_cpu(node)
                gone.append(node)
        for node in gone:
            duplicates.pop(node, None)

    def _host_order(self) -> Iterator[RadixNode]:
        """The host copies droppable now, in key order, merged with parents offered later."""
        self._host_heap = []
        if self.host_index is None:
            pri = self.eviction.priority
            first = _ranked([(pri(node), node.id, node) for node in self.tree.nodes() if self._host_droppable(node)])
        else:
            self.refresh_indexes()
            first = (entry for entry in self.host_index.candidates(None) if self._host_droppable(entry[2]))
        return _merged(first, self._host_heap)

    def _end_host_round(self) -> None:
        self._host_candidates = None
        if self.host_index is not None:
            self.host_index.done()

    def _host_free(self) -> int:
        # write-backs in flight hold their host space (`offloading_tokens`) until they land in
        # `tree.cpu_tokens`, so copies started together never overfill the host
        return self.cpu_capacity - self.tree.cpu_tokens - self.offloading_tokens

    # ------------------------------------------------------------------ copies
    def start_load(self, nodes: Sequence[RadixNode]) -> int:
        """Reserve device space for host-only `nodes` (path order) and mark them LOADING; the caller
        made room. Returns the tokens to copy."""
        tokens = sum(len(node.key) for node in nodes)
        if tokens > self.free_tokens:
            raise MemoryError(f"load of {tokens} tokens with only {self.free_tokens} free")
        for node in nodes:
            self.tree.begin_load(node)
        if nodes:
            self._keep_pending(nodes[0].path()[:-1])  # its ancestors
        return tokens

    def _keep_pending(self, nodes: Iterable[RadixNode]) -> None:
        """Call off the deferred eviction of `nodes`, which now hold a new device descendant (a commit
        or a load below them). They cannot leave before it, so no landing copy would settle them and
        `pending_free` must not count them: it counts only memory an event will free."""
        for node in nodes:
            if node.evict_pending:
                self._unpend(node)

    def finish_load(self, node: RadixNode, gpu_value: object = None) -> None:
        self.tree.finish_load(node, gpu_value)

    def finish_offload(self, node: RadixNode, cpu_value: object = None) -> None:
        assert node.offloading, node
        self._offload_ends(node)
        self.tree.set_cpu(node, True, cpu_value)
        # A request may have matched the node while its copy was in flight: then it stays. A node
        # whose device children are still being written back stays pending until they are freed.
        if node.evict_pending and (node.lock_ref or node.n_gpu_children == 0):
            self._settle_pending(node)

    def backup(self, node: RadixNode) -> bool:
        """Start a device -> host copy of `node` without evicting it (write-through); False if no room."""
        if not self.host_tier or node.cpu or node.in_flight or node.gpu is not GpuState.READY:
            return False
        self._host_candidates = None
        room = self._make_host_room(len(node.key))
        self._end_host_round()
        if not room:
            return False
        self._offload_starts(node)
        return True

    def _offload_starts(self, node: RadixNode) -> None:
        """A device -> host copy of `node` is on its way: it holds its host space until it lands."""
        node.offloading = True
        self.offloading_tokens += len(node.key)
        self.offloading_nodes[node] = None

    def _offload_ends(self, node: RadixNode) -> None:
        """The copy landed or was called off before it started."""
        node.offloading = False
        self.offloading_tokens -= len(node.key)
        del self.offloading_nodes[node]



def _ranked(entries: list[tuple[Rank, int, RadixNode]]) -> Iterator[tuple[Rank, int, RadixNode]]:
    heapq.heapify(entries)
    while entries:
        yield heapq.heappop(entries)


def _merged(first: Iterator[tuple[Rank, int, RadixNode]], second: list[tuple[Rank, int, RadixNode]]
            ) -> Iterator[RadixNode]:
    """Nodes of two key-ordered sources in key order; `second` is a heap that may grow meanwhile."""
    head = next(first, None)
    while head is not None or second:
        if second and (head is None or second[0][:2] < head[:2]):
            yield heapq.heappop(second)[2]
        else:
            assert head is not None
            yield head[2]
            head = next(first, None)


class RankIndex:
    """Nodes of one tier in eviction order, re-ranked only where something changed: a heap of
    (key, node id, stamp, node) with lazy invalidation. An entry is current iff its stamp is the
    node's stamp for this index (`stamp`: a RadixNode field) and the node is still a member; the
    cache re-ranks a node (a new entry, a new stamp) when the tree marks it in `rank_dirty`
    (touched, re-tagged, became a member) or a workflow it is tagged with changed steps in the
    policy's book. So a decision costs O((evicted + skipped) log n), not O(members)."""

    def __init__(self, priority: Callable[[RadixNode], Rank], members: Callable[[], Iterable[RadixNode]],
                 member: Callable[[RadixNode], bool], stamp: str) -> None:
        self.priority = priority
        self.members = members
        self.member = member
        self.stamp = stamp
        self.heap: list[tuple[Rank, int, int, RadixNode]] = []
        self._aside: list[tuple[Rank, int, int, RadixNode]] = []

    def _restamp(self, node: RadixNode) -> int:
        stamp = getattr(node, self.stamp) + 1
        setattr(node, self.stamp, stamp)
        return stamp

    def rerank(self, node: RadixNode) -> None:
        stamp = self._restamp(node)  # an entry it still has is stale now
        if self.member(node):
            heapq.heappush(self.heap, (self.priority(node), node.id, stamp, node))

    def rebuild(self) -> None:
        self.heap = [(self.priority(node), node.id, self._restamp(node), node) for node in self.members()]
        heapq.heapify(self.heap)

    def bloated(self, members: int) -> bool:
        """Mostly stale entries: cheaper to start over."""
        return len(self.heap) > 4 * members + 64

    def candidates(self, below: Rank | None) -> Iterator[tuple[Rank, int, RadixNode]]:
        """Current members, lowest key first, while below `below`. Those handed out keep their
        entries (skipped ones are still members): `done()` puts them back."""
        heap, aside, stamp, member = self.heap, self._aside, self.stamp, self.member
        while heap:
            entry = heap[0]
            key, node_id, at, node = entry
            if at != getattr(node, stamp) or not member(node):
                heapq.heappop(heap)  # stale: the node was re-ranked, or left the tier
                continue
            if below is not None and key >= below:
                return
            heapq.heappop(heap)
            aside.append(entry)
            yield key, node_id, node

    def check(self) -> None:
        """Against a full rescan: every member has exactly one current entry, ranked as it is now."""
        current: dict[int, Rank] = {}
        for key, node_id, at, node in self.heap:
            if at == getattr(node, self.stamp) and self.member(node):
                assert node_id not in current, f"two current entries for {node}"
                current[node_id] = key
                assert key == self.priority(node), (node, key, self.priority(node))
        assert set(current) == {node.id for node in self.members()}, "a member has no current entry"

    def done(self) -> None:
        """End of a decision: entries handed out and still current go back (evicted ones are stale)."""
        for entry in self._aside:
            heapq.heappush(self.heap, entry)
        self._aside.clear()
