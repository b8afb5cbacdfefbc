"""End to end, for real: local Ray, the Serve app with 2 CPU-engine replicas, a real redis-server,
real HTTP through the OpenAI Python SDK, and a real Prometheus server scraping `/metrics`.

One app serves the whole module (starting it costs ~15 s); tests that break things (killing the
router, killing a replica) come last and leave the app serving.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from kvflow_ray.client import Workflow  # noqa: E402
from kvflow_ray.client.loadgen import LoadConfig, run_load, summarise  # noqa: E402
from kvflow_ray.serve.app import LocalServer  # noqa: E402
from kvflow_ray.serve.config import AppConfig  # noqa: E402

pytestmark = pytest.mark.slow
PEER = Workflow.from_yaml(Path(__file__).resolve().parents[1] / "workflows" / "peer.yaml")
KEYS = {"key-acme": "acme", "key-beta": "beta"}
ORDER = ["planner", "executor", "expresser", "reviewer"]


@pytest.fixture(scope="module")
def server(redis_url: str, free_port: Callable[[], int]) -> Iterator[LocalServer]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    # A small device pool (prompts + a few requests) so that eviction, the host tier and prefetch all run.
    config = AppConfig(model="random", replicas=2, redis=redis_url, api_keys=KEYS, route_headers=True,
                       device_kv_tokens=1536, host_kv_tokens=16384, max_running=8, threads=1)
    with LocalServer(config, port=free_port(), num_cpus=2) as local:
        yield local


class _Response:
    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code, self.content = status_code, body
        self.text = body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)

    def raise_for_status(self) -> None:
        assert self.status_code < 400, f"HTTP {self.status_code}: {self.text}"


def _http(server: LocalServer, method: str, path: str, key: str | None = "key-acme", json_body: Any = None,
          content: bytes | None = None) -> _Response:
    """Plain HTTP (urllib), so the tests see exactly what any client sees."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if json_body is not None:
        content = json.dumps(json_body).encode()
    if content is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(server.url + path, data=content, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return _Response(response.status, response.read())
    except urllib.error.HTTPError as exc:
        return _Response(exc.code, exc.read())


def _metrics(server: LocalServer) -> str:
    return _http(server, "GET", "/metrics", key=None).text


def _sdk(server: LocalServer, key: str = "key-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, client_id: str, agent: str, workflow: str | None = "peer", text: str = "go",
          max_tokens: int = 8) -> Any:
    meta: dict[str, Any] = {"client_id": client_id, "agent": agent}
    if workflow:
        meta["workflow"] = workflow
    prompt = PEER.spec.agents[agent].prompt
    return client.chat.completions.with_raw_response.create(
        model="kvflow-cpu-random", max_tokens=max_tokens, temperature=0, extra_body={"kvflow": meta},
        messages=[{"role": "system", "content": prompt}, {"role": "user", "content": text}])


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------------------------- serving
def test_concurrent_peer_workflows_route_to_their_prefix_and_export_metrics(server: LocalServer,
                                                                          prometheus_factory: Any) -> None:
    prometheus = prometheus_factory(urllib.parse.urlsplit(server.url).netloc)
    load = LoadConfig(clients=8, iterations=3, max_tokens=16, task_chars=300, api_key="key-acme")
    result = run_load(PEER, server.url, load, progress=False)
    summary = summarise(result, PEER, load)

    assert summary["errors"] == 0, summary["first_error"]
    assert len(result.calls) == 8 * 3 * 4
    for call in result.calls:  # well-formed: usage adds up, the route and replica are reported
        assert call.prompt_tokens > 0 and 0 <= call.cached_tokens <= call.prompt_tokens
        assert call.route in ("affinity", "balanced", "cold") and call.replica != "?"
    assert len(summary["replicas"]) == 2, "both replicas served"
    warm = [c for c in result.calls if c.iteration > 0]
    on_holder = sum(c.route == "affinity" for c in warm) / len(warm)
    assert on_holder >= 0.9, summary
    # landing on the holder pays off: after warm-up most prompt tokens come from a cache tier
    assert sum(c.cached_tokens for c in warm) / sum(c.prompt_tokens for c in warm) > 0.4

    # Prometheus scrapes /metrics: the hit-ratio and prefetch series of docs/design.md §9, non-zero
    queries = {
        'sum(kvflow_prompt_tokens_total{tier="gpu"})': "device hits",
        'sum(kvflow_prompt_tokens_total{tier="cpu"})': "host hits",
        'sum(kvflow_prompt_tokens_total{tier="gpu"}) / sum(kvflow_prompt_tokens_total)': "device hit ratio",
        'sum(kvflow_prefetch_total{outcome="issued"})': "prefetches issued",
        'sum(kvflow_prefetch_total{outcome="completed"})': "prefetches completed",
        'sum(kvflow_evicted_tokens_total)': "evictions",
        "sum(kvflow_router_decisions_total)": "router decisions",
        "sum(kvflow_request_latency_seconds_count)": "requests",
    }
    deadline = time.monotonic() + 60
    missing = dict(queries)
    while missing and time.monotonic() < deadline:
        for expr in list(missing):
            data = prometheus.query(expr)
            if data and float(data[0]["value"][1]) > 0:
                del missing[expr]
        time.sleep(1)
    assert not missing, f"no non-zero data in Prometheus for {missing}"
    per_replica = prometheus.query('kvflow_prompt_tokens_total{tier="gpu"}')
    assert {s["metric"]["replica"] for s in per_replica} == set(summary["replicas"])


def test_streaming_chat_and_completions(server: LocalServer) -> None:
    client = _sdk(server)
    stream = client.chat.completions.create(
        model="kvflow-cpu-random", max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": PEER.spec.agents["planner"].prompt},
                  {"role": "user", "content": "stream it"}],
        extra_body={"kvflow": {"client_id": "stream-1", "workflow": "peer", "agent": "planner"}, "ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert chunks[-2].choices[0].finish_reason == "length" and text

    plain = client.completions.create(model="kvflow-cpu-random", prompt="plain request, no workflow", max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 5 and plain.choices[0].finish_reason == "length"
    _http(server, "POST", "/v1/clients/stream-1/finish").raise_for_status()


def test_models_health_and_workflow_lookup(server: LocalServer) -> None:
    assert _http(server, "GET", "/health", key=None).json()["status"] == "ok"
    assert [m.id for m in _sdk(server).models.list()] == ["kvflow-cpu-random"]
    registered = _http(server, "POST", "/v1/workflows", json_body=PEER.spec.to_dict())
    assert registered.status_code == 200 and registered.json()["name"] == "peer"
    assert _http(server, "GET", "/v1/workflows/peer").json()["agents"]["planner"]["after"] == ["reviewer"]


# ---------------------------------------------------------------------------------------------- bad input
def _error(response: _Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    return error["message"]


def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server: LocalServer) -> None:
    chat = "/v1/chat/completions"
    base = {"model": "kvflow-cpu-random", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert "not valid JSON" in _error(_http(server, "POST", chat, content=b"{not json"), 400)
    assert "'kvflow' must be an object" in _error(
        _http(server, "POST", chat, json_body={**base, "kvflow": "peer"}), 400)
    assert "kvflow.agent" in _error(
        _http(server, "POST", chat, json_body={**base, "kvflow": {"client_id": "x"}}), 400)
    assert "unknown parameter 'kvflow.tenant'" in _error(_http(server, "POST", chat, json_body={
        **base, "kvflow": {"client_id": "x", "agent": "planner", "tenant": "beta"}}), 400)
    assert "unknown workflow 'nope'" in _error(_http(server, "POST", chat, json_body={
        **base, "kvflow": {"client_id": "x", "agent": "planner", "workflow": "nope"}}), 404)
    _http(server, "POST", "/v1/workflows", json_body=PEER.spec.to_dict()).raise_for_status()
    message = _error(_http(server, "POST", chat, json_body={
        **base, "kvflow": {"client_id": "bad-agent", "agent": "ghost", "workflow": "peer"}}), 400)
    assert "ghost" in message and "planner" in message
    assert "unknown client" in _error(_http(server, "POST", chat, json_body={
        **base, "kvflow": {"client_id": "never-started", "agent": "planner"}}), 404)
    # oversized: beyond the model's context (ingress), and beyond the device pool (engine)
    huge = {**base, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert "context" in _error(_http(server, "POST", chat, json_body=huge), 400)
    big = {**base, "messages": [{"role": "user", "content": "x" * 2000}]}
    assert "device KV pool" in _error(_http(server, "POST", chat, json_body=big), 400)
    assert "max_tokens" in _error(_http(server, "POST", chat, json_body={**base, "max_tokens": 0}), 400)
    assert "does not exist" in _error(_http(server, "POST", chat, json_body={**base, "model": "gpt-9"}), 404)
    # malformed workflow specs name the field
    bad_spec = {"name": "broken", "agents": {"a": {"after": ["zzz"]}}}
    assert "zzz" in _error(_http(server, "POST", "/v1/workflows", json_body=bad_spec), 400)
    assert "name" in _error(_http(server, "POST", "/v1/workflows", json_body={"name": "bad name!", "agents": {}}), 400)
    assert "unknown client" in _error(_http(server, "POST", "/v1/clients/never-started/finish"), 404)
    # ... and nothing was lost: a normal call still works
    ok = _chat(_sdk(server), "after-bad-input", "planner")
    assert ok.parse().choices[0].message.content is not None
    assert _http(server, "GET", "/health", key=None).json()["status"] == "ok"


def test_a_workflow_spec_can_come_inline_with_the_first_call(server: LocalServer) -> None:
    inline = {**PEER.spec.to_dict(), "name": "peer-inline"}
    body = {"max_tokens": 4, "messages": [{"role": "system", "content": PEER.spec.agents["planner"].prompt},
                                          {"role": "user", "content": "inline"}],
            "kvflow": {"client_id": "inline-1", "agent": "planner", "workflow_spec": inline}}
    first = _http(server, "POST", "/v1/chat/completions", json_body=body)
    assert first.status_code == 200, first.text
    assert _http(server, "GET", "/v1/workflows/peer-inline").json()["name"] == "peer-inline"  # registered
    follow = {**body, "kvflow": {"client_id": "inline-1", "agent": "executor"}}  # the client is known now
    assert _http(server, "POST", "/v1/chat/completions", json_body=follow).status_code == 200
    clash = {**body, "kvflow": {**body["kvflow"], "client_id": "inline-2", "workflow": "other"}}
    assert "differs from the inline spec" in _error(_http(server, "POST", "/v1/chat/completions", json_body=clash), 400)
    broken = {**body, "kvflow": {**body["kvflow"], "client_id": "inline-3", "workflow_spec": {"name": "x"}}}
    assert "agents" in _error(_http(server, "POST", "/v1/chat/completions", json_body=broken), 400)
    _http(server, "POST", "/v1/clients/inline-1/finish").raise_for_status()


# ---------------------------------------------------------------------------------------------- tenancy
def test_tenants_cannot_see_finish_or_steer_each_other(server: LocalServer) -> None:
    acme, beta = _sdk(server, "key-acme"), _sdk(server, "key-beta")
    assert _error(_http(server, "POST", "/v1/chat/completions", key=None, json_body={}), 401)
    assert "invalid API key" in _error(_http(server, "POST", "/v1/chat/completions", key="stolen", json_body={}), 401)
    # acme registers a template only it has; beta cannot read it, even by name
    private = {**PEER.spec.to_dict(), "name": "acme-only"}
    _http(server, "POST", "/v1/workflows", key="key-acme", json_body=private).raise_for_status()
    assert _http(server, "GET", "/v1/workflows/acme-only", key="key-acme").status_code == 200
    _error(_http(server, "GET", "/v1/workflows/acme-only", key="key-beta"), 404)
    # both use client id "shared-id" with a workflow named "peer": two separate instances
    _http(server, "POST", "/v1/workflows", key="key-beta", json_body=PEER.spec.to_dict()).raise_for_status()
    _chat(acme, "shared-id", "planner")
    _error(_http(server, "POST", "/v1/chat/completions", key="key-beta", json_body={
        "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        "kvflow": {"client_id": "shared-id", "agent": "executor"}}), 404)  # beta cannot steer acme's instance
    _error(_http(server, "POST", "/v1/clients/shared-id/finish", key="key-beta"), 404)  # nor finish it
    _chat(beta, "shared-id", "planner")  # beta's own instance with the same name
    _http(server, "POST", "/v1/clients/shared-id/finish", key="key-beta").raise_for_status()
    # acme's instance is untouched: its next agent is in order (no deviation) and it can still finish
    before = _sample(_metrics(server), "kvflow_workflow_deviations_total", tenant="acme")
    _chat(acme, "shared-id", "executor", workflow=None)
    assert _sample(_metrics(server), "kvflow_workflow_deviations_total", tenant="acme") == before
    _http(server, "POST", "/v1/clients/shared-id/finish", key="key-acme").raise_for_status()


def test_hints_are_advisory_deviations_are_served_and_counted(server: LocalServer) -> None:
    client = _sdk(server)
    before = _sample(_metrics(server), "kvflow_workflow_deviations_total", tenant="acme")
    _chat(client, "deviant", "planner")
    response = _chat(client, "deviant", "reviewer", workflow=None)  # the graph expects the executor
    assert response.status_code == 200 and response.parse().choices[0].message.content is not None
    assert _sample(_metrics(server), "kvflow_workflow_deviations_total", tenant="acme") == before + 1
    _chat(client, "deviant", "planner", workflow=None)  # follows what ran: planner comes after the reviewer
    assert _sample(_metrics(server), "kvflow_workflow_deviations_total", tenant="acme") == before + 1
    _http(server, "POST", "/v1/clients/deviant/finish").raise_for_status()


# ---------------------------------------------------------------------------------------------- failures
def _drive(server: LocalServer, client_ids: list[str], iterations: int, errors: list[str],
           pause: threading.Event | None = None) -> list[threading.Thread]:
    """PEER loops in threads; every failure is recorded. `pause` is set after each client's first call."""
    def one(cid: str) -> None:
        client = _sdk(server)
        try:
            for it in range(iterations):
                for agent in ORDER:
                    response = _chat(client, cid, agent, text=f"{cid} iteration {it}")
                    if response.status_code != 200:
                        errors.append(f"{cid} {agent}: HTTP {response.status_code}")
                    if pause is not None:
                        pause.set()
            _http(server, "POST", f"/v1/clients/{cid}/finish").raise_for_status()
        except Exception as exc:
            errors.append(f"{cid}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(cid,)) for cid in client_ids]
    for thread in threads:
        thread.start()
    return threads


def _loads(server: LocalServer) -> dict[str, int]:
    from kvflow_ray.serve.router_actor import get_router

    return ray.get(get_router(create=False).replicas.remote())


def _wait_idle(server: LocalServer, what: str) -> None:
    deadline = time.monotonic() + 60
    while any(_loads(server).values()):
        assert time.monotonic() < deadline, f"{what}: the router still counts load {_loads(server)}"
        time.sleep(0.25)


def test_clients_that_hang_up_mid_stream_leave_no_load_behind(server: LocalServer) -> None:
    import http.client
    from urllib.parse import urlsplit

    _wait_idle(server, "before")
    address = urlsplit(server.url)
    prompt = PEER.spec.agents["planner"].prompt
    for i in range(6):
        body = json.dumps({"model": "kvflow-cpu-random", "max_tokens": 48, "ignore_eos": True, "stream": True,
                           "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "go"}],
                           "kvflow": {"client_id": f"hangup-{i}", "workflow": "peer", "agent": "planner"}})
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        connection.request("POST", "/v1/chat/completions", body,
                           {"Authorization": "Bearer key-acme", "Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event has arrived: the call is running
        connection.close()  # hang up mid-stream
    _wait_idle(server, "after 6 clients hung up")


def test_finishing_a_client_during_its_call_still_returns_the_answer(server: LocalServer) -> None:
    client = _sdk(server)
    prompt = PEER.spec.agents["planner"].prompt
    stream = client.chat.completions.create(
        model="kvflow-cpu-random", max_tokens=32, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "kvflow": {"client_id": "finish-mid-call", "workflow": "peer",
                                                    "agent": "planner"}},
        messages=[{"role": "system", "content": prompt}, {"role": "user", "content": "go"}])
    chunks = iter(stream)
    first = next(chunks)  # the first event has arrived: the call is routed and running
    finished = _http(server, "POST", "/v1/clients/finish-mid-call/finish")
    assert finished.status_code == 200, finished.text
    rest = list(chunks)  # the answer still comes back, to its end
    text = "".join(chunk.choices[0].delta.content or "" for chunk in [first, *rest] if chunk.choices)
    assert text
    assert [chunk.choices[0].finish_reason for chunk in rest if chunk.choices and chunk.choices[0].finish_reason] \
        == ["length"]
    # the client is over: a new call of it must name its workflow again (a new instance)
    assert "unknown client" in _error(_http(server, "POST", "/v1/chat/completions", json_body={
        "model": "kvflow-cpu-random", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "kvflow": {"client_id": "finish-mid-call", "agent": "planner"}}), 404)
    _wait_idle(server, "after the finished client's call")


def test_router_restart_loses_no_workflow_state(server: LocalServer) -> None:
    from kvflow_ray.serve.router_actor import get_router

    router = get_router(create=False)
    first = ray.get(router.ping.remote())
    errors: list[str] = []
    started = threading.Event()
    threads = _drive(server, [f"restart-{i}" for i in range(4)], iterations=2, errors=errors, pause=started)
    assert started.wait(60)
    time.sleep(1.0)
    ray.kill(router, no_restart=False)  # mid-run: Ray restarts it; it reloads from Redis
    for thread in threads:  # the calls need no router actor: the ingress routes them
        thread.join(timeout=300)
    assert not errors, errors
    _router_back(router, first)
    # the restarted router still knows the templates, and the ingress a client mid-workflow, in order
    client = _sdk(server)
    deviations = _sample(_metrics(server), "kvflow_workflow_deviations_total", tenant="acme")
    _chat(client, "resumed", "planner")
    # the store is written behind the calls (within FLUSH_PERIOD_S): a kill loses what was not written yet
    deadline = time.monotonic() + 30
    while (stats := ray.get(router.stats.remote()))["pending_writes"] or stats["calls_in_flight"]:
        assert time.monotonic() < deadline, "the router never wrote the call's end to Redis"
        time.sleep(0.05)
    second = ray.get(router.ping.remote())
    ray.kill(router, no_restart=False)
    _router_back(router, second)
    response = _chat(client, "resumed", "executor", workflow=None)  # a client that names no workflow
    assert response.status_code == 200
    assert _sample(_metrics(server), "kvflow_workflow_deviations_total", tenant="acme") == deviations  # in order
    assert _http(server, "GET", "/v1/workflows/peer").status_code == 200


def _router_back(router: object, before: str) -> None:
    """Until Ray has restarted the router actor (a new incarnation answers)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(router.ping.remote(), timeout=5) != before:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # dead, or restarting
        assert time.monotonic() < deadline, "the router did not come back"
        time.sleep(0.2)


def test_replica_loss_moves_workflows_to_the_survivor(server: LocalServer) -> None:
    from kvflow_ray.serve.router_actor import get_router

    router = get_router(create=False)
    replicas = sorted(ray.get(router.replicas.remote()))
    assert len(replicas) == 2
    errors: list[str] = []
    started = threading.Event()
    threads = _drive(server, [f"loss-{i}" for i in range(4)], iterations=2, errors=errors, pause=started)
    assert started.wait(60)
    time.sleep(0.5)
    victim = replicas[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::kvflow#EngineReplica#{victim}", namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    # the router forgets it: at once when a call fails on it, else when its heartbeats stop (15 s)
    deadline = time.monotonic() + 60
    while victim in ray.get(router.replicas.remote()):
        assert time.monotonic() < deadline, "the router still lists the killed replica"
        time.sleep(0.5)
    # Serve replaces the replica; the app is whole again
    server.wait_ready(timeout_s=120)
    assert len(json.loads(_http(server, "GET", "/health", key=None).text)["replicas"]) == 2
