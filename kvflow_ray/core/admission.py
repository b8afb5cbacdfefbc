"""Admission: which waiting requests are considered for the next batch, in which order, and what a
request whose prefix is still loading from the host tier does meanwhile.

A policy owns all of that, so the scheduler (`core.scheduler`) and the SGLang plugin's prefill adder
act on the same object: `order` ranks the waiting requests (given those whose cached prefix is
usable now), `loads_while_queued` says whether a queued request's host -> device load starts at once
(status-aware) or only once it is admitted, and `batch_waits_for_loads` whether a prefill batch waits
for a member's load (FCFS) or runs without it. Its driver tells it when a request arrives, is
admitted, and is done with its prefill (or cancelled), so a policy that looks at what the queue
shares keeps its view current at the cost of the request that changed.

- `fcfs`: arrival order; a batch waits for its members' loads (SGLang's default).
- `status-aware` (KVFlow): holds back a request whose prefix is still loading while other requests
  are ready, so compute never idles behind a copy it could have overlapped.
- `lpm`: SGLang's longest-prefix-match order, rebuilt from `python/sglang/srt/managers/
  schedule_policy.py` (0.5.23: `calc_priority`, `_compute_prefix_matches`, `_sort_by_longest_prefix`)
  with its defaults: the longest cached prefix first (device and host tokens, at most the prompt
  less one: `num_matched_prefix_tokens`); a request with at most `check` (32,
  IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD) device-cached tokens whose first `deprioritize` (32,
  IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD) tokens match an earlier such request's goes to the
  end (the in-batch prefix check); above `fcfs_above` (128, WAITING_QUEUE_PREFIX_MATCH_MAX) waiting
  requests the queue keeps its current order (SGLang falls back to FCFS, a no-op sort).
- `lpm-status-aware` (kvflow's): `lpm`'s order with status-aware loading: a queued request's load
  starts at once and a batch never waits for a member's load. Under memory pressure with deep
  queues the order decides what fits (admission stops at the first request that does not), and a
  prefix-first order admits requests that need little memory and computes a shared prompt once
  before its peers. While agent sessions are live, `status-aware`'s job order instead.
- `queue-aware`: PEEK's cLPM scheduler (github xiexbing/peek, `python/peek/online/lpm_integration.py`,
  preset `peek-online`) over the pending tree (`core.pending`), composed with status-aware loading.
  Details in `QueueAwareAdmission`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from kvflow_ray.core.pending import PendingNode, PendingTree, cluster_of
from kvflow_ray.core.radix import Namespace, RadixTree
from kvflow_ray.core.registry import PolicyContext, Registry

R = TypeVar("R", bound=Hashable)


class AdmissionPolicy(Protocol):
    name: str
    loads_while_queued: bool  # start a queued request's host -> device load before it is admitted
    batch_waits_for_loads: bool  # a prefill whose KV is loading holds its batch back (else it is passed over)

    def arrived(self, req: Any, namespace: Namespace, tokens: Sequence[int]) -> None:
        """`req` joined the waiting queue with prompt `tokens` in cache namespace `namespace`."""
        ...

    def admitted(self, req: Any) -> None:
        """`req` left the waiting queue for the running set (its prefill starts)."""
        ...

    def done(self, req: Any) -> None:
        """`req`'s prompt has KV now, or it was cancelled: the policy forgets it (idempotent)."""
        ...

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> Iterable[R]:
        """The requests to try to admit now, in order (the driver admits a prefix of it). `waiting`:
        the queue in arrival order; `ready`: those whose cached prefix is usable now (none of it
        loading or on the host only), in arrival order. The driver changes the queue while it
        consumes the order: a policy never hands back the list it was given."""
        ...


class ArrivalAdmission:
    """A policy that needs nothing but the queue it is given: the driver's reports are no-ops."""

    name = "arrival"
    loads_while_queued = False
    batch_waits_for_loads = True

    def arrived(self, req: Any, namespace: Namespace, tokens: Sequence[int]) -> None:
        pass

    def admitted(self, req: Any) -> None:
        pass

    def done(self, req: Any) -> None:
        pass

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> Iterable[R]:
        return list(waiting)


class FCFSAdmission(ArrivalAdmission):
    name = "fcfs"


class StatusAwareAdmission(ArrivalAdmission):
    """Ready requests first. Turns of agent sessions (`sessions`, a `core.sessions.SessionBook`) go by
    their session's first arrival (job-level FCFS, as Continuum orders jobs): a job's later turns do not
    queue behind sessions that started after it. Without live sessions, arrival order."""

    name = "status-aware"
    loads_while_queued = True
    batch_waits_for_loads = False

    def __init__(self, sessions: Any = None) -> None:
        self.sessions = sessions

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> Iterable[R]:
        return status_aware_order(waiting, ready, self.sessions)


def live_sessions(sessions: Any) -> bool:
    """The replica has agent sessions (`core.sessions.SessionBook`) open."""
    return sessions is not None and bool(sessions.sessions)


def status_aware_order(waiting: Sequence[R], ready: Sequence[R], sessions: Any) -> list[R]:
    """The ready requests (all waiting when none is ready): turns of agent sessions by their
    session's first arrival (job-level FCFS, as Continuum orders jobs), so a job's later turns do not
    queue behind sessions that started after it; everything else by arrival. Without live sessions,
    arrival order."""
    candidates = ready if ready else waiting
    if not live_sessions(sessions):
        return list(candidates)

    def job(req: Any) -> tuple[float, int]:
        state = sessions.state(req.workflow) if req.workflow is not None else None
        return (req.arrival if state is None else state.opened, req.seq)

    return sorted(candidates, key=job)


class QueueTracking(ArrivalAdmission):
    """A policy with a view of the queue: the pending tree of the oldest `window` waiting requests
    (and, for a policy that keeps them, those admitted whose prefill runs), with their cached
    prefixes from the paired walk against the replica's cache tree (`tree`; an engine without one
    reports each request's cached prefix through `pending.set_cached` before `order`). Younger
    requests wait outside the tree until older ones leave, so what a decision costs is bounded by the
    window, however long the queue grows."""

    def __init__(self, tree: RadixTree | None, clock: Callable[[], float] | None, window: int) -> None:
        if window < 1:
            raise ValueError(f"the queue window must be at least 1 request, got {window}")
        self.tree = tree
        self.clock = clock or time.monotonic
        self.window = window
        self.pending: PendingTree[Any] = PendingTree()
        self.queued = 0  # requests in the pending tree still waiting
        self.overflow: dict[Any, None] = {}  # waiting beyond the window, oldest first
        self.keys: dict[Any, tuple[Namespace, tuple[int, ...]]] = {}
        self.arrival: dict[Any, float] = {}

    def arrived(self, req: Any, namespace: Namespace, tokens: Sequence[int]) -> None:
        self.keys[req] = (namespace, tuple(tokens))
        self.arrival[req] = self.clock()
        if self.queued < self.window:
            self._track(req)
        else:
            self.overflow[req] = None

    def admitted(self, req: Any) -> None:
        if self.overflow.pop(req, None) is None and req in self.pending and not self.pending.inflight(req):
            self.running(req)
            self._left_queue()

    def running(self, req: Any) -> None:
        """An admitted request from the window: by default it leaves the pending tree."""
        self.pending.discard(req)

    def done(self, req: Any) -> None:
        if self.overflow.pop(req, None) is None and req in self.pending:
            queued = not self.pending.inflight(req)
            self.pending.discard(req)
            if queued:
                self._left_queue()
        self.keys.pop(req, None)
        self.arrival.pop(req, None)

    def _track(self, req: Any) -> None:
        namespace, tokens = self.keys[req]
        self.pending.add(req, namespace, tokens)
        self.queued += 1

    def _left_queue(self) -> None:
        self.queued -= 1
        while self.overflow and self.queued < self.window:
            req = next(iter(self.overflow))
            del self.overflow[req]
            self._track(req)

    def walk(self) -> None:
        if self.tree is not None:
            self.pending.walk(self.tree)


class LongestPrefixAdmission(QueueTracking):
    """SGLang's `--schedule-policy lpm` (see the module docstring for its source and defaults)."""

    name = "lpm"
    loads_while_queued = False
    batch_waits_for_loads = True

    def __init__(self, tree: RadixTree | None, clock: Callable[[], float] | None, *, check: int = 32,
                 deprioritize: int = 32, fcfs_above: int = 128) -> None:
        super().__init__(tree, clock, window=fcfs_above)  # above it, the order reads no prefixes
        self.check, self.deprioritize, self.fcfs_above = check, deprioritize, fcfs_above
        self.queue: dict[Any, None] = {}  # the waiting queue in its current order (SGLang sorts it in place)

    def arrived(self, req: Any, namespace: Namespace, tokens: Sequence[int]) -> None:
        super().arrived(req, namespace, tokens)
        self.queue[req] = None

    def admitted(self, req: Any) -> None:
        super().admitted(req)
        self.queue.pop(req, None)

    def done(self, req: Any) -> None:
        super().done(req)
        self.queue.pop(req, None)

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> Iterable[R]:
        if len(self.queue) > self.fcfs_above:
            return list(self.queue)
        self.walk()
        pending, claimed = self.pending, set()
        deprioritized: set[Any] = set()
        for req in self.queue:
            if pending.leaves[req].ready <= self.check:
                namespace, tokens = self.keys[req]
                if len(tokens) >= self.deprioritize:
                    claim = (namespace, tokens[:self.deprioritize])
                    if claim in claimed:
                        deprioritized.add(req)
                    else:
                        claimed.add(claim)

        def key(req: Any) -> float:
            if req in deprioritized:
                return math.inf
            return -min(pending.leaves[req].cached, len(self.keys[req][1]) - 1)

        ordered = sorted(self.queue, key=key)
        self.queue = dict.fromkeys(ordered)
        return ordered


class LongestPrefixStatusAware(LongestPrefixAdmission):
    """kvflow's admission: KVFlow's status-aware loading (queued loads start at once; a batch runs
    without a member whose prefix is still loading) over SGLang's longest-prefix-match order
    (`LongestPrefixAdmission`, its defaults): under memory pressure with a deep queue it admits what
    needs least new memory and computes a shared prompt once. While the replica has live agent
    sessions, the order is `status-aware`'s instead (ready requests first, by job): a session's
    history is private, so the prefix order has no prompt to share and passes over new sessions,
    while finishing started jobs first bounds their completion time (docs/design.md)."""

    name = "lpm-status-aware"
    loads_while_queued = True
    batch_waits_for_loads = False

    def __init__(self, tree: RadixTree | None, clock: Callable[[], float] | None, *, sessions: Any = None,
                 check: int = 32, deprioritize: int = 32, fcfs_above: int = 128) -> None:
        super().__init__(tree, clock, check=check, deprioritize=deprioritize, fcfs_above=fcfs_above)
        self.sessions = sessions

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> Iterable[R]:
        if live_sessions(self.sessions):
            return status_aware_order(waiting, ready, self.sessions)
        return super().order(waiting, ready)


class QueueAwareAdmission(QueueTracking):
    """PEEK's cLPM with group-major order and a dynamic oldest-first lane, composed with status-aware
    loading (requests whose prefix is loading wait while others are ready; queued loads start at once).

    Each pass ranks the candidates (the ready ones, else all waiting) in sections: 0 warm (more than
    `check` tokens cached), 1 the rest. A request is *cold* when the prefix it shares with other
    tracked requests (its pending-tree cluster) runs `check` or more tokens past what is cached: the
    first such request of a cluster is its pioneer; the others are *deferred* (left out of the order)
    while the pioneer is ranked ahead of them or its prefill runs, and hit the prefix it computed once
    it is done. (PEEK only moves them to the end, relying on SGLang's per-pass prefill token budget to
    keep them out of the pioneer's batch; a scheduler that admits whatever fits in memory needs them
    held back.) For the same reason the pioneers computing at once share at most `pioneer_tokens`
    uncached tokens (one pioneer always may): more fill the device with cold prefills and keep out
    the warm requests that need only their suffix. The default, 4,096, is the best of 4,096, 8,192,
    16,384 and no bound on the burst sweep (`benchmarks/queue_aware.py` reports that ablation).

    Two lanes, interleaved by stride scheduling: lane A keeps clusters together (buckets of a cluster,
    or a lone request, by section, then cluster depth x size, then oldest member; within a bucket the
    longest cached prefix first, then arrival); lane B is strict arrival order (PEEK ranks it by
    section first, so warm requests can pass a cold oldest one for as long as warm ones keep coming:
    on a fleet burst that waited 2.5-2.9x FCFS's p99 wait). Lane B's share b follows
    the share of lone requests and the age of the oldest (over `age_budget_s`):
    raw = 0.15 + 0.5 x lone share + 0.3 x age pressure, clamped to [`oldest_floor`, `oldest_ceiling`],
    smoothed b = 0.7 b + 0.3 raw (PEEK's defaults: floor 0.10, ceiling 0.60, budget 2 s). The floor
    bounds how long the oldest request can be passed over.

    The order covers the oldest `window` (1,024) waiting requests (`QueueTracking`): a decision costs
    at most that many, however long the queue (PEEK ranks the whole queue each pass; SGLang's lpm
    stops ranking above 128)."""

    name = "queue-aware"
    loads_while_queued = True
    batch_waits_for_loads = False

    def __init__(self, tree: RadixTree | None, clock: Callable[[], float] | None, *, check: int = 32,
                 oldest_floor: float = 0.10, oldest_ceiling: float = 0.60, age_budget_s: float = 2.0,
                 pioneer_tokens: int = 4096, window: int = 1024) -> None:
        super().__init__(tree, clock, window)
        if not 0 < oldest_floor <= oldest_ceiling < 1:
            raise ValueError("queue-aware admission needs 0 < oldest_floor <= oldest_ceiling < 1")
        if age_budget_s <= 0:
            raise ValueError("queue-aware admission needs age_budget_s > 0")
        if pioneer_tokens < 1:
            raise ValueError("queue-aware admission needs pioneer_tokens >= 1")
        self.check, self.floor, self.ceiling, self.age_budget = check, oldest_floor, oldest_ceiling, age_budget_s
        self.pioneer_tokens = pioneer_tokens
        self.oldest_share = 0.3  # b, smoothed across passes
        # pioneers admitted whose prefill runs: the shared tokens each computes for its cluster
        self.pioneers: dict[Any, int] = {}
        self.pioneering = 0  # their sum
        self._ranked_pioneers: dict[Any, int] = {}  # the latest order's pioneers

    def running(self, req: Any) -> None:
        """It stays in the pending tree, in flight, until its prefill is done: its cluster's other
        requests wait for the prefix it computes."""
        self.pending.admitted(req)

    def admitted(self, req: Any) -> None:
        super().admitted(req)
        shared = self._ranked_pioneers.get(req)
        if shared is not None:
            self.pioneers[req] = shared
            self.pioneering += shared

    def done(self, req: Any) -> None:
        super().done(req)
        self.pioneering -= self.pioneers.pop(req, 0)

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> Iterator[R]:
        self.walk()
        check, leaves = self.check, self.pending.leaves
        claimed: set[PendingNode] = set()
        pioneers = self._ranked_pioneers = {}
        pioneering = self.pioneering
        buckets: dict[object, list[tuple[int, Any]]] = {}  # a cluster (or a lone request) -> its members
        bucket_rank: list[tuple[int, int, int, object]] = []
        arrivals: list[Any] = []
        lone, oldest_lone = 0, None
        # candidates come in arrival order: a bucket's first member is its oldest
        for index, req in enumerate(ready if ready else waiting):
            leaf = leaves.get(req)
            if leaf is None:
                if req in self.overflow:
                    break  # the window is the oldest waiting requests: the rest are younger still
                continue
            cached = leaf.cached
            cluster = cluster_of(leaf)
            if cluster is not None and cluster.depth - cached >= check:
                # cold: the pioneer of the uncached shared prefix, unless another request computes it
                # now or is ranked ahead to (then this one waits, and hits what that one computed)
                cold: list[PendingNode] = []
                node, blocked = cluster, False
                while node.parent is not None and node.depth - cached >= check and not blocked:
                    blocked = bool(node.inflight) or node in claimed
                    cold.append(node)
                    node = node.parent
                shared = cluster.depth - cached
                # the pioneers computing at once are bounded (one always may): the memory they take
                # would otherwise keep warm requests, which only need their suffix, from running
                if blocked or (pioneering and pioneering + shared > self.pioneer_tokens):
                    continue
                claimed.update(cold)
                pioneers[req] = shared
                pioneering += shared
            section = 0 if cached > check else 1
            arrivals.append(req)
            if cluster is None:  # a bucket of its own
                lone += 1
                if oldest_lone is None:
                    oldest_lone = req
                buckets[req] = [(-cached, req)]
                bucket_rank.append((section, 0, index, req))
                continue
            members = buckets.get(cluster)
            if members is None:
                buckets[cluster] = members = []
                bucket_rank.append((section, -cluster.depth * cluster.count, index, cluster))
            members.append((-cached, req))
        total = len(arrivals)
        if not total:
            return iter(())
        age = (self.clock() - self.arrival[oldest_lone]) / self.age_budget if oldest_lone is not None else 0.0
        raw = min(max(0.15 + 0.5 * lone / total + 0.3 * min(1.0, age), self.floor), self.ceiling)
        self.oldest_share = 0.7 * self.oldest_share + 0.3 * raw
        bucket_rank.sort(key=lambda rank: rank[:3])
        lane_a = (req for *_rank, group in bucket_rank
                  for _neg, req in sorted(buckets[group], key=lambda member: member[0]))
        return self._interleave(lane_a, iter(arrivals), total)

    def _interleave(self, lane_a: Iterator[Any], lane_b: Iterator[Any], total: int) -> Iterator[Any]:
        """The two lanes by stride scheduling, each request once: the next pick comes from the lane
        whose clock is lower (ties: A); each clock starts at its lane's stride and advances by it."""
        b = self.oldest_share
        strides = (1 / (1 - b), 1 / b)
        clocks = list(strides)
        lanes = (lane_a, lane_b)
        picked: set[int] = set()
        while len(picked) < total:
            lane = 0 if clocks[0] <= clocks[1] else 1
            for req in lanes[lane]:
                if id(req) not in picked:
                    picked.add(id(req))
                    clocks[lane] += strides[lane]
                    yield req
                    break
            else:  # that lane is spent: the other holds the rest
                clocks[lane] = math.inf


ADMISSION: Registry[AdmissionPolicy] = Registry("admission")
# arrival order; a batch waits for its members' loads (SGLang's default)
ADMISSION.register("fcfs", lambda context: FCFSAdmission())
# ready requests first, queued loads start at once (KVFlow)
ADMISSION.register("status-aware", lambda context: StatusAwareAdmission(context.sessions))


@partial(ADMISSION.register, "lpm")
def _lpm(context: PolicyContext, *, check: int = 32, deprioritize: int = 32,
         fcfs_above: int = 128) -> AdmissionPolicy:
    """SGLang's longest-prefix-match order with its in-batch prefix check"""
    return LongestPrefixAdmission(context.tree, context.clock, check=check, deprioritize=deprioritize,
                                  fcfs_above=fcfs_above)


@partial(ADMISSION.register, "lpm-status-aware")
def _lpm_status_aware(context: PolicyContext, *, check: int = 32, deprioritize: int = 32,
                      fcfs_above: int = 128) -> AdmissionPolicy:
    """SGLang's longest-prefix-match order with KVFlow's status-aware loading"""
    return LongestPrefixStatusAware(context.tree, context.clock, sessions=context.sessions, check=check,
                                    deprioritize=deprioritize, fcfs_above=fcfs_above)


@partial(ADMISSION.register, "queue-aware")
def _queue_aware(context: PolicyContext, *, check: int = 32, oldest_floor: float = 0.10, oldest_ceiling: float = 0.60,
                 age_budget_s: float = 2.0, pioneer_tokens: int = 4096, window: int = 1024) -> AdmissionPolicy:
    """PEEK's cluster-aware order over the pending tree: pioneers first, clusters together, an
    oldest-first lane with a floor; status-aware loading"""
    return QueueAwareAdmission(context.tree, context.clock, check=check, oldest_floor=oldest_floor,
                               oldest_ceiling=oldest_ceiling, age_budget_s=age_budget_s,
                               pioneer_tokens=pioneer_tokens, window=window)
