"""The load generator behind `kvflow-ray run`: many concurrent instances of a workflow against a
kvflow-ray server, through the SDK (so through the OpenAI SDK), with what a platform team wants to
see afterwards: workflow latency percentiles, hit ratios by tier, and how often the router's
affinity held.

Each client walks the step graph as the workflow declares it, with the same step as the simulator's
clients (`WorkflowState.finish_and_ready`): entry agents first, then every successor that becomes
ready; a return to the entry ends one iteration of a loop. Unlike the simulator, which starts each
successor the moment its predecessors finish, a client plans an iteration up front as stages
(`iteration_stages`): agents that become ready together (an AND fan-out) run concurrently, and the
next stage waits for the whole stage.
Each agent call sends the agent's fixed prompt (system message) plus a dynamic user message that
carries the task and the previous agent's output (its first 200 characters), or, for a workflow that
reuses its agents' outputs (`reuse` in its spec, docs/design.md §12), the whole output of each of
the agent's predecessors, as a writer reads its researchers' reports.
"""

from __future__ import annotations

import math
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvflow_ray.client.workflow import Workflow
from kvflow_ray.core.graph import WorkflowState
from kvflow_ray.core.stats import percentile
from kvflow_ray.progress import progress as progress_bar


@dataclass
class LoadConfig:
    clients: int = 4  # concurrent workflow instances
    iterations: int = 2  # passes of the workflow per client (loops: returns to the entry)
    max_tokens: int = 32  # output tokens per agent call (at most; exactly, with ignore_eos)
    ignore_eos: bool = True  # every call generates max_tokens (benchmarks compare equal work); False: answers end
    # the request each client's calls carry (e.g. the workflow's `task`), besides the previous agent's output;
    # None: synthetic text of task_chars characters
    task: str | None = None
    task_chars: int = 120
    api_key: str | None = None
    # the server's /metrics token (`kvflow-ray serve --metrics-token`), for the hit ratios and routing
    # counts read from /metrics before and after the run; None: /metrics is open
    metrics_token: str | None = None
    model: str | None = None
    timeout_s: float = 600.0
    # what a call's message carries of earlier outputs: "previous" (the last agent's, its first 200
    # characters), "predecessors" (each predecessor's whole output); None: predecessors for a workflow
    # whose spec sets `reuse`, else previous
    reads: str | None = None
    reuse: str | None = None  # `kvflow.reuse` on every call (None: the workflow's, else the tenant's default)


@dataclass
class CallRecord:
    client: int
    iteration: int
    agent: str
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    route: str  # affinity | balanced | cold | plain
    replica: str
    error: str | None = None
    answer: str = ""
    reused_tokens: int = 0  # prompt tokens whose KV came from an earlier agent's kept output


@dataclass
class LoadResult:
    calls: list[CallRecord] = field(default_factory=list)
    iterations: list[float] = field(default_factory=list)  # workflow iteration latencies
    wall_s: float = 0.0
    metrics_before: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    metrics_after: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


def check_server(url: str, api_key: str | None = None, timeout: float = 10.0) -> None:
    """Before a run: the server at `url` answers, and takes `api_key` (`GET /v1/models`, which wants a
    key wherever keys are configured). Raises ConnectionError or PermissionError with one line naming
    the problem and the fix."""
    request = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            refused = "the API key" if api_key else "a call without an API key"
            raise PermissionError(f"the server at {url} refused {refused} (HTTP {exc.code}): pass a key it knows "
                                  "with --key") from None
        raise ConnectionError(f"the server at {url} answered GET /v1/models with HTTP {exc.code}: is it a "
                              "kvflow-ray server (`kvflow-ray serve`)?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConnectionError(f"cannot reach a server at {url} ({reason}): start one with `kvflow-ray serve`, "
                              "or leave out --url to start the embedded server for this run") from None


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # a scrape: (name, sorted labels) -> value


def scrape(url: str, token: str | None = None) -> Samples:
    """Every sample of `GET /metrics` as {(name, sorted labels): value}, sending `token` (the server's
    metrics token) as a bearer token. A 401 raises PermissionError: the server wants a (different) token."""
    request = urllib.request.Request(url.rstrip("/") + "/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise PermissionError(f"GET {request.full_url}: 401, the server protects /metrics with a metrics "
                                  f"token{' and this is not it' if token else ''}: pass it with "
                                  "--metrics-token") from None
        raise
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


WORDS = ("ledger", "accrual", "segment", "guidance", "margin", "liquidity", "covenant", "impairment", "tranche",
         "amortisation", "dividend", "backlog", "hedge", "provision", "goodwill", "yield", "capex", "churn")


def with_preamble(workflow: Workflow, name: str, heading: str, seed: int | str, preamble_chars: int) -> Workflow:
    """`workflow` under `name`, with a preamble before every agent's prompt: `heading`, then filler
    words drawn from `seed`, `preamble_chars` long in all (a handbook: rules, examples)."""
    import random

    rng = random.Random(seed)
    preamble = heading
    while len(preamble) < preamble_chars:
        preamble += " ".join(rng.choice(WORDS) for _ in range(12)) + ". "
    data = workflow.spec.to_dict()
    data["name"] = name
    for agent in data["agents"].values():
        agent["prompt"] = preamble[:preamble_chars] + "\n" + (agent.get("prompt") or "")
    return Workflow.from_dict(data)


def application_variants(workflow: Workflow, n: int, preamble_chars: int = 1200) -> list[Workflow]:
    """`n` applications built on one workflow: same graph, and each application's agents share an
    application-specific preamble (its handbook: rules, examples) before their own prompt, so no two
    applications share cached prefixes. This is the multi-tenant load a shared cluster sees."""
    return [with_preamble(workflow, f"{workflow.name}-app{k}", f"Handbook of application {k}: ", k, preamble_chars)
            for k in range(n)]


class _Client:
    def __init__(self, index: int, workflow: Workflow, base_url: str, config: LoadConfig,
                 result: LoadResult, lock: threading.Lock, on_call: Callable[[], None], register: bool) -> None:
        self.index, self.workflow, self.config = index, workflow, config
        self.result, self.lock, self.on_call = result, lock, on_call
        self.run = workflow.client(base_url=base_url, api_key=config.api_key, model=config.model,
                                   register=register, timeout=config.timeout_s, max_retries=0,  # counts failures
                                   client_id=f"{workflow.name}-{index}-{uuid.uuid4().hex[:8]}")
        self.last_output = ""
        self.last_agent = ""
        self.outputs: dict[str, str] = {}  # agent -> its latest whole output
        reads = config.reads or ("predecessors" if workflow.spec.reuse else "previous")
        if reads not in READS:
            raise ValueError(f"reads must be one of {', '.join(READS)}, got {reads!r}")
        self.reads = reads

    def call(self, agent: str, iteration: int) -> None:
        content = self._message(agent, iteration)
        handle = self.run.agent(agent)
        started = time.perf_counter()
        try:
            raw = handle.run.openai.chat.completions.with_raw_response.create(
                model=self.config.model or "default", messages=handle.messages([{"role": "user", "content": content}]),
                max_tokens=self.config.max_tokens, temperature=0, extra_body={
                    "kvflow": self.run.metadata(agent) | ({"reuse": self.config.reuse} if self.config.reuse else {}),
                    "ignore_eos": self.config.ignore_eos})
            response = raw.parse()
            usage = response.usage
            details = getattr(usage, "prompt_tokens_details", None)
            self.last_output = response.choices[0].message.content or ""
            self.last_agent = agent
            self.outputs[agent] = self.last_output
            record = CallRecord(self.index, iteration, agent, time.perf_counter() - started, usage.prompt_tokens,
                                (details.cached_tokens or 0) if details else 0,
                                raw.headers.get("x-kvflow-route", "plain"), raw.headers.get("x-kvflow-replica", "?"),
                                answer=self.last_output,
                                reused_tokens=(getattr(details, "reused_tokens", None) or 0) if details else 0)
        except Exception as exc:
            record = CallRecord(self.index, iteration, agent, time.perf_counter() - started, 0, 0, "error", "?",
                                f"{type(exc).__name__}: {exc}")
        with self.lock:
            self.result.calls.append(record)
        self.on_call()

    def _message(self, agent: str, iteration: int) -> str:
        """The call's user message: the task and what the previous agent wrote. A real task frames the
        previous output as another agent's (a small model otherwise repeats it as its own answer)."""
        if self.reads == "predecessors":
            return self._reading(agent, iteration)
        previous = self.last_output[:200]
        if self.config.task is not None:
            if not previous:
                return self.config.task
            return f"{self.config.task}\n\nFor reference, the {self.last_agent} wrote: \"{previous}\""
        task = (f"Task {self.index}.{iteration} for the {agent}: " + "analyse the quarterly filing; " * 40)
        return task[:self.config.task_chars] + (f"\n\nPrevious step said: {previous}" if previous else "")

    def _reading(self, agent: str, iteration: int) -> str:
        """The task, then each predecessor's whole output as another agent's report."""
        task = self.config.task if self.config.task is not None else f"Task {self.index}.{iteration} for the {agent}."
        reports = [f"The {pred} wrote:\n{self.outputs[pred]}" for pred in self.workflow.spec.agents[agent].after
                   if self.outputs.get(pred)]
        return "\n\n".join([task, *reports])

    def go(self) -> None:
        """All iterations of this client, then `finish`."""
        rng = random.Random(f"kvflow-run:{self.index}")  # each client's own draws at `next: one` agents
        with self.run, ThreadPoolExecutor(max_workers=max(1, len(self.workflow.spec.agents))) as pool:
            for iteration in range(self.config.iterations):
                started = time.perf_counter()
                for stage in iteration_stages(self.workflow, rng):
                    list(pool.map(lambda a, it=iteration: self.call(a, it), stage))
                with self.lock:
                    self.result.iterations.append(time.perf_counter() - started)


READS = ("previous", "predecessors")
MAX_STAGES = 1000  # a walk of a dynamic workflow whose loops keep coming back is cut here


def iteration_stages(workflow: Workflow, rng: random.Random | None = None) -> list[list[str]]:
    """One iteration's walk of the step graph, as stages of agents that become ready together (they
    run concurrently): the entry agents, then every successor that becomes ready once the whole
    stage has finished (in stage order), until the walk returns to the entry (a loop) or drains (a
    DAG). A `next: one` agent hands over to one successor, drawn by the spec's weights from `rng`
    (default: seeded 0), so a dynamic workflow's walk differs per draw; otherwise the walk depends on
    the graph alone."""
    spec = workflow.spec
    rng = rng or random.Random(0)
    entry = set(spec.start_agents())
    state = WorkflowState(spec, running=[])
    stages: list[list[str]] = []
    ready = sorted(entry)
    while ready and len(stages) < MAX_STAGES:
        stages.append(ready)
        for agent in ready:
            state.start(agent)
        following: list[str] = []
        for agent in ready:  # the stage's agents finish in stage order
            successors = state.finish_and_ready(agent)
            odds = spec.priors(agent)
            if odds:
                allowed = state.choices(agent)
                successors = rng.choices(allowed, weights=[odds[v] for v in allowed]) if allowed else []
            following += [v for v in successors if v not in following]
        ready = [v for v in following if v not in entry]  # back at the entry: the iteration is over
    return stages


def run_load(workflow: Workflow | Sequence[Workflow], base_url: str, config: LoadConfig, *,
             progress: bool = True) -> LoadResult:
    """Run `config.clients` concurrent instances of `workflow` against `base_url` (the server root).
    With several workflows, client i runs workflow i mod their number."""
    workflows = [workflow] if isinstance(workflow, Workflow) else list(workflow)
    root = base_url.rstrip("/").removesuffix("/v1")
    result = LoadResult()
    result.metrics_before = scrape(root, config.metrics_token)
    lock = threading.Lock()
    total = config.iterations * sum(_calls_per_iteration(workflows[i % len(workflows)])
                                    for i in range(config.clients))
    bar = progress_bar(total, f"run {workflows[0].name}", "call", disable=not progress)
    tick = lambda: bar.update(1)  # noqa: E731 (both kinds of bar update thread-safely)
    started = time.perf_counter()
    clients = [_Client(i, workflows[i % len(workflows)], root + "/v1", config, result, lock, tick,
                       register=i < len(workflows)) for i in range(config.clients)]
    run_concurrently([(f"client-{c.index}", c.go) for c in clients])
    bar.close()
    result.wall_s = time.perf_counter() - started
    answered = sum(c.prompt_tokens for c in result.calls if c.error is None)
    result.metrics_after = settled_metrics(root, config.metrics_token, result.metrics_before, answered)
    return result


def run_concurrently(tasks: Sequence[tuple[str, Callable[[], None]]]) -> None:
    """Run each (thread name, task) on its own thread, and return once all have ended."""
    threads = [threading.Thread(target=task, name=name) for name, task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def settled_metrics(root: str, token: str | None, before: Samples, answered: int, timeout_s: float = 10.0,
                    poll_s: float = 0.25) -> Samples:
    """`/metrics` once its prompt-token counters have grown (since `before`) by the `answered` prompt
    tokens the run's answers reported: replicas send their counters once a second, so a scrape right
    after the last answer misses the last second's calls, and the early, cold ones would weigh most.
    Gives up after `timeout_s` (a server that counts differently) and returns the latest scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(root, token)
        if counter_delta(before, after, "kvflow_prompt_tokens_total") >= answered or time.monotonic() >= deadline:
            return after
        time.sleep(poll_s)


def counter_delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much the counters named `name` (summed over series matching `labels`) grew from `before`."""
    def total(samples: Samples) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and all((k, x) in ls for k, x in labels.items()))
    return total(after) - total(before)


def _calls_per_iteration(workflow: Workflow) -> int:
    return sum(len(stage) for stage in iteration_stages(workflow))


def _delta(result: LoadResult, name: str, **labels: str) -> float:
    """How much the counters named `name` (summed over series matching `labels`) grew during the run."""
    return counter_delta(result.metrics_before, result.metrics_after, name, **labels)


def summarise(result: LoadResult, workflow: Workflow, config: LoadConfig) -> dict[str, Any]:
    """The `kvflow-ray run --json` object."""
    ok = [c for c in result.calls if c.error is None]
    warm = [c for c in ok if c.iteration > 0]  # each client's first pass is its warm-up
    routed = [c for c in warm if c.route != "plain"]
    prompt = {tier: _delta(result, "kvflow_prompt_tokens_total", tier=tier) for tier in ("gpu", "cpu", "miss")}
    all_prompt = sum(prompt.values()) or math.nan
    decisions = {o: _delta(result, "kvflow_router_decisions_total", outcome=o)
                 for o in ("affinity", "balanced", "cold")}
    errors = [c for c in result.calls if c.error is not None]
    return {
        "workflow": workflow.name,
        "clients": config.clients,
        "iterations": config.iterations,
        "calls": len(result.calls),
        "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "wall_s": round(result.wall_s, 3),
        "calls_per_s": round(len(ok) / result.wall_s, 3) if result.wall_s else None,
        "latency_s": summary_stats(result.iterations),
        "call_latency_s": summary_stats([c.latency_s for c in ok]),
        "gpu_hit_ratio": _ratio(prompt["gpu"], all_prompt),
        "cpu_hit_ratio": _ratio(prompt["cpu"], all_prompt),
        "cached_ratio": _ratio(sum(c.cached_tokens for c in ok), sum(c.prompt_tokens for c in ok) or math.nan),
        "reused_ratio": _ratio(sum(c.reused_tokens for c in ok), sum(c.prompt_tokens for c in ok) or math.nan),
        # prompt tokens computed: neither an exact prefix hit nor reused from a kept output
        "recomputed_prompt_tokens": sum(c.prompt_tokens - c.cached_tokens - c.reused_tokens for c in ok),
        "affinity_ratio_after_warmup": _ratio(sum(c.route == "affinity" for c in routed), len(routed) or math.nan),
        "router_decisions": {k: int(v) for k, v in decisions.items()},
        "prefetch": {o: int(_delta(result, "kvflow_prefetch_total", outcome=o))
                     for o in ("issued", "completed", "used", "wasted")},
        "prefetch_stall_s": round(_delta(result, "kvflow_prefetch_stall_seconds_sum"), 4),
        "replicas": dict(Counter(c.replica for c in ok)),
        "answers": _answers(ok, workflow),
    }


def _answers(calls: Sequence[CallRecord], workflow: Workflow) -> dict[str, str]:
    """One answer per agent role, in the workflow's order: client 0's latest, else another client's."""
    latest: dict[str, str] = {}
    for c in sorted(calls, key=lambda c: (c.client == 0, c.iteration)):  # the preferred one comes last
        latest[c.agent] = c.answer
    return {agent: latest[agent] for agent in workflow.spec.agents if agent in latest}


def _ratio(num: float, den: float) -> float | None:
    value = num / den
    return None if math.isnan(value) else round(value, 4)


def summary_stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50 and p99 of `values`, rounded (all None without values)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": round(sum(values) / len(values), 4), "p50": round(percentile(values, 0.5), 4),
            "p99": round(percentile(values, 0.99), 4)}
