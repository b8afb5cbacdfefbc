"""Discrete-event simulation: a clock, an event heap, N replicas, and the workflow clients that drive
them. Deterministic: events at equal times run in the order they were scheduled.

The simulation plays the router's part too: it keeps every client's step graph state, pins each
workflow to one replica (round-robin placement; prefix-affinity routing arrives with the Ray router)
and publishes its steps-to-execution and prompts to that replica's `StepBook` only, as the router
hints only the replicas a workflow touched. Each replica plans from what it was told: a fleet-wide
book or broadcast would make every replica re-plan on every workflow's step (work growing with
replicas x workflows) and let unrelated workflows' pace drive a replica's write-backs.
"""

from __future__ import annotations

import functools
import gc
import heapq
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvflow_ray.core.graph import WorkflowSpec, WorkflowState
from kvflow_ray.core.kv_budget import DEFAULT_SCORER, KvBudget, parse_scorer
from kvflow_ray.core.policies import FutureAccesses, StepBook
from kvflow_ray.core.predict import Forecaster
from kvflow_ray.core.radix import Tag
from kvflow_ray.core.reuse import parse_reuse
from kvflow_ray.core.scheduler import PolicyConfig
from kvflow_ray.core.sessions import PAUSES
from kvflow_ray.engines.events import CacheEventLog
from kvflow_ray.engines.sim.profile import Profile
from kvflow_ray.engines.sim.replica import SimReplica, SimRequest
from kvflow_ray.engines.sim.routed import SimRouter

# young objects are collected every 50,000 net allocations instead of Python's 700, the older
# generations as often relative to them as Python's defaults (SGLang takes a `gc_threshold` the same
# way: srt/entrypoints/engine.py)
RUN_GC_THRESHOLD = (50_000, 10, 10)


@contextmanager
def batch_collector() -> Iterator[None]:
    """The collector during a run: young objects collected at `RUN_GC_THRESHOLD`, restored
    afterwards. With Python's defaults a 32-replica fleet run spent a fifth of its time in
    collections scanning the simulated replicas' caches, and the pauses fell inside whatever ran,
    the router's decisions included, whose latency the run reports: a real router's process holds
    no simulated fleet. (Freezing the heap built before the run as well, as SGLang's `freeze_gc`
    does after warm-up, measured no better and needs a full collection first, or it freezes the
    cyclic garbage earlier runs left.)"""
    threshold = gc.get_threshold()
    gc.set_threshold(*RUN_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


@dataclass
class ClientPlan:
    """One workflow instance to drive: its graph, agents' fixed prompts and request shapes."""

    key: str
    spec: WorkflowSpec
    prompts: dict[str, tuple[int, ...]]
    dynamic: int
    output: int
    iterations: int
    warmup: int = 0
    start_at: float = 0.0
    salt: str = ""  # its requests' cache namespace (its tenant's, when routed as one of many tenants)
    # the application's true choices at its `next: one` agents (None: the spec's weights)
    branching: Branching | None = None
    # agents that read their predecessors' outputs (docs/design.md §12): set, each call's prompt carries,
    # after its dynamic suffix, the latest output of each of its predecessors, reused by this method
    # (`core.reuse`; "exact" computes them); None: prompts carry no outputs
    reuse: str | None = None


@dataclass
class Branching:
    """How a simulated application really chooses at its `next: one` agents: per chooser, weights
    over its successors (a chooser missing here follows the spec's weights); from the `switch_at`-th
    workflow instance started under this object on (shared by the clients of a scenario), `later`
    weights apply instead (a drifting mix)."""

    weights: dict[str, dict[str, float]] = field(default_factory=dict)
    later: dict[str, dict[str, float]] | None = None
    switch_at: int = 0
    instances: int = 0  # instances started so far

    def odds(self, spec: WorkflowSpec, chooser: str) -> dict[str, float]:
        table = self.later if self.later is not None and self.instances > self.switch_at else self.weights
        return table.get(chooser) or spec.priors(chooser)


def own_branching(plan: ClientPlan, copies: dict[int, Branching]) -> Branching:
    """A run's own copy of the plan's `Branching` (one per original, shared by the run's clients as the
    original is by the scenario's plans), so each run counts its instances from zero."""
    if plan.branching is None:
        return Branching()
    key = id(plan.branching)
    if key not in copies:
        copies[key] = replace(plan.branching, instances=0)
    return copies[key]


class KnownChoices:
    """The choices a client will make next, as a `predict.ChoiceModel` (the oracle's)."""

    def __init__(self, upcoming: dict[str, str]) -> None:
        self.upcoming = upcoming

    def transitions(self, spec: WorkflowSpec, history: Sequence[str] = ()) -> dict[str, dict[str, float]]:
        return {u: {v: 1.0} for u, v in self.upcoming.items()}


@dataclass
class IterationRecord:
    client: str
    index: int
    start: float
    end: float
    measured: bool

    @property
    def latency(self) -> float:
        return self.end - self.start


class TokenSource:
    """Fresh token ids: every dynamic suffix and output is unique, so only fixed prompts are reused."""

    def __init__(self, start: int = 1_000_000) -> None:
        self.next = start

    def fresh(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


class Simulation:
    def __init__(self, profile: Profile, policy: PolicyConfig, *, replicas: int = 1, horizon: int = 1,
                 max_inflight: int = 4, future: list[Tag] | None = None,
                 gpu_capacity: int | None = None, routing: str | None = None, seed: int = 0,
                 kv_budget: KvBudget | None = None, kv_scorer: str = DEFAULT_SCORER) -> None:
        """`routing`: a `core.routing` policy: every call goes through the serving router
        (`routed.SimRouter`). None: each workflow stays on one replica, assigned in turn, and its
        steps and prompts go to that replica alone (the router's part without the router).
        `kv_budget`: every call's private KV capped, its keys scored by `kv_scorer` (docs/design.md §13)."""
        if replicas < 1:
            raise ValueError("a simulation needs at least one replica")
        self.profile = profile
        self.policy = policy
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.future = FutureAccesses(future or []) if policy.oracle else None
        if policy.oracle and future is None:
            raise ValueError(f"{policy.name} needs the future access sequence (run another policy first)")
        # one pause model for the fleet: what a session's pause teaches serves every replica
        self.pauses = PAUSES.create(policy.pauses)
        self.replicas = [
            SimReplica(self, i, profile, policy, StepBook(near_horizon=max(horizon, 2)), future=self.future,
                       horizon=horizon, max_inflight=max_inflight, gpu_capacity=gpu_capacity,
                       events=None if routing is None else CacheEventLog(), pauses=self.pauses,
                       kv_budget=kv_budget, kv_queries=parse_scorer(kv_scorer).buffered)
            for i in range(replicas)
        ]
        self.router = None if routing is None else SimRouter(self, routing, seed)
        self.forecast = Forecaster(policy.prediction)
        self._branchings: dict[int, Branching] = {}  # this run's copy of each scenario's Branching
        self._placement: dict[str, int] = {}
        self.trace: list[Tag] = []  # agent invocations in arrival order (the belady oracle's input)
        self.tokens = TokenSource()
        self.iterations: list[IterationRecord] = []
        self.measuring = False
        self._rid = 0
        self.live_log: list[tuple[float, int]] = []  # agent sessions' live history tokens: (time, change)

    # ------------------------------------------------------------------ event loop
    def at(self, time: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, self._seq, fn))

    def pending_events(self) -> int:
        """Events scheduled and not yet run (a probe reschedules itself only while others remain)."""
        return len(self._events)

    def run(self, max_events: int = 50_000_000) -> None:
        with batch_collector():
            for _ in range(max_events):
                if not self._events:
                    break
                time, _seq, fn = heapq.heappop(self._events)
                self.now = time
                fn()
            else:
                raise RuntimeError(f"simulation did not finish within {max_events} events")
        stuck = [r for rep in self.replicas for r in rep.waiting + rep.running]
        if stuck:  # nothing left to happen, yet requests remain: a scheduling deadlock, never a result
            raise RuntimeError(f"simulation stalled at t={self.now:.3f}s with {len(stuck)} unfinished requests "
                               f"(first: agent {stuck[0].agent!r} of {stuck[0].workflow!r})")

    # ------------------------------------------------------------------ router role
    def replica_for(self, workflow: str) -> SimReplica:
        index = self._placement.setdefault(workflow, len(self._placement) % len(self.replicas))
        return self.replicas[index]

    def submit(self, req: SimRequest) -> None:
        self.trace.append((req.workflow, req.agent))
        if self.future is not None:
            self.future.advance(len(self.trace))
        if self.router is not None:
            self.router.submit(req)
        else:
            self.replica_for(req.workflow).submit(req)

    def publish(self, workflow: str, steps: Mapping[str, float]) -> None:
        if self.router is not None:  # the router derives steps from the calls it routes
            return
        replica = self.replica_for(workflow)
        replica.book.set_steps(workflow, steps)
        replica.on_hints()

    def retire(self, workflow: str) -> None:
        if self.router is not None:
            self.router.retire(workflow)
        else:
            self.replica_for(workflow).scheduler.retire([workflow])

    def register_prompts(self, workflow: str, prompts: dict[str, tuple[int, ...]], salt: str = "") -> None:
        if self.router is not None:  # a replica learns them with its first hint of the workflow
            return
        book = self.replica_for(workflow).book
        book.set_salt(workflow, salt)  # its requests' namespace, where prefetch must find the prompts
        for agent, tokens in prompts.items():
            book.register_prompt((workflow, agent), tokens)

    def call(self, client: WorkflowClient, agent: str) -> None:
        self.submit(self.new_request(client, agent))

    def add_client(self, plan: ClientPlan) -> WorkflowClient:
        client = WorkflowClient(self, plan, branching=own_branching(plan, self._branchings))
        if self.router is not None:
            self.router.add_client(plan)
        self.at(plan.start_at, client.begin)
        return client

    def branching_of(self, plan: ClientPlan) -> Branching | None:
        """This run's copy of the plan's `Branching` (its instance count), once a client of it exists."""
        return None if plan.branching is None else self._branchings.get(id(plan.branching))

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def new_request(self, client: WorkflowClient, agent: str) -> SimRequest:
        self._rid += 1
        plan = client.plan
        prompt = plan.prompts[agent]
        output = self.tokens.fresh(max(plan.output, 1))
        head = prompt + self.tokens.fresh(plan.dynamic)
        reads: tuple[int, ...] = ()
        share = 1.0
        if plan.reuse is not None:
            reads = tuple(t for pred in plan.spec.agents[agent].after for t in client.outputs.get(pred, ()))
            client.outputs[agent] = output  # what its successors read (a successor starts after it ends)
            share = _reuse_share(plan.reuse, self.profile.n_layers, max(plan.output, 1))
        return SimRequest(
            rid=self._rid, workflow=plan.key, agent=agent,
            tokens=head + reads, fixed_len=len(prompt), max_new=len(output),
            cache_salt=plan.salt,
            output_tokens=output, measured=client.iteration >= plan.warmup,
            on_done=lambda req: client.on_done(agent),
            # reused outputs' KV is approximate: only the prompt before them joins the tree
            exact_len=len(head) if reads and share < 1.0 else -1, reused=len(reads) if share < 1.0 else 0,
            reuse_share=share,
        )


@functools.lru_cache(maxsize=64)
def _reuse_share(reuse: str, n_layers: int, output: int) -> float:
    """A reused token's compute share under method `reuse` (parsed once per method, not per call)."""
    return parse_reuse(reuse).recomputed_share(n_layers, output)


class ClientHost(Protocol):
    """What a `WorkflowClient` drives: the simulator, or a real engine's benchmark driver. It plays
    the router's part (publishes steps-to-execution and prompts) and owns the clock."""

    measuring: bool
    iterations: list[IterationRecord]
    forecast: Forecaster  # the steps it publishes: the policy's prediction (`core.predict`)

    @property
    def now(self) -> float: ...

    def register_prompts(self, workflow: str, prompts: dict[str, tuple[int, ...]], salt: str = "") -> None: ...

    def publish(self, workflow: str, steps: Mapping[str, float]) -> None: ...

    def call(self, client: WorkflowClient, agent: str) -> None:
        """Send one request for `agent`; its completion calls `client.on_done(agent)`."""
        ...

    def retire(self, workflow: str) -> None: ...


@dataclass
class WorkflowClient:
    """Runs one workflow instance: starts agents as the step graph allows, one request per agent
    call, and counts an iteration each time the workflow returns to its entry (loops) or drains (DAGs).
    Event-driven: each completion starts the successors it made ready at once (`finish_and_ready`,
    the step `client.loadgen.iteration_stages` takes too, there a whole stage at a time)."""

    sim: ClientHost
    plan: ClientPlan
    state: WorkflowState = field(init=False)
    iteration: int = 0
    iteration_start: float = 0.0
    branching: Branching = field(default_factory=Branching)  # the run's (see `own_branching`)

    def __post_init__(self) -> None:
        self.state = WorkflowState(self.plan.spec, running=[])
        self._entry = set(self.plan.spec.start_agents())
        self.history: list[str] = []  # agents started in this instance, latest last (bounded)
        # the next choice of each `next: one` agent, drawn ahead from the client's own generator, so
        # that every policy sees the same choices and the oracle can know them
        self.rng = random.Random(f"{self.plan.key}")
        self.upcoming: dict[str, str] = {}
        self.outputs: dict[str, tuple[int, ...]] = {}  # agent -> its latest output (read by its successors)

    def begin(self) -> None:
        self.sim.register_prompts(self.plan.key, self.plan.prompts, self.plan.salt)
        self._start_iteration()

    def _start_iteration(self) -> None:
        self.iteration_start = self.sim.now
        if self.iteration >= self.plan.warmup:
            self.sim.measuring = True
        self.state = WorkflowState(self.plan.spec, running=[])
        self.history = []
        self.branching.instances += 1
        self._launch(sorted(self._entry))

    def _launch(self, agents: list[str]) -> None:
        spec = self.plan.spec
        for agent in agents:
            self.history = self.sim.forecast.started(self.plan.salt, spec.name, self.state, self.history, agent)
            self.state.start(agent)
        self._publish()
        for agent in agents:
            self.sim.call(self, agent)

    def _publish(self) -> None:
        plan = self.plan
        truth = KnownChoices(self._upcoming()) if plan.spec.dynamic else None
        self.sim.publish(plan.key, self.sim.forecast.steps(plan.salt, plan.spec.name, self.state, self.history, truth))

    def _upcoming(self) -> dict[str, str]:
        for chooser in self.plan.spec.choosers:
            if chooser not in self.upcoming:
                self.upcoming[chooser] = self._draw(self.branching.odds(self.plan.spec, chooser))
        return self.upcoming

    def _draw(self, odds: Mapping[str, float]) -> str:
        names = list(odds)
        return self.rng.choices(names, weights=[odds[v] for v in names])[0]

    def _choose(self, chooser: str, ready: list[str]) -> list[str]:
        """A `next: one` agent finished: exactly one of its ready successors runs (the drawn one)."""
        if not ready:
            return ready
        picked = self._upcoming()[chooser]
        del self.upcoming[chooser]
        if picked not in ready:  # that successor cannot run now (max_iterations): another by weight
            odds = self.branching.odds(self.plan.spec, chooser)
            picked = self._draw({v: odds.get(v, 1.0) for v in ready})
        return [picked]

    def _end_iteration(self) -> bool:
        """Record the iteration; True if another one follows."""
        self.sim.iterations.append(IterationRecord(self.plan.key, self.iteration, self.iteration_start,
                                                   self.sim.now, self.iteration >= self.plan.warmup))
        self.iteration += 1
        self.iteration_start = self.sim.now
        return self.iteration < self.plan.iterations

    def on_done(self, agent: str) -> None:
        state = self.state
        ready = state.finish_and_ready(agent)
        if agent in self.plan.spec.choosers:
            ready = self._choose(agent, state.choices(agent))
        loop_back = [v for v in ready if v in self._entry]
        if loop_back:  # back at the entry: one pass of the loop is done
            if self._end_iteration():
                if self.iteration >= self.plan.warmup:
                    self.sim.measuring = True
            else:
                ready = [v for v in ready if v not in self._entry]
        if ready:
            self._launch(ready)
            return
        if state.running:
            self._publish()
            return
        # drained: a DAG pass finished (or the loop's last pass)
        if not loop_back and self._end_iteration():
            self._start_iteration()
            return
        self.sim.retire(self.plan.key)
