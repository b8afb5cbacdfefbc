"""What the plugin knows inside one SGLang scheduler process, and every decision it makes there.

SGLang builds the eviction strategy, the prefill adder and the tree cache itself, with no handle to
share between them, so the plugin keeps one `PluginState` per process (`state()`); the hooks in
`hooks.py` only translate SGLang objects into calls on it. The decisions are `kvflow_ray.core`'s,
built through its registries from `--radix-eviction-policy-config` (`make_policies`): the eviction
policy ranks SGLang's nodes through `NodeView`, the prefetch policy chooses what `core.prefetch.plan_loads`
loads, the admission policy orders and gates the waiting queue, a `PrefetchLedger` counts outcomes and
an `EngineSnapshot` reports them. `StepBook` holds steps-to-execution, fixed prompts and namespaces.
Nothing here imports sglang or torch; it works on any tree node with `parent`, `id`, `key`, `evicted`
and `last_access_time`.

Plugin data lives on SGLang's tree nodes as attributes (`TAGS_ATTR`, `PRIO_ATTR`, copied onto the new
parent when SGLang splits a node; `DEMAND_ATTR`, set on the tails of queued requests' cached prefixes).
"""

from __future__ import annotations

import json
import logging
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow_ray.core.admission import ADMISSION, AdmissionPolicy
from kvflow_ray.core.policies import EVICTION, INF, EvictionPolicy, StepBook
from kvflow_ray.core.prefetch import PREFETCH, PrefetchLedger, PrefetchPolicy
from kvflow_ray.core.radix import Namespace, cache_namespace
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.core.routing import BLOCK_TOKENS, block_hashes
from kvflow_ray.core.scheduler import KVFLOW_ADMISSION
from kvflow_ray.core.snapshot import EngineSnapshot
from kvflow_ray.engines.base import prefix_hash
from kvflow_ray.engines.sglang import protocol

logger = logging.getLogger("kvflow_ray.sglang")

TAGS_ATTR = "kvflow_tags"  # frozenset of (client id, agent): whose fixed prompt the node lies in
PRIO_ATTR = "kvflow_prio"  # a distance policy's (version, distance), cached between hint updates
DEMAND_ATTR = "kvflow_demand"  # queued requests whose cached prefix ends at the node (`RadixNode.demand`)

Tag = protocol.Tag


def node_tags(node: Any) -> frozenset[Tag]:
    return getattr(node, TAGS_ATTR, frozenset())


def node_namespace(node: Any) -> Namespace:
    """The cache namespace of a SGLang tree node, as the core names it (`cache_namespace`) and
    `prefix_hash` takes it: its key's `cache_salt` (what the adapter sends as the request's
    `cache_salt`; "" = none) and `extra_key` (LoRA adapters, which kvflow never sets: a node under one
    gets a namespace no salt of the router's can equal, so its prefix is never taken for an un-keyed
    one)."""
    return request_namespace(getattr(node, "key", None))


def request_namespace(keyed: Any) -> Namespace:
    """The cache namespace of anything carrying SGLang's `cache_salt` and `extra_key`: a waiting `Req`,
    or a tree node's `RadixKey` (`node_namespace`)."""
    return cache_namespace(getattr(keyed, "cache_salt", None), getattr(keyed, "extra_key", None))


def radix_key(tokens: Sequence[int], namespace: Namespace) -> Any:
    """SGLang's `RadixKey` for `tokens` in a core cache namespace (the inverse of `request_namespace`)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    extra_key, salt = namespace if isinstance(namespace, tuple) else (None, namespace)
    return RadixKey(array("q", tokens), extra_key, cache_salt=salt or None)


def path_to_root(node: Any) -> Iterator[Any]:
    """`node` and its ancestors, root excluded (the root has no parent)."""
    while node is not None and node.parent is not None:
        yield node
        node = node.parent


# ------------------------------------------------------------------------------ policies
# Engine settings offered to every policy (as the core scheduler offers its --horizon/--max-inflight):
# each policy takes those it declares. Always accepted, so the old `{"horizon", "max_inflight",
# "prefetch": false}` config stays valid.
SETTINGS = ("horizon", "max_inflight")
PLUGIN_KEYS = ("eviction", "prefetch", "admission")


@dataclass(frozen=True)
class Policies:
    eviction: EvictionPolicy
    prefetch: PrefetchPolicy
    admission: AdmissionPolicy


def make_policies(book: StepBook, *, eviction: str = "kvflow", prefetch: str | bool = "steps-ahead",
                  admission: str = KVFLOW_ADMISSION, **options: Any) -> Policies:
    """The policies `--radix-eviction-policy-config` names, built through the core registries.

    `prefetch` may also be the old boolean (true: steps-ahead, false: none). Other keys are
    `SETTINGS` or options of a chosen policy; anything else raises ValueError naming what is accepted
    (as does an unknown policy name)."""
    if isinstance(prefetch, bool):
        prefetch = "steps-ahead" if prefetch else "none"
    chosen = ((EVICTION, eviction), (PREFETCH, prefetch), (ADMISSION, admission))
    takes = {registry.kind: set(registry.get(name).options) for registry, name in chosen}
    settings = {k: options.pop(k) for k in SETTINGS if k in options}
    unknown = sorted(k for k in options if not any(k in t for t in takes.values()))
    if unknown:
        extra = sorted(set().union(*takes.values()) - set(SETTINGS))
        accepted = ", ".join([*PLUGIN_KEYS, *SETTINGS, *extra])
        raise ValueError(f"kvflow --radix-eviction-policy-config: unknown key(s) {', '.join(unknown)} "
                         f"(accepted: {accepted}; policies: eviction {', '.join(EVICTION.names())}; "
                         f"prefetch {', '.join(PREFETCH.names())}; admission {', '.join(ADMISSION.names())})")
    context = PolicyContext(book=book, clock=monotonic)
    built = [registry.create(name, context, settings, **{k: v for k, v in options.items() if k in takes[registry.kind]})
             for registry, name in chosen]
    # agents up to the prefetch horizon (in the policy's own steps) must be in the book's near set,
    # which planning scans
    book.near_horizon = max(book.near_horizon, int(settings.get("horizon", 0)), getattr(built[1], "horizon", 0))
    return Policies(*built)


class NodeView:
    """A SGLang tree node as core eviction policies read a `core.radix.RadixNode`: `last_access`,
    `tags` and `prio_cache` (kept on the node as `PRIO_ATTR`, so `_DistancePolicy.node_distance`
    caches per node across calls); any other attribute is the SGLang node's."""

    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node

    @property
    def last_access(self) -> float:
        return self.node.last_access_time

    @property
    def tags(self) -> frozenset[Tag]:
        return node_tags(self.node)

    @property
    def demand(self) -> int:
        return getattr(self.node, DEMAND_ATTR, 0)

    @property
    def prio_cache(self) -> tuple[int, float]:
        cached = getattr(self.node, PRIO_ATTR, None)
        return (-1, 0.0) if cached is None else cached  # RadixNode's "never computed"

    @prio_cache.setter
    def prio_cache(self, value: tuple[int, float]) -> None:
        setattr(self.node, PRIO_ATTR, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


# ------------------------------------------------------------------------------ state
@dataclass
class Prefetch:
    """One host -> device load the plugin started for an agent about to run."""

    tag: Tag
    anchor: Any  # deepest node loaded (SGLang tracks the load under its id)
    nodes: list[Any]  # the nodes that were host-only and are now loading
    tokens: int
    started: float


@dataclass
class Boundary:
    """The last node of a fixed prompt, watched so the router hears when it changes tier."""

    node: Any
    prefix_hash: str
    tokens: int
    blocks: list[int]  # the chained hashes of the prompt's KV blocks (`core.routing.block_hashes`)
    on_device: bool = True
    on_host: bool = False


@dataclass
class Counters:
    prompt_tokens: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0, "miss": 0})
    ledger: PrefetchLedger = field(default_factory=PrefetchLedger)  # prefetch outcomes (core's definition)
    loaded_tokens: int = 0
    stall_s: float = 0.0
    held: int = 0  # admission passes that skipped a request whose prefix was loading


# the snapshot keys the plugin measures; the adapter fills the rest (its `status_keys` say which)
REPORTED = ("waiting", "running", "prompt_tokens", "loaded_tokens", "prefetch", "prefetch_stall_s",
            "cache_tokens", "held")


class PluginState:
    def __init__(self) -> None:
        self.book = StepBook()
        self.active = False  # the kvflow strategy was built in this process
        self.reports = True  # this process reports status and metrics (TP rank 0: every rank holds the same tree)
        self._use(make_policies(self.book))
        self.prefetch_enabled = True  # off for the rest of the process once a prefetch raised
        self.loading: dict[int, Prefetch] = {}  # anchor node id -> load in flight
        self.loading_ids: set[int] = set()  # ids of every node in a load in flight
        # node id -> node, for every node the ledger tracks (SGLang's nodes are found by id only in
        # the unified tree; the ledger keys by id)
        self.prefetched: dict[int, Any] = {}
        self.held_since: dict[str, float] = {}  # request id -> first time the gate held it back
        # what the admission policy has been told: requests queued, and admitted with their prefill
        # not done (by request id), and the nodes carrying queued demand
        self.queued: dict[str, Any] = {}
        self.prefilling: dict[str, Any] = {}
        self.demand_nodes: list[Any] = []
        self.boundaries: dict[int, Boundary] = {}
        self.counters = Counters()
        self.events: list[dict[str, Any]] = []  # cache events not yet written out
        self._status_at = 0.0
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ configuration
    def configure(self, **config: Any) -> None:
        """`--radix-eviction-policy-config` (see `make_policies`)."""
        self._use(make_policies(self.book, **config))
        self.active = True

    def _use(self, policies: Policies) -> None:
        self.eviction = policies.eviction
        self.prefetcher = policies.prefetch
        self.admission = policies.admission

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # ------------------------------------------------------------------ hints (control path)
    def apply_hints(self, payload: str) -> dict[Tag, tuple[int, ...]]:
        """Apply one hint batch to the book; returns the prompts it registered."""
        steps, prompts, retire, salts, elsewhere = protocol.decode_hints(payload)
        self.book.apply(steps, prompts, retire, salts, elsewhere)
        return prompts

    # ------------------------------------------------------------------ eviction
    def priority(self, node: Any) -> tuple[float, ...]:
        return self.eviction.priority(NodeView(node))

    # ------------------------------------------------------------------ tags
    @staticmethod
    def tag(nodes: Iterable[Any], tag: Tag) -> int:
        """Add `tag` to each node; returns how many nodes gained it."""
        added = 0
        for node in nodes:
            tags = node_tags(node)
            if tag not in tags:
                setattr(node, TAGS_ATTR, tags | {tag})
                setattr(node, PRIO_ATTR, None)
                added += 1
        return added

    @staticmethod
    def copy_tags(child: Any, new_parent: Any) -> None:
        """SGLang split `child`; `new_parent` holds its first part, so it lies in the same fixed prompts."""
        tags = node_tags(child)
        if tags:
            setattr(new_parent, TAGS_ATTR, tags | node_tags(new_parent))
            setattr(new_parent, PRIO_ATTR, None)

    def watch_boundary(self, node: Any, tokens: Sequence[int]) -> None:
        """`node` ends a fixed prompt (`tokens`): report it stored now, and its tier changes later.
        The prefix is named in the node's namespace (its tenant's salt), so router locations stay
        per tenant: the same prompt of another tenant is another prefix."""
        if node.id in self.boundaries:
            return
        namespace = node_namespace(node)
        boundary = Boundary(node, prefix_hash(tokens, namespace), len(tokens),
                            list(block_hashes(tokens, namespace, BLOCK_TOKENS)))
        self.boundaries[node.id] = boundary
        self.events.append({"kind": "stored", "tier": "gpu", "prefix_hash": boundary.prefix_hash,
                            "tokens": boundary.tokens, "blocks": boundary.blocks})

    def check_boundaries(self, attached: Callable[[Any], bool]) -> None:
        """Emit tier changes of watched fixed prompts (device evictions, host copies, reloads);
        `attached(node)` says whether the tree still holds the node (an evicted node without a host
        copy is removed from the tree, but the Python object keeps its fields)."""
        for node_id, b in list(self.boundaries.items()):
            detached = not attached(b.node)
            on_device = not detached and not b.node.evicted
            on_host = not detached and bool(getattr(b.node, "backuped", False))
            for tier, was, now in (("gpu", b.on_device, on_device), ("cpu", b.on_host, on_host)):
                if was != now:
                    self.events.append({"kind": "stored" if now else "removed", "tier": tier,
                                        "prefix_hash": b.prefix_hash, "tokens": b.tokens, "blocks": b.blocks})
            b.on_device, b.on_host = on_device, on_host
            if not on_device and not on_host:
                del self.boundaries[node_id]

    # ------------------------------------------------------------------ admission
    def request_loading(self, last_node: Any) -> bool:
        """Whether the cached prefix ending at `last_node` includes KV still being copied in."""
        if not self.loading_ids:
            return False
        return any(node.id in self.loading_ids for node in path_to_root(last_node))

    def held(self, rid: str, now: float) -> None:
        self.held_since.setdefault(rid, now)
        self.counters.held += 1

    def admitted(self, rid: str, last_node: Any, prompt: int, device: int, host: int, now: float) -> float:
        """A request entered a batch: count its prompt tokens by tier and the prefetches whose nodes
        its cached prefix contains (used); returns how long the gate held it back (its stall)."""
        stall = now - self.held_since.pop(rid, now)
        self.counters.stall_s += stall
        pt = self.counters.prompt_tokens
        pt["gpu"] += device
        pt["cpu"] += host
        pt["miss"] += max(prompt - device - host, 0)
        self.counters.ledger.use(path_to_root(last_node))
        return stall

    def sync_queue(self, waiting_queue: Sequence[Any]) -> None:
        """Tell the admission policy of requests that joined the waiting queue since the last pass, and
        of those that left it without being admitted (aborted)."""
        admission, queued = self.admission, self.queued
        present = {req.rid for req in waiting_queue}
        for rid in [rid for rid in queued if rid not in present]:
            admission.done(queued.pop(rid))
        for req in waiting_queue:
            if req.rid not in queued:
                queued[req.rid] = req
                admission.arrived(req, request_namespace(req), req.origin_input_ids)

    def mark_demand(self, tails: Iterable[Any]) -> None:
        """The queue's demand, for a demand-aware eviction policy: each node a queued request's cached
        prefix ends at counts that request (SGLang evicts leaves, so the nodes above are kept anyway)."""
        for node in self.demand_nodes:
            setattr(node, DEMAND_ATTR, 0)
        self.demand_nodes = []
        for node in tails:
            if node is not None and node.parent is not None:
                if not getattr(node, DEMAND_ATTR, 0):
                    self.demand_nodes.append(node)
                setattr(node, DEMAND_ATTR, getattr(node, DEMAND_ATTR, 0) + 1)

    def joined_batch(self, req: Any) -> None:
        """`req` left the waiting queue for a prefill batch."""
        if self.queued.pop(req.rid, None) is not None:
            self.admission.admitted(req)
            self.prefilling[req.rid] = req

    def settle_prefills(self) -> None:
        """Requests whose prompt has KV now (an output token exists, or they ended): the admission
        policy forgets them."""
        for rid, req in list(self.prefilling.items()):
            if req.output_ids or req.finished():
                del self.prefilling[rid]
                self.admission.done(req)

    # ------------------------------------------------------------------ prefetch
    def loading_started(self, tag: Tag, anchor: Any, nodes: list[Any], tokens: int, now: float) -> None:
        ledger = self.counters.ledger
        for node in nodes:
            if node.id in self.prefetched:  # loading again: the copy an earlier prefetch brought is gone
                ledger.left_device(self.prefetched.pop(node.id))
        self.loading[anchor.id] = Prefetch(tag, anchor, nodes, tokens, now)
        self.loading_ids.update(node.id for node in nodes)
        ledger.started(nodes)
        self.prefetched.update((node.id, node) for node in nodes)
        self.counters.loaded_tokens += tokens

    def reap(self, still_loading: set[int], attached: Callable[[Any], bool]) -> list[Prefetch]:
        """Loads whose anchor SGLang no longer tracks have landed; prefetched nodes whose device
        copy is gone (evicted, or out of the tree) leave the ledger."""
        ledger = self.counters.ledger
        done = [p for anchor_id, p in self.loading.items() if anchor_id not in still_loading]
        for p in done:
            del self.loading[p.anchor.id]
            self.loading_ids.difference_update(node.id for node in p.nodes)
            ledger.landed()
        for node_id in ledger.tracked():
            node = self.prefetched[node_id]
            if node.evicted or not attached(node):
                ledger.left_device(node)
                del self.prefetched[node_id]
        return done

    def farther_evictable(self, root: Any, steps: float) -> int:
        """Device tokens that eviction may take without touching a prompt needed by step `steps`
        (core.prefetch's budget rule: never evict something nearer for a load). A policy without a
        distance ranks nothing as needed: every unlocked device node counts."""
        node_distance = getattr(self.eviction, "node_distance", None)
        total, stack = 0, list(getattr(root, "children", {}).values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.evicted or not _unlocked(node):
                continue
            if node_distance is None or node_distance(NodeView(node)) > steps:
                total += len(node.key)
        return total

    # ------------------------------------------------------------------ status out
    def snapshot(self, waiting: int, running: int, cache_tokens: dict[str, int]) -> dict[str, Any]:
        c = self.counters
        data = EngineSnapshot(waiting=waiting, running=running, prompt_tokens=dict(c.prompt_tokens),
                              loaded_tokens=c.loaded_tokens, prefetch=c.ledger.as_dict(),
                              prefetch_stall_s=c.stall_s, cache_tokens=dict(cache_tokens),
                              held=c.held).to_dict()
        return {key: data[key] for key in REPORTED}

    def write_status(self, directory: str, snapshot: Callable[[], dict[str, Any]], now: float) -> None:
        """`stats.json` (atomic replace) and `events.jsonl` (appended), at most once per interval; the
        snapshot is built only then (this runs on every scheduler iteration)."""
        if now - self._status_at < protocol.STATUS_INTERVAL_S:
            return
        self._status_at = now
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".stats.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(snapshot(), f)
        os.replace(tmp, os.path.join(directory, "stats.json"))
        if self.events:
            with open(os.path.join(directory, "events.jsonl"), "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in self.events)
            self.events.clear()


def _unlocked(node: Any) -> bool:
    lock_ref = getattr(node, "lock_ref", None)
    if lock_ref is None:  # the unified tree keeps locks per component, in a list indexed by type
        data = getattr(node, "component_data", None) or ()
        return all(getattr(d, "lock_ref", 0) == 0 for d in (data.values() if isinstance(data, dict) else data))
    return lock_ref == 0


_STATE: PluginState | None = None


def state() -> PluginState:
    """The plugin's state in this process (SGLang runs one scheduler per process)."""
    global _STATE
    if _STATE is None:
        _STATE = PluginState()
    return _STATE


def reset_state() -> PluginState:
    """A fresh state (tests build several caches in one process)."""
    global _STATE
    _STATE = PluginState()
    return _STATE


def monotonic() -> float:
    return time.monotonic()


__all__ = ["INF", "PRIO_ATTR", "TAGS_ATTR", "NodeView", "PluginState", "make_policies", "node_namespace",
           "node_tags", "path_to_root", "reset_state", "state"]
