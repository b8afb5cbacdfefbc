"""Scenarios: the paper's workloads as client plans for the simulator (and, later, real engines).

- `single`: one workflow of N sequential agents run as a loop (agent N-1 hands back to agent 0), a
  warm-up pass then K measured passes; every call is fixed prompt + a fresh dynamic suffix.
- `concurrent`: many independent `single` loops at once, each with its own agents' prompts.
- `peer`: the PEER loop (Plan -> Execute -> Express -> Review -> Plan) with short prompts that share a
  common preamble, many clients of the same template.
- `workflow`: any spec file; prompts come from the spec (byte-level tokens) or `fixed` fresh tokens.
- `dynamic`: support applications whose triage hands each ticket to one of K specialists (skewed
  odds) and whose reviewer loops back at random; a drifting or adversarial mix on request.
- `fleet`: many tenants' applications (a mix of workflow shapes, each with its own prompts sharing an
  application preamble), instances arriving as a Poisson process; `llmd` is llm-d's benchmark shape.
- `burst`: many single calls over a few long system prompts arriving together (`prompts` equal to
  `requests`: every call its own prompt, the no-sharing control).
- `fanout`: a planner whose barrier starts N workers with one prompt, then an aggregator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from kvflow_ray.core.graph import AgentSpec, WorkflowSpec
from kvflow_ray.engines.sim.simulator import Branching, ClientPlan, TokenSource


@dataclass(frozen=True)
class Scenario:
    name: str
    plans: list[ClientPlan]
    params: dict[str, object]
    sessions: list[Any] = field(default_factory=list)  # agent sessions (`agentic.SessionPlan`)


def sequential_loop(name: str, agents: list[str]) -> WorkflowSpec:
    specs = {a: AgentSpec(a, None, (agents[i - 1],), "all") for i, a in enumerate(agents)}
    return WorkflowSpec(name=name, entry=agents[0], agents=specs)


def single(agents: int = 10, fixed: int = 8192, dynamic: int = 32, output: int = 32, iterations: int = 10,
           warmup: int = 1) -> Scenario:
    _check_positive(agents=agents, fixed=fixed, iterations=iterations)
    tokens = TokenSource(1)
    names = [f"agent{i}" for i in range(agents)]
    spec = sequential_loop("single", names)
    plan = ClientPlan(key="single/0", spec=spec, prompts={a: tokens.fresh(fixed) for a in names},
                      dynamic=dynamic, output=output, iterations=warmup + iterations, warmup=warmup)
    return Scenario("single", [plan], dict(agents=agents, fixed=fixed, dynamic=dynamic, output=output,
                                           iterations=iterations, warmup=warmup))


def concurrent(tasks: int = 64, fixed: int = 1024, agents: int = 10, dynamic: int = 256, output: int = 256,
               iterations: int = 3, warmup: int = 1) -> Scenario:
    """Independent ("non-interacting, non-sharing") workflows run at once: every task is the `single`
    loop with its own agents' prompts, so together they overflow the device tier."""
    _check_positive(tasks=tasks, fixed=fixed, agents=agents, iterations=iterations)
    tokens = TokenSource(1)
    names = [f"agent{i}" for i in range(agents)]
    spec = sequential_loop("task", names)
    plans = [ClientPlan(key=f"task/{t}", spec=spec, prompts={a: tokens.fresh(fixed) for a in names},
                        dynamic=dynamic, output=output, iterations=warmup + iterations, warmup=warmup)
             for t in range(tasks)]
    return Scenario("concurrent", plans, dict(tasks=tasks, fixed=fixed, agents=agents, dynamic=dynamic,
                                               output=output, iterations=iterations, warmup=warmup))


PEER_AGENTS = ("planner", "executor", "expresser", "reviewer")


def peer(clients: int = 64, preamble: int = 96, role: tuple[int, ...] = (180, 420, 120, 260), dynamic: int = 128,
         output: int = 64, iterations: int = 3, warmup: int = 1) -> Scenario:
    """PEER (Plan/Execute/Express/Review) loop; the four roles share a preamble (tens of tokens) and
    add role text of tens to hundreds of tokens. Every client runs the same template."""
    _check_positive(clients=clients, iterations=iterations)
    tokens = TokenSource(1)
    common = tokens.fresh(preamble)
    prompts = {a: common + tokens.fresh(n) for a, n in zip(PEER_AGENTS, role, strict=True)}
    spec = sequential_loop("peer", list(PEER_AGENTS))
    plans = [ClientPlan(key=f"peer/{c}", spec=spec, prompts=prompts, dynamic=dynamic, output=output,
                        iterations=warmup + iterations, warmup=warmup) for c in range(clients)]
    return Scenario("peer", plans, dict(clients=clients, preamble=preamble, dynamic=dynamic, output=output,
                                        iterations=iterations, warmup=warmup))


def from_spec(spec: WorkflowSpec, clients: int = 1, fixed: int = 1024, dynamic: int = 32, output: int = 32,
              iterations: int = 3, warmup: int = 1, reuse: str | None = None) -> Scenario:
    """Agents with a `prompt` use its UTF-8 bytes as tokens (the byte-level tokenizer of the CPU
    engine); agents without one get `fixed` fresh tokens. `reuse`: every call carries its predecessors'
    outputs, reused by that method (default: the spec's `reuse`, else none carried)."""
    reuse = reuse if reuse is not None else spec.reuse
    _check_positive(clients=clients, iterations=iterations)
    tokens = TokenSource(256)  # ids below 256 are bytes
    prompts = {name: tuple(a.prompt.encode()) if a.prompt else tokens.fresh(fixed) for name, a in spec.agents.items()}
    plans = [ClientPlan(key=f"{spec.name}/{c}", spec=spec, prompts=prompts, dynamic=dynamic, output=output,
                        iterations=warmup + iterations, warmup=warmup, reuse=reuse) for c in range(clients)]
    params: dict[str, object] = dict(clients=clients, fixed=fixed, dynamic=dynamic, output=output,
                                     iterations=iterations, warmup=warmup)
    if reuse is not None:
        params["reuse"] = reuse
    return Scenario(spec.name, plans, params)


# ---------------------------------------------------------------------------------------------- dynamic
def support_spec(branches: int) -> WorkflowSpec:
    """intake -> triage -> exactly one of `branches` specialists -> reviewer -> triage again, or
    finalize. The spec states the choices (`next: one`) but no odds: what the application really
    does is for the router to learn."""
    specialists = tuple(f"specialist{i}" for i in range(branches))
    return WorkflowSpec("support", "intake", {
        "intake": _agent("intake"),
        "triage": AgentSpec("triage", None, ("intake", "reviewer"), "any", next="one"),
        **{s: _agent(s, ("triage",)) for s in specialists},
        "reviewer": AgentSpec("reviewer", None, specialists, "any", next="one"),
        "finalize": _agent("finalize", ("reviewer",)),
    })


def dynamic(branches: int = 4, skew: float = 1.5, loop_p: float = 0.3, clients: int = 8, apps: int = 4,
            fixed: int = 2048, dynamic: int = 64, output: int = 64, iterations: int = 12, warmup: int = 2,
            mix: str = "steady", seed: int = 0) -> Scenario:
    """`apps` support applications (`support_spec`), each a tenant with its own prompts (`fixed`
    tokens per agent: together they overflow an A10G's device tier); `clients` tickets in flight at
    once, spread over the applications, each client working through `iterations` tickets in turn.
    Triage picks specialist i with odds 1 / (i + 1) ** `skew` (Zipf; 0: uniform, each application its
    own order); the reviewer sends the work back with probability `loop_p`. `mix`: `steady`; `drift`
    (the specialists' odds reverse once half the tickets of an application have started); or
    `adversarial` (they reverse right after the warm-up, against everything learned)."""
    _check_positive(branches=branches, clients=clients, apps=apps, fixed=fixed, iterations=iterations)
    if not 0 <= loop_p < 1:
        raise ValueError(f"--loop-p must be in [0, 1), got {loop_p}")
    if skew < 0:
        raise ValueError(f"--skew must be >= 0, got {skew}")
    if mix not in DYNAMIC_MIXES:
        raise ValueError(f"unknown mix {mix!r} (choose one of {', '.join(DYNAMIC_MIXES)})")
    rng = random.Random(seed)
    tokens = TokenSource(1)
    spec = support_spec(branches)
    applications = []
    for a in range(apps):
        order = list(range(branches))
        rng.shuffle(order)
        odds = {f"specialist{i}": 1.0 / (rank + 1) ** skew for rank, i in enumerate(order)}
        flipped = {f"specialist{i}": 1.0 / (branches - rank) ** skew for rank, i in enumerate(order)}
        weights = {"triage": odds, "reviewer": {"triage": loop_p, "finalize": 1.0 - loop_p}}
        later = {**weights, "triage": flipped}
        tickets = len(range(a, clients, apps))
        switch_at = {"steady": 0, "drift": tickets * (warmup + iterations) // 2, "adversarial": tickets * warmup}[mix]
        branching = Branching(weights, later if mix != "steady" else None, switch_at)
        prompts = {agent: tokens.fresh(fixed) for agent in spec.agents}
        applications.append((f"app{a}", prompts, branching))
    plans = []
    for c in range(clients):
        tenant, prompts, branching = applications[c % apps]
        plans.append(ClientPlan(key=f"{tenant}/ticket{c}", spec=spec, prompts=prompts, dynamic=dynamic,
                                output=output, iterations=warmup + iterations, warmup=warmup, salt=tenant,
                                branching=branching))
    return Scenario("dynamic", plans, dict(branches=branches, skew=skew, loop_p=loop_p, clients=clients, apps=apps,
                                           fixed=fixed, dynamic=dynamic, output=output, iterations=iterations,
                                           warmup=warmup, mix=mix, seed=seed))


DYNAMIC_MIXES = ("steady", "drift", "adversarial")


# ---------------------------------------------------------------------------------------------- fleet
def _agent(name: str, after: tuple[str, ...] = (), join: str = "all") -> AgentSpec:
    return AgentSpec(name, None, after, join)


def _chain(name: str, agents: list[str]) -> WorkflowSpec:
    return WorkflowSpec(name, agents[0], {a: _agent(a, (agents[i - 1],) if i else ()) for i, a in enumerate(agents)})


def chat_spec() -> WorkflowSpec:
    """One agent, one call per instance: a plain chat request (its fixed prompt is the system prompt)."""
    return WorkflowSpec("chat", "user", {"user": _agent("user")})


def fleet_shapes() -> dict[str, WorkflowSpec]:
    """The application shapes of the fleet scenario: the PEER loop, a software team whose coders meet
    at a barrier, a triage that fans out and joins, and a 10-agent chain."""
    team = WorkflowSpec("team", "pm", {
        "pm": _agent("pm"), "architect": _agent("architect", ("pm",)),
        **{f"coder{i}": _agent(f"coder{i}", ("architect",)) for i in range(3)},
        "tester": _agent("tester", tuple(f"coder{i}" for i in range(3)))})
    triage = WorkflowSpec("triage", "triage", {
        "triage": _agent("triage"), "research": _agent("research", ("triage",)),
        "draft": _agent("draft", ("triage",)), "respond": _agent("respond", ("research", "draft"))})
    return {"peer": sequential_loop("peer", list(PEER_AGENTS)), "team": team, "triage": triage,
            "chain": _chain("chain", [f"step{i}" for i in range(10)])}


def _prompt_tokens(rng: random.Random, median: int) -> int:
    """A prompt length: log-normal around `median` (sigma 0.6), within [median / 8, median * 4]."""
    return int(min(max(rng.lognormvariate(math.log(median), 0.6), median / 8), median * 4))


FLEET_PRESETS = ("default", "tools")
TOOL_PROMPT_RANGE = (4096, 16384)  # the `tools` preset: each agent's system prompt, log-uniform


@dataclass(frozen=True)
class _App:
    tenant: int
    index: int  # its tenant's n-th application
    spec: WorkflowSpec
    preamble: int  # tokens every agent's prompt starts with
    roles: dict[str, int]  # agent -> the tokens its prompt adds

    @property
    def working_set(self) -> int:
        """The distinct tokens of its prompts (what caching all of them takes)."""
        return self.preamble + sum(self.roles.values())


def _draw_app(rng: random.Random, shapes: list[WorkflowSpec], tenant: int, index: int, apps: int, preset: str,
              preamble: int, prompt: int) -> _App:
    spec = shapes[(tenant * apps + index) % len(shapes)]
    if preset == "tools":  # a shared preamble, then each agent's tool schemas and role: 4-16k tokens in all
        common = _prompt_tokens(rng, preamble)
        low, high = TOOL_PROMPT_RANGE
        roles = {agent: max(prompt, int(math.exp(rng.uniform(math.log(low), math.log(high)))) - common)
                 for agent in spec.agents}
    else:
        common = _prompt_tokens(rng, preamble)
        roles = {agent: _prompt_tokens(rng, prompt) for agent in spec.agents}
    return _App(tenant, index, spec, common, roles)


def _scaled(app: _App, factor: float) -> _App:
    return replace(app, preamble=max(1, round(app.preamble * factor)),
                   roles={agent: max(1, round(n * factor)) for agent, n in app.roles.items()})


def fleet_applications(rng: random.Random, tenants: int | None = 8, apps: int = 2, preamble: int = 1024,
                       prompt: int = 512, preset: str = "default", pressure: float | None = None,
                       fleet_kv_tokens: int | None = None) -> list[_App]:
    """The fleet's applications, drawn from `rng`. With `pressure` (and the fleet's device KV,
    `fleet_kv_tokens`), their working sets add up to `pressure` x the fleet's device KV: applications
    are added, `apps` per tenant, until they do (`tenants` None: the last tenant may have fewer), or
    the prompts of `tenants` x `apps` applications are scaled to it (`tenants` given)."""
    if preset not in FLEET_PRESETS:
        raise ValueError(f"unknown fleet preset {preset!r} (choose one of {', '.join(FLEET_PRESETS)})")
    shapes = list(fleet_shapes().values())
    if pressure is None or tenants is not None:
        _check_positive(tenants=tenants or 0, apps=apps, preamble=preamble, prompt=prompt)
        drawn = [_draw_app(rng, shapes, t, a, apps, preset, preamble, prompt) for t in range(tenants or 0)
                 for a in range(apps)]
        if pressure is None:
            return drawn
    _check_positive(apps=apps, preamble=preamble, prompt=prompt)
    if not pressure > 0:
        raise ValueError(f"--pressure must be positive, got {pressure}")
    if not fleet_kv_tokens or fleet_kv_tokens < 1:
        raise ValueError("--pressure needs the fleet's device KV (replicas x the profile's device pool)")
    target = pressure * fleet_kv_tokens
    if tenants is not None:
        factor = target / sum(app.working_set for app in drawn)
        return [_scaled(app, factor) for app in drawn]
    drawn, total = [], 0
    while total < target:
        tenant, index = divmod(len(drawn), apps)
        drawn.append(_draw_app(rng, shapes, tenant, index, apps, preset, preamble, prompt))
        total += drawn[-1].working_set
    return drawn


def fleet(tenants: int | None = 8, apps: int = 2, clients: int = 256, rate: float = 2.0, preamble: int = 1024,
          prompt: int = 512, dynamic: int = 256, output: int = 128, seed: int = 0, preset: str = "default",
          pressure: float | None = None, fleet_kv_tokens: int | None = None) -> Scenario:
    """`tenants` x `apps` applications, each one workflow shape (in turn through `fleet_shapes`) with
    its own agents' prompts: an application preamble (log-normal around `preamble` tokens) then a
    role prompt per agent (around `prompt`; the `tools` preset: each agent's whole system prompt is
    4-16k tokens, log-uniform, as agent frameworks send tool schemas). Tenants share nothing (each is
    a cache namespace). `pressure`: the applications' working sets over the fleet's device KV
    (`fleet_applications`). `clients` workflow instances, each of a random application, arrive as a
    Poisson process of `rate` per second and run one pass. The params carry the pressure reached
    (`pressure`, when the fleet's KV is known) and the working set in tokens."""
    _check_positive(clients=clients)
    if not rate > 0:
        raise ValueError(f"--rate must be positive, got {rate}")
    rng = random.Random(seed)  # the applications' draws, then the arrivals'
    drawn = fleet_applications(rng, tenants, apps, preamble, prompt, preset, pressure, fleet_kv_tokens)
    tokens = TokenSource(1)
    applications = []
    for app in drawn:
        common = tokens.fresh(app.preamble)
        prompts = {agent: common + tokens.fresh(n) for agent, n in app.roles.items()}
        applications.append((f"t{app.tenant}", f"{app.spec.name}{app.index}", app.spec, prompts))
    plans, at = [], 0.0
    for c in range(clients):
        at += rng.expovariate(rate)
        tenant, name, spec, prompts = rng.choice(applications)
        plans.append(ClientPlan(key=f"{tenant}/{name}-{c}", spec=spec, prompts=prompts, dynamic=dynamic,
                                output=output, iterations=1, start_at=at, salt=tenant))
    working_set = sum(app.working_set for app in drawn)
    return Scenario("fleet", plans, dict(
        tenants=len({app.tenant for app in drawn}), apps=apps, clients=clients, rate=rate, preamble=preamble,
        prompt=prompt, dynamic=dynamic, output=output, seed=seed, preset=preset, working_set_tokens=working_set,
        pressure=round(working_set / fleet_kv_tokens, 3) if fleet_kv_tokens else None))


def llmd(clients: int = 1024, rate: float = 10.0, groups: int = 150, system: int = 6000, question: int = 1200,
         output: int = 1000, seed: int = 0) -> Scenario:
    """llm-d's precise prefix-cache benchmark (llm-d-kv-cache-manager benchmarking/73-capacity;
    blog "KV-Cache Wins You Can See"): `groups` customers, each with a `system`-token system prompt,
    send single calls (system prompt + a fresh `question`, `output` tokens out) as a Poisson process
    of `rate` per second; 150 x 6,000 tokens at 3-60 QPS on 8 replicas is their shape."""
    _check_positive(clients=clients, groups=groups, system=system)
    if not rate > 0:
        raise ValueError(f"--rate must be positive, got {rate}")
    rng = random.Random(seed)
    tokens = TokenSource(1)
    spec = chat_spec()
    systems = [{"user": tokens.fresh(system)} for _ in range(groups)]
    plans, at = [], 0.0
    for c in range(clients):
        at += rng.expovariate(rate)
        g = rng.randrange(groups)
        plans.append(ClientPlan(key=f"llmd/g{g}-{c}", spec=spec, prompts=systems[g], dynamic=question, output=output,
                                iterations=1, start_at=at))
    return Scenario("llmd", plans, dict(clients=clients, rate=rate, groups=groups, system=system, question=question,
                                        output=output, seed=seed))


# ---------------------------------------------------------------------------------------------- queue-aware
def burst(requests: int = 256, prompts: int = 16, system: int = 4096, question: int = 128, output: int = 64,
          window: float = 1.0, skew: float = 0.0, seed: int = 0) -> Scenario:
    """`requests` single calls arriving uniformly at random within `window` seconds, each a system
    prompt (`system` tokens, one of `prompts`, picked with Zipf odds 1 / (i + 1) ** `skew`) plus a
    fresh `question`. Shared-prompt chat under a burst: PEEK's setting. With `prompts` >= `requests`
    every call has its own prompt (nothing to share: the control)."""
    _check_positive(requests=requests, prompts=prompts, system=system)
    if window < 0 or skew < 0:
        raise ValueError("--window and --skew must be >= 0")
    rng = random.Random(seed)
    tokens = TokenSource(1)
    spec = chat_spec()
    systems = [{"user": tokens.fresh(system)} for _ in range(prompts)]
    odds = [1.0 / (i + 1) ** skew for i in range(prompts)]
    plans = []
    for c in range(requests):
        g = c if prompts >= requests else rng.choices(range(prompts), weights=odds)[0]
        plans.append(ClientPlan(key=f"burst/p{g}-{c}", spec=spec, prompts=systems[g], dynamic=question,
                                output=output, iterations=1, start_at=rng.uniform(0.0, window)))
    return Scenario("burst", plans, dict(requests=requests, prompts=prompts, system=system, question=question,
                                         output=output, window=window, skew=skew, seed=seed))


def fanout_spec(workers: int) -> WorkflowSpec:
    """planner -> `workers` workers (one prompt between them) -> aggregator (`join: all`)."""
    names = [f"worker{i}" for i in range(workers)]
    return WorkflowSpec("fanout", "planner", {
        "planner": _agent("planner"), **{w: _agent(w, ("planner",)) for w in names},
        "aggregator": _agent("aggregator", tuple(names))})


def fanout(workers: int = 16, clients: int = 8, apps: int | None = None, fixed: int = 2048, dynamic: int = 128,
           output: int = 64, iterations: int = 2, warmup: int = 0, window: float = 2.0, seed: int = 0) -> Scenario:
    """`clients` instances of `fanout_spec`, starting uniformly within `window` seconds, each of one of
    `apps` applications (default: one per instance) with its own prompts of `fixed` tokens; an
    application's workers all send its one worker prompt (plus a fresh task of `dynamic` tokens), at
    once, when the planner is done."""
    apps = clients if apps is None else apps
    _check_positive(workers=workers, clients=clients, apps=apps, fixed=fixed, iterations=iterations)
    rng = random.Random(seed)
    tokens = TokenSource(1)
    spec = fanout_spec(workers)
    applications = []
    for _ in range(apps):
        worker = tokens.fresh(fixed)
        applications.append({"planner": tokens.fresh(fixed), "aggregator": tokens.fresh(fixed),
                             **{f"worker{i}": worker for i in range(workers)}})
    plans = [ClientPlan(key=f"fanout/{c}", spec=spec, prompts=applications[c % apps], dynamic=dynamic, output=output,
                        iterations=warmup + iterations, warmup=warmup, start_at=rng.uniform(0.0, window))
             for c in range(clients)]
    return Scenario("fanout", plans, dict(workers=workers, clients=clients, apps=apps, fixed=fixed, dynamic=dynamic,
                                          output=output, iterations=iterations, warmup=warmup, window=window,
                                          seed=seed))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
