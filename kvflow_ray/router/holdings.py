"""Which replica holds which prefix: one index, fed by one producer, the replicas' cache events.

Each event names a cached prefix (its hash, as the ingress names an agent's fixed prompt) and the KV
blocks ending inside it; the index keeps both views a routing policy reads: per prefix, the best tier
each replica holds it in (`holders`, exact for a fixed prompt), and per block (`Fleet.blocks`, for
policies pricing any prompt's overlap, as Dynamo's and llm-d's). The store keeps the prefix view so a
restarted router starts with it.

Each replica's events come as a feed of numbered batches. A batch that does not follow the last one
applied (one lost on its way, or a router restarted mid-feed, which starts from the store's possibly
stale copy) makes the replica's view stale: a phantom holder would draw calls that then miss, and a
prefix stored meanwhile would be unknown. The replica is asked for a snapshot of what it holds, which
replaces its view (as Dynamo repairs an event-id gap from the worker).

An ingress replica keeps a copy (`persist=False`: the router actor alone writes the store), fed with
the events the actor relays and started, or repaired, from the actor's `export`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvflow_ray.core.routing import BlockIndex
from kvflow_ray.engines.base import CacheEvent
from kvflow_ray.router.store import BufferedStore


class Holdings:
    def __init__(self, store: BufferedStore, blocks: BlockIndex, *, persist: bool = True) -> None:
        self.store = store
        self.blocks = blocks
        self.persist = persist  # the store keeps this view (the router actor's), or it is a copy
        # replica -> prefix -> tiers it holds the prefix in (a write-back briefly holds both)
        self._held: dict[str, dict[str, set[str]]] = {}
        self._locations: dict[str, dict[str, str]] = {}  # prefix hash -> {replica: best tier}
        self._seq: dict[str, int] = {}  # replica -> the number of its last batch applied
        self._stale: set[str] = set()  # replicas whose feed had a gap: their snapshot is due
        self._foreseen: list[tuple[str, str]] = []  # a copy's foreseen holders, for the other copies

    def load(self) -> None:
        """The prefix view the store holds, once, at (re)start."""
        if not self.persist:
            return
        for prefix_hash, holders in self.store.location_items():
            self._locations[prefix_hash] = holders
            for replica, tier in holders.items():
                self._held.setdefault(replica, {})[prefix_hash] = {tier}

    def reconcile(self) -> int:
        """Queue every reported location for the store (not the foreseen ones); how many writes."""
        writes = 0
        if not self.persist:
            return writes
        for prefix_hash, holders in self._locations.items():
            for replica, tier in holders.items():
                if prefix_hash in self._held.get(replica, {}):
                    self.store.set_location(prefix_hash, replica, tier)
                    writes += 1
        return writes

    def holders(self, prefix_hash: str) -> dict[str, str]:
        """replica -> the best tier it holds the prefix in."""
        return self._locations.get(prefix_hash, {})

    def foresee(self, prefix_hash: str, replica: str, *, share: bool = True) -> None:
        """A call for the prefix was just sent to `replica`: it will hold it once the prefill runs, so
        calls for it that arrive before the cache event follow it there instead of computing a second
        copy elsewhere. (Memory only: the store keeps what replicas report.) A copy notes it for the
        other copies (`take_foreseen`), unless it came from one (`share=False`)."""
        self._locations.setdefault(prefix_hash, {})[replica] = "gpu"
        if share and not self.persist:
            self._foreseen.append((prefix_hash, replica))

    def has_foreseen(self) -> bool:
        """Whether prompts were foreseen here since the last `take_foreseen`."""
        return bool(self._foreseen)

    def take_foreseen(self) -> list[tuple[str, str]]:
        """(prefix hash, replica) foreseen here since the last take."""
        foreseen, self._foreseen = self._foreseen, []
        return foreseen

    def feed(self, replica: str, events: Iterable[CacheEvent], seq: int | None) -> None:
        """Batch `seq` of `replica`'s feed (numbered from 1; None: unnumbered). A batch that does not
        follow the last one applied marks the replica stale; its events are applied either way."""
        if seq is not None:
            if seq != self._seq.get(replica, 0) + 1:
                self._stale.add(replica)
            self._seq[replica] = seq
        self.apply(replica, events)

    def replace(self, replica: str, seq: int, events: Iterable[CacheEvent] | None) -> None:
        """`replica`'s snapshot as of batch `seq`: what it holds replaces what it was thought to hold
        (O(what it held)). None: the replica cannot tell (its view stays, and the feed goes on)."""
        if events is not None:
            held = self._forget(replica)
            if self.persist:  # its locations only: the replica itself stays (its heartbeat with it)
                for prefix_hash in held:
                    self.store.set_location(prefix_hash, replica, None)
            self.blocks.drop(replica)
            self.apply(replica, events)
        self._seq[replica] = seq
        self._stale.discard(replica)

    def stale(self, replica: str) -> bool:
        return replica in self._stale

    def distrust(self, replica: str) -> None:
        """What the store says `replica` holds may lag (a restarted router): its snapshot is due."""
        self._stale.add(replica)

    def apply(self, replica: str, events: Iterable[CacheEvent]) -> None:
        """`replica` stored or removed prefixes in a tier."""
        held = self._held.setdefault(replica, {})
        for event in events:
            tiers = held.setdefault(event.prefix_hash, set())
            if event.kind == "stored":
                tiers.add(event.tier)
                self.blocks.stored(replica, event.tier, event.blocks)
            else:
                tiers.discard(event.tier)
                self.blocks.removed(replica, event.tier, event.blocks)
            best = "gpu" if "gpu" in tiers else "cpu" if "cpu" in tiers else None
            holders = self._locations.setdefault(event.prefix_hash, {})
            if best is None:
                del held[event.prefix_hash]
                holders.pop(replica, None)
                if not holders:
                    del self._locations[event.prefix_hash]
            else:
                holders[replica] = best
            if self.persist:
                self.store.set_location(event.prefix_hash, replica, best)

    def drop(self, replica: str) -> None:
        """`replica` left: it holds nothing (O(what it held)). Its blocks go with the fleet's entry."""
        held = self._forget(replica)
        self._seq.pop(replica, None)
        self._stale.discard(replica)
        if self.persist:
            self.store.drop_replica(replica, held)

    def _forget(self, replica: str) -> list[str]:
        """What `replica` was thought to hold, forgotten here (not in the store); those prefixes."""
        held = self._held.pop(replica, {})
        for prefix_hash in held:
            holders = self._locations.get(prefix_hash, {})
            holders.pop(replica, None)
            if not holders:
                self._locations.pop(prefix_hash, None)
        return list(held)

    def export(self) -> dict[str, dict[str, object]]:
        """Everything reported, as plain data: replica -> {"prefixes": [[hash, [tiers]]], "blocks":
        {tier: [block hashes]}} (O(what is held); sent to an ingress that starts or lost track)."""
        blocks = self.blocks.export()
        return {replica: {"prefixes": [[h, sorted(tiers)] for h, tiers in held.items()],
                          "blocks": blocks.get(replica, {})}
                for replica, held in self._held.items()}

    def restore(self, exported: dict[str, dict[str, object]]) -> None:
        """Replace the whole view with another's `export` (replicas it does not name hold nothing)."""
        for replica in [*self._held, *exported]:
            self.drop(replica)
            self.blocks.drop(replica)
        for replica, view in exported.items():
            held = self._held.setdefault(replica, {})
            for prefix_hash, tiers in view["prefixes"]:  # type: ignore[union-attr]
                held[prefix_hash] = set(tiers)
                self._locations.setdefault(prefix_hash, {})[replica] = "gpu" if "gpu" in tiers else "cpu"
            for tier, hashes in view["blocks"].items():  # type: ignore[union-attr]
                self.blocks.stored(replica, tier, hashes)

    def __len__(self) -> int:
        return len(self._locations)
