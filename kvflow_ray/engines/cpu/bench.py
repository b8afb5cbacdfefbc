"""Run the simulator's scenarios for real on the CPU engine, policy by policy in one process, and
report the same JSON as `kvflow-ray sim` (docs/design.md §8).

The driver plays the router's part, as the simulator does: it keeps each client's step-graph state
(`WorkflowClient`, shared with the simulator), sends steps-to-execution and the agents' fixed prompts
to the engine as `Hints`, and times each workflow pass on the wall clock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from typing import Any

from kvflow_ray.core.predict import Forecaster
from kvflow_ray.core.scheduler import engine_policies
from kvflow_ray.engines.base import GenerateRequest, Hints
from kvflow_ray.engines.cpu.config import CpuEngineConfig
from kvflow_ray.engines.cpu.engine import CpuEngine, CpuRequest
from kvflow_ray.engines.cpu.model import CpuModel
from kvflow_ray.engines.sim.runner import summarise_run
from kvflow_ray.engines.sim.simulator import Branching, IterationRecord, TokenSource, WorkflowClient, own_branching
from kvflow_ray.engines.sim.workload import Scenario


def to_vocab(ids: tuple[int, ...], vocab: int = 256) -> tuple[int, ...]:
    """Scenario token ids are unique integers; the byte-level model has 256 ids. A multiplicative hash
    keeps distinct sequences distinct (two prompts share at most a token or two by chance), where
    `id % 256` would make every agent's prompt the same cycle of bytes."""
    return tuple(((t * 2654435761) & 0xFFFFFFFF) * vocab >> 32 for t in ids)


class EngineDriver:
    """A `ClientHost` over a real engine, on the wall clock."""

    def __init__(self, engine: CpuEngine, scenario: Scenario, on_request: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.scenario = scenario
        self.measuring = False
        self.iterations: list[IterationRecord] = []
        self.tokens = TokenSource()
        self.on_request = on_request
        self._t0 = time.perf_counter()
        self._prompts: dict[tuple[str, str], tuple[int, ...]] = {}
        self._salts: dict[str, str] = {}  # workflow -> its requests' cache namespace
        self.forecast = Forecaster(engine.scheduler.policy.prediction)

    @property
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def register_prompts(self, workflow: str, prompts: dict[str, tuple[int, ...]], salt: str = "") -> None:
        mapped = {(workflow, agent): to_vocab(tokens) for agent, tokens in prompts.items()}
        self._prompts.update(mapped)
        self._salts[workflow] = salt
        self.engine.apply_hints(Hints(prompts=mapped, salts={workflow: salt}))

    def publish(self, workflow: str, steps: Mapping[str, float]) -> None:
        self.engine.apply_hints(Hints(steps={workflow: dict(steps)}))

    def call(self, client: WorkflowClient, agent: str) -> None:
        plan = client.plan
        prompt = self._prompts[(plan.key, agent)]
        tokens = prompt + to_vocab(self.tokens.fresh(plan.dynamic))
        request = GenerateRequest(tokens=tokens, max_tokens=max(plan.output, 1), ignore_eos=True,
                                  workflow=plan.key, agent=agent, fixed_prefix_tokens=len(prompt),
                                  cache_salt=self._salts.get(plan.key, ""))

        def done(req: CpuRequest) -> None:
            if req.error is not None:
                raise RuntimeError(f"agent {agent!r} of {plan.key!r} failed: {req.error}") from req.error
            if self.on_request is not None:
                self.on_request()
            client.on_done(agent)

        req = self.engine.submit(request, on_done=done)
        req.measured = client.iteration >= plan.warmup

    def retire(self, workflow: str) -> None:
        self.engine.apply_hints(Hints(retire=[workflow]))

    def run(self, stall_timeout_s: float = 300.0) -> float:
        """Run every client to the end; returns the makespan in seconds."""
        self._t0 = time.perf_counter()
        copies: dict[int, Branching] = {}
        for plan in self.scenario.plans:
            WorkflowClient(self, plan, branching=own_branching(plan, copies)).begin()  # type: ignore[arg-type]
        last_progress, done = time.perf_counter(), self.engine.requests_done
        while self.engine.busy:
            self.engine.step(timeout=0.01)
            if self.engine.requests_done != done:
                last_progress, done = time.perf_counter(), self.engine.requests_done
            elif time.perf_counter() - last_progress > stall_timeout_s:
                raise RuntimeError(f"the CPU engine made no progress for {stall_timeout_s:.0f} s "
                                   f"({len(self.engine.scheduler.waiting)} waiting, "
                                   f"{len(self.engine.scheduler.running)} running)")
        return self.now


@contextlib.contextmanager
def policy_progress(label: str) -> Iterator[Callable[[str, int | None], Callable[[], None]]]:
    """Progress bars for `run_cpu_policies`: one per policy, counting finished requests (stderr)."""
    from kvflow_ray.progress import progress

    bars: list[Any] = []

    def start(policy: str, total: int | None) -> Callable[[], None]:
        if bars:
            bars[-1].close()
        bar = progress(total, f"{label} {policy}", "req")
        bars.append(bar)
        return lambda: bar.update(1)

    try:
        yield start
    finally:
        if bars:
            bars[-1].close()


def expected_requests(scenario: Scenario) -> int | None:
    """Agent calls the scenario makes (for the progress bar): every agent once per pass; None when a
    workflow chooses at run time (`next: one`: the count is not known ahead)."""
    if any(plan.spec.dynamic for plan in scenario.plans):
        return None
    return sum(plan.iterations * len(plan.spec.agents) for plan in scenario.plans)


def run_cpu_policies(scenario: Scenario, config: CpuEngineConfig, policies: list[str], *,
                     model: CpuModel | None = None,
                     progress: Callable[[str, int | None], Callable[[], None]] | None = None) -> dict[str, Any]:
    """Every policy on the same scenario and the same model (built once), one after another."""
    unknown = [p for p in policies if p not in engine_policies()]
    if unknown:
        raise ValueError(f"--policies: {', '.join(unknown)} cannot run on the CPU engine "
                         f"(it runs {', '.join(engine_policies())})")
    model = model if model is not None else CpuModel(config.model, threads=config.threads)
    results: dict[str, Any] = {}
    for policy in policies:
        tick = progress(policy, expected_requests(scenario)) if progress else None
        with CpuEngine(replace(config, policy=policy), model=model) as engine:
            driver = EngineDriver(engine, scenario, tick)
            makespan = driver.run()
            result = summarise_run(driver.iterations, [engine.scheduler.stats], makespan,
                                   engine.cache.gpu_capacity)
            stats = engine.stats()
            result["compute_s"] = stats["compute_s"]
            result["forward_steps"] = stats["forward_steps"]
            result["copy_busy_s"] = stats["copy_busy_s"]
            results[policy] = result
    cfg = asdict(config)
    cfg.pop("policy")
    return {"scenario": scenario.name, "profile": "cpu-engine", "engine": "cpu", "params": scenario.params,
            "config": cfg, "results": results}
