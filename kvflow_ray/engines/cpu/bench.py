"""Run the simulator's scenarios for real on the CPU engine, policy by policy in one process, and
report the same JSON as `kvflow-ray sim` (docs/design.md §8).

The driver plays the router's part, as the simulator does: it keeps each client's step-graph state
(`WorkflowClient`, shared with the simulator), sends steps-to-execution and the agents' fixed prompts
to the engine as `Hints`, and times each workflow pass on the wall clock.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from typing import Any

from kvflow_ray.core.predict import Forecaster
from kvflow_ray.core.scheduler import engine_policies
from kvflow_ray.engines.base import GenerateRequest, Hints
from kvflow_ray.engines.cpu.config import CpuEngineConfig
from kvflow_ray.engines.cpu.engine import CpuEngine
from kvflow_ray.engines.cpu.model import CpuModel
from kvflow_ray.engines.cpu.requests import CpuRequest
from kvflow_ray.engines.sim.agentic import SessionClient, SessionPlan, turns_of
from kvflow_ray.engines.sim.replica import SimRequest
from kvflow_ray.engines.sim.runner import pause_measures, summarise_run
from kvflow_ray.engines.sim.simulator import Branching, IterationRecord, TokenSource, WorkflowClient, own_branching
from kvflow_ray.engines.sim.workload import Scenario


def to_vocab(ids: tuple[int, ...], vocab: int = 256) -> tuple[int, ...]:
    """Scenario token ids are unique integers; the byte-level model has 256 ids. A multiplicative hash
    keeps distinct sequences distinct (two prompts share at most a token or two by chance), where
    `id % 256` would make every agent's prompt the same cycle of bytes."""
    return tuple(((t * 2654435761) & 0xFFFFFFFF) * vocab >> 32 for t in ids)


class VocabTokens(TokenSource):
    """Fresh token ids within the model's vocabulary (`to_vocab` of the unique ids)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def fresh(self, n: int) -> tuple[int, ...]:
        return to_vocab(super().fresh(n), self.vocab)


def in_vocab(plan: SessionPlan, vocab: int) -> SessionPlan:
    """`plan` (and its sub-agents) with its system prompt's ids within the vocabulary."""
    return replace(plan, system=to_vocab(plan.system, vocab), spawn=[in_vocab(p, vocab) for p in plan.spawn])


class EngineDriver:
    """A `ClientHost` (workflows) and `SessionHost` (agent sessions) over a real engine, on the wall
    clock: a session's tool pause is a timer the driver's loop runs when it falls due."""

    def __init__(self, engine: CpuEngine, scenario: Scenario, on_request: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.scenario = scenario
        self.measuring = False
        self.iterations: list[IterationRecord] = []
        self.tokens = TokenSource()
        self.on_request = on_request
        self.live_log: list[tuple[float, int]] = []
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._rid = 0
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

    # ------------------------------------------------------------------ agent sessions (SessionHost)
    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._rid += 1
        heapq.heappush(self._timers, (when, self._rid, fn))

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def submit(self, req: SimRequest) -> None:
        """A session's turn: its tokens are in the vocabulary already (`VocabTokens`, `in_vocab`)."""
        turn = req.session
        assert turn is not None and req.workflow is not None
        request = GenerateRequest(tokens=req.tokens, max_tokens=req.max_new, ignore_eos=True, workflow=req.workflow,
                                  agent=req.agent, cache_salt=req.cache_salt,
                                  session={"tenant": turn.tenant, "agent": turn.agent, "tool": turn.tool,
                                           "hint_s": turn.hint_s, "final": turn.final,
                                           "true_pause_s": turn.true_pause_s})

        def done(engine_req: CpuRequest) -> None:
            if engine_req.error is not None:
                error = engine_req.error
                raise RuntimeError(f"a turn of session {req.workflow!r} failed: {error}") from error
            if self.on_request is not None:
                self.on_request()
            assert engine_req.result is not None and req.on_done is not None
            req.output_tokens = tuple(engine_req.result.tokens)
            req.on_done(req)

        self.engine.submit(request, on_done=done)

    def _run_timers(self) -> bool:
        """Run the timers that fell due; whether any is left."""
        now = self.now
        while self._timers and self._timers[0][0] <= now:
            _when, _seq, fn = heapq.heappop(self._timers)
            fn()
        return bool(self._timers)

    def run(self, stall_timeout_s: float = 300.0) -> float:
        """Run every client to the end; returns the makespan in seconds."""
        self._t0 = time.perf_counter()
        copies: dict[int, Branching] = {}
        for plan in self.scenario.plans:
            WorkflowClient(self, plan, branching=own_branching(plan, copies)).begin()  # type: ignore[arg-type]
        vocab = self.engine.model.vocab_size
        tokens = VocabTokens(vocab)
        for session in self.scenario.sessions:
            client = SessionClient(self, in_vocab(session, vocab), tokens)
            self.at(session.start_at, client.begin)
        last_progress, done = time.perf_counter(), self.engine.requests_done
        while self._run_timers() or self.engine.busy:
            if not self.engine.step(timeout=0.01):
                time.sleep(0.001)  # idle until the next timer (a tool pause)
                last_progress = time.perf_counter()
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
    return sum(plan.iterations * len(plan.spec.agents) for plan in scenario.plans) + turns_of(scenario.sessions)


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
            if scenario.sessions:
                result["pauses"] = pause_measures([engine.scheduler.sessions.stats])
            stats = engine.stats()
            result["compute_s"] = stats["compute_s"]
            result["forward_steps"] = stats["forward_steps"]
            result["copy_busy_s"] = stats["copy_busy_s"]
            results[policy] = result
    cfg = asdict(config)
    cfg.pop("policy")
    return {"scenario": scenario.name, "profile": "cpu-engine", "engine": "cpu", "params": scenario.params,
            "config": cfg, "results": results}
