"""Eviction strategies: one small class per policy, one method (in the style of SGLang's
`evict_policy.py`). The driver (`cache.TieredCache`) pops the node with the smallest `priority` first
and knows nothing else about the policy.

The workflow-aware policies rank a node by a *distance*: how soon any user of the node needs it.
A node tagged by several agents (a shared preamble, or the same template in several workflow
instances) takes the minimum; an untagged node (a dynamic suffix, or a retired workflow's prompt)
is at distance +inf and goes first. Ties break by LRU.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from functools import partial
from typing import Protocol

from kvflow_ray.core.radix import RadixNode, Tag
from kvflow_ray.core.registry import PolicyContext, Registry

INF = math.inf


class NearMap(dict[Tag, float]):
    """Agents near execution: tag -> steps-to-execution, also kept in (steps, tag) order, so the
    nearest are read without sorting every live workflow. Write through `[]=` and `pop` only."""

    def __init__(self) -> None:
        super().__init__()
        self._order: list[tuple[float, Tag]] = []

    def __setitem__(self, tag: Tag, steps: float) -> None:
        old = dict.get(self, tag)
        if old is not None:
            self._unorder(old, tag)
        dict.__setitem__(self, tag, steps)
        bisect.insort(self._order, (steps, tag))

    def pop(self, tag: Tag, default: float | None = None) -> float | None:  # type: ignore[override]
        if tag not in self:
            return default
        steps = dict.pop(self, tag)
        self._unorder(steps, tag)
        return steps

    def __delitem__(self, tag: Tag) -> None:
        self.pop(tag)

    def _unorder(self, steps: float, tag: Tag) -> None:
        del self._order[bisect.bisect_left(self._order, (steps, tag))]

    def ordered(self) -> Iterator[tuple[Tag, float]]:
        """(tag, steps), nearest first (ties by tag); safe to change the map while iterating."""
        for steps, tag in list(self._order):
            yield tag, steps


class StepBook:
    """What the workflow layer knows: steps-to-execution of every live agent and its fixed prompt.

    Written by whoever tracks workflow state (the router, or a simulator's client), read by the
    eviction and prefetch policies of every replica. `version` changes on every update so nodes can
    cache their distance between updates."""

    def __init__(self, near_horizon: int = 2) -> None:
        self.version = 0
        self._steps: dict[str, dict[str, float]] = {}
        self._prompts: dict[str, dict[str, tuple[int, ...]]] = {}  # workflow -> agent -> fixed prompt
        # workflow -> cache namespace of its requests (absent: the default ""), so its prompts are
        # matched, tagged and prefetched where its requests will look for them
        self._salts: dict[str, str] = {}
        # (namespace, fixed prompt) -> the agents registered with it: the same template's agent in
        # every live instance, so a prompt's nodes carry the steps of all of them (`sharing`)
        self._sharing: dict[tuple[str, tuple[int, ...]], set[Tag]] = {}
        self.near_horizon = near_horizon
        # agents with E <= near_horizon that this replica may prefetch for, so prefetch planning never
        # scans every live workflow (an agent the router sends elsewhere is not among them)
        self.near = NearMap()
        # workflow -> the version of its latest change of steps, oldest first, so an eviction index
        # re-ranks only the nodes of workflows that changed (`changed_since`); bounded: a reader
        # further behind than the oldest kept change re-ranks everything
        self._changes: OrderedDict[str, int] = OrderedDict()
        self._forgotten = 0  # the newest version dropped from `_changes`

    MAX_CHANGES = 1 << 16

    def _changed(self, workflow: str) -> None:
        self.version += 1
        changes = self._changes
        changes.pop(workflow, None)
        changes[workflow] = self.version
        if len(changes) > self.MAX_CHANGES:
            _workflow, self._forgotten = changes.popitem(last=False)

    def changed_since(self, version: int) -> list[str] | None:
        """Workflows whose steps changed after `version` (None: too far back to tell)."""
        if version < self._forgotten:
            return None
        out = []
        for workflow, at in reversed(self._changes.items()):
            if at <= version:
                break
            out.append(workflow)
        return out

    def set_steps(self, workflow: str, steps: Mapping[str, float], elsewhere: Iterable[str] = ()) -> None:
        """`elsewhere`: agents the router will run on another replica: their steps still rank this
        replica's cache (it may hold their prompts), but they are not prefetched here."""
        old = self._steps.get(workflow, {})
        for agent, e in old.items():
            if e <= self.near_horizon:
                self.near.pop((workflow, agent), None)
        self._steps[workflow] = dict(steps)
        skip = set(elsewhere)
        for agent, e in steps.items():
            if e <= self.near_horizon and agent not in skip:
                self.near[(workflow, agent)] = e
        self._changed(workflow)

    def retire(self, workflow: str) -> None:
        for agent, e in self._steps.pop(workflow, {}).items():
            if e <= self.near_horizon:
                self.near.pop((workflow, agent), None)
        self._unshare(workflow)
        self._prompts.pop(workflow, None)
        self._salts.pop(workflow, None)
        self._changed(workflow)

    def steps(self, tag: Tag) -> float:
        agents = self._steps.get(tag[0])
        if agents is None:
            return INF
        return agents.get(tag[1], INF)

    def live(self, workflow: str) -> bool:
        return workflow in self._steps

    def agents(self, workflow: str) -> Iterable[str]:
        """The agents `workflow`'s latest steps name (none once it retired)."""
        return self._steps.get(workflow, {}).keys()

    def apply(self, steps: Mapping[str, Mapping[str, float]], prompts: Mapping[Tag, Sequence[int]],
              retire: Iterable[str], salts: Mapping[str, str] | None = None,
              elsewhere: Mapping[str, Iterable[str]] | None = None) -> None:
        """One batch of hints from the workflow layer, in the order every engine applies them:
        namespaces, prompts, then new steps-to-execution (with the agents to prefetch elsewhere),
        then retired instances."""
        for workflow, salt in (salts or {}).items():
            self.set_salt(workflow, salt)
        for tag, tokens in prompts.items():
            self.register_prompt(tag, tokens)
        for workflow, agent_steps in steps.items():
            self.set_steps(workflow, agent_steps, (elsewhere or {}).get(workflow, ()))
        for workflow in retire:
            self.retire(workflow)

    def fixed_length(self, tag: Tag, tokens: Sequence[int], explicit: int | None = None) -> int:
        """Where a request's fixed prompt ends (docs/design.md §3): the explicit boundary when given, else
        the agent's registered prompt when the request starts with it, else nothing fixed."""
        if explicit is not None:
            return min(max(explicit, 0), len(tokens))
        prompt = self.prompt(tag)
        if prompt is not None and tuple(tokens[:len(prompt)]) == prompt:
            return len(prompt)
        return 0

    def set_salt(self, workflow: str, salt: str) -> None:
        """The cache namespace of `workflow`'s requests ("" = the default namespace)."""
        if self._salts.get(workflow, "") == salt:
            return
        self._unshare(workflow)
        if salt:
            self._salts[workflow] = salt
        else:
            self._salts.pop(workflow, None)
        for agent, tokens in self._prompts.get(workflow, {}).items():
            self._share((salt, tokens), (workflow, agent))
        self.version += 1  # prefetch plans look its prompts up elsewhere now

    def salt(self, workflow: str) -> str:
        """The cache namespace `workflow`'s prompts live in ("" unless a hint said otherwise)."""
        return self._salts.get(workflow, "")

    def register_prompt(self, tag: Tag, tokens: Sequence[int]) -> None:
        prompts = self._prompts.setdefault(tag[0], {})
        salt = self.salt(tag[0])
        old = prompts.get(tag[1])
        if old is not None:
            self._drop_sharer((salt, old), tag)
        prompts[tag[1]] = prompt = tuple(tokens)
        self._share((salt, prompt), tag)

    def registered(self, prompts: Mapping[Tag, Sequence[int]]) -> Iterator[tuple[Tag, Sequence[int], str]]:
        """Of a hint batch's `prompts` (after `apply`), those of live instances, with their namespace:
        a cache tags what it holds of each now, so an agent's prompt carries its steps from the
        moment they are known, not from its first call (docs/design.md §3)."""
        for tag, tokens in prompts.items():
            if self.live(tag[0]):
                yield tag, tokens, self.salt(tag[0])

    def sharing(self, namespace: str, prompt: Sequence[int]) -> AbstractSet[Tag]:
        """The agents whose fixed prompt is `prompt` in `namespace` (in every live instance)."""
        return self._sharing.get((namespace, tuple(prompt)), frozenset())

    def _share(self, key: tuple[str, tuple[int, ...]], tag: Tag) -> None:
        self._sharing.setdefault(key, set()).add(tag)

    def _drop_sharer(self, key: tuple[str, tuple[int, ...]], tag: Tag) -> None:
        sharers = self._sharing.get(key)
        if sharers is not None:
            sharers.discard(tag)
            if not sharers:
                del self._sharing[key]

    def _unshare(self, workflow: str) -> None:
        salt = self.salt(workflow)
        for agent, tokens in self._prompts.get(workflow, {}).items():
            self._drop_sharer((salt, tokens), (workflow, agent))

    def prompt(self, tag: Tag) -> tuple[int, ...] | None:
        agents = self._prompts.get(tag[0])
        return None if agents is None else agents.get(tag[1])


class EvictionPolicy(Protocol):
    """`priority(node)`: the node with the smallest key is evicted first. A policy may also say
    `incremental = True`: a node's key changes only with its last access, its tags, and (through
    `book`, a `StepBook`) the steps of the workflows it is tagged with, so the cache keeps an
    eviction index re-ranked by what changed instead of ranking every device leaf per decision."""

    name: str

    def priority(self, node: RadixNode) -> tuple[float, ...]:
        """Sort key: the node with the smallest key is evicted first."""
        ...


def ranks_by_agents(policy: EvictionPolicy) -> bool:
    """Whether `policy` ranks a node by the agents whose prompts it holds (a distance policy, alone or
    under queued demand). Only such a cache tags prompts with their agents ahead of the agents' calls
    (`StepBook.registered`, `StepBook.sharing`): the others never read those tags, and the look-ups
    would split their nodes where SGLang's tree does not."""
    return hasattr(policy, "node_distance")


class LRUPolicy:
    name = "lru"
    incremental = True

    def priority(self, node: RadixNode) -> tuple[float, ...]:
        return (node.last_access,)


class _DistancePolicy:
    """Evict the node whose nearest user is farthest away; ties by LRU."""

    name = "distance"

    def distance(self, tag: Tag) -> float:
        raise NotImplementedError

    def version(self) -> int:
        raise NotImplementedError

    def tags_distance(self, tags: Iterable[Tag]) -> float:
        """A node's distance from its tags: the nearest user; untagged = +inf (evicted first)."""
        return min((self.distance(t) for t in tags), default=INF)

    def node_distance(self, node: RadixNode) -> float:
        v = self.version()
        cached_v, cached = node.prio_cache
        if cached_v == v:
            return cached
        d = self.tags_distance(node.tags)
        node.prio_cache = (v, d)
        return d

    def needed_by(self, steps: float) -> tuple[float, float]:
        """The lowest key of a node needed within `steps` steps: exactly the nodes ranked below it
        are farther away (what a prefetch for an agent `steps` away may evict)."""
        return self.rank(steps, -INF)

    @staticmethod
    def rank(distance: float, last_access: float) -> tuple[float, float]:
        """The eviction sort key (smallest goes first): farthest first, then least recently used.
        Other trees (SGLang's, through the plugin) rank their own nodes with this same key."""
        return (-distance, last_access)

    def priority(self, node: RadixNode) -> tuple[float, ...]:
        return self.rank(self.node_distance(node), node.last_access)


class KVFlowPolicy(_DistancePolicy):
    """KVFlow: distance = steps-to-execution from the Agent Step Graph."""

    name = "kvflow"
    incremental = True

    def __init__(self, book: StepBook) -> None:
        self.book = book

    def distance(self, tag: Tag) -> float:
        return self.book.steps(tag)

    def version(self) -> int:
        return self.book.version


class FutureAccesses:
    """A known future sequence of agent invocations (an offline trace), for the Belady bound."""

    def __init__(self, sequence: Iterable[Tag]) -> None:
        self._positions: dict[Tag, list[int]] = {}
        for i, tag in enumerate(sequence):
            self._positions.setdefault(tag, []).append(i)
        self.position = 0  # index of the next invocation to arrive

    def advance(self, to: int | None = None) -> None:
        self.position = self.position + 1 if to is None else to

    def next_use(self, tag: Tag) -> float:
        positions = self._positions.get(tag)
        if not positions:
            return INF
        i = bisect.bisect_left(positions, self.position)
        return INF if i == len(positions) else positions[i] - self.position


class BeladyPolicy(_DistancePolicy):
    """Offline optimum (MIN): evict the node whose next use in the known future is farthest."""

    name = "belady"

    def __init__(self, future: FutureAccesses) -> None:
        self.future = future

    def distance(self, tag: Tag) -> float:
        return self.future.next_use(tag)

    def version(self) -> int:
        return self.future.position


EVICTION: Registry[EvictionPolicy] = Registry("eviction")
EVICTION.register("lru", lambda context: LRUPolicy())  # least recently used first (SGLang's default)


@partial(EVICTION.register, "kvflow")
def _kvflow(context: PolicyContext) -> EvictionPolicy:
    """farthest steps-to-execution first, then LRU (KVFlow)"""
    if context.book is None:
        raise ValueError("the kvflow eviction policy needs a StepBook")
    return KVFlowPolicy(context.book)


@partial(EVICTION.register, "belady")
def _belady(context: PolicyContext) -> EvictionPolicy:
    """farthest next use in a known future first (offline bound)"""
    if context.future is None:
        raise ValueError("the belady eviction policy needs the future access sequence")
    return BeladyPolicy(context.future)


class DemandFirst:
    """Queued demand first, then the base policy: a node that queued requests' cached prefixes reach
    (`RadixNode.demand`, left by the queue-aware admission's paired walk, `core.pending`) goes after
    every node none reaches, the least demanded first. PEEK's eviction hook (github xiexbing/peek,
    `python/peek/online/eviction.py`) weighs demand by depth and looks up through the node's
    ancestors; here a node's own demand ranks it: a leaf only a finished request used goes before the
    prompt a queued request is about to hit, whatever sits above it."""

    def __init__(self, base: EvictionPolicy) -> None:
        self.base = base
        self.name = f"demand-{base.name}"
        self.incremental = getattr(base, "incremental", False)  # demand changes mark nodes dirty
        self.book = getattr(base, "book", None)

    def priority(self, node: RadixNode) -> tuple[float, ...]:
        return (node.demand, *self.base.priority(node))

    def __getattr__(self, name: str) -> object:
        """What else the base offers (a distance policy's `node_distance`), with keys that match."""
        if name == "needed_by" and hasattr(self.base, "needed_by"):
            return lambda steps: (0, *self.base.needed_by(steps))  # type: ignore[attr-defined]
        if name in ("node_distance", "tags_distance", "distance", "version"):
            return getattr(self.base, name)
        raise AttributeError(name)


# queued demand first, then least recently used (PEEK's eviction over SGLang's LRU)
EVICTION.register("demand-lru", lambda context: DemandFirst(LRUPolicy()))


@partial(EVICTION.register, "demand-kvflow")
def _demand_kvflow(context: PolicyContext) -> EvictionPolicy:
    """queued demand first, then farthest steps-to-execution, then LRU"""
    return DemandFirst(_kvflow(context))


def make_eviction_policy(name: str, book: StepBook | None = None,
                         future: FutureAccesses | None = None) -> EvictionPolicy:
    return EVICTION.create(name, PolicyContext(book=book, future=future))
