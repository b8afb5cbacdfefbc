"""The request lifecycle of one replica over a `TieredCache`: arrival, admission, loads, prefetch,
prefill/decode batches, commit and release. Engine-agnostic and shared by every engine.

An engine supplies two things: a `Copier` that moves bytes between tiers (a simulated stream, a CPU
copy thread, SGLang's HiCache controller) and reports back through `load_done` / `offload_done`, and
a compute loop that asks `next_batch` what to run and reports through `prefill_done` / `decoded`.
Every cache decision (what to evict, what to load, which request runs) is made here or in the
policies this calls, never in an engine.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import kvflow_ray.core.session_policies  # noqa: F401  (registers the session baselines)
from kvflow_ray.core.admission import ADMISSION, AdmissionPolicy
from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.kv_budget import KvBudget
from kvflow_ray.core.policies import EVICTION, FutureAccesses, StepBook, ranks_by_agents
from kvflow_ray.core.predict import PREDICTION
from kvflow_ray.core.prefetch import (
    PREFETCH,
    PrefetchCandidates,
    PrefetchLedger,
    PrefetchPolicy,
    plan_prefetch,
    queued_need,
)
from kvflow_ray.core.radix import GpuState, RadixNode, Tag
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.core.sessions import PAUSES, SESSION_AGENT, PauseModel, SessionBook, SessionTurn
from kvflow_ray.core.snapshot import EngineSnapshot
from kvflow_ray.core.waiting import ArrivalOrder, WaitingIndex


@dataclass(frozen=True)
class PolicyConfig:
    """A named combination of core policies, as compared in the benchmarks. Each policy is a name in
    its registry (`policies.EVICTION`, `prefetch.PREFETCH`, `admission.ADMISSION`)."""

    name: str
    eviction: str  # lru | kvflow | belady | any registered eviction policy
    host_tier: bool  # evicted KV is written back to a host tier and loaded on demand
    prefetch: str  # none | steps-ahead | any registered prefetch policy
    admission: str  # fcfs | status-aware | any registered admission policy
    infinite: bool = False  # no device capacity limit (lower bound on latency)
    oracle: bool = False  # eviction reads the future access sequence (an offline bound: a reference run's trace)
    # how the workflow layer ranks agents (`predict.PREDICTION`): graph | priors | learned | oracle
    prediction: str = "graph"
    # host room as SGLang 0.5.23's HiCache (write_back) makes it: host copies of device-resident nodes
    # first, then host-only leaves by the eviction policy (`TieredCache._make_host_room`); off: the
    # eviction policy ranks every host copy (the workflow-aware policies)
    host_duplicates_first: bool = False
    # how a session's tool pause is predicted (`sessions.PAUSES`): learned | oracle
    pauses: str = "learned"
    # options of the eviction policy (name, value), as its registry entry takes them
    eviction_options: tuple[tuple[str, float], ...] = ()


WRITE_AHEAD_FACTOR = 10.0  # a paused history is written to the host at once when its pause is this many copies long

KVFLOW_ADMISSION = "lpm-status-aware"

POLICIES: dict[str, PolicyConfig] = {
    "lru": PolicyConfig("lru", "lru", host_tier=False, prefetch="none", admission="fcfs"),
    "hicache": PolicyConfig("hicache", "lru", host_tier=True, prefetch="none", admission="fcfs",
                            host_duplicates_first=True),
    # kvflow's admission: status-aware loading, the queue in SGLang's longest-prefix-match order (a
    # memory-bound replica with a deep queue admits what needs least memory and computes a shared prompt
    # once; docs/results/fleet-routing.md); the rest of its family shares it, so they compare like for like
    "kvflow": PolicyConfig("kvflow", "kvflow", host_tier=True, prefetch="steps-ahead", admission=KVFLOW_ADMISSION),
    "kvflow-noprefetch": PolicyConfig("kvflow-noprefetch", "kvflow", host_tier=True, prefetch="none",
                                      admission=KVFLOW_ADMISSION),
    "belady": PolicyConfig("belady", "belady", host_tier=True, prefetch="none", admission="fcfs", oracle=True),
    "infinite": PolicyConfig("infinite", "lru", host_tier=False, prefetch="none", admission="fcfs", infinite=True),
    # dynamic workflows: KVFlow's eviction over expected steps from the learned transition model,
    # prefetch of likely next agents only, status-aware admission
    "predictive": PolicyConfig("predictive", "kvflow", host_tier=True, prefetch="likely-next",
                               admission=KVFLOW_ADMISSION, prediction="learned"),
    # the clairvoyant bound: Belady eviction over the recorded trace, prefetch of the true next agent
    "oracle": PolicyConfig("oracle", "belady", host_tier=True, prefetch="steps-ahead", admission=KVFLOW_ADMISSION,
                           oracle=True, prediction="oracle"),
    # queue-aware prefix scheduling: SGLang's longest-prefix-match order (its `--schedule-policy lpm`,
    # with HiCache), PEEK's queue-aware order and demand-protecting eviction, and that with KVFlow's
    "lpm": PolicyConfig("lpm", "lru", host_tier=True, prefetch="none", admission="lpm", host_duplicates_first=True),
    "queue-aware": PolicyConfig("queue-aware", "demand-lru", host_tier=True, prefetch="none",
                                admission="queue-aware", host_duplicates_first=True),
    "kvflow-qa": PolicyConfig("kvflow-qa", "demand-kvflow", host_tier=True, prefetch="steps-ahead",
                              admission="queue-aware"),
    # the ablation of kvflow's order: status-aware loading with the queue in arrival order (ready
    # requests first; a session's turns by its first arrival)
    "kvflow-fcfs": PolicyConfig("kvflow-fcfs", "kvflow", host_tier=True, prefetch="steps-ahead",
                                admission="status-aware"),
    # agent sessions in tool pauses (core.sessions, core.session_policies): kvflow ranks a paused
    # history by its predicted return and prefetches it before; the pause oracle knows each pause's
    # length; the peers' policies, each with HiCache's host tier (docs/design.md §11)
    "pause-oracle": PolicyConfig("pause-oracle", "kvflow", host_tier=True, prefetch="steps-ahead",
                                 admission=KVFLOW_ADMISSION, pauses="oracle"),
    "tlru": PolicyConfig("tlru", "tlru", host_tier=True, prefetch="none", admission="fcfs",
                         host_duplicates_first=True,
                         # SGLang's defaults (0, 0) are LRU: ξ a TTFT budget of 4,096 uncached tokens,
                         # Q̂ the agentic scenario's mean new tokens per turn (tool result + output)
                         eviction_options=(("threshold", 4096), ("next_prompt_estimate", 2400))),
    "retention": PolicyConfig("retention", "retention", host_tier=True, prefetch="none", admission="fcfs",
                              host_duplicates_first=True),
    "continuum": PolicyConfig("continuum", "continuum", host_tier=True, prefetch="none", admission="continuum",
                              host_duplicates_first=True),
}


@dataclass(eq=False)
class CacheRequest:
    """What the scheduler tracks for one request. Engines subclass it with their own fields."""

    workflow: str | None  # workflow instance key (None: a plain request, nothing tagged)
    agent: str | None
    tokens: tuple[int, ...]  # the prompt
    fixed_len: int  # the agent's fixed prompt: tokens[:fixed_len] get the agent's tag
    max_new: int  # output budget: device KV reserved for the answer
    measured: bool = True  # counts in the replica's statistics (benchmarks leave warm-up out)
    # the cache namespace (`GenerateRequest.cache_salt`): every look-up, commit and tag of this request
    # stays in it, so it reuses KV only of requests with the same salt
    cache_salt: str = ""
    # a turn of an agent session (`workflow` is the session's key, `agent` SESSION_AGENT): its history
    # joins the session's tag when it ends, and its pause is predicted (`sessions.SessionBook`)
    session: SessionTurn | None = None
    arrival: float = 0.0
    # cache state
    locked: RadixNode | None = None
    reserved: int = 0  # private tokens promised to it while its queued load holds a lock
    tail: RadixNode | None = None  # last node of the cached prefix at the latest look-up
    # the root's child a look-up of its tokens starts at, and that child's subtree version, at the last
    # look-up (None: not looked up yet); and what it found
    seen_top: tuple[RadixNode | None, int] | None = None
    seen_state: tuple[bool, list[RadixNode]] = (True, [])
    seq: int = 0  # arrival order at its scheduler
    pending_nodes: list[RadixNode] = field(default_factory=list)  # prefix nodes not on the device at arrival
    ready_at_arrival: int = 0
    cached_at_arrival: int = 0  # prefix tokens in the tree (either tier) at arrival
    waiting_on: list[RadixNode] = field(default_factory=list)  # LOADING nodes the prefill needs
    matched: int = 0  # prefix tokens served from the cache (either tier)
    private: int = 0  # device tokens allocated to it outside the tree
    prefill_pos: int = 0  # prompt tokens whose KV exists (cached or computed)
    # prompt tokens the tree holds once the prompt is committed (all of them, unless the prompt diverges
    # inside a node with a copy in flight, which cannot be split: the rest stays private to the request)
    committed: int = 0
    # prompt tokens whose KV is exact: all (-1), or those before the first token whose KV was placed
    # from a reused segment (docs/design.md §12): everything after attended to approximate KV, so
    # only this prefix joins the tree, and the request keeps the rest private until it ends
    exact_len: int = -1
    # a cap on its private KV (docs/design.md §13): it reserves `KvBudget.reserve` device slots instead
    # of its uncached prompt and whole output, and compacts (`compacted`) to stay inside them
    kv_budget: KvBudget | None = None
    decoded: int = 0  # output tokens produced
    # outcome
    gpu_hit: int = 0
    cpu_hit: int = 0
    miss: int = 0
    stall: float = 0.0  # time from arrival until the KV it had to load was on the device
    started: bool = False
    admitted_at: float = -1.0  # when it left the waiting queue (its wait: admitted_at - arrival)
    first_token_at: float = -1.0  # when its prompt had KV and its first output token existed

    @property
    def prefilling(self) -> bool:
        return self.prefill_pos < len(self.tokens)

    def private_need(self, cached: int) -> int:
        """Device slots it reserves outside the tree when the first `cached` prompt tokens are cached
        (a fully cached prompt still computes its last token, for the next-token logits)."""
        cached = min(cached, len(self.tokens) - 1)
        uncached = len(self.tokens) - cached
        if self.kv_budget is None:
            return uncached + self.max_new
        # past its agent's fixed prompt (which joins the tree when the prompt is done) its KV stays private
        return self.kv_budget.reserve(uncached, self.max_new, shared=max(0, self.fixed_len - cached))

    def exact(self, sequence: tuple[int, ...]) -> tuple[int, ...]:
        """The part of `sequence` (its prompt, or prompt and output) whose KV is exact (`exact_len`)."""
        return sequence if self.exact_len < 0 else sequence[:self.exact_len]


SAMPLES = 100_000


@dataclass
class ReplicaStats:
    gpu_tokens: int = 0
    cpu_tokens: int = 0
    miss_tokens: int = 0
    loaded_tokens: int = 0
    stall_s: float = 0.0
    requests: int = 0
    prefetch: PrefetchLedger = field(default_factory=PrefetchLedger)  # the cache's ledger
    # measured requests' time to first token and time in the waiting queue (the latest `SAMPLES` of
    # each, so a long-running engine stays bounded), and the longest wait of all
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    max_wait_s: float = 0.0


class Copier(Protocol):
    """Moves KV bytes for the scheduler. Each copy is reported back when it lands: `load_done` for
    host -> device, `offload_done` for device -> host (on the scheduler's thread)."""

    def load(self, nodes: list[RadixNode], tokens: int, prefetch: bool) -> None: ...

    def write_back(self, nodes: list[RadixNode]) -> None: ...


@dataclass
class Batch:
    """One forward step: prefill chunks (request, new tokens) or decodes, never both (SGLang's default
    scheduler runs a ready prefill batch on its own and decodes in between)."""

    prefill: list[tuple[CacheRequest, int]]
    decode: list[CacheRequest]


def register_policy(config: PolicyConfig) -> PolicyConfig:
    """Add (or replace) a named combination; its parts must be registered policies."""
    EVICTION.get(config.eviction)
    PREFETCH.get(config.prefetch)
    ADMISSION.get(config.admission)
    PREDICTION.get(config.prediction)
    POLICIES[config.name] = config
    return config


def engine_policies() -> tuple[str, ...]:
    """Policies an engine serving live requests can run: not the offline bounds of the simulator (no
    finite pool, or eviction that needs the future)."""
    return tuple(name for name, p in POLICIES.items() if not (p.infinite or p.oracle))


def resolve_policy(name: str, *, serving_on: str | None = None) -> PolicyConfig:
    """The combination called `name`; `serving_on` (e.g. "the CPU engine"): it must be one a live
    engine can run, and the error names that engine."""
    if serving_on is not None:
        if name not in engine_policies():
            known = ", ".join(engine_policies())
            raise ValueError(f"policy {name!r} cannot run on {serving_on} (choose one of {known})")
    elif name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name]


class CacheListener(Protocol):
    """Hears what enters and leaves each tier (an engine's `CacheEventLog`, which tells the router)."""

    def record(self, kind: str, tier: str, node: RadixNode) -> None: ...

    def on_free(self, node: RadixNode, tier: str) -> None: ...

    def committed(self, last: RadixNode | None, end: int, adopted: list[tuple[int, int]]) -> None: ...


class ReplicaScheduler:
    """One replica's request lifecycle. Engines build it with `build_replica` and drive it:
    `submit`/`apply_hints` in, `next_batch` and the `*_done` reports as work completes. It owns the
    ordering rules between the engine and the cache (a copy's tier events before its effects, a
    finished request's slots back before prefetch is planned), so engines cannot get them wrong."""

    def __init__(self, cache: TieredCache, policy: PolicyConfig, book: StepBook, copier: Copier, *,
                 clock: Callable[[], float], horizon: int = 1, max_inflight: int = 4,
                 max_running: int = 1 << 30, measuring: Callable[[], bool] = lambda: True,
                 events: CacheListener | None = None, sessions: SessionBook | None = None) -> None:
        self.cache = cache
        self.policy = policy
        self.book = book
        self.copier = copier
        self.clock = clock
        self.measuring = measuring
        self.events = events
        self.max_running = max_running
        # agent sessions in tool pauses: their pauses ranked in `book` (time to reuse, one ranking)
        self.sessions = sessions if sessions is not None else SessionBook(book, PAUSES.create(policy.pauses))
        context = PolicyContext(book=book, tree=cache.tree, clock=clock, sessions=self.sessions)
        self.admission: AdmissionPolicy = ADMISSION.create(policy.admission, context)
        self.prefetcher: PrefetchPolicy = PREFETCH.create(policy.prefetch, context,
                                                          {"horizon": horizon, "max_inflight": max_inflight})
        # the book lists the agents the prefetcher may choose (a policy that looks further in expected
        # steps widens it; set before any steps arrive)
        book.near_horizon = max(book.near_horizon, getattr(self.prefetcher, "horizon", 0))
        self.waiting: list[CacheRequest] = []
        self.running: list[CacheRequest] = []
        self.prefetch_inflight = 0
        # device tokens the waiting requests still need (`queued_need` over them), kept as they come and go
        self.waiting_need = 0
        self.candidates: PrefetchCandidates | None = None  # built at the first plan
        self._last_plan: tuple[int, ...] | None = None
        self.queued_reserved = 0  # see _start_queued_loads
        self.holding: ArrivalOrder[CacheRequest] = ArrivalOrder()  # waiting requests holding a queued load
        self.queue: WaitingIndex[CacheRequest] = WaitingIndex(cache.tree, self._prefix_state)
        self._arrivals = 0
        self.stats = ReplicaStats(prefetch=cache.prefetches)
        # prompts carry their agents' steps from the hint on (design §3), where the eviction reads them
        self.tags_ahead = ranks_by_agents(cache.eviction)
        # Settled admission (see `admit`): calls of the entry points that change what admission reads,
        # and the state (with the tree's access clock) an admission pass that changed nothing left
        # behind. Only for eviction
        # policies ranked by access times, tags and steps (`incremental`): an oracle's keys move with
        # every arrival anywhere.
        self._changes = 0
        self._settled: tuple[tuple[int, ...], int] | None = None
        self.settle_admission = cache.index is not None
        # the last decode-only batch while every running request decodes: the next step's, unchanged
        self._decode_batch: Batch | None = None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ arrival
    def check(self, req: CacheRequest) -> None:
        """Reject a request that can never run here (raises ValueError; nothing changes)."""
        need = req.private_need(0)
        if need > self.cache.gpu_capacity:
            raise ValueError(f"a call of agent {req.agent!r} needs {need} device KV tokens (prompt + output) "
                             f"but the device pool holds {self.cache.gpu_capacity}: shorten the prompt, "
                             "lower max_tokens or enlarge the device pool")

    def submit(self, req: CacheRequest) -> None:
        """Queue a request. `fixed_len` < 0: the boundary of the agent's registered prompt when the
        request starts with it, else none (docs/design.md §3)."""
        if req.fixed_len < 0:
            req.fixed_len = (self.book.fixed_length((req.workflow, req.agent), req.tokens)
                             if req.workflow is not None and req.agent is not None else 0)
        self.check(req)
        req.arrival = self.clock()
        history = None
        if req.session is not None and req.workflow is not None:
            history = self.sessions.resumed(req.workflow, req.session, req.arrival, len(req.tokens))
        # split: a prefix that ends inside a node (a preamble shared by other agents) counts too
        match = self.cache.tree.match_prefix(req.tokens, namespace=req.cache_salt)
        ready, loading, host = match.split_by_tier()
        if history is not None:  # a paused session's client came back: was its history on the device?
            whole = min(history, len(req.tokens)) - self.cache.tree.page_size  # its last token may have no KV
            self.sessions.returned(ready >= whole, bool(loading))
        req.ready_at_arrival = ready
        req.cached_at_arrival = match.length
        req.pending_nodes = loading + host
        req.tail = match.last
        req.seen_top, req.seen_state = self._top_stamp(req), (not (loading or host), host)
        self._changes += 1
        self._arrivals += 1
        req.seq = self._arrivals
        self.waiting.append(req)
        self.queue.add(req)
        self.admission.arrived(req, req.cache_salt, req.tokens)
        self.waiting_need += self._queued_need(req)

    def cancel(self, req: CacheRequest) -> None:
        """Drop a request (client gone, engine error): its locks and memory go back."""
        self._changes += 1
        self._decode_batch = None
        self.admission.done(req)
        if req in self.waiting:
            self.waiting.remove(req)
            self.queue.discard(req)
            self.waiting_need -= self._queued_need(req)
            if req.locked is not None:
                self.cache.tree.unlock(req.locked)
                self.queued_reserved -= req.reserved
                self.holding.discard(req)
                req.locked, req.reserved = None, 0
        elif req in self.running:
            self.running.remove(req)
            self.cache.release(req.private)
            req.private = 0
            self.cache.tree.unlock(req.locked)
            req.locked = None

    def apply_hints(self, steps: Mapping[str, Mapping[str, float]], prompts: Mapping[Tag, Sequence[int]],
                    retire: Iterable[str], salts: Mapping[str, str] | None = None,
                    elsewhere: Mapping[str, Iterable[str]] | None = None) -> None:
        """What the workflow layer says: each workflow instance's cache namespace (`salts`), agents'
        fixed prompts, new steps-to-execution (and the agents another replica will run:
        `elsewhere`), finished workflow instances (their prompts lose their tags); then plan
        prefetches (each prompt in its workflow's namespace)."""
        retire = list(retire)
        sessions = self.sessions.sessions
        if sessions:  # a live session's rank is its pause's, kept here (the router's steps know no time)
            steps = {wf: agent_steps for wf, agent_steps in steps.items() if wf not in sessions}
        self.book.apply(steps, prompts, retire, salts, elsewhere)
        if self.tags_ahead:
            for tag, tokens, namespace in self.book.registered(prompts):
                self.cache.tree.tag_prefix(tokens, tag, namespace=namespace)
        self.retire(retire, book=False)
        self.plan_prefetch()

    def retire(self, workflows: Iterable[str], *, book: bool = True) -> None:
        """Finished workflow instances: their prompts lose their tags here (and their steps and
        prompts leave the book, unless `apply_hints` already took them out). A finished session's
        history past its first prompt is freed at once (`TieredCache.free_private`): no one reads it
        again, so it neither waits for eviction nor costs a write-back."""
        self._changes += 1
        for workflow in workflows:
            first_prompt = self.sessions.close(workflow)
            history = list(self.cache.tree.workflow_nodes(workflow)) if first_prompt is not None else []
            if book:
                self.book.retire(workflow)
            self.cache.retire_workflow(workflow)
            if first_prompt is not None:
                self.cache.free_private(history, first_prompt)

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> EngineSnapshot:
        """Occupancy and cumulative counters, as every engine reports them in `stats()`."""
        s, c = self.stats, self.cache.counters
        return EngineSnapshot(
            waiting=len(self.waiting),
            running=len(self.running),
            prompt_tokens={"gpu": s.gpu_tokens, "cpu": s.cpu_tokens, "miss": s.miss_tokens},
            loaded_tokens=s.loaded_tokens,
            prefetch=s.prefetch.as_dict(),
            prefetch_stall_s=s.stall_s,
            evicted_tokens={"gpu": c.evicted_gpu_tokens, "cpu": c.evicted_cpu_tokens,
                            "written_back": c.written_back_tokens, "dropped": c.dropped_tokens},
            cache_tokens={"gpu": self.cache.tree.gpu_tokens, "cpu": self.cache.tree.cpu_tokens,
                          "private": self.cache.private_tokens},
            capacity_tokens={"gpu": self.cache.gpu_capacity, "cpu": self.cache.cpu_capacity},
            sessions=self.sessions.report(getattr(self.cache.eviction, "pins", None)),
        )

    # ------------------------------------------------------------------ prefetch
    def plan_prefetch(self) -> None:
        """New steps-to-execution values or freed memory: plan prefetches (no-op without prefetch)."""
        if not self.prefetcher.max_inflight:
            return
        # nothing that planning reads has changed since the last plan: it would find nothing new
        key = (self.cache.tree.version, self.book.version, self.prefetch_inflight, len(self.waiting),
               self.cache.used_tokens)
        if key == self._last_plan:
            return
        self._last_plan = key
        # what queued requests still need on the device (their uncached prompt part and output)
        reserved = self.waiting_need
        if self.candidates is None:
            self.candidates = PrefetchCandidates(self.book, self.cache.tree)
        self.candidates.refresh()
        for op in plan_prefetch(self.cache, self.prefetcher, self.candidates, self.prefetch_inflight, reserved):
            self.copier.write_back(op.writebacks)
            if op.nodes:
                self.prefetch_inflight += 1
                self.cache.prefetches.started(op.nodes)
                self._load(op.nodes, op.tokens, prefetch=True)

    # ------------------------------------------------------------------ copies
    def _load(self, nodes: list[RadixNode], tokens: int, prefetch: bool) -> None:
        if self.measuring():
            self.stats.loaded_tokens += tokens
        self.copier.load(nodes, tokens, prefetch)

    def load_done(self, nodes: list[RadixNode], prefetch: bool, values: list[object] | None = None) -> None:
        self._changes += 1
        now = self.clock()
        for i, node in enumerate(nodes):
            self.cache.finish_load(node, None if values is None else values[i])
            node.loaded_at = now
        if self.events is not None:
            for node in nodes:
                self.events.record("stored", "gpu", node)
        if prefetch:
            self.prefetch_inflight -= 1
            self.cache.prefetches.landed()
            self.plan_prefetch()

    def offload_done(self, node: RadixNode, value: object = None) -> None:
        self._changes += 1
        if self.events is not None:
            self.events.record("stored", "cpu", node)  # before finish_offload, which may free the device copy
        self.cache.finish_offload(node, value)
        self.plan_prefetch()  # room that a prefetch was waiting for may be free now

    # ------------------------------------------------------------------ admission
    def _top_stamp(self, req: CacheRequest) -> tuple[RadixNode | None, int]:
        """The root's child a look-up of `req` starts in, and its subtree version: while it stays the
        same, so does what the look-up finds."""
        _key, top = self.cache.tree.top_of(req.tokens, req.cache_salt)
        return top, top.subtree_version if top is not None else 0

    def _prefix_state(self, req: CacheRequest) -> tuple[bool, list[RadixNode]]:
        """(cached prefix usable now, its host-only nodes). The tail node remembered from the last
        look-up answers most calls: device residency is prefix-closed, so a READY tail means the
        whole cached prefix is on the device."""
        tree = self.cache.tree
        seen = self._top_stamp(req)
        if req.seen_top == seen:
            return req.seen_state
        tail = req.tail
        if tail is not None and tail.parent is not None and tail.gpu is GpuState.READY:
            state: tuple[bool, list[RadixNode]] = (True, [])
        else:
            match = tree.match_prefix(req.tokens, split=False, namespace=req.cache_salt)
            req.tail = match.last
            _ready, loading, host = match.split_by_tier()
            state = (not (loading or host), host)
        req.seen_top, req.seen_state = seen, state
        return state

    @staticmethod
    def _queued_need(req: CacheRequest) -> int:
        uncached = max(len(req.tokens) - req.ready_at_arrival, 0)
        output = req.max_new if req.kv_budget is None else req.private_need(req.ready_at_arrival) - uncached
        return queued_need(((len(req.tokens), req.ready_at_arrival, output),))

    def _start_queued_loads(self) -> None:
        """Admission policies that load while queued (status-aware) start the host->device load of
        queued requests right away and run ready work meanwhile (others load only once a request
        reaches the batch).

        A queued load locks its prefix until the request is admitted (otherwise loads for different
        queued requests evict each other before use), and starts only while free memory still covers
        the private needs of every request holding such a load, so they can all be admitted.

        The requests are taken in arrival order from the index of those with host-only nodes, kept
        current after each load started (a load or an eviction changes what others find)."""
        queue = self.queue
        queue.refresh()
        req = queue.needs_load.after(0)
        while req is not None:
            if req.locked is None and self._start_queued_load(req):
                break
            queue.refresh()
            req = queue.needs_load.after(req.seq)

    def _start_queued_load(self, req: CacheRequest) -> bool:
        """Start `req`'s queued load if memory allows; True when it does not (the pass stops)."""
        match = self.cache.match(req.tokens, req.cache_salt)
        _ready_len, _loading, host = match.split_by_tier()
        if not host:
            return False
        private = req.private_need(match.length)
        self.cache.tree.lock(match.last)
        ok, writebacks = self.cache.make_room(sum(len(n.key) for n in host) + private + self.queued_reserved)
        self.copier.write_back(writebacks)
        if not ok:
            self.cache.tree.unlock(match.last)
            return True
        req.locked = match.last
        req.reserved = private
        self.queued_reserved += private
        self.holding.add(req)
        self._load(host, self.cache.start_load(host), prefetch=False)
        return False

    def _admission_state(self) -> tuple[int, ...]:
        """What an admission pass reads, beyond the requests' own fields and access times, in counters:
        the scheduler's entry points, the tree's structure and tiers, the book, device and host
        accounting, locks and queued reservations."""
        cache, tree = self.cache, self.cache.tree
        return (self._changes, tree.version, self.book.version, cache.private_tokens, tree.gpu_tokens,
                cache.pending_free, cache.offloading_tokens, tree.locked_gpu_tokens, self.queued_reserved,
                self.prefetch_inflight, len(self.running))

    def admit(self) -> list[CacheRequest]:
        """Move waiting requests into the running set while memory allows; returns the admitted.

        A pass that admits nothing and changes nothing but access times (the head request does not
        fit) does exactly that again until something it reads changes; it is skipped then, so a
        replica blocked on memory costs O(1) per step. Skipping its touches keeps every relative
        access order, as no other touch came in between."""
        if not self.waiting:
            return []
        if self.settle_admission:
            before = self._admission_state()
            if self._settled == (before, self.cache.tree.clock):
                return []
        admitted = self._admit()
        if self.settle_admission:
            after = self._admission_state()
            self._settled = (after, self.cache.tree.clock) if not admitted and after == before else None
        if admitted:
            self._decode_batch = None
        return admitted

    def _admit(self) -> list[CacheRequest]:
        admitted: list[CacheRequest] = []
        if self.admission.loads_while_queued:
            self._start_queued_loads()
        # Requests holding a queued load go first: their memory is already reserved, so admitting them
        # takes nothing from anyone. Otherwise a request ahead of them that does not fit (because
        # their locked prefixes cannot be evicted) waits for memory that only they would free.
        self.queue.refresh()
        holding = self.holding.items()
        # the rest is filtered as the pass reaches it: most passes stop at their first request
        rest = (r for r in self.admission.order(self.waiting, self.queue.ready.items()) if r.locked is None)
        for req in itertools.chain(holding, rest):
            if len(self.running) >= self.max_running:
                break
            match = self.cache.match(req.tokens, req.cache_salt)
            _ready, loading, host = match.split_by_tier()
            private = req.private_need(match.length)
            need = private + sum(len(n.key) for n in host)
            self.cache.tree.lock(match.last)  # before evicting: never evict the prefix we matched
            ok, writebacks = self.cache.make_room(need)
            self.copier.write_back(writebacks)
            if not ok:
                self.cache.tree.unlock(match.last)
                break  # keep arrival order: wait for memory rather than let later requests starve it
            if req.locked is not None:  # the lock of its queued load passes to the admitted request
                self.cache.tree.unlock(req.locked)
                self.queued_reserved -= req.reserved
                self.holding.discard(req)
                req.reserved = 0
            req.locked = match.last
            self.cache.prefetches.use(match.path)
            if host:
                self._load(host, self.cache.start_load(host), prefetch=False)
            self.cache.alloc(private)
            req.private = private
            req.waiting_on = loading + host
            req.matched = match.length
            # Device hits: on the device at arrival, or computed on the device by another request since
            # (a concurrent call of the same agent); host hits: on the host or loading at arrival.
            req.cpu_hit = max(0, min(match.length, req.cached_at_arrival) - req.ready_at_arrival)
            req.gpu_hit = match.length - req.cpu_hit
            req.miss = len(req.tokens) - match.length
            req.prefill_pos = min(match.length, len(req.tokens) - 1)
            self.waiting.remove(req)
            self.queue.discard(req)
            self.waiting_need -= self._queued_need(req)
            self.running.append(req)
            self.admission.admitted(req)
            req.admitted_at = self.clock()
            admitted.append(req)
        return admitted

    # ------------------------------------------------------------------ batches
    def kv_ready(self, req: CacheRequest) -> bool:
        return all(n.gpu is GpuState.READY for n in req.waiting_on)

    def next_batch(self, prefill_budget: int, idle_budget: int | None = None) -> Batch | None:
        """Admit what fits, then pick the next step: prefill chunks of requests whose KV is on the
        device (up to `prefill_budget` tokens), else one decode step of every decoding request.
        `idle_budget`: the prefill budget instead while no running request decodes. Chunking bounds
        how long a prefill step holds the decodes back; with none to hold, a longer chunk only saves
        the engine a pass over its weights per chunk (None: `prefill_budget` always, as SGLang).

        None: nothing can run now (idle, or an FCFS batch waits for a load). While no request joins
        or leaves the running set and all of them decode, it is the same `Batch` object as the last
        step's (an engine may count on that to advance a decode run incrementally)."""
        if not self.admit() and self._decode_batch is not None:
            return self._decode_batch
        budget = prefill_budget
        if idle_budget is not None and idle_budget > budget and all(r.prefilling for r in self.running):
            budget = idle_budget
        prefill: list[tuple[CacheRequest, int]] = []
        decode: list[CacheRequest] = []
        blocked = False
        for req in self.running:
            if req.prefilling:
                if not self.kv_ready(req):
                    # FCFS: the batch containing this request waits for its load (the stall KVFlow's
                    # status-aware admission avoids by admitting ready requests first).
                    blocked = blocked or self.admission.batch_waits_for_loads
                    continue
                if budget > 0:
                    n = min(budget, len(req.tokens) - req.prefill_pos)
                    prefill.append((req, n))
                    budget -= n
            else:
                decode.append(req)
        if blocked or (not prefill and not decode):
            return None
        if prefill:
            decode = []
        elif len(decode) == len(self.running):
            self._decode_batch = Batch(prefill, decode)
            return self._decode_batch
        for req, _n in prefill:
            if not req.started:
                req.started = True
                if req.kv_budget is not None:  # past its agent's fixed prompt, its prompt stays private
                    req.exact_len = max(req.prefill_pos, req.fixed_len)  # (compactable) until it ends
                kv_ready = max((n.loaded_at for n in req.pending_nodes), default=req.arrival)
                req.stall = max(0.0, kv_ready - req.arrival)
        return Batch(prefill, decode)

    def prefill_done(self, req: CacheRequest, n: int, gpu_value: object = None,
                     adopted: list[tuple[int, int]] | None = None) -> bool:
        """`n` more prompt tokens have KV. At the end of the prompt the KV joins the tree (shareable
        now; `gpu_value` is the engine's payload for the whole prompt) and the first output token
        exists. Returns True when the request is finished. `adopted` receives the ranges of the prompt
        whose KV the tree took from `gpu_value` (the engine frees the rest)."""
        self._changes += 1
        req.prefill_pos += n
        if req.prefilling:
            return False
        self.admission.done(req)
        req.first_token_at = self.clock()
        matched = min(req.matched, len(req.tokens) - 1)
        computed = len(req.tokens) - matched
        exact = req.exact(req.tokens)
        if adopted is None and self.events is not None:
            adopted = []
        path = self.cache.commit(exact, max(0, len(exact) - matched), gpu_value, adopted,
                                 keep_uncovered=True, namespace=req.cache_salt)
        req.committed = sum(len(node.key) for node in path)
        req.private -= computed - min(computed, len(req.tokens) - req.committed)
        if req.fixed_len and req.workflow is not None and req.agent is not None:
            fixed = req.tokens[:req.fixed_len]
            tree = self.cache.tree
            fixed_path = tree.tag_prefix(fixed, (req.workflow, req.agent), namespace=req.cache_salt)
            if self.tags_ahead:  # the same prompt's agents in other live instances: their steps too
                for tag in self.book.sharing(req.cache_salt, fixed):
                    tree.tag_path(fixed_path, tag)
        self.cache.tree.lock(path[-1] if path else None)
        self.cache.tree.unlock(req.locked)
        req.locked = path[-1] if path else None
        if self.events is not None:
            self.events.committed(req.locked, req.committed, adopted or [])
        return self.decoded(req)

    def compacted(self, req: CacheRequest, held: int) -> None:
        """A budgeted request compacted its private KV and now holds `held` device slots outside the
        tree; the engine has freed the rest already (prefetch planned now may take them)."""
        if not 0 <= held <= req.private:
            raise ValueError(f"a compacted request holds {held} slots, it had {req.private}")
        self._changes += 1
        self.cache.release(req.private - held)
        req.private = held
        self.plan_prefetch()

    def decoded(self, req: CacheRequest, eos: bool = False) -> bool:
        """One more output token; True when the request is finished (budget used up or `eos`)."""
        req.decoded += 1
        return eos or req.decoded >= req.max_new

    def finish(self, req: CacheRequest, sequence: tuple[int, ...], gpu_value: object = None,
               adopted: list[tuple[int, int]] | None = None, free_slots: Callable[[], None] | None = None) -> None:
        """The request is done: `sequence` (prompt + output whose KV exists) joins the tree, the rest
        of its private memory is released, `free_slots()` hands the engine's leftover device slots
        back (those the tree did not adopt), and then prefetch is planned (memory freed: a prefetch
        that did not fit may fit now). Planned before `free_slots`, a load would be given slots the
        engine has not freed yet."""
        self._changes += 1
        self._decode_batch = None
        self.cache.commit(req.exact(sequence), req.private, gpu_value, adopted, namespace=req.cache_salt)
        req.private = 0
        self.cache.tree.unlock(req.locked)
        req.locked = None
        self.running.remove(req)
        if req.measured:
            self.stats.requests += 1
            self.stats.gpu_tokens += req.gpu_hit
            self.stats.cpu_tokens += req.cpu_hit
            self.stats.miss_tokens += req.miss
            self.stats.stall_s += req.stall
            wait = req.admitted_at - req.arrival
            self.stats.waits.append(wait)
            self.stats.max_wait_s = max(self.stats.max_wait_s, wait)
            self.stats.ttfts.append(req.first_token_at - req.arrival)
        if req.session is not None and req.workflow is not None:
            self._turn_ended(req, sequence)
        if free_slots is not None:
            free_slots()
        self.plan_prefetch()

    # ------------------------------------------------------------------ sessions
    def _turn_ended(self, req: CacheRequest, sequence: tuple[int, ...]) -> None:
        """A session's turn ended: its history (prompt and output) is the session's prompt now. The
        final turn frees it at once (past the first prompt, `retire`). Otherwise its pause is
        predicted, and a replica that prefetches writes a history whose pause is long against its copy
        (`WRITE_AHEAD_FACTOR` times) to the host now, off the critical path: its eviction later frees
        the device at once. A shorter pause keeps the link for the write-backs and loads that requests
        wait on."""
        assert req.session is not None and req.workflow is not None
        key, turn = req.workflow, req.session
        tag = (key, SESSION_AGENT)
        self.cache.tree.tag_prefix(sequence, tag, namespace=req.cache_salt)
        if turn.final:
            self.retire([key])  # closes the session and frees its history (tagged whole just now)
            return
        self.book.register_prompt(tag, sequence)
        forecast = self.sessions.pause(key, turn, len(sequence), self.clock())
        writes_ahead = self.cache.host_tier and self.prefetcher.max_inflight
        if writes_ahead and forecast.expected > WRITE_AHEAD_FACTOR * self.sessions.load_seconds(len(sequence)):
            match = self.cache.tree.match_prefix(sequence, split=False, namespace=req.cache_salt)
            backups = [node for node in match.path if self.cache.backup(node)]
            if backups:
                self.copier.write_back(backups)

    def wake_at(self) -> float | None:
        """When the engine should call `tick` next (a paused session's prefetch falls due)."""
        return self.sessions.next_wake()

    def tick(self) -> None:
        """Time moved: paused sessions' ranks and due prefetches, then plan prefetches."""
        self.sessions.advance(self.clock())
        self.plan_prefetch()


def build_replica(policy: str | PolicyConfig, copier: Copier, *, gpu_capacity: int, cpu_capacity: int = 0,
                  clock: Callable[[], float], book: StepBook | None = None, future: FutureAccesses | None = None,
                  horizon: int = 1, max_inflight: int = 4, max_running: int = 1 << 30,
                  measuring: Callable[[], bool] = lambda: True, events: CacheListener | None = None,
                  free_value: Callable[[RadixNode, str, object], None] | None = None,
                  serving_on: str | None = None, pauses: PauseModel | None = None,
                  load_seconds: Callable[[int], float] | None = None,
                  tenant_retain_tokens: int | None = None) -> ReplicaScheduler:
    """The one recipe every engine builds a replica with: the named policy combination (`serving_on`:
    the engine, which must be able to run it live, see `resolve_policy`), a step book (shared by
    several replicas when given), the eviction policy from its registry, the tiered cache (an
    `infinite` policy lifts the device limit) and the scheduler. `free_value(node, tier, value)`: the
    engine releases a dropped copy's payload (`events` hears the drop after it)."""
    config = resolve_policy(policy, serving_on=serving_on) if isinstance(policy, str) else policy
    book = book if book is not None else StepBook(near_horizon=max(horizon, 2))
    # `pauses`: a pause model shared by several replicas (what one learns, all use)
    sessions = SessionBook(book, pauses if pauses is not None else PAUSES.create(config.pauses),
                           load_seconds=load_seconds or (lambda tokens: 0.0), tenant_retain_tokens=tenant_retain_tokens)
    eviction = EVICTION.create(config.eviction, PolicyContext(book=book, future=future, clock=clock, sessions=sessions),
                               **dict(config.eviction_options))
    capacity = 1 << 60 if config.infinite else gpu_capacity
    cache = TieredCache(capacity, eviction, cpu_capacity=cpu_capacity, host_tier=config.host_tier,
                        host_duplicates_first=config.host_duplicates_first)
    if free_value is not None or events is not None:
        def on_free(node: RadixNode, tier: str, value: object) -> None:
            if free_value is not None:
                free_value(node, tier, value)
            if events is not None:
                events.on_free(node, tier)
        cache.tree.on_free = on_free
    return ReplicaScheduler(cache, config, book, copier, clock=clock, horizon=horizon,
                            max_inflight=max_inflight, max_running=max_running, measuring=measuring, events=events,
                            sessions=sessions)
