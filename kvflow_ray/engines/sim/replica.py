"""One simulated GPU replica: a compute stream with continuous batching and chunked prefill, an H2D
and a D2H copy stream that overlap with compute.

Every cache, eviction, prefetch and admission decision comes from `kvflow_ray.core` (the shared
`ReplicaScheduler`); this file only turns them into simulated time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvflow_ray.core.kv_budget import KvBudget
from kvflow_ray.core.policies import FutureAccesses, StepBook
from kvflow_ray.core.radix import RadixNode
from kvflow_ray.core.scheduler import Batch, CacheRequest, PolicyConfig, ReplicaStats, build_replica
from kvflow_ray.core.sessions import PauseModel
from kvflow_ray.engines.events import CacheEventLog
from kvflow_ray.engines.sim.profile import Profile


class SimClock(Protocol):
    """The event loop a replica runs on: the offline simulation's (simulated time) or the serving
    engine's `WallClock`. Events scheduled for the same time run in the order they were scheduled."""

    @property
    def now(self) -> float: ...

    @property
    def measuring(self) -> bool: ...  # whether requests finishing now count in the statistics

    def at(self, when: float, fn: Callable[[], None]) -> None: ...

@dataclass(eq=False)
class SimRequest(CacheRequest):
    rid: int = 0
    output_tokens: tuple[int, ...] = ()
    on_done: Callable[[SimRequest], None] | None = None
    on_prefilled: Callable[[SimRequest], None] | None = None  # its first output token is out
    # its prompt's last `reused` tokens are kept outputs reused beyond the prefix: each costs `reuse_share`
    # of a computed token's compute (`ReuseMethod.recomputed_share`)
    reused: int = 0
    reuse_share: float = 1.0
    private_kv: int = 0  # under a KV budget: private tokens whose KV it holds (its compacted context)
    compactions: int = 0

    def computed_tokens(self, n: int) -> int:
        """The compute of its next `n` prompt tokens, in computed tokens (reused ones cost their share)."""
        overlap = max(0, self.prefill_pos + n - max(self.prefill_pos, len(self.tokens) - self.reused))
        return n - round(overlap * (1.0 - self.reuse_share))


class SimReplica:
    decode_runs = True  # advance unchanged decode batches in O(1) per step (off: every request, every step)

    def __init__(self, sim: SimClock, index: int, profile: Profile, policy: str | PolicyConfig,
                 book: StepBook | None = None, *, future: FutureAccesses | None = None, horizon: int = 1,
                 max_inflight: int = 4, gpu_capacity: int | None = None, events: CacheEventLog | None = None,
                 serving_on: str | None = None, pauses: PauseModel | None = None,
                 session_retain_tokens: int | None = None, kv_budget: KvBudget | None = None,
                 kv_queries: int = 0) -> None:
        self.sim = sim
        # a KV budget for every request that brings none, and its scorer's buffered queries (the
        # compaction cost); docs/design.md §13
        self.kv_budget = kv_budget
        self.kv_queries = kv_queries
        self.compactions = 0
        self.events = events  # serving: what the router learns of this replica's cache (offline: None)
        self.index = index
        self.profile = profile
        self.scheduler = build_replica(
            policy, self, gpu_capacity=profile.gpu_kv_tokens if gpu_capacity is None else gpu_capacity,
            cpu_capacity=profile.host_kv_tokens, clock=lambda: sim.now, book=book, future=future,
            horizon=horizon, max_inflight=max_inflight, max_running=profile.max_running_requests,
            measuring=lambda: sim.measuring, events=events, serving_on=serving_on, pauses=pauses,
            load_seconds=profile.h2d_time, tenant_retain_tokens=session_retain_tokens)
        self.cache = self.scheduler.cache
        self.book = self.scheduler.book
        self.policy = self.scheduler.policy
        self.busy = False
        self.kick_pending = False
        # the H2D stream's queued loads: demand first, then prefetches (each in issue order)
        self.h2d_demand: deque[tuple[list[RadixNode], int, bool]] = deque()
        self.h2d_prefetches: deque[tuple[list[RadixNode], int, bool]] = deque()
        self.h2d_busy = False
        self.d2h_free_at = 0.0
        # A decode run: steps of the same decode batch (`next_batch` hands back the same object) cost
        # O(1) each. Its requests' `decoded` counts lag `run_lag` tokens behind until the run ends,
        # `run_context` is their context total at the current step, and `run_left` the steps until
        # one of them is done (processed one by one again).
        self.run: Batch | None = None
        self.run_lag = 0
        self.run_context = 0
        self.run_left = 0
        # what a fleet comparison reads: compute time spent, and the measured requests' output tokens
        self.busy_s = 0.0
        self.output_tokens = 0
        self.wake_armed: float | None = None  # the earliest session wake-up scheduled (`_arm_wake`)

    @property
    def stats(self) -> ReplicaStats:
        return self.scheduler.stats

    @property
    def waiting(self) -> list[CacheRequest]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[CacheRequest]:
        return self.scheduler.running

    # ------------------------------------------------------------------ entry points
    def submit(self, req: SimRequest) -> None:
        if req.kv_budget is None:
            req.kv_budget = self.kv_budget
        self.scheduler.submit(req)
        self.kick()

    def on_hints(self) -> None:
        """New steps-to-execution values: plan prefetches (a no-op for policies without prefetch)."""
        self.scheduler.plan_prefetch()

    def kick(self) -> None:
        """Run a scheduling pass as soon as the current event finishes (coalesced)."""
        if not self.kick_pending and not self.busy:
            self.kick_pending = True
            self.sim.at(self.sim.now, self._schedule)

    # ------------------------------------------------------------------ copies (the Copier protocol)
    def load(self, nodes: list[RadixNode], tokens: int, prefetch: bool) -> None:
        """One copy at a time on the H2D stream; a demand load goes ahead of every queued prefetch
        (a speculative load never delays a request that is waiting now; one already copying ends)."""
        (self.h2d_prefetches if prefetch else self.h2d_demand).append((nodes, tokens, prefetch))
        if not self.h2d_busy:
            self._next_load()

    def _next_load(self) -> None:
        queue = self.h2d_demand or self.h2d_prefetches
        if not queue:
            self.h2d_busy = False
            return
        nodes, tokens, prefetch = queue.popleft()
        self.h2d_busy = True

        def done() -> None:
            self.scheduler.load_done(nodes, prefetch)
            self._next_load()
            self.kick()

        self.sim.at(self.sim.now + self.profile.h2d_time(tokens), done)

    def write_back(self, nodes: list[RadixNode]) -> None:
        for node in nodes:
            start = max(self.sim.now, self.d2h_free_at)
            self.d2h_free_at = start + self.profile.d2h_time(len(node.key))

            def done(node: RadixNode = node) -> None:
                self.scheduler.offload_done(node)
                self.kick()

            self.sim.at(self.d2h_free_at, done)

    # ------------------------------------------------------------------ compute
    def _schedule(self) -> None:
        self.kick_pending = False
        if self.busy:
            return
        batch = self.scheduler.next_batch(self.profile.chunked_prefill_tokens, self.profile.idle_prefill_tokens or None)
        if batch is None:
            self._end_run()
            return
        if batch is self.run:
            self.run_context += len(batch.decode)
            duration = self.profile.decode_step_time(len(batch.decode), self.run_context)
        else:
            self._end_run()
            duration = self.profile.step_time([(_computed(r, n), r.prefill_pos) for r, n in batch.prefill],
                                              [_context(r) for r in batch.decode])
            duration += sum(self._compact(r) for r in batch.decode if r.kv_budget is not None)
            # a run's context grows by one token per request and step: not a compacting request's
            if not batch.prefill and self.decode_runs and not any(r.kv_budget for r in batch.decode):
                self._start_run(batch)
        self.busy = True
        self.busy_s += duration
        self.sim.at(self.sim.now + duration, lambda: self._step_done(batch))

    def _compact(self, req: CacheRequest) -> float:
        """Before its next token: compact when its budget says so (the engine's rule); the time it takes."""
        assert isinstance(req, SimRequest) and req.kv_budget is not None
        budget = req.kv_budget
        if not budget.due(req.private_kv):
            return 0.0
        keys = req.private_kv
        req.private_kv = budget.tokens
        req.compactions += 1
        self.compactions += 1
        self.scheduler.compacted(req, budget.ceiling)
        return self.profile.compaction_time(self.kv_queries, keys, budget.tokens)

    def _start_run(self, batch: Batch) -> None:
        self.run, self.run_lag = batch, 0
        self.run_context = sum(len(r.tokens) + r.decoded for r in batch.decode)
        self.run_left = min(self._steps_left(r) for r in batch.decode)

    def _end_run(self) -> None:
        """Bring the run's requests' `decoded` counts up to date; the next batch is ranked afresh."""
        if self.run is not None:
            for req in self.run.decode:
                req.decoded += self.run_lag
            self.run = None

    @staticmethod
    def _steps_left(req: CacheRequest) -> int:
        """Decode steps until `req` is done (the step that finishes it included)."""
        assert isinstance(req, SimRequest)
        end = min(req.max_new, len(req.output_tokens)) if req.output_tokens else req.max_new
        return max(1, end - req.decoded)

    def _step_done(self, batch: Batch) -> None:
        self.busy = False
        if batch is self.run and self.run_left > 1:  # nobody in the run finishes at this step
            self.run_left -= 1
            self.run_lag += 1
            self.kick()
            return
        self._end_run()
        for req, n in batch.prefill:
            finished = self.scheduler.prefill_done(req, n)
            if not req.prefilling:
                assert isinstance(req, SimRequest)
                req.private_kv = len(req.tokens) - req.committed
                if req.on_prefilled is not None:
                    req.on_prefilled(req)
            if finished or self._output_done(req, 0):
                self._finish(req)
        for req in batch.decode:
            assert isinstance(req, SimRequest)
            req.private_kv += 1
            if self.scheduler.decoded(req, eos=self._output_done(req, 1)):
                self._finish(req)
        self.kick()

    @staticmethod
    def _output_done(req: CacheRequest, step: int) -> bool:
        """Its output is all out once `step` more tokens are decoded: a stop string (serving.py) may
        end it before its max_new budget is used up."""
        assert isinstance(req, SimRequest)
        return bool(req.output_tokens) and req.decoded + step >= len(req.output_tokens)

    def _finish(self, req: CacheRequest) -> None:
        assert isinstance(req, SimRequest)
        if req.measured:
            self.output_tokens += len(req.output_tokens)
        if req.kv_budget is not None:  # a compacted sequence is exact up to its first dropped token,
            req.exact_len = req.committed if req.compactions else -1  # modelled as its cached prefix
        self.scheduler.finish(req, req.tokens + req.output_tokens)  # simulated memory: no slots to hand back
        if req.session is not None:
            self._arm_wake()
        assert req.on_done is not None
        req.on_done(req)

    # ------------------------------------------------------------------ session pauses
    def _arm_wake(self) -> None:
        """Wake up when a paused session's rank or prefetch falls due (one event per earlier time)."""
        at = self.scheduler.wake_at()
        if at is None or (self.wake_armed is not None and self.wake_armed <= at):
            return
        self.wake_armed = at
        self.sim.at(max(at, self.sim.now), self._wake)

    def _wake(self) -> None:
        if self.wake_armed is not None and self.wake_armed > self.sim.now:
            return  # superseded by an earlier wake-up that re-armed a later one
        self.wake_armed = None
        self.scheduler.tick()
        self._arm_wake()
        self.kick()


def _context(req: CacheRequest) -> int:
    """The KV a decoding request attends over: its whole sequence, or under a budget its prefix and
    the private KV it holds."""
    if isinstance(req, SimRequest) and req.kv_budget is not None:
        return req.committed + req.private_kv
    return len(req.tokens) + req.decoded


def _computed(req: CacheRequest, n: int) -> int:
    return req.computed_tokens(n) if isinstance(req, SimRequest) else n
