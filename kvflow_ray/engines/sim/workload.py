"""Scenarios: the paper's workloads as client plans for the simulator (and, later, real engines).

- `single`: one workflow of N sequential agents run as a loop (agent N-1 hands back to agent 0), a
  warm-up pass then K measured passes; every call is fixed prompt + a fresh dynamic suffix.
- `concurrent`: many independent `single` loops at once, each with its own agents' prompts.
- `peer`: the PEER loop (Plan -> Execute -> Express -> Review -> Plan) with short prompts that share a
  common preamble, many clients of the same template.
- `workflow`: any spec file; prompts come from the spec (byte-level tokens) or `fixed` fresh tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow_ray.core.graph import AgentSpec, WorkflowSpec
from kvflow_ray.engines.sim.simulator import ClientPlan, TokenSource


@dataclass(frozen=True)
class Scenario:
    name: str
    plans: list[ClientPlan]
    params: dict[str, object]


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
              iterations: int = 3, warmup: int = 1) -> Scenario:
    """Agents with a `prompt` use its UTF-8 bytes as tokens (the byte-level tokenizer of the CPU
    engine); agents without one get `fixed` fresh tokens."""
    _check_positive(clients=clients, iterations=iterations)
    tokens = TokenSource(256)  # ids below 256 are bytes
    prompts = {name: tuple(a.prompt.encode()) if a.prompt else tokens.fresh(fixed) for name, a in spec.agents.items()}
    plans = [ClientPlan(key=f"{spec.name}/{c}", spec=spec, prompts=prompts, dynamic=dynamic, output=output,
                        iterations=warmup + iterations, warmup=warmup) for c in range(clients)]
    return Scenario(spec.name, plans, dict(clients=clients, fixed=fixed, dynamic=dynamic, output=output,
                                           iterations=iterations, warmup=warmup))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
