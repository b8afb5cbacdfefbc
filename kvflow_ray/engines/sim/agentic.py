"""The `agentic` scenario: agent sessions whose history grows turn by turn across tool pauses.

Each session is an application's agent (a system prompt with tool schemas of 4-8k tokens, shared by
the application's sessions) given a task; each of its 5-30 turns adds a tool result of 200-4,000
tokens and 100-500 output tokens, and ends in a tool call the client runs for the tool's drawn
duration (heavy-tailed, bimodal per tool: `ls` about 0.2 s, test runs and builds 5-120 s). Sessions
arrive as a Poisson process. In the `planner` variant a planner's `spawn` tool starts sub-agent
sessions and its pause lasts until they all finish.

A job's completion time is its first turn's arrival to its last turn's end (the scenario's
`IterationRecord`s). `--pressure` sets the device pool: the live histories' time-averaged size,
measured by a run without capacity limit, over the fleet's device KV (`pressure_capacity`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvflow_ray.core.sessions import SESSION_AGENT, SessionTurn
from kvflow_ray.engines.sim.replica import SimRequest
from kvflow_ray.engines.sim.simulator import IterationRecord, TokenSource
from kvflow_ray.engines.sim.workload import Scenario

# name -> ((fast median s, slow median s), probability of the slow mode); each mode lognormal (sigma 0.6)
TOOLS: dict[str, tuple[tuple[float, float], float]] = {
    "ls": ((0.2, 2.0), 0.05),
    "cat": ((0.2, 1.5), 0.05),
    "grep": ((0.4, 3.0), 0.1),
    "edit": ((0.8, 4.0), 0.1),
    "python": ((2.0, 20.0), 0.2),
    "run_tests": ((8.0, 90.0), 0.35),
    "build": ((15.0, 120.0), 0.3),
}
SIGMA = 0.6
MAX_PAUSE_S = 300.0


def draw_pause(rng: random.Random, tool: str) -> float:
    (fast, slow), p_slow = TOOLS[tool]
    median = slow if rng.random() < p_slow else fast
    return min(MAX_PAUSE_S, max(0.05, median * math.exp(rng.gauss(0.0, SIGMA))))


@dataclass(frozen=True)
class TurnPlan:
    added: int  # new tokens this turn brings (the task, or the previous tool's result)
    output: int
    tool: str  # the tool its output calls ("" on the last turn)
    pause: float  # the tool's true duration (0 on the last turn)


@dataclass
class SessionPlan:
    key: str
    tenant: str
    agent: str  # the application's agent (its pauses are learned per tenant, agent and tool)
    system: tuple[int, ...]
    turns: list[TurnPlan]
    start_at: float = 0.0
    hint_s: float | None = None
    spawn: list[SessionPlan] = field(default_factory=list)  # planner: sub-agents its `spawn` turn starts


class SessionHost(Protocol):
    """What a `SessionClient` drives (`simulator.Simulation`, the CPU engine's `EngineDriver`): the
    clock, events and submission."""

    @property
    def now(self) -> float: ...

    iterations: list[IterationRecord]
    measuring: bool
    live_log: list[tuple[float, int]]  # (time, change of the live histories' tokens)

    def at(self, time: float, fn: Callable[[], None]) -> None: ...

    def submit(self, req: SimRequest) -> None: ...

    def next_rid(self) -> int: ...


class SessionClient:
    """Runs one session: a turn's request is the history so far plus the tokens the turn adds; when it
    ends, the client runs the tool (waits its true duration, or for its sub-agents) and sends the next."""

    def __init__(self, sim: SessionHost, plan: SessionPlan, tokens: TokenSource,
                 on_close: Callable[[SessionClient], None] | None = None) -> None:
        self.sim, self.plan, self.tokens, self.on_close = sim, plan, tokens, on_close
        self.history: tuple[int, ...] = plan.system
        self.turn = 0
        self.opened = 0.0
        self.children_left = 0

    def begin(self) -> None:
        self.opened = self.sim.now
        self.sim.measuring = True
        self.sim.live_log.append((self.sim.now, len(self.history)))
        self._send()

    def _send(self) -> None:
        plan, turn = self.plan, self.plan.turns[self.turn]
        last = self.turn == len(plan.turns) - 1
        output = self.tokens.fresh(turn.output)
        req = SimRequest(
            rid=self.sim.next_rid(), workflow=plan.key, agent=SESSION_AGENT,
            tokens=self.history + self.tokens.fresh(turn.added), fixed_len=-1, max_new=len(output),
            cache_salt=plan.tenant, output_tokens=output,
            session=SessionTurn(tenant=plan.tenant, agent=plan.agent, tool=turn.tool, hint_s=plan.hint_s,
                                final=last, true_pause_s=self._true_pause(turn, last)),
            on_done=self._done)
        self.sim.submit(req)

    def _true_pause(self, turn: TurnPlan, last: bool) -> float | None:
        """What the pause oracle knows: the tool's drawn duration (not a wait for sub-agents)."""
        return None if last or (turn.tool == "spawn" and self.plan.spawn) else turn.pause

    def _done(self, req: SimRequest) -> None:
        self.sim.live_log.append((self.sim.now, len(req.tokens) + len(req.output_tokens) - len(self.history)))
        self.history = req.tokens + req.output_tokens
        turn = self.plan.turns[self.turn]
        self.turn += 1
        if self.turn == len(self.plan.turns):
            self.sim.live_log.append((self.sim.now, -len(self.history)))
            self.sim.iterations.append(IterationRecord(self.plan.key, 0, self.opened, self.sim.now, True))
            if self.on_close is not None:
                self.on_close(self)
            return
        if turn.tool == "spawn" and self.plan.spawn:
            self.children_left = len(self.plan.spawn)
            for child in self.plan.spawn:
                client = SessionClient(self.sim, child, self.tokens, on_close=self._child_closed)
                self.sim.at(self.sim.now, client.begin)
            return
        self.sim.at(self.sim.now + turn.pause, self._send)

    def _child_closed(self, child: SessionClient) -> None:
        self.children_left -= 1
        if not self.children_left:
            self._send()


@dataclass(frozen=True)
class Shape:
    """Token counts and pause scale of a scenario's sessions (inclusive ranges)."""

    system: tuple[int, int] = (4096, 8192)
    task: tuple[int, int] = (200, 800)
    result: tuple[int, int] = (200, 4000)  # log-uniform
    output: tuple[int, int] = (100, 500)
    turns: tuple[int, int] = (5, 30)
    pause_scale: float = 1.0


# the same structure at a size the CPU engine runs in minutes: short prompts and turns, pauses / 20
_SMALL = Shape(system=(256, 512), task=(32, 64), result=(32, 128), output=(8, 16), turns=(3, 6), pause_scale=0.05)
SHAPES = {
    "standard": Shape(),  # the agent sessions (SWE-bench-like)
    "small": _SMALL,
    # the small shape with pauses / 10 more: a smoke run's sessions, whose wall clock is mostly their pauses
    "tiny": replace(_SMALL, pause_scale=_SMALL.pause_scale / 10),
}


def _turns(rng: random.Random, tools: list[str], weights: list[float], n: int, task: int, shape: Shape
           ) -> list[TurnPlan]:
    out = []
    low, high = shape.result
    for i in range(n):
        added = task if i == 0 else int(math.exp(rng.uniform(math.log(low), math.log(high))))
        last = i == n - 1
        tool = "" if last else rng.choices(tools, weights=weights)[0]
        pause = 0.0 if last else draw_pause(rng, tool) * shape.pause_scale
        out.append(TurnPlan(added, rng.randint(*shape.output), tool, pause))
    return out


def agentic_sessions(sessions: int = 64, apps: int = 4, tenants: int = 2, rate: float | None = None,
                     variant: str = "single", shape: str = "standard", hint_s: float | None = None,
                     seed: int = 0) -> list[SessionPlan]:
    """The sessions of the scenario, arrivals at `rate` per second (default: `sessions` per minute, in
    the shape's time scale)."""
    for name, value in (("sessions", sessions), ("apps", apps), ("tenants", tenants)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    if shape not in SHAPES:
        raise ValueError(f"--shape: one of {', '.join(SHAPES)}, got {shape!r}")
    form = SHAPES[shape]
    if variant not in ("single", "planner"):
        raise ValueError(f"--variant: single or planner, got {variant!r}")
    rng = random.Random(f"agentic-{seed}")
    source = TokenSource(start=10_000_000)
    names = list(TOOLS)
    apps_tools = []
    for a in range(apps):
        weights = [rng.uniform(0.2, 1.0) for _ in names]
        apps_tools.append((f"t{a % tenants}", f"app{a}", source.fresh(rng.randint(*form.system)), weights))
    rate = sessions / (60.0 * form.pause_scale) if rate is None else rate
    if rate <= 0:
        raise ValueError(f"--rate must be positive, got {rate}")
    plans, t = [], 0.0
    for s in range(sessions):
        t += rng.expovariate(rate)
        tenant, agent, system, weights = apps_tools[s % apps]
        n = rng.randint(*form.turns)
        plan = SessionPlan(f"{tenant}/s{s}", tenant, agent, system,
                           _turns(rng, names, weights, n, rng.randint(*form.task), form), start_at=t, hint_s=hint_s)
        if variant == "planner":
            spawn_at = rng.randint(0, n - 2) if n > 1 else 0
            turns = list(plan.turns)
            turns[spawn_at] = TurnPlan(turns[spawn_at].added, turns[spawn_at].output, "spawn", 0.0)
            plan.turns = turns
            plan.spawn = [SessionPlan(f"{plan.key}.sub{c}", tenant, f"{agent}-sub", system,
                                      _turns(rng, names, weights, rng.randint(2, max(2, form.turns[1] // 5)),
                                             rng.randint(*form.task), form))
                          for c in range(rng.randint(2, 4))]
        plans.append(plan)
    return plans


def live_tokens_mean(records: list[tuple[float, int]]) -> float:
    """Time-averaged sum of live history tokens from (time, change) events, over the span they cover."""
    if not records:
        return 0.0
    records = sorted(records)
    area, level, last = 0.0, 0, records[0][0]
    for time, change in records:
        area += level * (time - last)
        level, last = level + change, time
    span = records[-1][0] - records[0][0]
    return area / span if span > 0 else 0.0


def agentic(sessions: int = 64, pressure: float | None = 2.0, apps: int = 4, tenants: int = 2,
            rate: float | None = None, variant: str = "single", shape: str = "standard", hint_s: float | None = None,
            seed: int = 0) -> Scenario:
    """The scenario; `pressure`: the simulator sets the device pool from it (`runner.pressure_capacity`)
    unless given one; None: the pool is the engine's own."""
    if pressure is not None and pressure <= 0:
        raise ValueError(f"--pressure must be positive, got {pressure}")
    plans = agentic_sessions(sessions, apps, tenants, rate, variant, shape, hint_s, seed)
    return Scenario("agentic", [], dict(sessions=sessions, pressure=pressure, apps=apps, tenants=tenants,
                                        rate=rate, variant=variant, shape=shape, hint_s=hint_s, seed=seed),
                    sessions=plans)


def turns_of(plans: list[SessionPlan]) -> int:
    """Requests the sessions make (sub-agents' included)."""
    return sum(len(plan.turns) + turns_of(plan.spawn) for plan in plans)


def largest_need(plans: list[SessionPlan]) -> int:
    """The most device KV one turn of these sessions needs (its prompt and output)."""
    need = 0
    for plan in plans:
        history = len(plan.system)
        for turn in plan.turns:
            need = max(need, history + turn.added + turn.output)
            history += turn.added + turn.output
        need = max(need, largest_need(plan.spawn))
    return need
