"""The serving stack on simulated GPUs: `engine: sim` replicas (A10G timing from the profile, made-up
tokens) behind the same ingress, router and Ray Serve request router; real Ray, real HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kvflow_ray.client import Workflow  # noqa: E402
from kvflow_ray.client.loadgen import LoadConfig, application_variants, run_load, summarise  # noqa: E402
from kvflow_ray.serve.app import LocalServer  # noqa: E402
from kvflow_ray.serve.config import AppConfig  # noqa: E402

pytestmark = pytest.mark.slow
PEER = Workflow.from_yaml(Path(__file__).resolve().parents[1] / "workflows" / "peer.yaml")



@pytest.fixture(scope="module")
def server(free_port: Callable[[], int]) -> Iterator[LocalServer]:
    config = AppConfig(engine="sim", replicas=3, ingress_replicas=2, time_scale=0.05, route_headers=True)
    with LocalServer(config, port=free_port(), num_cpus=2) as local:
        yield local


def test_simulated_gpu_replicas_serve_workflows_with_affinity(server: LocalServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["sim-a10g-llama3.1-8b"]
    apps = application_variants(PEER, 3, preamble_chars=3000)
    load = LoadConfig(clients=6, iterations=3, max_tokens=8)
    result = run_load(apps, server.url, load, progress=False)
    summary = summarise(result, apps[0], load)
    assert summary["errors"] == 0, summary["first_error"]
    assert len(summary["replicas"]) == 3  # the applications spread over the replicas
    assert summary["affinity_ratio_after_warmup"] >= 0.9
    assert summary["gpu_hit_ratio"] > 0.6  # each application's preamble is computed about once per replica
    for call in result.calls:
        assert call.prompt_tokens > 3000 and call.cached_tokens <= call.prompt_tokens
    # the router ran the simulator's default policy, with the inputs it reads: each call's first token
    # came back from its replica (with the cache events, within a push period)
    from kvflow_ray.serve.router_actor import get_router

    router = get_router(create=False)
    deadline = time.monotonic() + 10
    while (stats := ray.get(router.stats.remote()))["first_tokens"] < len(result.calls) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["routing"] == "WorkflowRouter"
    assert stats["first_tokens"] == len(result.calls)


def test_each_clients_calls_stay_on_one_ingress_replica(server: LocalServer) -> None:
    """The SDK names the client in the session header; Serve's consistent-hash router keeps all of a
    client's calls on one ingress replica, and the clients spread over both."""
    seen: dict[str, set[str]] = {}
    for k in range(16):  # all on one of two replicas by chance: 2 in 65,536
        run = PEER.client(base_url=server.url + "/v1", client_id=f"sticky-{k}", register=k == 0)
        for agent in ("planner", "executor"):
            handle = run.agent(agent)
            raw = run.openai.chat.completions.with_raw_response.create(
                model="default", messages=handle.messages([{"role": "user", "content": f"task {k}"}]), max_tokens=2,
                extra_body={"kvflow": run.metadata(agent)})
            seen.setdefault(run.client_id, set()).add(raw.headers["x-kvflow-ingress"])
        run.finish()
    assert all(len(ingresses) == 1 for ingresses in seen.values()), seen
    assert len(set().union(*seen.values())) == 2, seen


def test_forced_tool_choice_is_refused_where_the_engine_cannot_constrain(server: LocalServer) -> None:
    """The simulated engine has no constrained decoding: a forced tool choice is a 400 that says so, never
    an unforced answer; tool_choice auto is served (its made-up text parsed for calls)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    ask = [{"role": "user", "content": "Time?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="default", messages=ask, tools=tools, tool_choice=choice,
                                           max_tokens=96)
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "tool_choice" and body["code"] == "unsupported_parameter"
        assert "this engine (sim) does not support forced tool choice" in body["message"]
    served = client.chat.completions.create(model="default", messages=ask, tools=tools, max_tokens=4)
    assert served.choices[0].finish_reason in ("stop", "length") and not served.choices[0].message.tool_calls
