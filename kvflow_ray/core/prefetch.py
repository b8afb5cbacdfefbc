"""Prefetch: which host-tier prefixes to load onto the device before their agents run.

Three parts, each written once and used by every engine (the core scheduler and the SGLang plugin):
- a `PrefetchPolicy` chooses *which* agents (`choose`, nearest first) and *how many* loads may be in
  flight (`max_inflight`);
- `plan_loads` walks those choices and asks a `PrefetchTarget` (one per cache implementation) to
  load each agent's fixed prompt within the budget: free device tokens plus tokens evictable without
  touching anything needed as soon or sooner, minus what queued requests need (`queued_need`);
  nearest first, strictly: once the nearest missing prompt does not fit, planning stops;
- a `PrefetchLedger` counts each prefetch as issued, completed, used or wasted.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from kvflow_ray.core.policies import NearMap, StepBook
from kvflow_ray.core.predict import PREFETCH_THRESHOLD, likely_reach
from kvflow_ray.core.radix import Namespace, RadixNode, Tag
from kvflow_ray.core.registry import PolicyContext, Registry


class NearAgents(Protocol):
    """What a prefetch policy reads: the agents near execution (`near`: tag -> steps-to-execution)
    and their fixed prompts. A `StepBook` is one; a cache's `PrefetchCandidates` is the book minus
    the agents it knows it has nothing to load for."""

    near: NearMap

    def prompt(self, tag: Tag) -> tuple[int, ...] | None: ...

    def salt(self, workflow: str) -> str: ...


class PrefetchPolicy(Protocol):
    name: str
    max_inflight: int  # prefetch loads in flight at once (0: this policy never prefetches)

    def choose(self, book: NearAgents) -> Iterable[tuple[Tag, float]]:
        """Agents to prefetch for, nearest first, with their steps-to-execution."""
        ...

    # Optional: `room_beyond(steps) -> float`, the distance past which a load for an agent `steps`
    # away may displace cached nodes (default `steps`: anything needed later than the agent).


class NoPrefetch:
    name = "none"
    max_inflight = 0

    def choose(self, book: NearAgents) -> Iterable[tuple[Tag, float]]:
        return ()


class StepsAheadPrefetch:
    """KVFlow: agents whose steps-to-execution is at most `horizon` (running agents included: their
    request may not have arrived yet), nearest first, at most `max_inflight` loads at once."""

    name = "steps-ahead"

    def __init__(self, horizon: int = 1, max_inflight: int = 4) -> None:
        if horizon < 0 or max_inflight < 1:
            raise ValueError("prefetch needs horizon >= 0 and max_inflight >= 1")
        self.horizon = horizon
        self.max_inflight = max_inflight

    def choose(self, book: NearAgents) -> Iterable[tuple[Tag, float]]:
        for tag, e in book.near.ordered():
            if e > self.horizon:
                return
            yield tag, e


NEVER_NEEDED = float("1e300")  # a distance only nodes without a live user are farther than


class LikelyNextPrefetch(StepsAheadPrefetch):
    """Predictive: agents within `likely_reach(horizon, threshold)` expected steps
    (`WorkflowState.expected_steps`, a choice taken with probability p costing 1/p): the next agent
    when it is chosen with probability >= `threshold`, never an unlikely alternative; on a workflow
    without choices, exactly the agents KVFlow's steps-ahead prefetch loads. What a load may displace
    is `room_beyond`'s rule."""

    name = "likely-next"

    def __init__(self, threshold: float = PREFETCH_THRESHOLD, horizon: int = 1, max_inflight: int = 4) -> None:
        if not 0.5 < threshold <= 1:
            raise ValueError(f"likely-next prefetch needs 0.5 < threshold <= 1, got {threshold}")
        super().__init__(horizon, max_inflight)
        self.threshold = threshold
        self.certain = horizon  # expected steps within which a load is as sure as KVFlow's
        self.horizon = likely_reach(horizon, threshold)

    def room_beyond(self, steps: float) -> float:
        """A load for an agent at most `horizon` expected steps away (no uncertain choice on the way,
        at horizon 1) may displace what is needed later, as KVFlow's does. A speculative one (further,
        through a choice) follows PBKV's rule: it takes free memory or nodes no live agent will use
        (retired prompts, dynamic suffixes), never live cache, so a wrong guess costs nothing."""
        return steps if steps <= self.certain else NEVER_NEEDED


PREFETCH: Registry[PrefetchPolicy] = Registry("prefetch")
PREFETCH.register("none", lambda context: NoPrefetch())  # never prefetch (loads happen on demand)


@partial(PREFETCH.register, "steps-ahead")
def _steps_ahead(context: PolicyContext, *, horizon: int = 1, max_inflight: int = 4) -> PrefetchPolicy:
    """load the prompts of agents at most `horizon` steps away, nearest first (KVFlow)"""
    return StepsAheadPrefetch(horizon, max_inflight)


@partial(PREFETCH.register, "likely-next")
def _likely_next(context: PolicyContext, *, threshold: float = PREFETCH_THRESHOLD, horizon: int = 1,
                 max_inflight: int = 4) -> PrefetchPolicy:
    """load the prompts of agents likely (probability >= `threshold`) to run within `horizon` steps"""
    return LikelyNextPrefetch(threshold, horizon, max_inflight)


# ---------------------------------------------------------------------------------------------- planning
def queued_need(queued: Iterable[tuple[int, int, int]]) -> int:
    """Device tokens that queued requests still need, from (prompt tokens, prompt tokens already on
    the device, output budget) of each: a prefetch never takes them, because a load for an agent that
    runs *later* must not delay one that could run *now* (and under memory pressure such a load
    would be evicted again before use)."""
    return sum(max(prompt - cached, 0) + max_new for prompt, cached, max_new in queued)


class Load(enum.Enum):
    """What a target did with one agent's prompt."""

    STARTED = "started"  # a load is in flight
    NOTHING = "nothing"  # nothing to load: on the device already, loading, or not on the host tier
    NO_ROOM = "no_room"  # it does not fit the budget: stop planning (nearest first, strictly)


class PrefetchTarget(Protocol):
    """One cache implementation's side of prefetch: find an agent's prompt on the host tier and load
    it if it fits, evicting only nodes whose nearest user is farther than `steps`."""

    def load_prompt(self, tag: Tag, tokens: Sequence[int], namespace: Namespace, steps: float,
                    reserved: int) -> Load: ...


def plan_loads(policy: PrefetchPolicy, book: NearAgents, inflight: int, target: PrefetchTarget,
               reserved: int = 0) -> int:
    """Start the loads `policy` asks for, nearest first, while fewer than `policy.max_inflight`
    are in flight and each fits; returns how many started. `reserved`: `queued_need(...)`. With
    `PrefetchCandidates` as the book, an agent found to have nothing to load is set aside until
    that can change."""
    started = 0
    park = getattr(book, "park", None)
    room_beyond = getattr(policy, "room_beyond", None)
    for tag, steps in policy.choose(book):
        if inflight + started >= policy.max_inflight:
            break
        tokens = book.prompt(tag)
        if tokens is None:
            continue
        # the prompt is cached where its workflow's requests put it (their namespace)
        namespace = book.salt(tag[0])
        room = steps if room_beyond is None else room_beyond(steps)
        outcome = target.load_prompt(tag, tokens, namespace, room, reserved)
        if outcome is Load.NO_ROOM:
            # a farther agent's budget is never larger (it may evict fewer nodes): stop here
            break
        if outcome is Load.STARTED:
            started += 1
        elif park is not None:
            park(tag, tokens, namespace)
    return started


class PrefetchCandidates:
    """The step book as one cache's prefetch planning sees it: the agents near execution, minus those
    a look-up here found nothing to load for (their prompt on the device or loading, or not on the
    host tier), until something that could change that answer happens: their workflow's steps
    change, or the subtree of the tree their prompt lies in changes (structure or tiers; the tree
    reports the root's children that changed). A look-up's answer (and what it splits) is a function
    of that subtree alone, so setting an agent aside changes no decision; planning then costs what
    changed, not every live workflow."""

    def __init__(self, book: StepBook, tree: Any) -> None:
        self.book = book
        self.tree = tree  # radix.RadixTree
        self.watch = tree.watch_tops()
        self.near = NearMap()
        self._agents: dict[str, set[str]] = {}  # workflow -> its agents in `near` or set aside
        for tag, e in book.near.items():
            self._add(tag, e)
        self.seen = book.version
        self._parked: set[Tag] = set()
        self._at_top: dict[Any, set[Tag]] = {}  # root child -> agents set aside on a look-up under it
        self._at_key: dict[Any, set[Tag]] = {}  # root child key with no node yet -> agents set aside

    def prompt(self, tag: Tag) -> tuple[int, ...] | None:
        return self.book.prompt(tag)

    def salt(self, workflow: str) -> str:
        return self.book.salt(workflow)

    def park(self, tag: Tag, tokens: Sequence[int], namespace: Namespace) -> None:
        key, top = self.tree.top_of(tokens, namespace)
        self.near.pop(tag, None)
        self._parked.add(tag)
        (self._at_key.setdefault(key, set()) if top is None else self._at_top.setdefault(top, set())).add(tag)

    def _add(self, tag: Tag, e: float) -> None:
        self.near[tag] = e
        self._agents.setdefault(tag[0], set()).add(tag[1])

    def _unpark(self, tags: Iterable[Tag]) -> None:
        near = self.book.near
        for tag in tags:
            if tag in self._parked:
                self._parked.discard(tag)
                e = near.get(tag)
                if e is not None:
                    self._add(tag, e)

    def refresh(self) -> None:
        """Take in what changed since the last plan: steps of workflows, subtrees of the tree."""
        book = self.book
        if book.version != self.seen:
            changed = book.changed_since(self.seen)
            self.seen = book.version
            if changed is None:  # too far behind: start over
                self.near, self._agents = NearMap(), {}
                for tag, e in book.near.items():
                    self._add(tag, e)
                self._parked.clear()
                self._at_top.clear()
                self._at_key.clear()
            else:
                for workflow in changed:
                    self._refresh_workflow(workflow)
        for top in self.watch.changed:
            self._unpark(self._at_top.pop(top, ()))
        for key in self.watch.new_keys:
            self._unpark(self._at_key.pop(key, ()))
        self.watch.clear()

    def _refresh_workflow(self, workflow: str) -> None:
        """Its steps changed (or it retired): its agents' entries are the book's again."""
        for agent in self._agents.pop(workflow, ()):
            self.near.pop((workflow, agent), None)
            self._parked.discard((workflow, agent))
        near = self.book.near
        for agent in self.book.agents(workflow):
            e = near.get((workflow, agent))
            if e is not None:
                self._add((workflow, agent), e)


@dataclass
class PrefetchOp:
    tag: Tag
    steps: float
    nodes: list[RadixNode]  # host-only nodes now LOADING, in path order
    tokens: int
    writebacks: list[RadixNode] = field(default_factory=list)  # evictions that need a device -> host copy


@dataclass
class TieredCacheTarget:
    """`PrefetchTarget` over the core `TieredCache`: collects the loads (and the write-backs eviction
    started) as `PrefetchOp`s for the engine to copy."""

    cache: Any  # cache.TieredCache (imported lazily: cache.py imports the ledger from here)
    ops: list[PrefetchOp] = field(default_factory=list)

    def load_prompt(self, tag: Tag, tokens: Sequence[int], namespace: Namespace, steps: float, reserved: int) -> Load:
        cache = self.cache
        if cache.prompt_on_device(tag, namespace):
            return Load.NOTHING
        match = cache.tree.match_prefix(tokens, namespace=namespace)
        cache.remember_prompt(tag, tokens, match)
        _ready, _loading, host = match.split_by_tier()
        if not host:
            return Load.NOTHING
        need = sum(len(node.key) for node in host)
        if need + reserved > cache.gpu_capacity:
            return Load.NO_ROOM
        # The prompt's path is locked while room is made: eviction must drop neither the device
        # parent of the nodes about to load (a load needs its parents on the device) nor the host
        # copies being loaded, whatever their tags say.
        cache.tree.lock(match.last)
        try:
            # a distance policy says which nodes are needed as soon as this agent: those stay
            needed_by = getattr(cache.eviction, "needed_by", None)
            ok, writebacks = cache.make_room(need + reserved, None if needed_by is None else needed_by(steps))
            if not ok:
                if writebacks:  # room comes once these copies finish; the engine must still run them
                    self.ops.append(PrefetchOp(tag, steps, [], 0, writebacks))
                return Load.NO_ROOM
            cache.tree.touch_match(match)
            self.ops.append(PrefetchOp(tag, steps, host, cache.start_load(host), writebacks))
            return Load.STARTED
        finally:
            cache.tree.unlock(match.last)


def plan_prefetch(cache: Any, policy: PrefetchPolicy, book: NearAgents, inflight: int,
                  reserved_tokens: int = 0) -> list[PrefetchOp]:
    """`plan_loads` on a `TieredCache`: the loads started (and write-backs to run) as ops."""
    target = TieredCacheTarget(cache)
    plan_loads(policy, book, inflight, target, reserved_tokens)
    return target.ops


# ---------------------------------------------------------------------------------------------- the ledger
@dataclass(eq=False)
class _Prefetch:
    on_device: int  # its nodes still holding the device copy it loaded
    used: bool = False


@dataclass
class PrefetchLedger:
    """Outcomes of prefetches, one definition for every engine: a prefetch is *used* once a request
    admitted to a batch has any of its nodes in its cached prefix; *wasted* if all its nodes left the
    device before that. Nodes are keyed by `node.id` (any tree: the core's, SGLang's)."""

    issued: int = 0
    completed: int = 0
    used: int = 0
    wasted: int = 0
    _by_node: dict[Hashable, _Prefetch] = field(default_factory=dict)

    def started(self, nodes: Sequence[Any]) -> None:
        """One prefetch loads `nodes`."""
        self.issued += 1
        op = _Prefetch(on_device=len(nodes))
        for node in nodes:
            self._by_node[node.id] = op

    def landed(self) -> None:
        self.completed += 1

    def use(self, path: Iterable[Any]) -> None:
        """A request's cached prefix is `path` (on the device or loading): its prefetches paid off."""
        if not self._by_node:
            return
        for node in path:
            op = self._by_node.get(node.id)
            if op is not None and not op.used:
                op.used = True
                self.used += 1

    def left_device(self, node: Any) -> None:
        """`node`'s device copy is gone (evicted, or the node left the tree)."""
        op = self._by_node.pop(node.id, None)
        if op is not None:
            op.on_device -= 1
            if op.on_device == 0 and not op.used:
                self.wasted += 1

    def tracked(self) -> list[Any]:
        """Node ids whose device copy a prefetch brought and that have not left the device."""
        return list(self._by_node)

    def as_dict(self) -> dict[str, int]:
        return {"issued": self.issued, "completed": self.completed, "used": self.used, "wasted": self.wasted}
