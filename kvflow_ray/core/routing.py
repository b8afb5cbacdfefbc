"""Which replica serves an agent's call (docs/design.md §5). Pure: a router feeds a policy what it knows
(`Fleet`: its own counts of the calls it routed, what replicas last reported, which KV blocks their
cache events say they hold) and the call (`RouteRequest`), and gets a decision.

Every routing rule lives here behind the `ROUTING` registry: the workflow router's own
(`WorkflowRouter`, the default; `PrefixAffinityRouter`, its predecessor) and the peers' rules it is
measured against (`core/peer_routers.py`: Ray Serve LLM, the SGLang gateway, Dynamo, llm-d; `pow2`
and `round-robin` here). The serving router (`router/core.py`) and the simulator call the same
objects.

A policy's `route` is a pure function of its state, the request and the fleet: a router may ask it
where a call *would* go (prefetch targets) without sending one. What it learns from a call it
actually routed comes through `routed` (Ray Serve's `on_request_routed`); a replica that left,
through `removed` (`on_replica_actor_died`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import time
from collections.abc import Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from kvflow_ray.core.registry import PolicyContext, Registry

TIER_RANK = {"gpu": 0, "cpu": 1}
DEFAULT_ROUTING = "workflow"  # what a router runs unless told otherwise: serving, RouterCore
BLOCK_TOKENS = 16  # KV block of the router's block index (vLLM's and Dynamo's default block size)
# how long a router keeps the news of another router's call's first token: that router stops listing
# the call's prefill within a sync or two of hearing it too
HEARD_KEPT_S = 2.0

# What a routing policy may need from the router that drives it, beyond its own counts of the calls
# it routed (`RoutingPolicy.needs`): a router refuses at start a policy needing an input it does not
# give, instead of letting it degrade quietly.
ROUTING_INPUTS: dict[str, str] = {
    "tokens": "each call's prompt token ids and output budget",
    "blocks": "the KV block hashes of everything the replicas cache (cache events)",
    "first_token": "when each call's first token came back (its prefill is done)",
    "load": "each replica's device KV pool, usage and waiting queue (load reports)",
}


def missing_inputs(policy: object, given: frozenset[str]) -> list[str]:
    """The inputs `policy` needs that a router giving `given` lacks, in `ROUTING_INPUTS` order."""
    needs = getattr(policy, "needs", frozenset())
    return [name for name in ROUTING_INPUTS if name in needs and name not in given]


# ---------------------------------------------------------------------------------------------- blocks
@functools.lru_cache(maxsize=4096)
def _salt_seed(salt: str) -> int:
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "big")


def block_hashes(tokens: Sequence[int], salt: str = "", block: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """Chained hashes of the full `block`-token blocks of `tokens` in cache namespace `salt`: block i's
    hash names the whole prefix up to its end (as vLLM's, Dynamo's and llm-d's block hashes do), so
    two sequences share a block hash exactly when they share that prefix. Stable across processes
    (tuples of ints hash the same everywhere)."""
    h = _salt_seed(salt)
    out = []
    for chunk in zip(*[iter(tokens)] * block, strict=False):  # full blocks, cut in C; a partial one drops
        h = hash((h, chunk))
        out.append(h)
    return tuple(out)


class BlockIndex:
    """Which KV blocks each replica holds, per tier, from its cache events: Dynamo's and llm-d's
    view of the fleet ("exact holdings"). O(blocks of an event) per event; a look-up walks the
    request's blocks from the start and drops a replica at its first missing block."""

    def __init__(self, block: int = BLOCK_TOKENS) -> None:
        self.block = block
        self._holders: dict[int, dict[str, set[str]]] = {}  # block hash -> replica -> tiers
        self._blocks: dict[str, int] = {}  # replica -> blocks it holds on the device

    def stored(self, replica: str, tier: str, blocks: Sequence[int]) -> None:
        for h in blocks:
            tiers = self._holders.setdefault(h, {}).setdefault(replica, set())
            if tier == "gpu" and "gpu" not in tiers:
                self._blocks[replica] = self._blocks.get(replica, 0) + 1
            tiers.add(tier)

    def removed(self, replica: str, tier: str, blocks: Sequence[int]) -> None:
        for h in blocks:
            holders = self._holders.get(h)
            tiers = holders.get(replica) if holders else None
            if tiers is None or tier not in tiers:
                continue
            tiers.discard(tier)
            if tier == "gpu":
                self._blocks[replica] -= 1
            if not tiers:
                del holders[replica]
                if not holders:
                    del self._holders[h]

    def drop(self, replica: str) -> None:
        """A replica left: forget its blocks (O(blocks held anywhere), rare)."""
        for h in list(self._holders):
            holders = self._holders[h]
            if holders.pop(replica, None) is not None and not holders:
                del self._holders[h]
        self._blocks.pop(replica, None)

    def device_blocks(self, replica: str) -> int:
        return self._blocks.get(replica, 0)

    def export(self) -> dict[str, dict[str, list[int]]]:
        """replica -> tier -> the blocks it holds there: the whole index as plain data, for a router
        that starts from another's view (O(blocks held), rare)."""
        out: dict[str, dict[str, list[int]]] = {}
        for h, holders in self._holders.items():
            for replica, tiers in holders.items():
                for tier in tiers:
                    out.setdefault(replica, {}).setdefault(tier, []).append(h)
        return out

    def overlaps(self, blocks: Sequence[int]) -> dict[str, tuple[int, int]]:
        """replica -> (leading blocks of `blocks` it holds on the device, leading blocks it holds on
        the device or the host), for every replica holding the first block."""
        out: dict[str, tuple[int, int]] = {}
        if not blocks:
            return out
        first = self._holders.get(blocks[0])
        if not first:
            return out
        device = {r for r, tiers in first.items() if "gpu" in tiers}
        anywhere = set(first)
        counts = {r: [0, 0] for r in anywhere}
        for h in blocks:
            holders = self._holders.get(h, {})
            for r in list(anywhere):
                tiers = holders.get(r)
                if not tiers:
                    anywhere.discard(r)
                    device.discard(r)
                    continue
                counts[r][1] += 1
                if r in device:
                    if "gpu" in tiers:
                        counts[r][0] += 1
                    else:
                        device.discard(r)
            if not anywhere:
                break
        return {r: (c[0], c[1]) for r, c in counts.items()}


# ---------------------------------------------------------------------------------------------- work in flight
def held_prefix(blocks: Sequence[int], held: Container[int]) -> int:
    """How many leading blocks of `blocks` are in `held`, for a `held` closed under prefixes (a
    chained block hash is held only with its whole prefix): a binary search, O(log blocks)."""
    lo, hi = 0, len(blocks)  # blocks[:lo] are held, blocks[hi:] are not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _call_key(replica: str, name: str) -> str:
    """A named call on a replica, as routers share its prefill (`absorb` splits the replica off)."""
    return f"{replica}\x00{name}"


@dataclass
class _Work:
    """A replica's work in flight. Its calls' blocks form a tree: a block stays while a call's prompt
    passes through it, so the set is closed under prefixes and a call shares a prefix of its blocks
    with it. Plain dicts of ints, so a call's blocks allocate no objects for the collector to track."""

    prefill_tokens: int = 0
    named_prefill: int = 0  # of which named calls' (the other routers count those call by call)
    parent: dict[int, int | None] = field(default_factory=dict)  # each block held -> its parent (None: a first block)
    ends: dict[int, int] = field(default_factory=dict)  # block -> calls whose prompt ends there (absent: none)
    children: dict[int, int] = field(default_factory=dict)  # block -> its children held (absent: none)


class WorkInFlight:
    """Per replica, the work of the calls a router sent there that have not ended (Dynamo's
    `ActiveSequences`, lib/kv-router/src/sequences/single.rs): the prompt tokens still to prefill
    (what was not cached when routed; until the first token), and the KV blocks of the calls' prompts,
    each counted once however many calls share it. Chained hashes make each replica's blocks a tree
    closed under prefixes, so the blocks a call shares with a replica's are a prefix of its own, found
    by binary search: pricing a call is O(replicas holding its first block x log its blocks), and
    a call routed or ended changes only the blocks it adds or frees, O(log blocks + those).

    The other routers' work (`absorb`) counts in the totals: their KV blocks per replica, and their
    prompts still to prefill call by call, each until its first token is heard of (`prefilled` with
    the call's name alone), as Dynamo's router replicas mark a sequence's prefill completed. Their
    state is one sync old; a first token comes from the replica to every router at once."""

    def __init__(self, block: int = BLOCK_TOKENS) -> None:
        self.block = block
        self._replicas: dict[str, _Work] = {}
        self._prefill: dict[int, tuple[str, int, str]] = {}  # id(request) -> (replica, prefill tokens it added, name)
        self._first: dict[int, set[str]] = {}  # first block hash -> replicas whose calls in flight hold it
        # replica -> (prefill tokens of unnamed calls, KV blocks) of the other routers' calls there
        self.elsewhere: Mapping[str, Sequence[float]] = {}
        self._others: dict[str, tuple[str, float]] = {}  # "replica\x00name" -> (replica, tokens) still to prefill
        self._others_prefill: dict[str, float] = {}  # replica -> the sum of those
        self._heard: dict[str, float] = {}  # "replica\x00name" -> when its first token was heard, oldest first

    def prefill_tokens(self, replica: str) -> float:
        work = self._replicas.get(replica)
        return ((work.prefill_tokens if work else 0) + self._elsewhere(replica, 0)
                + self._others_prefill.get(replica, 0.0))

    def blocks(self, replica: str) -> float:
        work = self._replicas.get(replica)
        return (len(work.parent) if work else 0) + self._elsewhere(replica, 1)

    def _elsewhere(self, replica: str, i: int) -> float:
        other = self.elsewhere.get(replica)
        return other[i] if other else 0

    def own(self) -> dict[str, list[float]]:
        """replica -> [prefill tokens of unnamed calls, KV blocks] of this router's own calls there (for
        the others; `own_prefill` has the named calls')."""
        return {replica: [work.prefill_tokens - work.named_prefill, len(work.parent)]
                for replica, work in self._replicas.items() if work.prefill_tokens or work.parent}

    def own_prefill(self) -> dict[str, list[float]]:
        """"replica\x00name" -> [prompt tokens still to prefill] of this router's named calls (for the
        others, who count each until they hear of its first token). O(calls not yet prefilled)."""
        return {_call_key(replica, name): [float(tokens)] for replica, tokens, name in self._prefill.values()
                if name and tokens}

    def absorb(self, work: Mapping[str, Sequence[float]], prefill: Mapping[str, Sequence[float]]) -> None:
        """The other routers' `own` and `own_prefill`, summed (they replace the last); a call whose
        first token was heard of already does not count. O(their calls not yet prefilled)."""
        self.elsewhere = work
        self._others, totals = {}, {}
        for key, (tokens, *_rest) in prefill.items():
            if key in self._heard:
                continue
            replica = key.partition("\x00")[0]
            self._others[key] = (replica, tokens)
            totals[replica] = totals.get(replica, 0.0) + tokens
        self._others_prefill = totals

    def shared_blocks(self, request: RouteRequest) -> dict[str, int]:
        """replica -> the call's prompt blocks that calls in flight there already hold."""
        blocks = request.blocks(self.block) if request.tokens else ()
        if not blocks:
            return {}
        return {replica: held_prefix(blocks, self._replicas[replica].parent)
                for replica in self._first.get(blocks[0], ())}

    def new_blocks(self, replica: str, request: RouteRequest, shared: Mapping[str, int] | None = None) -> int:
        """The call's prompt blocks not already held by calls in flight there (`shared`: this call's
        `shared_blocks`, when the caller prices several replicas)."""
        if not request.tokens:
            return 0
        blocks = request.blocks(self.block)
        if shared is not None:
            return len(blocks) - shared.get(replica, 0)
        work = self._replicas.get(replica)
        return len(blocks) - (held_prefix(blocks, work.parent) if work else 0)

    def add(self, request: RouteRequest, replica: str, prefill_tokens: int) -> None:
        work = self._replicas.setdefault(replica, _Work())
        work.prefill_tokens += prefill_tokens
        if request.name:
            work.named_prefill += prefill_tokens
        self._prefill[id(request)] = (replica, prefill_tokens, request.name)
        blocks = request.blocks(self.block) if request.tokens else ()
        if not blocks:
            return
        start = held_prefix(blocks, work.parent)
        if start < len(blocks):  # the new blocks hang below the shared prefix, each the one child of the last
            if start == 0:
                self._first.setdefault(blocks[0], set()).add(replica)
                work.parent[blocks[0]] = None
            else:
                work.children[blocks[start - 1]] = work.children.get(blocks[start - 1], 0) + 1
                work.parent[blocks[start]] = blocks[start - 1]
            work.parent.update(zip(blocks[start + 1:], blocks[start:-1], strict=True))
            work.children.update(dict.fromkeys(blocks[start:-1], 1))
        last = blocks[-1]
        work.ends[last] = work.ends.get(last, 0) + 1

    def prefilled(self, request: RouteRequest, replica: str | None = None) -> None:
        """The call's first token came back: its prompt no longer counts. A call this router did not
        route (`request.name` alone, and the `replica` that reported it) is another router's: it
        stops counting here at once, before that router's next word."""
        entry = self._prefill.pop(id(request), None)
        if entry is not None:
            work = self._replicas.get(entry[0])
            if work is not None:
                work.prefill_tokens -= entry[1]
                if entry[2]:
                    work.named_prefill -= entry[1]
        elif request.name and replica is not None:
            self._hear(_call_key(replica, request.name))

    def _hear(self, key: str) -> None:
        now = time.monotonic()
        heard = self._heard
        heard.pop(key, None)
        heard[key] = now
        while heard:  # a call's router stops listing it within a sync or two: older news is dropped
            oldest, at = next(iter(heard.items()))
            if now - at <= HEARD_KEPT_S:
                break
            del heard[oldest]
        other = self._others.pop(key, None)
        if other is not None:
            self._others_prefill[other[0]] -= other[1]

    def ended(self, request: RouteRequest, replica: str) -> None:
        self.prefilled(request, replica)
        work = self._replicas.get(replica)
        blocks = request.blocks(self.block) if request.tokens and work is not None else ()
        if not blocks or blocks[-1] not in work.ends:
            return
        h = blocks[-1]
        if work.ends[h] > 1:
            work.ends[h] -= 1
            return
        del work.ends[h]
        while h not in work.children and h not in work.ends:  # no call passes through it: it goes
            parent = work.parent.pop(h)
            if parent is None:
                self._unhold_first(h, replica)
                return
            if work.children[parent] > 1:
                work.children[parent] -= 1
                return
            del work.children[parent]
            h = parent

    def drop(self, replica: str) -> None:
        work = self._replicas.pop(replica, None)
        for h, parent in work.parent.items() if work else ():
            if parent is None:
                self._unhold_first(h, replica)

    def _unhold_first(self, h: int, replica: str) -> None:
        holders = self._first.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._first[h]


# ---------------------------------------------------------------------------------------------- the fleet
@dataclass
class Fleet:
    """What a router knows of its replicas: `loads`, the calls it routed there that have not ended
    (its own count, always current); `usage` / `waiting` / `capacity`, the device KV utilization
    (0..1), the queue and the device KV pool (tokens) each replica last reported; `blocks`, their
    holdings from cache events."""

    loads: dict[str, int] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    blocks: BlockIndex = field(default_factory=BlockIndex)
    _capacity_total: int = field(default=0, init=False, repr=False)  # the sum of `capacity`

    def add(self, replica: str) -> None:
        self.loads.setdefault(replica, 0)
        self.usage.setdefault(replica, 0.0)
        self.waiting.setdefault(replica, 0)

    def remove(self, replica: str) -> None:
        for counts in (self.loads, self.usage, self.waiting):
            counts.pop(replica, None)
        self._capacity_total -= self.capacity.pop(replica, 0)
        self.blocks.drop(replica)

    @classmethod
    def of(cls, loads: Mapping[str, int]) -> Fleet:
        """A fleet of these replicas with these loads (nothing reported, nothing held)."""
        fleet = cls()
        for replica, load in loads.items():
            fleet.add(replica)
            fleet.loads[replica] = load
        return fleet

    def report(self, replica: str, *, usage: float, waiting: int, capacity: int | None = None) -> None:
        if replica in self.loads:
            self.usage[replica] = usage
            self.waiting[replica] = waiting
            if capacity is not None:
                self._capacity_total += capacity - self.capacity.get(replica, 0)
                self.capacity[replica] = capacity

    def device_capacity(self) -> int:
        """The device KV tokens of the replicas that reported their pool (0: none did)."""
        return self._capacity_total

    def prompt_blocks(self, request: RouteRequest, block: int) -> dict[str, tuple[int, int]]:
        """replica -> (leading `block`-token blocks of the call's prompt it holds on the device, blocks
        extending those on the host), for every replica holding the first; `block` is a multiple of
        the index's block (a coarser block is held when all of its index blocks are)."""
        if not request.tokens:
            return {}
        scale = block // self.blocks.block
        out = {}
        for replica, (device, anywhere) in self.blocks.overlaps(request.blocks(self.blocks.block)).items():
            out[replica] = (device // scale, anywhere // scale - device // scale)
        return out


@dataclass
class RouteRequest:
    """One call as a routing policy sees it. `tokens`: the prompt's token ids (empty when the caller
    knows only its fixed prefix's hash); `salt`: its cache namespace; `prefix_hash` /
    `prefix_tokens`: the agent's fixed prompt; `holders`: replica -> best tier holding that prompt
    (the router's location index); `home`: where the workflow's previous agent ran; `max_new`: its
    output budget; `group`: the application the call belongs to (its tenant and workflow template),
    empty when unknown; `name`: the call's name in its replica's first-token report (`call_name`),
    by which the other routers that price its work learn that its prompt is computed (empty: a call
    only its own router prices)."""

    tokens: Sequence[int] = ()
    salt: str = ""
    prefix_hash: str | None = None
    prefix_tokens: int = 0
    holders: Mapping[str, str] = field(default_factory=dict)
    home: str | None = None
    max_new: int = 0
    group: str = ""
    name: str = ""
    _blocks: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)

    def blocks(self, block: int = BLOCK_TOKENS) -> tuple[int, ...]:
        """Its prompt's block hashes (computed once per block size)."""
        got = self._blocks.get(block)
        if got is None:
            got = self._blocks[block] = block_hashes(self.tokens, self.salt, block)
        return got


@dataclass(frozen=True)
class RouteDecision:
    replica: str
    outcome: str  # "affinity" | "balanced" | "cold"
    tier: str | None  # where the chosen replica holds the agent's fixed prompt (None: it does not)


class RoutingPolicy(Protocol):
    needs: frozenset[str]  # the `ROUTING_INPUTS` it reads (empty: its own counts suffice)

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        """Where the call goes; pure (a router may ask without sending the call). Raises ValueError
        when the fleet has no replica."""
        ...

    def routed(self, request: RouteRequest, replica: str) -> None:
        """The call was sent to `replica` (what a stateful policy learns from its own decisions)."""
        ...

    def prefilled(self, request: RouteRequest, replica: str) -> None:
        """The call's first token came back: its prompt is computed. A call another router routed
        comes with its `name` alone (a policy that prices other routers' work by call retires it)."""
        ...

    def ended(self, request: RouteRequest, replica: str) -> None:
        """The call finished (served or failed)."""
        ...

    def removed(self, replica: str) -> None:
        """`replica` left the fleet."""
        ...

    def shared(self) -> dict[str, dict[str, list[float]]]:
        """What the other routers of the fleet (other ingress replicas) price with of this one's own
        state: name -> replica -> numbers. Empty: nothing (a policy with a history of its own)."""
        ...

    def absorb(self, others: Mapping[str, Mapping[str, Sequence[float]]], fleet: Fleet) -> None:
        """The other routers' `shared`, summed per name and replica (it replaces the last); `fleet`:
        this router's view of the replicas as of the same sync."""
        ...


class RoutingHooks:
    """`RoutingPolicy`'s hooks, doing nothing: a policy overrides those it needs."""

    needs: frozenset[str] = frozenset()

    def routed(self, request: RouteRequest, replica: str) -> None:
        return None

    def prefilled(self, request: RouteRequest, replica: str) -> None:
        return None

    def ended(self, request: RouteRequest, replica: str) -> None:
        return None

    def removed(self, replica: str) -> None:
        return None

    def shared(self) -> dict[str, dict[str, list[float]]]:
        return {}

    def absorb(self, others: Mapping[str, Mapping[str, Sequence[float]]], fleet: Fleet) -> None:
        return None


def seeded(seed: int, n: int) -> random.Random:
    """The random draws of a policy's `n`-th routed call: a function of (seed, n), so asking where a
    call would go draws nothing and runs repeat per seed."""
    return random.Random(hash((seed, n)))


def random_best(values: Mapping[str, float], rng: random.Random, lowest: bool = True) -> str:
    """A replica with the lowest (or highest) value, ties at random."""
    best = min(values.values()) if lowest else max(values.values())
    return rng.choice([r for r, v in values.items() if v == best])


def live_replicas(fleet: Fleet) -> list[str]:
    if not fleet.loads:
        raise ValueError("no live replica to route to")
    return list(fleet.loads)


def decision(request: RouteRequest, replica: str) -> RouteDecision:
    """The decision to send `request` to `replica`, with the outcome the router's metrics count:
    affinity (it holds the fixed prompt), balanced (others hold it) or cold (nobody does)."""
    tier = request.holders.get(replica)
    if tier is not None:
        return RouteDecision(replica, "affinity", tier)
    return RouteDecision(replica, "balanced" if request.holders else "cold", None)


def preferred(costs: Mapping[str, float], request: RouteRequest) -> str:
    """The cheapest replica; among equals, the workflow's previous replica, then the one ranked first
    for the call's application by rendezvous hashing (highest random weight). The rank is the same in
    every router, so routers that price alike (ingress replicas placing a new application at the same
    moment, in an idle fleet) pick the same replica, and different applications spread. O(replicas),
    hashing only the tied."""
    low = min(costs.values())
    tied = [r for r, cost in costs.items() if cost == low]
    if len(tied) == 1:
        return tied[0]
    if request.home in tied:
        return request.home
    return min(tied, key=lambda r: (_rank(request.group, r), r))


def _rank(group: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{group}\x00{replica}".encode(), digest_size=8).digest()


class WorkPricingRouter(RoutingHooks):
    """A policy that prices the work in flight (`work`, kept by its hooks): it notes the cached prompt
    tokens it priced a call at on each replica (`_priced`), and a routed call joins the chosen
    replica's prefill work with the rest of its prompt."""

    work: WorkInFlight
    _last: tuple[RouteRequest, Mapping[str, float]] | None = None

    def _priced(self, request: RouteRequest, cached: Mapping[str, float]) -> None:
        self._last = (request, cached)

    def routed(self, request: RouteRequest, replica: str) -> None:
        last, self._last = self._last, None
        cached = last[1].get(replica, 0.0) if last is not None and last[0] is request else 0.0
        self.work.add(request, replica, max(0, len(request.tokens) - round(cached)))

    def prefilled(self, request: RouteRequest, replica: str) -> None:
        self.work.prefilled(request, replica)

    def ended(self, request: RouteRequest, replica: str) -> None:
        self.work.ended(request, replica)

    def removed(self, replica: str) -> None:
        self.work.drop(replica)


# ---------------------------------------------------------------------------------------------- workflow router
@dataclass(frozen=True)
class PrefixAffinityRouter(RoutingHooks):
    """The workflow router's rule:
    - affinity: a replica holding the prefix, device tier before host tier, unless its queue is longer
      than the least loaded replica's by more than `balance_threshold` requests;
    - balanced: the prefix is held, but its holders are overloaded: the cheapest replica instead;
    - cold: nobody holds the prefix: the workflow's home replica (where its previous agent ran, which
      holds the context that agent produced and the prompt preamble agents of one application share)
      while it is within the balance threshold, else the cheapest replica.
    "Cheapest" prices the queue ahead of the call and the prefix work it would need there: nothing on
    the device tier, a copy from the host tier, a full recompute elsewhere."""

    balance_threshold: int = 4  # extra queued requests a holder may have before the call goes elsewhere
    queued_request_cost: float = 1.0  # cost of one request queued ahead (the unit of cost)
    host_token_cost: float = 0.0002  # per prefix token loaded from the host tier
    miss_token_cost: float = 0.001  # per prefix token recomputed

    def __post_init__(self) -> None:
        if self.balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {self.balance_threshold}")

    def cost(self, load: int, tier: str | None, prefix_tokens: int) -> float:
        per_token = 0.0 if tier == "gpu" else self.host_token_cost if tier == "cpu" else self.miss_token_cost
        return load * self.queued_request_cost + prefix_tokens * per_token

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        """Ties break by replica name (stable)."""
        loads, home = fleet.loads, request.home
        if not loads:
            raise ValueError("no live replica to route to")
        live_holders = {r: t for r, t in request.holders.items() if r in loads}
        least = min(loads.values())
        if live_holders:
            # the best tier among the holders within the threshold (a device holder that is too busy
            # does not hide a host holder that is not)
            within = [r for r in live_holders if loads[r] - least <= self.balance_threshold]
            if within:
                best = min(within, key=lambda r: (TIER_RANK.get(live_holders[r], 2), loads[r], r))
                return RouteDecision(best, "affinity", live_holders[best])
        elif home in loads and loads[home] - least <= self.balance_threshold:
            return RouteDecision(home, "cold", None)
        tokens = request.prefix_tokens
        cheapest = min(loads, key=lambda r: (self.cost(loads[r], live_holders.get(r), tokens), r))
        outcome = "balanced" if live_holders else "cold"
        if cheapest in live_holders:  # overloaded holders can still be the cheapest choice
            outcome = "affinity"
        return RouteDecision(cheapest, outcome, live_holders.get(cheapest))


@dataclass
class _Application:
    home: str | None = None
    prompts: dict[str, int] = field(default_factory=dict)  # fixed-prompt hash -> its tokens
    tokens: int = 0  # their sum: the application's working set
    inflight: dict[str, int] = field(default_factory=dict)  # replica -> its calls routed there, not yet ended


class Applications:
    """The applications a router has seen (a tenant's workflow template: `RouteRequest.group`): each
    one's home replica, its working set (the distinct fixed prompts its calls sent, in tokens) and its
    calls in flight; and the fleet's hot working set, the working sets of the applications with a call
    in flight. O(1) per call. Idle applications beyond `max_idle` are forgotten, least recently used
    first (their next call is placed afresh)."""

    def __init__(self, max_idle: int = 1 << 16) -> None:
        self.max_idle = max_idle
        self.hot_tokens = 0
        # the hot working set of the applications busy only at the other routers (ingress replicas), as
        # of their last word (`elsewhere`): memory binds when all of it together exceeds the fleet's
        self.hot_elsewhere = 0.0
        self._apps: dict[str, _Application] = {}
        self._idle: dict[str, None] = {}  # applications without a call in flight, least recently used first
        self._busy_elsewhere: set[str] = set()  # applications with a call in flight at another router

    def home(self, group: str) -> str | None:
        app = self._apps.get(group)
        return app.home if app is not None else None

    def busy(self, group: str) -> bool:
        app = self._apps.get(group)
        return app is not None and bool(app.inflight)

    def pressure(self, fleet: Fleet) -> float:
        """The hot working set over the fleet's device KV (0 while no replica reported its pool)."""
        capacity = fleet.device_capacity()
        return (self.hot_tokens + self.hot_elsewhere) / capacity if capacity > 0 else 0.0

    def homes(self) -> dict[str, list[float]]:
        """"application\x00home" -> [1] for every application with a home (for the other routers:
        summed over them, how many routers chose that home)."""
        return {f"{group}\x00{app.home}": [1.0] for group, app in self._apps.items() if app.home is not None}

    def agree(self, votes: Mapping[str, Sequence[float]], replicas: Collection[str]) -> None:
        """The other routers' `homes()`, summed: each application goes home where most routers (this
        one included) put it, so that routers that placed an application apart (their first calls
        crossed) converge on one copy of its prompts. A tie goes to the replica that fewest other
        applications call home, then to the first by name. Then the busy applications' homes (a call in
        flight at any router) are spread over the live `replicas` (`spread`): routers that placed two
        new applications at once on one replica do not leave them there while another replica is
        home to no busy one. An idle application stays where its prompts are cached. Every router
        counts the same votes (the others' and its own) and the same busy applications, so all decide
        alike. O(applications), and O(busy applications x replicas) while a replica is home to none."""
        tally: dict[str, dict[str, float]] = {}  # application -> home -> routers that chose it
        crowd: dict[str, float] = {}  # replica -> votes for it as any application's home
        for key, (count, *_rest) in votes.items():
            group, _, home = key.partition("\x00")
            tally.setdefault(group, {})[home] = count  # keys are summed already: one per (group, home)
            crowd[home] = crowd.get(home, 0.0) + count
        for group, app in self._apps.items():
            if app.home is not None:
                counts = tally.setdefault(group, {})
                counts[app.home] = counts.get(app.home, 0.0) + 1
                crowd[app.home] = crowd.get(app.home, 0.0) + 1
        homes = {group: min(counts, key=lambda home: (-counts[home], crowd[home] - counts[home], home))
                 for group, counts in tally.items()}
        busy = self._busy_elsewhere.union(group for group, app in self._apps.items() if app.inflight)
        spread(homes, replicas, busy)
        for group, home in homes.items():
            app = self._apps.get(group)
            if app is not None:
                app.home = home

    def hot(self) -> dict[str, list[float]]:
        """application -> [its working set, 1] for those with a call in flight (for the other routers:
        summed over them, the second number says by how many routers it is busy)."""
        return {group: [float(app.tokens), 1.0] for group, app in self._apps.items() if app.inflight}

    def elsewhere(self, hot: Mapping[str, Sequence[float]]) -> None:
        """The other routers' `hot()`, summed: the applications busy there and not here count."""
        self.hot_elsewhere = sum(tokens / routers for group, (tokens, routers) in hot.items()
                                 if not self.busy(group))
        self._busy_elsewhere = set(hot)

    def routed(self, request: RouteRequest, replica: str, rehome: bool) -> None:
        """A call of `request.group` went to `replica`; it becomes the home of an application without
        one, or of any when `rehome`."""
        if not request.group:
            return
        app = self._apps.get(request.group)
        if app is None:
            app = self._apps[request.group] = _Application()
        if app.home is None or rehome:
            app.home = replica
        if request.prefix_hash and request.prefix_hash not in app.prompts:
            app.prompts[request.prefix_hash] = request.prefix_tokens
            app.tokens += request.prefix_tokens
            if app.inflight:
                self.hot_tokens += request.prefix_tokens
        if not app.inflight:
            self._idle.pop(request.group, None)
            self.hot_tokens += app.tokens
        app.inflight[replica] = app.inflight.get(replica, 0) + 1

    def ended(self, request: RouteRequest, replica: str) -> None:
        app = self._apps.get(request.group) if request.group else None
        if app is not None and replica in app.inflight:
            self._leave(request.group, app, replica, 1)

    def removed(self, replica: str) -> None:
        """`replica` left: its applications have no home, and its calls are no longer in flight
        (O(applications), rare)."""
        for group, app in list(self._apps.items()):
            if app.home == replica:
                app.home = None
            if replica in app.inflight:
                self._leave(group, app, replica, app.inflight[replica])

    def _leave(self, group: str, app: _Application, replica: str, calls: int) -> None:
        left = app.inflight[replica] - calls
        if left > 0:
            app.inflight[replica] = left
            return
        del app.inflight[replica]
        if not app.inflight:
            self.hot_tokens -= app.tokens
            self._idle[group] = None
            while len(self._idle) > self.max_idle:
                oldest = next(iter(self._idle))
                del self._idle[oldest]
                del self._apps[oldest]


def spread(homes: dict[str, str], replicas: Collection[str], busy: Container[str]) -> None:
    """The `busy` applications' homes (application -> replica, in place) spread over `replicas`:
    while a replica is home to no busy application and another is home to two or more, the one of
    those ranked first for the empty replica (rendezvous rank, then name) moves there. Idle
    applications neither count nor move (their prompts stay where they are cached). A function of
    its arguments alone, so routers that hold the same homes spread them alike. Homes on replicas
    not in `replicas` stay as they are (the router forgets them when the replica leaves)."""
    residents: dict[str, list[str]] = {replica: [] for replica in replicas}
    for group, home in homes.items():
        if home in residents and group in busy:
            residents[home].append(group)
    for empty in sorted(r for r, groups in residents.items() if not groups):
        crowded = [group for groups in residents.values() if len(groups) > 1 for group in groups]
        if not crowded:
            return
        group = min(crowded, key=lambda g: (_rank(g, empty), g))
        residents[homes[group]].remove(group)
        residents[empty].append(group)
        homes[group] = empty


class WorkflowRouter(WorkPricingRouter):
    """The workflow router. Each replica is priced by the work the call would wait behind and bring
    there, in tokens:

        prompt tokens still to prefill there (calls in flight)
        + the call's prompt tokens not cached there (host copies at `host_credit` of a device copy)
        + `kv_weight` x (KV tokens the calls in flight there hold, and the call's own not among them)

    and every application (a tenant's workflow template) has a **home**, the replica its first call
    was priced to. Which one wins depends on whether memory binds, which the router measures: the
    *pressure* is the working sets of the applications with a call in flight (their distinct fixed
    prompts) over the device KV of the fleet (the replicas report their pools).
    - Pressure below `sticky_pressure` (every hot prompt fits): the cheapest replica, or the home
      when it costs at most `slack` x the call's prompt tokens more. Spreading an application then
      costs one prefill per replica, and the price counts it.
    - Pressure at or above it: the home, while its calls in flight are within `load_bound` x the
      fleet's mean (consistent hashing with bounded loads' rule; Mirrokni et al. 2018). A copy of a
      prompt on a second replica would evict other applications' prompts that are needed again, a
      cost the price cannot see, so an application stays in one place and is replicated only when its
      load exceeds what the bound allows; the overflow goes to the cheapest replica. An idle
      application whose home is over the bound moves to where its next call goes (homes follow
      load, slowly).
    The price is not computed for a call its home takes under pressure (O(1); the spilled calls,
    and every call below the pressure, pay O(replicas + prompt blocks)).

    A token to prefill costs more than a token of KV a decode step reads (a prefill token is a
    matrix row through every layer; a context token, one KV read per step): `kv_weight` 0.25 was
    chosen on `benchmarks/fleet.py`'s rate sweep (0.1-1.0 tried; Dynamo's `prefill_load_scale`, the
    same knob inverted, is swept there too); `load_bound` 2 and `sticky_pressure` 1 on its pressure
    sweep (`docs/simulator.md`).

    What it knows that the peers' routers do not: which application a call belongs to, where each
    agent's fixed prompt is cached, exactly, from the router's location index (a replica it just
    sent the prompt to counts as a holder before its cache event arrives), and where the workflow's
    previous agent ran (`home`, which wins ties; then the application's rendezvous rank, `preferred`).
    The prompt's leading blocks come from the fleet's block index, as Dynamo's. Without the call's
    tokens (a router asking where an upcoming agent would go), the fixed prompt alone is priced."""

    # blocks are priced where cache events carry them (a fixed prompt's holders are exact without)
    needs = frozenset({"tokens", "first_token", "load"})

    def __init__(self, host_credit: float = 0.75, kv_weight: float = 0.25, block_tokens: int = BLOCK_TOKENS,
                 load_bound: float = 2.0, sticky_pressure: float = 1.0, slack: float = 1.0) -> None:
        if not 0 <= host_credit <= 1:
            raise ValueError(f"host_credit must be within [0, 1], got {host_credit}")
        if load_bound < 1:
            raise ValueError(f"load_bound must be >= 1, got {load_bound}")
        self.host_credit = host_credit
        self.kv_weight = kv_weight
        self.load_bound = load_bound
        self.sticky_pressure = sticky_pressure
        self.slack = slack
        self.work = WorkInFlight(block_tokens)
        self.apps = Applications()
        self._rehome: RouteRequest | None = None  # the call whose replica becomes its application's home

    def cached_tokens(self, request: RouteRequest, fleet: Fleet) -> dict[str, float]:
        """replica -> the call's prompt tokens it would not compute (host copies at their credit)."""
        block = fleet.blocks.block
        out: dict[str, float] = {replica: (device + self.host_credit * host) * block
                                 for replica, (device, host) in fleet.prompt_blocks(request, block).items()}
        for replica, tier in request.holders.items():  # the fixed prompt, exactly
            out[replica] = max(out.get(replica, 0.0), self._holder_credit(request, tier))
        return out

    def _holder_credit(self, request: RouteRequest, tier: str | None) -> float:
        return request.prefix_tokens * (1.0 if tier == "gpu" else self.host_credit if tier == "cpu" else 0.0)

    def costs(self, request: RouteRequest, fleet: Fleet) -> dict[str, float]:
        cached = self.cached_tokens(request, fleet)
        self._priced(request, cached)
        work, block = self.work, self.work.block
        prompt = len(request.tokens) or request.prefix_tokens
        shared = work.shared_blocks(request)
        return {replica: work.prefill_tokens(replica) + max(0.0, prompt - cached.get(replica, 0.0))
                + self.kv_weight * (work.blocks(replica) + work.new_blocks(replica, request, shared)) * block
                for replica in live_replicas(fleet)}

    def within_bound(self, replica: str, fleet: Fleet) -> bool:
        """One more call there keeps its calls in flight within `load_bound` x the fleet's mean."""
        loads = fleet.loads
        return loads[replica] + 1 <= math.ceil(self.load_bound * (sum(loads.values()) + 1) / len(loads))

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        self._rehome = None
        home = self.apps.home(request.group)
        sticky = self.apps.pressure(fleet) >= self.sticky_pressure
        if home in fleet.loads:
            if sticky and self.within_bound(home, fleet):
                self._priced(request, {home: self._holder_credit(request, request.holders.get(home))})
                return decision(request, home)
            if sticky and not self.apps.busy(request.group):
                self._rehome = request
        costs = self.costs(request, fleet)
        best = preferred(costs, request)
        if (home in costs and home != best and not sticky and self.within_bound(home, fleet)
                and costs[home] <= costs[best] + self.slack * (len(request.tokens) or request.prefix_tokens)):
            return decision(request, home)
        return decision(request, best)

    def routed(self, request: RouteRequest, replica: str) -> None:
        super().routed(request, replica)
        rehome, self._rehome = self._rehome is request, None
        self.apps.routed(request, replica, rehome)

    def ended(self, request: RouteRequest, replica: str) -> None:
        super().ended(request, replica)
        self.apps.ended(request, replica)

    def removed(self, replica: str) -> None:
        super().removed(replica)
        self.apps.removed(replica)

    def shared(self) -> dict[str, dict[str, list[float]]]:
        """Its work in flight, which the routers of the other ingress replicas price with: KV blocks per
        replica, and prompts still to prefill call by call, which every router retires when the
        call's first token comes (Dynamo's router replicas can share their active sequences the same
        way, `--router-replica-sync`; the Dynamo rule here keeps its default, each router its own);
        its busy applications' working sets, which make up the memory pressure together with theirs;
        and its applications' homes, which the routers agree on. O(replicas + applications + calls
        not yet prefilled) per sync."""
        return {"work": self.work.own(), "prefill": self.work.own_prefill(), "hot": self.apps.hot(),
                "homes": self.apps.homes()}

    def absorb(self, others: Mapping[str, Mapping[str, Sequence[float]]], fleet: Fleet) -> None:
        self.work.absorb(others.get("work", {}), others.get("prefill", {}))
        self.apps.elsewhere(others.get("hot", {}))
        self.apps.agree(others.get("homes", {}), fleet.loads)


# ---------------------------------------------------------------------------------------------- load only
class RoundRobinRouter(RoutingHooks):
    """Every replica in turn, blind to load and cache (Ray Serve's and the SGLang gateway's
    `round_robin`): the n-th routed call goes to the n-th replica, modulo the fleet."""

    def __init__(self) -> None:
        self.sent = 0

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        replicas = live_replicas(fleet)
        return decision(request, replicas[self.sent % len(replicas)])

    def routed(self, request: RouteRequest, replica: str) -> None:
        self.sent += 1


class PowerOfTwoRouter(RoutingHooks):
    """Power of two choices, Ray Serve's default router (ray: python/ray/serve/_private/request_router/
    pow_2_router.py, `PowerOfTwoChoicesRequestRouter`): two distinct replicas drawn at random, the
    one with the shorter queue (requests in flight) wins; with two replicas, both in random order,
    so a tie goes either way. The draw of the n-th call is a function of (seed, n), so asking
    where a call would go draws nothing."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.sent = 0

    def route(self, request: RouteRequest, fleet: Fleet) -> RouteDecision:
        return decision(request, pow2_choice(fleet, seeded(self.seed, self.sent)))

    def routed(self, request: RouteRequest, replica: str) -> None:
        self.sent += 1


def pow2_choice(fleet: Fleet, rng: random.Random) -> str:
    """Ray Serve's pow2 pick: the shorter queue of two distinct random replicas (first on a tie, the
    pair in random order)."""
    replicas = live_replicas(fleet)
    pair = list(replicas) if len(replicas) <= 2 else rng.sample(replicas, 2)
    rng.shuffle(pair)
    return min(pair, key=lambda r: fleet.loads[r])


# ---------------------------------------------------------------------------------------------- registry
ROUTING: Registry[RoutingPolicy] = Registry("routing")


def parse_routing(text: str) -> tuple[str, dict[str, float]]:
    """`name` or `name:option=value:option=value` (a policy with options other than its defaults, as
    a threshold sweep names them) -> (name, options); raises ValueError naming what is wrong."""
    name, *pairs = text.strip().split(":")
    options: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"routing {text!r}: expected option=value after ':', got {pair!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"routing {text!r}: {key} must be a number, got {value!r}") from None
        options[key.strip()] = int(number) if number.is_integer() else number
    ROUTING.check_options(name, options)
    return name, options


def create_routing(text: str, seed: int = 0, settings: Mapping[str, object] | None = None) -> RoutingPolicy:
    """The policy `text` names (`parse_routing`), drawing from `seed` if it draws at random;
    `settings`: a deployment's settings, each taken by a policy with an option of that name."""
    name, options = parse_routing(text)
    if "seed" in ROUTING.get(name).options:
        options.setdefault("seed", seed)
    return ROUTING.create(name, PolicyContext(), settings=settings, **options)


@partial(ROUTING.register, "workflow")
def _workflow(context: PolicyContext, *, host_credit: float = 0.75, kv_weight: float = 0.25,
              block_tokens: int = BLOCK_TOKENS, load_bound: float = 2.0, sticky_pressure: float = 1.0,
              slack: float = 1.0) -> RoutingPolicy:
    """the cheapest replica priced in tokens, or the application's home while memory binds (the workflow router)"""
    return WorkflowRouter(host_credit, kv_weight, block_tokens, load_bound, sticky_pressure, slack)


@partial(ROUTING.register, "prefix-affinity")
def _prefix_affinity(context: PolicyContext, *, balance_threshold: int = 4, queued_request_cost: float = 1.0,
                     host_token_cost: float = 0.0002, miss_token_cost: float = 0.001) -> RoutingPolicy:
    """a holder of the agent's prefix unless its queue is longer by more than the threshold, else the cheapest"""
    return PrefixAffinityRouter(balance_threshold, queued_request_cost, host_token_cost, miss_token_cost)


@partial(ROUTING.register, "round-robin")
def _round_robin(context: PolicyContext) -> RoutingPolicy:
    """every replica in turn"""
    return RoundRobinRouter()


@partial(ROUTING.register, "pow2")
def _pow2(context: PolicyContext, *, seed: int = 0) -> RoutingPolicy:
    """the shorter queue of two random replicas (Ray Serve's default)"""
    return PowerOfTwoRouter(seed)


# the peers' prefix-aware rules register themselves (they build on the types above)
from kvflow_ray.core import peer_routers as _peer_routers  # noqa: E402,F401

