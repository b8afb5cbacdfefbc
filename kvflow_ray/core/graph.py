"""Agent Step Graph: workflow spec loading/validation and steps-to-execution (docs/design.md §3, §6).

A workflow spec names agents and, for each, the agents it runs after (``after``) and how it joins
them (``join: all`` = barrier, ``join: any`` = branch). An agent with ``next: one`` hands over to
exactly one of its successors, chosen at run time (``weights``: priors over them); ``max_iterations``
bounds how often an agent runs per instance. A :class:`WorkflowState` is the live state of one running
instance of a workflow; :meth:`WorkflowState.steps_to_execution` turns it into E values, the number
of steps until each agent runs next, which the cache policies use as eviction priority, and
:meth:`WorkflowState.expected_steps` weighs the exclusive choices by their probabilities.

Pure Python on purpose: the router, every engine and the simulator all import this module, and none
of them should pay for torch/ray/numpy just to read a workflow.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvflow_ray.core.reuse import parse_reuse
from kvflow_ray.core.safe_yaml import (
    MAX_CONFIG_FILE_BYTES,
    TextFileError,
    decode_utf8,
    describe_yaml_error,
    load_yaml,
    read_text_file,
)

__all__ = [
    "AGENT_KEYS",
    "JOINS",
    "KEY_PART_PATTERN",
    "KEY_PART_RE",
    "MAX_PROMPT_FILE_BYTES",
    "MAX_SPEC_FILE_BYTES",
    "NAME_PATTERN",
    "NAME_RE",
    "NEXTS",
    "TOP_LEVEL_KEYS",
    "AgentSpec",
    "SpecError",
    "SpecLimitError",
    "SpecLimits",
    "Transitions",
    "UnknownAgentError",
    "WorkflowSpec",
    "WorkflowState",
    "is_name",
    "load_spec",
    "loads_spec",
    "parse_spec",
]

# The two name rules of the system, side by side because one is built on the other. Both use only
# characters that need no escaping in Redis keys, Prometheus labels and URLs, and neither contains
# ':' (the key separator), so no name can reach into another key's namespace.
# - NAME_PATTERN: workflow and agent names of a spec.
# - KEY_PART_PATTERN: every part of a store key (tenants, client ids, template names, replica names,
#   prefix hashes). Wider on purpose: a replaced template is kept as `name@version` (16 hex digits),
#   so '@' is reserved as that separator (a spec name never holds it) and 128 leaves room for a
#   64-character name plus its version.
NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
KEY_PART_PATTERN = r"[A-Za-z0-9_.@-]{1,128}"
NAME_RE = re.compile(NAME_PATTERN)
KEY_PART_RE = re.compile(KEY_PART_PATTERN)


def is_name(value: object, rule: re.Pattern[str] = NAME_RE) -> bool:
    """Whether `value` is a string that `rule` (NAME_RE or KEY_PART_RE) matches in full."""
    return isinstance(value, str) and rule.fullmatch(value) is not None

TOP_LEVEL_KEYS: tuple[str, ...] = ("name", "entry", "agents", "description", "task", "reuse")
AGENT_KEYS: tuple[str, ...] = ("prompt", "prompt_file", "after", "join", "next", "weights", "max_iterations",
                                "description")
JOINS: tuple[str, ...] = ("all", "any")
NEXTS: tuple[str, ...] = ("all", "one")  # all: every ready successor runs; one: exactly one of them

# agent -> successor -> probability that the agent hands over to it (the `next: one` agents only; an
# agent missing here uses its spec's weights)
Transitions = Mapping[str, Mapping[str, float]]

# What a spec file may read from disk: the spec itself, and each `prompt_file` (a regular file inside
# the spec's folder). Bounded so that a mistaken path (a log, /dev/zero) cannot fill memory.
MAX_SPEC_FILE_BYTES = MAX_CONFIG_FILE_BYTES  # 4 MiB
MAX_PROMPT_FILE_BYTES = 1024 * 1024  # 1 MiB per prompt file
STEPS_MEMO = 1024  # states per spec whose steps-to-execution are remembered


class SpecError(ValueError):
    """An invalid workflow spec. ``field`` is the dotted path of the offending value
    (``"agents.executor.after[0]"``) so a user can find it in the file without guessing."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (it crosses Ray process boundaries)
        return (type(self), (self.field, self.message))


class SpecLimitError(SpecError):
    """A well-formed spec that exceeds a :class:`SpecLimits` bound (an HTTP layer answers 4xx naming
    it). ``limit`` is the setting's name as the message shows it, ``maximum`` its value and ``actual``
    what the spec has (for prompt bytes: the running total when the limit was crossed)."""

    def __init__(self, field: str, message: str, limit: str, maximum: int, actual: int) -> None:
        super().__init__(field, message)
        self.limit = limit
        self.maximum = maximum
        self.actual = actual

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.message, self.limit, self.maximum, self.actual))


@dataclass(frozen=True)
class SpecLimits:
    """Size bounds for specs from untrusted sources (``POST /v1/workflows``, inline ``workflow_spec``).

    ``max_agents``: agents per spec, checked before any agent is parsed. ``max_prompt_bytes``: the
    UTF-8 bytes of all agent prompts of the spec together (a per-spec total, so many medium prompts
    cannot add up to a huge template; descriptions and names are not counted, the request body cap
    bounds those). The ``*_setting`` names are what error messages call each limit, so a server can
    name its own config keys (``"limits.max_agents_per_spec"``).
    """

    max_agents: int
    max_prompt_bytes: int
    max_agents_setting: str = "max_agents"
    max_prompt_bytes_setting: str = "max_prompt_bytes"

    def __post_init__(self) -> None:
        for name in ("max_agents", "max_prompt_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpecLimits.{name} must be a positive integer, got {value!r}")


class UnknownAgentError(KeyError, ValueError):
    """A live-state operation named an agent that the workflow does not have.

    Subclasses both KeyError (it is a failed lookup) and ValueError (it is bad input from a request),
    so callers can catch whichever reads naturally at their level.
    """

    def __init__(self, agent: str, workflow: str, known: Iterable[str] = ()) -> None:
        known_list = ", ".join(known)
        message = f"unknown agent {agent!r} in workflow {workflow!r}"
        if known_list:
            message += f" (agents: {known_list})"
        super().__init__(message)
        self.agent = agent
        self.workflow = workflow
        self.known = tuple(known)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (it crosses Ray process boundaries)
        return (type(self), (self.agent, self.workflow, self.known))

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return self.message


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a workflow. ``after`` lists its predecessors in file order."""

    name: str
    prompt: str | None = None
    after: tuple[str, ...] = ()
    join: str = "all"
    description: str | None = None
    next: str = "all"
    # priors over the successors of a `next: one` agent, as (successor, weight) pairs in file order
    weights: tuple[tuple[str, float], ...] = ()
    max_iterations: int | None = None

    def __post_init__(self) -> None:
        # Accept any iterable for convenience in code-built specs; a tuple keeps the object hashable.
        if not isinstance(self.after, tuple):
            object.__setattr__(self, "after", tuple(self.after))
        if isinstance(self.weights, Mapping):
            object.__setattr__(self, "weights", tuple(self.weights.items()))
        where = f"agents.{self.name}"
        if self.join not in JOINS:
            raise SpecError(f"{where}.join", f"must be one of {', '.join(JOINS)}, got {self.join!r}")
        if self.next not in NEXTS:
            raise SpecError(f"{where}.next", f"must be one of {', '.join(NEXTS)}, got {self.next!r}")
        if self.weights and self.next != "one":
            raise SpecError(f"{where}.weights", "needs `next: one` (weights are priors over which successor runs)")
        for successor, weight in self.weights:
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
                raise SpecError(f"{where}.weights.{successor}", f"must be a positive number, got {weight!r}")
        if self.max_iterations is not None and (
                isinstance(self.max_iterations, bool) or not isinstance(self.max_iterations, int)
                or self.max_iterations < 1):
            raise SpecError(f"{where}.max_iterations", f"must be an integer >= 1, got {self.max_iterations!r}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        out["after"] = list(self.after)
        out["join"] = self.join
        if self.next != "all":
            out["next"] = self.next
        if self.weights:
            out["weights"] = dict(self.weights)
        if self.max_iterations is not None:
            out["max_iterations"] = self.max_iterations
        if self.description is not None:
            out["description"] = self.description
        return out


@dataclass(frozen=True)
class WorkflowSpec:
    """A validated workflow. Constructing one directly runs the same structural checks as
    :func:`parse_spec`, so every ``WorkflowSpec`` in the system is known to be well formed.

    ``agents`` keeps the file's order (outputs list agents in that order); treat it as read-only,
    because the successor lists below are derived from it once.
    """

    name: str
    entry: str | None
    agents: dict[str, AgentSpec]
    description: str | None = None
    task: str | None = None  # a sample request the workflow serves (`kvflow-ray run` sends it); in no prompt
    # how its agents' calls reuse earlier agents' outputs beyond the prefix (`core.reuse`, docs/design.md
    # §12): None leaves it to the call's `kvflow.reuse`, else the tenant's default (exact)
    reuse: str | None = None
    # Derived once here because steps_to_execution runs on every agent transition of every live
    # workflow; recomputing successors there would dominate its cost.
    _successors: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _start: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # agent -> the `next: one` agents among its predecessors (whose other alternatives lose their
    # arrival when it starts)
    _exclusive_after: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    # agent -> successor -> prior probability, for the `next: one` agents
    _priors: dict[str, dict[str, float]] = field(init=False, repr=False, compare=False)
    # agent -> the agents reachable from it (itself included), for agents with `max_iterations` in a
    # spec that has any (an exhausted chooser leaves its loop through a successor outside it)
    _reaches: dict[str, frozenset[str]] = field(init=False, repr=False, compare=False)
    # steps_to_execution by state (running agents, arrivals): a workflow cycles through few states,
    # and thousands of live instances share one spec
    _steps_memo: dict[tuple[frozenset[str], frozenset[tuple[str, frozenset[str]]]], dict[str, float]] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_name("name", self.name)
        if not self.agents:
            raise SpecError("agents", "must define at least one agent")
        succ: dict[str, list[str]] = {name: [] for name in self.agents}
        for key, agent in self.agents.items():
            _check_name(f"agents.{key}", key)
            if agent.name != key:
                raise SpecError(f"agents.{key}", f"AgentSpec.name {agent.name!r} does not match its key")
            seen: set[str] = set()
            for i, pred in enumerate(agent.after):
                where = f"agents.{key}.after[{i}]"
                if pred not in self.agents:
                    raise SpecError(where, f"unknown agent {pred!r}")
                if pred in seen:
                    raise SpecError(where, f"duplicate predecessor {pred!r}")
                seen.add(pred)
                succ[pred].append(key)
        object.__setattr__(self, "_successors", {k: tuple(v) for k, v in succ.items()})
        priors: dict[str, dict[str, float]] = {}
        for key, agent in self.agents.items():
            if agent.next != "one":
                continue
            given = dict(agent.weights)
            for successor in given:
                if successor not in succ[key]:
                    raise SpecError(f"agents.{key}.weights.{successor}",
                                    f"{successor!r} is not a successor of {key!r} (successors: "
                                    f"{', '.join(succ[key]) or 'none'})")
            raw = {v: float(given.get(v, 1.0)) for v in succ[key]}
            total = sum(raw.values())
            priors[key] = {v: w / total for v, w in raw.items()}
        object.__setattr__(self, "_priors", priors)
        reaches: dict[str, frozenset[str]] = {}
        if any(agent.max_iterations is not None for agent in self.agents.values()):
            for key in self.agents:
                seen = {key}
                todo = [key]
                while todo:
                    for nxt in succ[todo.pop()]:
                        if nxt not in seen:
                            seen.add(nxt)
                            todo.append(nxt)
                reaches[key] = frozenset(seen)
        object.__setattr__(self, "_reaches", reaches)
        object.__setattr__(self, "_exclusive_after", {
            key: tuple(u for u in agent.after if u in priors) for key, agent in self.agents.items()})

        if self.entry is not None:
            if self.entry not in self.agents:
                raise SpecError("entry", f"unknown agent {self.entry!r}")
            start: tuple[str, ...] = (self.entry,)
        else:
            start = tuple(name for name, agent in self.agents.items() if not agent.after)
            if not start:
                raise SpecError(
                    "entry", "required when every agent has a predecessor (the workflow is a loop)"
                )
        object.__setattr__(self, "_start", start)
        object.__setattr__(self, "_steps_memo", {})

        # An agent no start agent leads to can never run: almost always a typo in `after`.
        reached = set(start)
        frontier = list(start)
        while frontier:
            for nxt in self._successors[frontier.pop()]:
                if nxt not in reached:
                    reached.add(nxt)
                    frontier.append(nxt)
        for name in self.agents:
            if name not in reached:
                if self.entry is not None:
                    origin = f"the entry {self.entry!r}"
                else:
                    origin = f"the entry (start agents, those without `after`: {', '.join(start)})"
                raise SpecError(f"agents.{name}", f"unreachable from {origin}")

    def successors(self, agent: str) -> tuple[str, ...]:
        """Agents that list ``agent`` in their ``after``, in file order."""
        try:
            return self._successors[agent]
        except KeyError:
            raise UnknownAgentError(agent, self.name, self.agents) from None

    def start_agents(self) -> tuple[str, ...]:
        """Where a new instance begins: the entry if given, else every agent without predecessors."""
        return self._start

    def priors(self, agent: str) -> dict[str, float]:
        """The spec's probability of each successor of a `next: one` agent (its weights, normalised;
        a successor without a weight counts 1); empty for an agent whose successors all run."""
        return self._priors.get(agent, {})

    @property
    def dynamic(self) -> bool:
        """Whether any agent chooses one successor at run time (`next: one`)."""
        return bool(self._priors)

    @property
    def choosers(self) -> tuple[str, ...]:
        """The `next: one` agents, in file order."""
        return tuple(self._priors)

    def choosers_before(self, agent: str) -> tuple[str, ...]:
        """The `next: one` agents among `agent`'s predecessors."""
        return self._exclusive_after[agent]

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :func:`parse_spec` turns back into an equal spec (prompt files are inlined)."""
        out: dict[str, Any] = {"name": self.name}
        if self.entry is not None:
            out["entry"] = self.entry
        if self.description is not None:
            out["description"] = self.description
        if self.task is not None:
            out["task"] = self.task
        if self.reuse is not None:
            out["reuse"] = self.reuse
        out["agents"] = {name: agent.to_dict() for name, agent in self.agents.items()}
        return out


class WorkflowState:
    """Live state of ONE workflow instance: which agents run now, and which predecessors have
    already arrived at each barrier.

    ``arrived[v]`` holds the predecessors of ``v`` that finished since ``v`` last started. It is what
    makes a barrier remember partial progress: in A → {B, C} → D, once B finished only C still holds
    D back, so D is one step away while C runs instead of looking unreachable.
    """

    __slots__ = ("arrived", "running", "runs", "spec")

    def __init__(self, spec: WorkflowSpec, running: Iterable[str] | None = None) -> None:
        self.spec = spec
        # Only agents with at least one arrival have an entry, which keeps copies cheap.
        self.arrived: dict[str, set[str]] = {}
        # how often each agent with `max_iterations` has started in this instance
        self.runs: dict[str, int] = {}
        self.running: set[str] = set()
        for agent in spec.start_agents() if running is None else running:
            self._check(agent)
            self._count(agent)
            self.running.add(agent)

    def _check(self, agent: str) -> None:
        if agent not in self.spec.agents:
            raise UnknownAgentError(agent, self.spec.name, self.spec.agents)

    def _count(self, agent: str) -> None:
        if self.spec.agents[agent].max_iterations is not None:
            self.runs[agent] = self.runs.get(agent, 0) + 1

    def start(self, agent: str) -> None:
        """``agent`` begins executing; the arrivals it was waiting for are consumed. An arrival from a
        `next: one` predecessor was a choice among alternatives: starting this one withdraws it from
        the others, which are no longer one step away."""
        self._check(agent)
        self.running.add(agent)
        self._count(agent)
        got = self.arrived.pop(agent, None)
        if got:
            arrived = self.arrived
            for chooser in self.spec._exclusive_after[agent]:
                if chooser not in got:
                    continue
                for other in self.spec._successors[chooser]:
                    others = arrived.get(other)
                    if others is not None:
                        others.discard(chooser)
                        if not others:
                            del arrived[other]

    def exhausted(self, agent: str) -> bool:
        """Whether ``agent`` has run its `max_iterations` in this instance (it cannot run again)."""
        limit = self.spec.agents[agent].max_iterations
        return limit is not None and self.runs.get(agent, 0) >= limit

    def finish(self, agent: str) -> None:
        """``agent`` completed. Also accepted for an agent not marked running, because a router that
        missed a start event should still record the completion rather than fail the request."""
        self._check(agent)
        self.running.discard(agent)
        arrived = self.arrived
        for succ in self.spec._successors[agent]:
            got = arrived.get(succ)
            if got is None:
                arrived[succ] = {agent}
            else:
                got.add(agent)

    def ready(self, agent: str) -> bool:
        """Whether ``agent`` may start now: every predecessor arrived (``join: all``) or any one did
        (``join: any``). A workflow driver asks this after each ``finish`` for the successors."""
        self._check(agent)
        spec = self.spec.agents[agent]
        got = self.arrived.get(agent)
        if not got or self.exhausted(agent):
            return False
        return spec.join == "any" or all(u in got for u in spec.after)

    def finish_and_ready(self, agent: str) -> list[str]:
        """The step of every walk of the graph: ``finish(agent)``, then the successors of ``agent``
        that may start now and are not running, in file order. Starting them (``start``) is the
        caller's move, and so is reading a start agent in the list as a return to the entry (one
        pass of a loop over)."""
        self.finish(agent)
        return self._ready_after(agent)

    def _ready_after(self, agent: str) -> list[str]:
        """The successors of ``agent`` that may start now and are not running, in file order."""
        return [v for v in self.spec._successors[agent] if v not in self.running and self.ready(v)]

    def choices(self, agent: str) -> list[str]:
        """After a `next: one` agent finished: the successors it may hand over to (ready, not running,
        not exhausted), in file order; the caller starts exactly one of them. An agent that has run its
        `max_iterations` leaves its loop: only the successors it cannot come back through remain
        (when there are any), so the walk goes on to the exit instead of stalling at the limit."""
        ready = self._ready_after(agent)
        if self.exhausted(agent):
            exits = [v for v in ready if agent not in self.spec._reaches[v]]
            return exits or ready
        return ready

    def steps_to_execution(self) -> dict[str, float]:
        """E value of every agent, in spec order: 0 when running, ``math.inf`` when it cannot run
        again, otherwise f(E of pending predecessors) + 1 with f = max (``join: all``) or min
        (``join: any``). Finite values are ints.

        Loops make this a fixed-point problem. We take the greatest fixed point by starting every
        non-running agent at ∞ and only ever lowering values (a worklist form of Bellman-Ford): an
        agent whose only way to run is through itself stays at ∞ instead of getting a made-up value.
        Termination: a value only drops when a predecessor's value dropped, and tracing any finite
        value back through the evaluations that produced it visits distinct agents (a later value of
        an agent is never larger than an earlier one), so finite values are <= len(agents) and each
        agent is lowered at most len(agents) + 1 times. Typical DAGs settle in one pass.

        Every alternative of a `next: one` agent is one step away after it finished, until one of
        them starts; an agent that ran its `max_iterations` is at ∞.

        The values depend on the state alone, so each spec remembers them per state (up to
        `STEPS_MEMO` states); the caller gets its own copy.
        """
        key = self._memo_key()
        memo = self.spec._steps_memo
        e = memo.get(key)
        if e is None:
            e = self._distances(None, weighted=False)[0]
            if len(memo) >= STEPS_MEMO:
                memo.clear()
            memo[key] = e
        return dict(e)

    def expected_steps(self, transitions: Transitions | None = None) -> dict[str, float]:
        """Like :meth:`steps_to_execution`, with the exclusive choices weighed: the step from a `next:
        one` agent u to a successor v it picks with probability p counts 1/p (the expected number of
        passes through u until it picks v, were the choice repeated), so the likelier alternative is
        the nearer one and an agent that p = 0 leads to is at ∞ through u. ``transitions`` gives p
        (a learned model's); an agent missing there uses its spec's weights. Without `next: one`
        agents the values equal :meth:`steps_to_execution` (and are those, remembered per state)."""
        if not self.spec.dynamic:
            return self.steps_to_execution()
        return self._distances(transitions)[0]

    def reach_probability(self, transitions: Transitions | None = None) -> dict[str, float]:
        """The probability that each agent runs by the path :meth:`expected_steps` measures (the
        product of the choices along it; 1 for running agents and choice-free paths, 0 at ∞)."""
        return self._distances(transitions)[1]

    def _memo_key(self) -> tuple[frozenset[str], frozenset[tuple[str, frozenset[str]]], frozenset[str]]:
        exhausted = frozenset(a for a in self.runs if self.exhausted(a)) if self.runs else frozenset()
        return (frozenset(self.running), frozenset((v, frozenset(got)) for v, got in self.arrived.items() if got),
                exhausted)

    def _distances(self, transitions: Transitions | None,
                   weighted: bool = True) -> tuple[dict[str, float], dict[str, float]]:
        """(distance, reach probability) of every agent: the worklist below, where an edge from a
        `next: one` agent costs 1/p under the choice probabilities (`transitions` over the spec's
        priors), or, not `weighted`, every edge costs 1 (the graph meaning)."""
        spec = self.spec
        agents = spec.agents
        successors = spec._successors
        running = self.running
        arrived = self.arrived
        inf = math.inf
        choice: dict[str, Mapping[str, float]] = {}
        if weighted:
            priors = spec._priors
            choice = {u: (transitions or {}).get(u) or priors[u] for u in priors}

        def edge(u: str, v: str) -> tuple[float, float]:
            """(cost, probability) of the step u -> v."""
            p = choice[u].get(v, 0.0) if u in choice else 1.0
            return (1.0 / p, p) if p > 0 else (inf, 0.0)

        e: dict[str, float] = {}
        q: dict[str, float] = {}
        work: deque[str] = deque()
        for name in agents:
            if name in running:
                e[name] = 0
                q[name] = 1.0
            else:
                e[name] = inf
                q[name] = 0.0
                work.append(name)
        queued = set(work)

        while work:
            name = work.popleft()
            queued.discard(name)
            agent = agents[name]
            after = agent.after
            if not after or (self.runs and self.exhausted(name)):
                continue  # a start agent that is not running, or one that ran its limit: stays ∞
            got = arrived.get(name) or ()
            if not weighted:
                # the graph meaning, in integers: an arrived predecessor counts as E = 0, and
                # join any needs one arrival only (the branch is ready)
                if agent.join == "all":
                    pending = [e[u] for u in after if u not in got]
                    value = max(pending) + 1 if pending else 1
                else:
                    value = 1 if got else min(e[u] for u in after) + 1
                prob = 1.0
            else:
                legs = [((0.0, 1.0) if u in got else (e[u], q[u]), edge(u, name)) for u in after]
                if agent.join == "all":
                    # every predecessor must hand over: the farthest leg decides, the chances multiply
                    value = max(dist + cost for (dist, _), (cost, _) in legs)
                    prob = math.prod(reach * p for (_, reach), (_, p) in legs)
                else:
                    (dist, reach), (cost, p) = min(legs, key=lambda leg: leg[0][0] + leg[1][0])
                    value, prob = dist + cost, reach * p
            if value < e[name]:
                e[name] = value
                q[name] = prob if value < inf else 0.0
                for nxt in successors[name]:
                    if nxt not in running and nxt not in queued:
                        queued.add(nxt)
                        work.append(nxt)
        return e, q

    def copy(self) -> WorkflowState:
        """Independent state sharing the (immutable) spec; only the small sets are copied."""
        new = WorkflowState.__new__(WorkflowState)
        new.spec = self.spec
        new.running = set(self.running)
        new.arrived = {k: set(v) for k, v in self.arrived.items()}
        new.runs = dict(self.runs)
        return new

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly snapshot (for Redis), in spec order so it is stable across processes."""
        order = self.spec.agents
        out: dict[str, Any] = {
            "running": [a for a in order if a in self.running],
            "arrived": {v: [u for u in order[v].after if u in got] for v, got in self.arrived.items() if got},
        }
        if self.runs:
            out["runs"] = {a: self.runs[a] for a in order if a in self.runs}
        return out

    @classmethod
    def from_dict(cls, spec: WorkflowSpec, data: Mapping[str, Any]) -> WorkflowState:
        """Inverse of :meth:`to_dict`; unknown agents raise :class:`UnknownAgentError`."""
        state = cls(spec, running=())
        for agent in data.get("running", ()):
            state._check(agent)
            state.running.add(agent)
        for v, preds in (data.get("arrived") or {}).items():
            state._check(v)
            for u in preds:
                state._check(u)
            if preds:
                state.arrived[v] = set(preds)
        for agent, count in (data.get("runs") or {}).items():
            state._check(agent)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                state.runs[agent] = count
        return state

    def __repr__(self) -> str:
        return f"WorkflowState({self.spec.name!r}, running={sorted(self.running)}, arrived={self.arrived})"


# --------------------------------------------------------------------------------------------------
# Parsing


def _type_name(value: object) -> str:
    # Users write YAML, so describe values in YAML's vocabulary rather than Python's.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _check_name(field_path: str, value: object) -> None:
    if not isinstance(value, str):
        hint = " (quote it: YAML reads yes/no/on/off and numbers as non-strings)" if value is not None else ""
        raise SpecError(field_path, f"name must be a string, got {_type_name(value)}{hint}")
    if not is_name(value):
        raise SpecError(field_path, f"invalid name {value!r}: must match {NAME_PATTERN}")


def _optional_str(data: Mapping[Any, Any], key: str, field_path: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise SpecError(field_path, f"must be a string, got {_type_name(value)}")
    return value


def _check_keys(data: Mapping[Any, Any], allowed: tuple[str, ...], prefix: str) -> None:
    for key in data:
        if key not in allowed:
            raise SpecError(f"{prefix}{key}", f"unknown key {key!r} (allowed: {', '.join(allowed)})")


def _read_prompt_file(prompt_file: str, base_dir: Path, field_path: str) -> str:
    """The text of ``prompt_file``, which must name a regular file inside ``base_dir`` (symlinks are
    followed, but must land inside too). Never opens anything but a regular file: it is stat-ed
    first, and opened non-blocking and without following a final symlink, so a FIFO swapped in
    between cannot block the loader; the opened file must be the one that was checked."""
    rel = Path(prompt_file)
    if not prompt_file or rel.is_absolute() or rel.anchor:
        raise SpecError(field_path, f"must be a path relative to the spec's folder, got {prompt_file!r}")
    shown = str(base_dir / rel)
    try:
        root = base_dir.resolve(strict=True)
        target = (root / rel).resolve()  # not strict: "outside" is the answer for ../missing too
        if target != root and not target.is_relative_to(root):
            raise SpecError(field_path, f"{prompt_file!r} is outside the spec's folder (resolves to {str(target)!r})")
        checked = os.stat(target, follow_symlinks=False)  # resolved: no symlink left to follow
        if not stat.S_ISREG(checked.st_mode):
            raise SpecError(field_path, f"cannot read {shown!r}: not a regular file")
        if checked.st_size > MAX_PROMPT_FILE_BYTES:
            raise SpecError(field_path, f"cannot read {shown!r}: larger than the {MAX_PROMPT_FILE_BYTES}-byte limit")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(target, flags)
        with os.fdopen(fd, "rb") as f:
            opened = os.fstat(f.fileno())
            if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
                raise SpecError(field_path, f"cannot read {shown!r}: the file changed while it was being read")
            data = f.read(MAX_PROMPT_FILE_BYTES + 1)
        if len(data) > MAX_PROMPT_FILE_BYTES:
            raise SpecError(field_path, f"cannot read {shown!r}: larger than the {MAX_PROMPT_FILE_BYTES}-byte limit")
        return decode_utf8(data)
    except SpecError:
        raise
    except (OSError, TextFileError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError(field_path, f"cannot read {shown!r}: {reason}") from exc
    except (ValueError, RuntimeError) as exc:  # a NUL byte in the path; a symlink loop (RuntimeError in 3.11)
        raise SpecError(field_path, f"cannot read {shown!r}: {exc}") from exc


def _parse_agent(name: str, raw: object, base_dir: Path | None) -> AgentSpec:
    where = f"agents.{name}"
    if raw is None:
        raw = {}  # `planner:` with nothing under it is an agent with all defaults
    if not isinstance(raw, Mapping):
        raise SpecError(where, f"must be a mapping, got {_type_name(raw)}")
    _check_keys(raw, AGENT_KEYS, f"{where}.")

    prompt = _optional_str(raw, "prompt", f"{where}.prompt")
    prompt_file = _optional_str(raw, "prompt_file", f"{where}.prompt_file")
    if prompt is not None and prompt_file is not None:
        raise SpecError(f"{where}.prompt_file", "cannot be combined with prompt (give one of them)")
    if prompt_file is not None:
        if base_dir is None:
            # Not from a file (a spec sent over HTTP): reading server files for a tenant would leak
            # them, so refuse without touching the filesystem (the answer must not depend on the path).
            raise SpecError(
                f"{where}.prompt_file",
                "is not allowed in a spec sent over HTTP (only in spec files); inline the text as prompt",
            )
        prompt = _read_prompt_file(prompt_file, base_dir, f"{where}.prompt_file")

    after_raw = raw.get("after")
    if after_raw is None:
        after: tuple[str, ...] = ()
    elif isinstance(after_raw, list):
        for i, pred in enumerate(after_raw):
            if not isinstance(pred, str):
                raise SpecError(
                    f"{where}.after[{i}]", f"must be an agent name (string), got {_type_name(pred)}"
                )
        after = tuple(after_raw)
    else:
        raise SpecError(f"{where}.after", f"must be a list of agent names, got {_type_name(after_raw)}")

    join = raw.get("join", "all")
    if not isinstance(join, str) or join not in JOINS:
        shown = repr(join) if isinstance(join, str) else _type_name(join)
        raise SpecError(f"{where}.join", f"must be one of {', '.join(JOINS)}, got {shown}")

    next_ = raw.get("next", "all")
    if not isinstance(next_, str) or next_ not in NEXTS:
        shown = repr(next_) if isinstance(next_, str) else _type_name(next_)
        raise SpecError(f"{where}.next", f"must be one of {', '.join(NEXTS)}, got {shown}")
    weights_raw = raw.get("weights") or {}
    if not isinstance(weights_raw, Mapping):
        raise SpecError(f"{where}.weights", f"must be a mapping of successor to weight, got {_type_name(weights_raw)}")
    for successor in weights_raw:
        _check_name(f"{where}.weights", successor)
    # the values' and max_iterations' checks are AgentSpec's own

    description = _optional_str(raw, "description", f"{where}.description")
    return AgentSpec(name=name, prompt=prompt, after=after, join=join, description=description, next=next_,
                     weights=tuple(weights_raw.items()), max_iterations=raw.get("max_iterations"))


def parse_spec(data: object, base_dir: Path | None = None, *, limits: SpecLimits | None = None) -> WorkflowSpec:
    """Validate plain data (as loaded from YAML or JSON) into a :class:`WorkflowSpec`.

    ``base_dir`` is the spec file's folder: ``prompt_file`` must name a regular file inside it (at most
    :data:`MAX_PROMPT_FILE_BYTES`, UTF-8). Without ``base_dir`` (a spec that came over the network)
    ``prompt_file`` is refused and nothing on disk is read. ``limits`` bounds the agent count and the
    prompts' total size (:class:`SpecLimitError`); None means unbounded. Raises :class:`SpecError`
    naming the bad field.
    """
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else _type_name(data)
        raise SpecError("spec", f"must be a mapping with name and agents, got {got}")
    _check_keys(data, TOP_LEVEL_KEYS, "")

    if "name" not in data:
        raise SpecError("name", "required")
    name = data["name"]
    _check_name("name", name)

    entry = data.get("entry")
    if entry is not None and not isinstance(entry, str):
        raise SpecError("entry", f"must be an agent name (string), got {_type_name(entry)}")
    description = _optional_str(data, "description", "description")
    task = _optional_str(data, "task", "task")
    reuse = _optional_str(data, "reuse", "reuse")
    if reuse is not None:
        try:
            parse_reuse(reuse)
        except ValueError as exc:
            raise SpecError("reuse", str(exc)) from None

    if "agents" not in data:
        raise SpecError("agents", "required")
    agents_raw = data["agents"]
    if not isinstance(agents_raw, Mapping):
        raise SpecError(
            "agents", f"must be a mapping of agent name to settings, got {_type_name(agents_raw)}"
        )
    if not agents_raw:
        raise SpecError("agents", "must define at least one agent")
    if limits is not None and len(agents_raw) > limits.max_agents:  # before parsing any agent
        raise SpecLimitError(
            "agents",
            f"has {len(agents_raw)} agents; the limit is {limits.max_agents} ({limits.max_agents_setting})",
            limits.max_agents_setting, limits.max_agents, len(agents_raw),
        )

    agents: dict[str, AgentSpec] = {}
    prompt_bytes = 0
    for agent_name, raw in agents_raw.items():
        _check_name(f"agents.{agent_name}", agent_name)
        agent = agents[agent_name] = _parse_agent(agent_name, raw, base_dir)
        if limits is not None and agent.prompt is not None:
            # A str has at least one UTF-8 byte per character: skip encoding one that is too long anyway.
            if prompt_bytes + len(agent.prompt) > limits.max_prompt_bytes:
                prompt_bytes += len(agent.prompt)
            else:
                prompt_bytes += len(agent.prompt.encode("utf-8", "surrogatepass"))
            if prompt_bytes > limits.max_prompt_bytes:
                raise SpecLimitError(
                    f"agents.{agent_name}.prompt",
                    f"brings the spec's prompts to more than {limits.max_prompt_bytes} bytes (UTF-8, all "
                    f"prompts together); the limit is {limits.max_prompt_bytes} ({limits.max_prompt_bytes_setting})",
                    limits.max_prompt_bytes_setting, limits.max_prompt_bytes, prompt_bytes,
                )
    return WorkflowSpec(name=name, entry=entry, agents=agents, description=description, task=task, reuse=reuse)


def _parse_text(text: str, as_json: bool) -> object:
    if as_json:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError("file", f"invalid JSON: {exc}") from exc
        except RecursionError:
            raise SpecError("file", "invalid JSON: nested too deeply") from None
    try:
        # SafeLoader subclass: plain data only, no anchors/aliases (alias bombs), no duplicate keys.
        return load_yaml(text)
    except yaml.YAMLError as exc:
        raise SpecError("file", f"invalid YAML: {describe_yaml_error(exc)}") from exc


def loads_spec(text: str, base_dir: Path | None = None) -> WorkflowSpec:
    """Parse a spec from YAML or JSON text (JSON objects are tried as JSON first, since a few valid
    JSON documents are not valid YAML 1.1)."""
    stripped = text.lstrip()
    data: object
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = _parse_text(text, as_json=False)  # flow-style YAML mapping
        except RecursionError:
            raise SpecError("file", "invalid JSON: nested too deeply") from None
    else:
        data = _parse_text(text, as_json=False)
    return parse_spec(data, base_dir=base_dir)


def load_spec(path: str | Path) -> WorkflowSpec:
    """Load a spec file (.yaml, .yml or .json, at most :data:`MAX_SPEC_FILE_BYTES`); ``prompt_file``
    paths are relative to its folder and must stay inside it."""
    path = Path(path)
    try:
        text = read_text_file(path, MAX_SPEC_FILE_BYTES)
    except (OSError, TextFileError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError("file", f"cannot read {str(path)!r}: {reason}") from exc
    base_dir = path.parent
    if path.suffix.lower() == ".json":
        return parse_spec(_parse_text(text, as_json=True), base_dir=base_dir)
    return loads_spec(text, base_dir=base_dir)
