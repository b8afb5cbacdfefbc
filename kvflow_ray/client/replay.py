"""A simulator scenario replayed against a running server, so serving and `kvflow-ray sim` can be
compared on one workload.

The simulator's own clients (`engines.sim.simulator.WorkflowClient`) walk each instance's step graph
and start its agents; here each agent call goes over HTTP instead of into a simulated replica: the
agent's fixed prompt and a fresh dynamic suffix as token ids (OpenAI's completions take a prompt of
token ids), the fixed-prompt boundary and the workflow in the `kvflow` metadata, each tenant with its
own API key. Instances start at their planned times on the server's clock (`time_scale` wall
seconds per simulated second, as the simulated engine's). The scenario's token ids are mapped into
the served model's vocabulary by a scrambling hash, so prompts that share a prefix still do and
prompts that do not share at most a token by chance.
"""

from __future__ import annotations

import heapq
import json
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvflow_ray.client.workflow import SESSION_HEADER
from kvflow_ray.core.predict import Forecaster
from kvflow_ray.engines.sim.simulator import ClientPlan, IterationRecord, WorkflowClient
from kvflow_ray.router.core import split_workflow_key

BYTE_VOCAB = 256  # the byte-level tokenizer's ordinary tokens (its specials lie above)


@dataclass
class ReplayResult:
    calls: int = 0
    prompt_tokens: int = 0  # what the answers' usage reported
    failures: list[str] = field(default_factory=list)
    iterations: list[IterationRecord] = field(default_factory=list)
    wall_s: float = 0.0


class HttpHost:
    """A `ClientHost` over HTTP: `WorkflowClient`s call agents through it, and it feeds each call's
    completion back to its client on the one thread that runs them all."""

    measuring = True

    def __init__(self, url: str, keys: Mapping[str, str], *, time_scale: float, vocab: int = BYTE_VOCAB,
                 workers: int = 32, seed: int = 0, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.keys = dict(keys)  # tenant -> its API key
        self.time_scale = time_scale
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.forecast = Forecaster("graph")
        self.iterations: list[IterationRecord] = []
        self.result = ReplayResult(iterations=self.iterations)
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(workers)
        self._done: queue.Queue[tuple[WorkflowClient, str]] = queue.Queue()
        self._in_flight = 0
        self._registered: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    @property
    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_scale

    # ------------------------------------------------------------------ ClientHost
    def register_prompts(self, workflow: str, prompts: dict[str, tuple[int, ...]], salt: str = "") -> None:
        return None  # the server's router sends replicas the prompts it learns from the calls

    def publish(self, workflow: str, steps: Mapping[str, float]) -> None:
        return None  # the server's router computes the steps from the calls it routes

    def retire(self, workflow: str) -> None:
        tenant, client = split_workflow_key(workflow)
        self._pool.submit(self._post, tenant, f"/v1/clients/{client}/finish", None, client)

    def call(self, client: WorkflowClient, agent: str) -> None:
        plan = client.plan
        tenant, client_id = split_workflow_key(plan.key)
        prompt = self._ids(plan.prompts[agent])
        dynamic = [self._rng.randrange(self.vocab) for _ in range(plan.dynamic)]
        meta: dict[str, Any] = {"client_id": client_id, "workflow": plan.spec.name, "agent": agent,
                                "fixed_prefix_tokens": len(prompt)}
        if (tenant, plan.spec.name) not in self._registered:  # its template, with its first call
            self._registered.add((tenant, plan.spec.name))
            meta["workflow_spec"] = plan.spec.to_dict()
        body = {"prompt": prompt + dynamic, "max_tokens": max(plan.output, 1), "ignore_eos": True,
                "temperature": 0, "kvflow": meta}
        with self._lock:
            self._in_flight += 1
        self._pool.submit(self._agent_call, client, agent, tenant, client_id, body)

    # ------------------------------------------------------------------ the run
    def run(self, plans: Sequence[ClientPlan]) -> ReplayResult:
        """Every plan's instance, each started at its `start_at`; returns when all have ended."""
        starts = [(plan.start_at, i, plan) for i, plan in enumerate(plans)]
        heapq.heapify(starts)
        started = time.perf_counter()
        self._t0 = time.monotonic()
        while starts or self._busy():
            wait = max(0.0, (starts[0][0] - self.now) * self.time_scale) if starts else 0.5
            try:
                client, agent = self._done.get(timeout=wait)
                client.on_done(agent)
            except queue.Empty:
                pass
            while starts and starts[0][0] <= self.now:
                _at, _i, plan = heapq.heappop(starts)
                WorkflowClient(self, plan).begin()  # type: ignore[arg-type]
        self._pool.shutdown(wait=True)  # the last finishes
        self.result.wall_s = time.perf_counter() - started
        return self.result

    def _busy(self) -> bool:
        with self._lock:
            return self._in_flight > 0 or not self._done.empty()

    def _agent_call(self, client: WorkflowClient, agent: str, tenant: str, client_id: str,
                    body: dict[str, Any]) -> None:
        try:
            answer = self._post(tenant, "/v1/completions", body, client_id)
        finally:
            with self._lock:
                self.result.calls += 1
        if answer is not None:
            with self._lock:
                self.result.prompt_tokens += int(answer.get("usage", {}).get("prompt_tokens", 0))
        self._done.put((client, agent))  # a failed call is counted, and its workflow goes on
        with self._lock:
            self._in_flight -= 1

    def _post(self, tenant: str, path: str, body: dict[str, Any] | None, client_id: str) -> dict[str, Any] | None:
        """The answer's JSON, or None when the call failed (counted in `failures`)."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body or {}).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.keys[tenant]}",
                     SESSION_HEADER: client_id})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except (urllib.error.URLError, OSError) as exc:
            detail = exc.read().decode(errors="replace")[:200] if isinstance(exc, urllib.error.HTTPError) else ""
            with self._lock:
                self.result.failures.append(f"{path}: {exc} {detail}".strip())
            return None

    def _ids(self, tokens: Sequence[int]) -> list[int]:
        """The scenario's token ids in the served vocabulary: the high bits of a multiplicative hash
        (equal ids stay equal, consecutive ones scatter)."""
        return [((((t * 2654435761) & 0xFFFFFFFF) * self.vocab) >> 32) for t in tokens]
