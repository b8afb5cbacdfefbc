"""One simulated GPU replica: a compute stream with continuous batching and chunked prefill, an H2D
and a D2H copy stream that overlap with compute, and a `TieredCache` from `kvflow_ray.core`.

All cache, eviction, prefetch and admission decisions come from `kvflow_ray.core`; this file only
turns them into simulated time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow_ray.core.admission import AdmissionPolicy, FCFSAdmission, StatusAwareAdmission
from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.policies import EvictionPolicy, StepBook
from kvflow_ray.core.prefetch import NoPrefetch, PrefetchPolicy, StepsAheadPrefetch, plan_prefetch
from kvflow_ray.core.radix import GpuState, RadixNode
from kvflow_ray.engines.sim.profile import Profile

if TYPE_CHECKING:
    from kvflow_ray.engines.sim.simulator import Simulation


@dataclass(frozen=True)
class PolicyConfig:
    """A named combination of core policies, as compared in the benchmarks."""

    name: str
    eviction: str  # lru | kvflow | belady
    host_tier: bool  # evicted KV is written back to a host tier and loaded on demand
    prefetch: bool  # proactive host -> device loads for agents about to run
    admission: str  # fcfs | status-aware
    infinite: bool = False  # no device capacity limit (lower bound on latency)


POLICIES: dict[str, PolicyConfig] = {
    "lru": PolicyConfig("lru", "lru", host_tier=False, prefetch=False, admission="fcfs"),
    "hicache": PolicyConfig("hicache", "lru", host_tier=True, prefetch=False, admission="fcfs"),
    "kvflow": PolicyConfig("kvflow", "kvflow", host_tier=True, prefetch=True, admission="status-aware"),
    "kvflow-noprefetch": PolicyConfig("kvflow-noprefetch", "kvflow", host_tier=True, prefetch=False,
                                      admission="status-aware"),
    "belady": PolicyConfig("belady", "belady", host_tier=True, prefetch=False, admission="fcfs"),
    "infinite": PolicyConfig("infinite", "lru", host_tier=False, prefetch=False, admission="fcfs", infinite=True),
}


@dataclass(eq=False)
class SimRequest:
    rid: int
    workflow: str
    agent: str
    tokens: tuple[int, ...]
    fixed_len: int
    output_tokens: tuple[int, ...]
    measured: bool
    on_done: Callable[[SimRequest], None]
    arrival: float = 0.0
    # cache state
    locked: RadixNode | None = None
    reserved: int = 0  # private tokens promised to it while its queued load holds a lock
    tail: RadixNode | None = None  # last node of the cached prefix at the latest look-up
    seen_version: int = -1  # tree version of that look-up, and what it found
    seen_state: tuple[bool, list[RadixNode]] = (True, [])
    pending_nodes: list[RadixNode] = field(default_factory=list)  # prefix nodes not on the device at arrival
    ready_at_arrival: int = 0
    waiting_on: list[RadixNode] = field(default_factory=list)  # LOADING nodes the prefill needs
    matched: int = 0
    prefill_pos: int = 0
    decoded: int = 0
    # outcome
    gpu_hit: int = 0
    cpu_hit: int = 0
    miss: int = 0
    stall: float = 0.0
    started: bool = False


@dataclass
class ReplicaStats:
    gpu_tokens: int = 0
    cpu_tokens: int = 0
    miss_tokens: int = 0
    loaded_tokens: int = 0
    stall_s: float = 0.0
    prefetch_issued: int = 0
    requests: int = 0


class SimReplica:
    def __init__(self, sim: Simulation, index: int, profile: Profile, policy: PolicyConfig,
                 eviction: EvictionPolicy, book: StepBook, *, horizon: int = 1, max_inflight: int = 4,
                 gpu_capacity: int | None = None) -> None:
        self.sim = sim
        self.index = index
        self.profile = profile
        self.policy = policy
        self.book = book
        capacity = profile.gpu_kv_tokens if gpu_capacity is None else gpu_capacity
        if policy.infinite:
            capacity = 1 << 60
        self.cache = TieredCache(capacity, eviction, cpu_capacity=profile.host_kv_tokens,
                                 host_tier=policy.host_tier)
        self.admission: AdmissionPolicy = (StatusAwareAdmission() if policy.admission == "status-aware"
                                           else FCFSAdmission())
        self.prefetcher: PrefetchPolicy = (StepsAheadPrefetch(horizon, max_inflight) if policy.prefetch
                                           else NoPrefetch())
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.busy = False
        self.kick_pending = False
        self.h2d_free_at = 0.0
        self.d2h_free_at = 0.0
        self.prefetch_inflight = 0
        self.load_done_at: dict[int, float] = {}
        self._last_plan: tuple[int, ...] | None = None
        self.queued_reserved = 0  # see _start_queued_loads
        self.stats = ReplicaStats()

    # ------------------------------------------------------------------ entry points
    def submit(self, req: SimRequest) -> None:
        need = len(req.tokens) + len(req.output_tokens)
        if need > self.cache.gpu_capacity:
            raise ValueError(f"a call of agent {req.agent!r} needs {need} device KV tokens (prompt + output) "
                             f"but the device pool holds {self.cache.gpu_capacity}: shorten the prompt "
                             "or raise --gpu-kv-tokens")
        req.arrival = self.sim.now
        match = self.cache.tree.match_prefix(req.tokens, split=False)
        ready, loading, host = match.split_by_tier()
        req.ready_at_arrival = ready
        req.pending_nodes = loading + host
        req.tail = match.last
        self.waiting.append(req)
        self.kick()

    def on_hints(self) -> None:
        """New steps-to-execution values: plan prefetches (a no-op for policies without prefetch)."""
        if not self.policy.prefetch:
            return
        # nothing that planning reads has changed since the last plan: it would find nothing new
        key = (self.cache.tree.version, self.book.version, self.prefetch_inflight, len(self.waiting),
               self.cache.used_tokens)
        if key == self._last_plan:
            return
        self._last_plan = key
        # what queued requests still need on the device (their uncached prompt part and output)
        reserved = sum(len(r.tokens) - r.ready_at_arrival + len(r.output_tokens) for r in self.waiting)
        for op in plan_prefetch(self.cache, self.prefetcher, self.book, self.prefetch_inflight, reserved):
            self._write_back(op.writebacks)
            if op.nodes:
                self.prefetch_inflight += 1
                self.stats.prefetch_issued += 1
                self._load(op.nodes, op.tokens, prefetch=True)

    def kick(self) -> None:
        """Run a scheduling pass as soon as the current event finishes (coalesced)."""
        if not self.kick_pending and not self.busy:
            self.kick_pending = True
            self.sim.at(self.sim.now, self._schedule)

    # ------------------------------------------------------------------ copies
    def _load(self, nodes: list[RadixNode], tokens: int, prefetch: bool) -> None:
        start = max(self.sim.now, self.h2d_free_at)
        self.h2d_free_at = start + self.profile.h2d_time(tokens)
        if self.sim.measuring:
            self.stats.loaded_tokens += tokens

        def done() -> None:
            for node in nodes:
                self.cache.finish_load(node)
                self.load_done_at[node.id] = self.sim.now
            if prefetch:
                self.prefetch_inflight -= 1
                self.on_hints()
            self.kick()

        self.sim.at(self.h2d_free_at, done)

    def _write_back(self, nodes: list[RadixNode]) -> None:
        for node in nodes:
            start = max(self.sim.now, self.d2h_free_at)
            self.d2h_free_at = start + self.profile.d2h_time(len(node.key))

            def done(node: RadixNode = node) -> None:
                self.cache.finish_offload(node)
                self.on_hints()  # room that a prefetch was waiting for may be free now
                self.kick()

            self.sim.at(self.d2h_free_at, done)

    # ------------------------------------------------------------------ scheduling
    def _prefix_state(self, req: SimRequest) -> tuple[bool, list[RadixNode]]:
        """(cached prefix usable now, its host-only nodes). The tail node remembered from the last
        look-up answers most calls: device residency is prefix-closed, so a READY tail means the
        whole cached prefix is on the device."""
        tree = self.cache.tree
        if req.seen_version == tree.version:
            return req.seen_state
        tail = req.tail
        if tail is not None and tail.parent is not None and tail.gpu is GpuState.READY:
            state: tuple[bool, list[RadixNode]] = (True, [])
        else:
            match = tree.match_prefix(req.tokens, split=False)
            req.tail = match.last
            _ready, loading, host = match.split_by_tier()
            state = (not (loading or host), host)
        req.seen_version, req.seen_state = tree.version, state
        return state

    def _is_loading(self, req: SimRequest) -> bool:
        return not self._prefix_state(req)[0]

    def _start_queued_loads(self) -> None:
        """Status-aware engines start the host->device load of queued requests right away and run
        ready work meanwhile (FCFS engines load only once a request reaches the batch).

        A queued load locks its prefix until the request is admitted (otherwise loads for different
        queued requests evict each other before use), and starts only while free memory still covers
        the private needs of every request holding such a load, so they can all be admitted."""
        for req in self.waiting:
            if req.locked is not None:
                continue
            _ready, host = self._prefix_state(req)
            if not host:
                continue
            match = self.cache.match(req.tokens)
            _ready_len, _loading, host = match.split_by_tier()
            if not host:
                continue
            private = len(req.tokens) - match.length + len(req.output_tokens)
            self.cache.tree.lock(match.last)
            ok, writebacks = self.cache.make_room(sum(len(n.key) for n in host) + private + self.queued_reserved)
            self._write_back(writebacks)
            if not ok:
                self.cache.tree.unlock(match.last)
                break
            req.locked = match.last
            req.reserved = private
            self.queued_reserved += private
            self._load(host, self.cache.start_load(host), prefetch=False)

    def _admit(self) -> None:
        if self.policy.admission == "status-aware":
            self._start_queued_loads()
        for req in self.admission.order(self.waiting, self._is_loading):
            if len(self.running) >= self.profile.max_running_requests:
                break
            match = self.cache.match(req.tokens)
            _ready, loading, host = match.split_by_tier()
            private = len(req.tokens) - match.length + len(req.output_tokens)
            need = private + sum(len(n.key) for n in host)
            self.cache.tree.lock(match.last)  # before evicting: never evict the prefix we matched
            ok, writebacks = self.cache.make_room(need)
            self._write_back(writebacks)
            if not ok:
                self.cache.tree.unlock(match.last)
                break  # keep arrival order: wait for memory rather than let later requests starve it
            if req.locked is not None:  # the lock of its queued load passes to the admitted request
                self.cache.tree.unlock(req.locked)
                self.queued_reserved -= req.reserved
                req.reserved = 0
            req.locked = match.last
            if host:
                self._load(host, self.cache.start_load(host), prefetch=False)
            self.cache.alloc(private)
            req.waiting_on = loading + host
            req.matched = match.length
            req.gpu_hit = min(req.ready_at_arrival, match.length)
            req.cpu_hit = match.length - req.gpu_hit
            req.miss = len(req.tokens) - match.length
            # a fully cached prompt still recomputes its last token to get the next-token logits
            req.prefill_pos = min(match.length, len(req.tokens) - 1)
            self.waiting.remove(req)
            self.running.append(req)

    def _schedule(self) -> None:
        self.kick_pending = False
        if self.busy:
            return
        self._admit()
        budget = self.profile.chunked_prefill_tokens
        prefill: list[tuple[SimRequest, int]] = []
        decode: list[SimRequest] = []
        blocked = False
        for req in self.running:
            if req.prefill_pos < len(req.tokens):
                if any(n.gpu is not GpuState.READY for n in req.waiting_on):
                    # FCFS: the batch containing this request waits for its load (the stall KVFlow's
                    # status-aware admission avoids by admitting ready requests first).
                    blocked = blocked or self.policy.admission == "fcfs"
                    continue
                if budget > 0:
                    n = min(budget, len(req.tokens) - req.prefill_pos)
                    prefill.append((req, n))
                    budget -= n
            else:
                decode.append(req)
        if blocked or (not prefill and not decode):
            return
        if prefill:
            # SGLang's default scheduler runs a ready prefill batch on its own and decodes in between
            # (mixed chunks are off by default), so decodes wait for it.
            decode = []
        for req, _n in prefill:
            if not req.started:
                req.started = True
                kv_ready = max((self.load_done_at.get(n.id, req.arrival) for n in req.pending_nodes),
                               default=req.arrival)
                req.stall = max(0.0, kv_ready - req.arrival)
        duration = self.profile.step_time([(n, r.prefill_pos) for r, n in prefill],
                                          [len(r.tokens) + r.decoded for r in decode])
        self.busy = True
        self.sim.at(self.sim.now + duration, lambda: self._step_done(prefill, decode))

    def _step_done(self, prefill: list[tuple[SimRequest, int]], decode: list[SimRequest]) -> None:
        self.busy = False
        for req, n in prefill:
            req.prefill_pos += n
            if req.prefill_pos == len(req.tokens):
                self._prompt_done(req)
        for req in decode:
            req.decoded += 1
            if req.decoded >= len(req.output_tokens):
                self._finish(req)
        self.kick()

    def _prompt_done(self, req: SimRequest) -> None:
        """Prefill produced the first output token; the prompt's KV joins the tree (shareable now)."""
        path = self.cache.commit(req.tokens, len(req.tokens) - req.matched)
        if req.fixed_len:
            self.cache.tree.tag_prefix(req.tokens[:req.fixed_len], (req.workflow, req.agent))
        self.cache.tree.lock(path[-1] if path else None)
        self.cache.tree.unlock(req.locked)
        req.locked = path[-1] if path else None
        req.decoded = 1
        if req.decoded >= len(req.output_tokens):
            self._finish(req)

    def _finish(self, req: SimRequest) -> None:
        self.cache.commit(req.tokens + req.output_tokens, len(req.output_tokens))
        self.cache.tree.unlock(req.locked)
        req.locked = None
        self.running.remove(req)
        if req.measured:
            self.stats.requests += 1
            self.stats.gpu_tokens += req.gpu_hit
            self.stats.cpu_tokens += req.cpu_hit
            self.stats.miss_tokens += req.miss
            self.stats.stall_s += req.stall
        req.on_done(req)
        self.on_hints()  # memory freed: a prefetch that did not fit may fit now
