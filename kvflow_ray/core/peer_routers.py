"""The routing rules users would pick instead of the workflow router, rebuilt from their source with
their defaults, so that every comparison runs them on the same fleet (`core/routing.py` has the
protocol; `pow2` and `round-robin` live there too).

Prompts are routed as token ids: where a peer matches characters of the request text (Ray Serve
LLM, the SGLang gateway), a token plays the part of a character. Every timestamp is a logical clock
(the n-th routed call), so runs are deterministic.

- `ray-prefix`: Ray Serve LLM's `PrefixCacheAffinityRouter`, a prefix tree of routing history;
- `sglang-cache-aware`: the SGLang model gateway's `cache_aware` policy, the same kind of tree;
- `dynamo-kv`: NVIDIA Dynamo's KV router cost over exact holdings from KV events;
- `llmd-precise`: llm-d's precise prefix-cache scorer plus its load scorers, weighted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.core.routing import (
    ROUTING,
    Fleet,
    RouteDecision,
    RouteRequest,
    RoutingHooks,
    RoutingPolicy,
    WorkInFlight,
    WorkPricingRouter,
    decision,
    live_replicas,
    pow2_choice,
    random_best,
    seeded,
)


# ---------------------------------------------------------------------------------------------- history tree
@dataclass(eq=False)
class _TextNode:
    text: tuple[int, ...]
    parent: _TextNode | None
    children: dict[int, _TextNode] = field(default_factory=dict)
    owners: dict[str, int] = field(default_factory=dict)  # tenant (replica) -> last access (logical time)


def _common(text: Sequence[int], at: int, edge: tuple[int, ...]) -> int:
    """How many tokens of `edge` equal `text[at:]` from its start."""
    n = min(len(edge), len(text) - at)
    if tuple(text[at:at + n]) == edge[:n]:
        return n
    k = 0
    while k < n and text[at + k] == edge[k]:
        k += 1
    return k


class HistoryTree:
    """A multi-tenant radix tree of what was routed where (an "approximate" tree: it records
    routing history, not what the engines hold), as Ray Serve LLM's `PrefixTree` and the SGLang
    gateway's `Tree` build it; a tenant is a replica. A tenant owning a node owns its ancestors;
    `size[t]` is the tokens of the nodes `t` owns."""

    def __init__(self) -> None:
        self.root = _TextNode((), None)
        self.size: dict[str, int] = {}

    def add_tenant(self, tenant: str, now: int) -> None:
        if tenant not in self.size:
            self.size[tenant] = 0
            self.root.owners[tenant] = now

    def insert(self, text: Sequence[int], tenant: str, now: int) -> None:
        """Every node on `text`'s path is owned by `tenant` as of `now` (splitting a partly matched
        node: the upper part copies the owners)."""
        if tenant not in self.size:
            return
        node, at = self.root, 0
        node.owners[tenant] = now
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                leaf = _TextNode(tuple(text[at:]), node, owners={tenant: now})
                node.children[text[at]] = leaf
                self.size[tenant] += len(leaf.text)
                return
            k = _common(text, at, child.text)
            if k < len(child.text):
                upper = _TextNode(child.text[:k], node, owners=dict(child.owners))
                child.text = child.text[k:]
                child.parent = upper
                upper.children[child.text[0]] = child
                node.children[text[at]] = upper
                child = upper
            if tenant not in child.owners:
                self.size[tenant] += len(child.text)
            child.owners[tenant] = now
            node, at = child, at + k

    def walk(self, text: Sequence[int], tenants: set[str] | None = None) -> tuple[int, _TextNode]:
        """(tokens matched, deepest node reached) along `text`; with `tenants`, only through nodes one
        of them owns. A partial match inside a node counts and ends the walk there."""
        node, at = self.root, 0
        while at < len(text):
            child = node.children.get(text[at])
            if child is None or (tenants is not None and tenants.isdisjoint(child.owners)):
                break
            k = _common(text, at, child.text)
            node, at = child, at + k
            if k < len(child.text):
                break
        return at, node

    def remove_tenant(self, tenant: str) -> None:
        """Drop `tenant` from every node; nodes left without owners go (O(tree), rare)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.owners.pop(tenant, None) is None:
                continue
            stack.extend(node.children.values())
            if not node.owners and node.parent is not None:
                del node.parent.children[node.text[0]]
        self.size.pop(tenant, None)

    def evict_lru_leaves(self, tenant: str, max_size: int) -> None:
        """The SGLang gateway's `evict_tenant_by_size` for one tenant: drop its least recently used
        leaf-most nodes until it owns at most `max_size` tokens."""
        heap: list[tuple[int, int, _TextNode]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if tenant in node.owners:
                owned = [c for c in node.children.values() if tenant in c.owners]
                if not owned:
                    heap.append((node.owners[tenant], id(node), node))
                stack.extend(owned)
        heapq.heapify(heap)
        while heap and self.size[tenant] > max_size:
            _at, _id, node = heapq.heappop(heap)
            if node.parent is None:
                continue
            self.size[tenant] -= len(node.text)
            del node.owners[tenant]
            parent = node.parent
            if not node.owners and not node.children:
                del parent.children[node.text[0]]
            if parent.parent is not None and not any(tenant in c.owners for c in parent.children.values()):
                heapq.heappush(heap, (parent.owners[tenant], id(parent), parent))


class _HistoryRouter(RoutingHooks):
    """A router keeping a `HistoryTree` of the calls it routed, over the replicas it has seen."""

    needs = frozenset({"tokens"})

    def __init__(self) -> None:
        self.tree = HistoryTree()
        self.clock = 0  # logical time: calls routed so far

    def _tenants(self, fleet: Fleet) -> list[str]:
        replicas = live_replicas(fleet)
        for replica in replicas:
            self.tree.add_tenant(replica, self.clock)
        return replicas

    def routed(self, request: RouteRequest, replica: str) -> None:
        self.clock += 1
        self.tree.add_tenant(replica, self.clock)
        self.tree.insert(request.tokens, replica, self.clock)

    def removed(self, replica: str) -> None:
        self.tree.remove_tenant(replica)


# ---------------------------------------------------------------------------------------------- Ray Serve LLM
class RayPrefixRouter(_HistoryRouter):
    """Ray Serve LLM's `PrefixCacheAffinityRouter` (ray: python/ray/llm/_internal/serve/routing_policies/
    prefix_aware/prefix_aware_router.py, with prefix_tree.py beside it):
    - load imbalanced (the longest queue exceeds the shortest by more than `imbalanced_threshold`,
      strictly): power of two choices (`pow_2_router.py`);
    - else the prompt is matched against the tree of routing history, only through nodes a live
      replica owns; match rate = matched / prompt length; below `match_rate_threshold` (strictly)
      the candidates are the replicas owning the fewest tokens, else those owning the deepest node
      reached;
    - the candidate with the shortest queue wins, first in order on a tie
      (`RequestRouter._select_from_candidate_replicas`);
    - the routed prompt is inserted under the chosen replica (`on_request_routed`).
    Queue length is requests in flight (the router's own count). `imbalanced_threshold` is infinite
    in Ray since PR #59390 (the router is prefix-only by default); 10 before. The tree is never
    trimmed (`do_eviction` defaults to False). Not modelled: `max_ongoing_requests` back-off."""

    def __init__(self, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1,
                 seed: int = 0) -> None:
        super().__init__()
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.seed = seed

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        replicas = self._tenants(fleet)
        loads = fleet.loads
        if max(loads.values()) - min(loads.values()) > self.imbalanced_threshold or not request.tokens:
            return decision(request, pow2_choice(fleet, seeded(self.seed, self.clock)))
        text = request.tokens
        matched, node = self.tree.walk(text, set(replicas))
        if matched / len(text) < self.match_rate_threshold:
            fewest = min(self.tree.size[r] for r in replicas)
            chosen = [r for r in replicas if self.tree.size[r] == fewest]
        else:
            chosen = [r for r in replicas if r in node.owners]
        return decision(request, min(chosen, key=lambda r: loads[r]))


# ---------------------------------------------------------------------------------------------- SGLang gateway
class SGLangCacheAwareRouter(_HistoryRouter):
    """The SGLang model gateway's `cache_aware` policy (sglang: sgl-model-gateway/src/policies/
    cache_aware.rs, tree in tree.rs; sgl-router/src/policies/cache_aware.rs before the rename):
    - imbalanced when max load - min load > `balance_abs_threshold` and max load >
      min load * `balance_rel_threshold` (both strict): the least loaded replica (first on a tie);
    - else the prompt's match rate against the tree of routing history (matched / prompt length):
      above `cache_threshold` (strictly), the first owner of the deepest node reached; else the
      least loaded replica (since PR #14650; the smallest tree before);
    - the prompt is inserted under the chosen replica on every path; a tenant whose tree exceeds
      `max_tree_size` tokens loses its least recently used leaves.
    Load is requests in flight through the router. Defaults are the gateway's CLI defaults (0.3, 64,
    1.5, 2**26). The gateway trims trees every `eviction_interval_secs`; here at the insert that
    exceeds the bound (with 2**26 tokens per replica, neither happens in practice). The matched
    owner's access time is refreshed on the matched path, as `prefix_match` does."""

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 26) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._matched: tuple[RouteRequest, str, _TextNode] | None = None  # the last look-up's owner and node

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        replicas = self._tenants(fleet)
        loads = fleet.loads
        least = min(replicas, key=lambda r: loads[r])
        low, high = min(loads.values()), max(loads.values())
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            return decision(request, least)
        text = request.tokens
        matched, node = self.tree.walk(text)
        owner = next(iter(node.owners), None)
        self._matched = (request, owner, node) if owner is not None else None
        rate = matched / len(text) if text else 0.0
        if rate > self.cache_threshold and owner in loads:
            return decision(request, owner)
        return decision(request, least)

    def routed(self, request: RouteRequest, replica: str) -> None:
        seen, self._matched = self._matched, None
        if seen is not None and seen[0] is request:  # `prefix_match` refreshes the owner it returns
            _request, owner, at = seen
            node: _TextNode | None = at
            while node is not None:
                if owner in node.owners:
                    node.owners[owner] = self.clock + 1
                node = node.parent
        super().routed(request, replica)
        if self.tree.size.get(replica, 0) > self.max_tree_size:
            self.tree.evict_lru_leaves(replica, self.max_tree_size)


# ---------------------------------------------------------------------------------------------- Dynamo
def dynamo_cost(isl: int, block: int, active_prefill_tokens: int, device_blocks: int, host_blocks: int,
                decode_blocks: int, overlap_score_credit: float = 1.0, prefill_load_scale: float = 1.0,
                host_cache_hit_weight: float = 0.75) -> float:
    """Dynamo's `worker_logit` (selector/default.rs) for a prompt of `isl` tokens on one worker:
    `decode_blocks` = its active blocks plus the prompt's blocks not among them."""
    credit = overlap_score_credit * device_blocks + host_cache_hit_weight * host_blocks
    return prefill_load_scale * max(0.0, (active_prefill_tokens + isl) / block - credit) + decode_blocks


class DynamoKvRouter(WorkPricingRouter):
    """NVIDIA Dynamo's KV router (dynamo: lib/kv-router/src/scheduling/selector/default.rs
    `worker_logit`, selector/mod.rs; load from lib/kv-router/src/sequences/single.rs; tier weights
    in overlap.rs / config.rs). For each replica:

        cost = prefill_load_scale * max(0, (active prefill tokens + prompt tokens) / block
                                           - overlap credit)
             + active blocks + the call's blocks not among them

    with overlap credit = `overlap_score_credit` x device blocks + `host_cache_hit_weight` x host
    blocks (the leading prompt blocks the replica holds on the device, then those extending them on
    the host: exact holdings from KV events). Lowest cost wins; ties at random (temperature 0, the
    default). On routing, the call's uncached prompt tokens join the replica's active prefill until
    its first token, and its blocks join the active set until it ends (`ActiveSequences`)."""

    needs = frozenset({"tokens", "blocks", "first_token"})

    def __init__(self, overlap_score_credit: float = 1.0, prefill_load_scale: float = 1.0,
                 host_cache_hit_weight: float = 0.75, block_tokens: int = 16, seed: int = 0) -> None:
        self.overlap_score_credit = overlap_score_credit
        self.prefill_load_scale = prefill_load_scale
        self.host_cache_hit_weight = host_cache_hit_weight
        self.block_tokens = block_tokens
        self.seed = seed
        self.sent = 0
        self.work = WorkInFlight(block_tokens)  # `ActiveSequences`

    def costs(self, request: RouteRequest, fleet: Fleet) -> dict[str, float]:
        cached = fleet.prompt_blocks(request, self.block_tokens)
        bs, host_w = self.block_tokens, self.host_cache_hit_weight
        self._priced(request, {r: (device + host_w * host) * bs for r, (device, host) in cached.items()})
        work = self.work
        shared = work.shared_blocks(request)
        out = {}
        for replica in live_replicas(fleet):
            device, host = cached.get(replica, (0, 0))
            decode = work.blocks(replica) + work.new_blocks(replica, request, shared)
            out[replica] = dynamo_cost(len(request.tokens), self.block_tokens, work.prefill_tokens(replica), device,
                                       host, decode, self.overlap_score_credit, self.prefill_load_scale,
                                       self.host_cache_hit_weight)
        return out

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        return decision(request, random_best(self.costs(request, fleet), seeded(self.seed, self.sent)))

    def routed(self, request: RouteRequest, replica: str) -> None:
        self.sent += 1
        super().routed(request, replica)


# ---------------------------------------------------------------------------------------------- llm-d
class LlmdPreciseRouter(RoutingHooks):
    """llm-d's precise prefix-cache aware scheduling, as its guide configures the endpoint picker
    (llm-d: guides/precise-prefix-cache-aware; llm-d-inference-scheduler: pkg/plugins/scorer/
    precise_prefix_cache.go; gateway-api-inference-extension: queue and kv-cache-utilization
    scorers, max-score picker). Each replica's score is the weighted sum of
    - prefix: the leading `block_tokens`-token blocks of the prompt it holds (from KV events), each
      1.0 on the device and `host_block_weight` on the host, min-max scaled over the replicas with a
      hit (released versions up to v0.8.0);
    - kv-cache utilization: 1 - its device KV usage;
    - queue: (max - its waiting queue) / (max - min) over the replicas (1 when all are equal);
    with the guide's weights 2 : 1 : 1; the highest score wins, ties at random."""

    needs = frozenset({"tokens", "blocks", "load"})

    def __init__(self, prefix_weight: float = 2.0, kv_cache_weight: float = 1.0, queue_weight: float = 1.0,
                 block_tokens: int = 64, host_block_weight: float = 0.8, seed: int = 0) -> None:
        self.prefix_weight = prefix_weight
        self.kv_cache_weight = kv_cache_weight
        self.queue_weight = queue_weight
        self.block_tokens = block_tokens
        self.host_block_weight = host_block_weight
        self.seed = seed
        self.sent = 0

    def scores(self, request: RouteRequest, fleet: Fleet) -> dict[str, float]:
        replicas = live_replicas(fleet)
        raw = {replica: device + self.host_block_weight * host
               for replica, (device, host) in fleet.prompt_blocks(request, self.block_tokens).items()
               if device + host and replica in fleet.loads}
        low, high = (min(raw.values()), max(raw.values())) if raw else (0.0, 0.0)
        waiting = [fleet.waiting.get(r, 0) for r in replicas]
        q_low, q_high = min(waiting), max(waiting)
        out = {}
        for replica in replicas:
            prefix = 0.0 if replica not in raw else 1.0 if high == low else (raw[replica] - low) / (high - low)
            q = fleet.waiting.get(replica, 0)
            queue = 1.0 if q_high == q_low else (q_high - q) / (q_high - q_low)
            kv = min(max(1.0 - fleet.usage.get(replica, 0.0), 0.0), 1.0)
            out[replica] = self.prefix_weight * prefix + self.kv_cache_weight * kv + self.queue_weight * queue
        return out

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        return decision(request, random_best(self.scores(request, fleet), seeded(self.seed, self.sent), lowest=False))

    def routed(self, request: RouteRequest, replica: str) -> None:
        self.sent += 1


# ---------------------------------------------------------------------------------------------- registry
@partial(ROUTING.register, "ray-prefix")
def _ray_prefix(context: PolicyContext, *, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1,
                seed: int = 0) -> RoutingPolicy:
    """Ray Serve LLM's PrefixCacheAffinityRouter (routing-history prefix tree, pow2 when imbalanced)"""
    return RayPrefixRouter(imbalanced_threshold, match_rate_threshold, seed)


@partial(ROUTING.register, "sglang-cache-aware")
def _sglang_cache_aware(context: PolicyContext, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                        balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 26) -> RoutingPolicy:
    """the SGLang model gateway's cache_aware policy (routing-history tree, least load when imbalanced)"""
    return SGLangCacheAwareRouter(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size)


@partial(ROUTING.register, "dynamo-kv")
def _dynamo_kv(context: PolicyContext, *, overlap_score_credit: float = 1.0, prefill_load_scale: float = 1.0,
               host_cache_hit_weight: float = 0.75, block_tokens: int = 16, seed: int = 0) -> RoutingPolicy:
    """NVIDIA Dynamo's KV router (prefill and active-block cost minus cached-block credit)"""
    return DynamoKvRouter(overlap_score_credit, prefill_load_scale, host_cache_hit_weight, block_tokens, seed)


@partial(ROUTING.register, "llmd-precise")
def _llmd_precise(context: PolicyContext, *, prefix_weight: float = 2.0, kv_cache_weight: float = 1.0,
                  queue_weight: float = 1.0, block_tokens: int = 64, host_block_weight: float = 0.8,
                  seed: int = 0) -> RoutingPolicy:
    """llm-d's precise prefix-cache scorer + kv-cache utilization + queue scorers (2:1:1, max score)"""
    return LlmdPreciseRouter(prefix_weight, kv_cache_weight, queue_weight, block_tokens, host_block_weight, seed)
