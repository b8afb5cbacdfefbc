"""Faults injected into a running stack, as an operator meets them: a real redis-server with AOF (fsync
every second), real Ray Serve with two simulated-GPU replicas, and 16 clients running two passes of
the PEER workflow over HTTP, through two ingress replicas (each client's calls keyed to one by its
session header, as the SDK sends it), while, a few seconds in, Redis dies and comes back (with its
data, or empty), an engine replica is killed, the router actor is, or an ingress replica is. Every
test counts the workflows started, completed and failed and looks at the state after: no fault may
fail a workflow or have kvflow-ray answer a 500."""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis_proc import RedisProcess

ray = pytest.importorskip("ray")

from kvflow_ray.client import Workflow  # noqa: E402
from kvflow_ray.client.loadgen import iteration_stages  # noqa: E402
from kvflow_ray.client.workflow import SESSION_HEADER  # noqa: E402
from kvflow_ray.serve import replica_actors  # noqa: E402
from kvflow_ray.serve.app import LocalServer  # noqa: E402
from kvflow_ray.serve.config import AppConfig  # noqa: E402
from kvflow_ray.serve.router_actor import get_router  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PEER = Workflow.from_yaml(ROOT / "workflows" / "peer.yaml")
GRACE_S = 6.0  # the stack's store_grace_s: the Redis outages below are shorter, but for the last one
CLIENTS = 16
RESEND_AFTER_S = 30.0  # a call normally takes under 3 s here


@dataclass
class Outcome:
    """What the clients saw: per workflow instance, whether it completed; every HTTP status."""

    started: int = 0
    completed: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # client id -> its first error
    statuses: list[int] = field(default_factory=list)  # kvflow-ray's answers
    # Ray Serve's proxy's own 500s (not JSON), and calls it never answered (the client timed out)
    proxy_errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _post(url: str, body: dict[str, Any], timeout: float = 120, session: str | None = None
          ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One POST; a body that is not JSON (Ray Serve's proxy answering for a replica that died under
    the request) comes back as {"proxy": its text}."""
    headers = {"content-type": "application/json", **({SESSION_HEADER: session} if session else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        raw = error.read() or b"{}"
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"proxy": raw.decode(errors="replace")}
        return error.code, answer, {k.lower(): v for k, v in error.headers.items()}


def _call(server: LocalServer, client_id: str, agent: str, text: str, timeout: float = 120, max_tokens: int = 8
          ) -> tuple[int, dict[str, Any], dict[str, str]]:
    run = PEER.client(base_url=server.url + "/v1", client_id=client_id, register=False)
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": run.agent(agent).messages([{"role": "user", "content": text}]),
            "kvflow": run.metadata(agent)}
    return _post(server.url + "/v1/chat/completions", body, timeout, session=client_id)


def _finish(server: LocalServer, client_id: str, timeout: float = 120) -> tuple[int, dict[str, Any], dict[str, str]]:
    return _post(f"{server.url}/v1/clients/{client_id}/finish", {}, timeout, session=client_id)


def _answer(outcome: Outcome, send: Callable[[], tuple[int, dict[str, Any], dict[str, str]]],
            retry_proxy_errors: bool) -> tuple[int, dict[str, Any]]:
    """`send()`, recorded. With `retry_proxy_errors`, a 500 from Ray Serve's proxy (a request in flight
    on an ingress replica that was killed), or no answer at all (the proxy sometimes keeps a request
    it had for the dead replica until the client gives up), is sent again, as the OpenAI SDK does with
    a 500 or a timeout by default."""
    for attempt in range(3):
        try:
            status, body, _headers = send()
        except TimeoutError:
            if not (retry_proxy_errors and attempt < 2):
                raise
            with outcome.lock:
                outcome.proxy_errors.append("timed out")
            continue
        with outcome.lock:
            if status == 500 and "proxy" in body:
                outcome.proxy_errors.append(body["proxy"][:200])
            else:
                outcome.statuses.append(status)
        if not (retry_proxy_errors and status == 500 and "proxy" in body and attempt < 2):
            return status, body
        time.sleep(0.5)
    raise AssertionError("unreachable")


def _workflow(server: LocalServer, client_id: str, iterations: int, outcome: Outcome, finish: bool = True,
              retry_proxy_errors: bool = False) -> None:
    """One instance: `iterations` passes of the step graph (stages' agents concurrently), then finish.
    No retries (but for `_answer`'s): the first non-200 fails the workflow. Resending a call the proxy
    never answered waits RESEND_AFTER_S for it, not the default two minutes."""
    timeout = RESEND_AFTER_S if retry_proxy_errors else 120
    with outcome.lock:
        outcome.started += 1
    try:
        for iteration in range(iterations):
            for stage in iteration_stages(PEER):
                for agent in stage:
                    started = time.perf_counter()
                    text = f"{client_id} pass {iteration}"
                    status, body = _answer(outcome, lambda a=agent, t=text: _call(server, client_id, a, t, timeout),
                                           retry_proxy_errors)
                    with outcome.lock:
                        outcome.latencies.append(time.perf_counter() - started)
                    if status != 200:
                        raise RuntimeError(f"{agent}: HTTP {status} {body.get('error', {}).get('message')}")
        if finish:
            status, body = _answer(outcome, lambda: _finish(server, client_id, timeout), retry_proxy_errors)
            if status != 200:
                raise RuntimeError(f"finish: HTTP {status} {body.get('error', {}).get('message')}")
        with outcome.lock:
            outcome.completed += 1
    except Exception as exc:
        with outcome.lock:
            outcome.failed[client_id] = f"{type(exc).__name__}: {exc}"


def _run_with_fault(server: LocalServer, name: str, fault: Callable[[], None], at_s: float = 2.0,
                    iterations: int = 2, retry_proxy_errors: bool = False) -> Outcome:
    outcome = Outcome()
    threads = [threading.Thread(target=_workflow, args=(server, f"{name}-{i}", iterations, outcome),
                                kwargs={"retry_proxy_errors": retry_proxy_errors})
               for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    time.sleep(at_s)
    fault()
    for thread in threads:
        thread.join(timeout=600)
    latencies = sorted(outcome.latencies)
    print(f"\n{name}: started {outcome.started}, completed {outcome.completed}, failed {len(outcome.failed)}; "
          f"{len(latencies)} calls, p50 {latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s")
    return outcome


def _assert_clean(outcome: Outcome, proxy_errors: int = 0) -> None:
    """Every workflow completed, and kvflow-ray answered every call 200; at most `proxy_errors` calls
    met Ray Serve's proxy's own 500 or no answer (see `test_an_ingress_replica_killed_mid_run`)."""
    assert outcome.started == CLIENTS and not outcome.failed, outcome.failed
    assert outcome.completed == CLIENTS and 500 not in outcome.statuses
    assert set(outcome.statuses) == {200}
    assert len(outcome.proxy_errors) <= proxy_errors, outcome.proxy_errors


ENGINE_ACTOR = "SERVE_REPLICA::kvflow#EngineReplica#"  # + Serve's unique id: an engine replica's actor name


def _engine_actor(replica: str) -> Any:
    return ray.get_actor(ENGINE_ACTOR + replica, namespace="serve")


def _engine_replicas() -> list[str]:
    """The engine replicas alive now (Serve's unique ids)."""
    return [a["name"][len(ENGINE_ACTOR):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(ENGINE_ACTOR)]


def _router_stats() -> dict[str, Any]:
    return ray.get(get_router(create=False).stats.remote())


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def redis_server(free_port: Callable[[], int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(free_port(), tmp_path_factory.mktemp("redis-aof"), aof=True).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(redis_server: RedisProcess, free_port: Callable[[], int]) -> Iterator[LocalServer]:
    config = AppConfig(engine="sim", replicas=2, ingress_replicas=2, time_scale=0.05, redis=redis_server.url,
                       route_headers=True, store_grace_s=GRACE_S)
    with LocalServer(config, port=free_port()) as running:
        status, body, _headers = _post(running.url + "/v1/workflows", PEER.spec.to_dict())
        assert status == 200, body
        yield running


def _restart_redis(redis_server: RedisProcess, down_s: float, *, keep_data: bool) -> Callable[[], None]:
    def fault() -> None:
        redis_server.kill()
        if not keep_data:  # a restart without persistence: it comes back empty
            shutil.rmtree(redis_server.workdir)
            redis_server.workdir.mkdir()
        time.sleep(down_s)
        redis_server.start()
    return fault


def test_redis_killed_and_restarted_with_its_aof(server: LocalServer, redis_server: RedisProcess) -> None:
    outcome = _run_with_fault(server, "aof", _restart_redis(redis_server, 3.0, keep_data=True))
    _assert_clean(outcome)
    _wait(lambda: _router_stats()["reconciles"].get("reconnect", 0) >= 1, "the router never wrote its state back")
    # every store (the router actor's, each ingress's) is back, and every workflow finished: nothing
    # live is left (the ingresses' counts reach the router with their next sync)
    _wait(lambda: (stats := _router_stats())["store_up"] and stats["live_clients"] == 0,
          "a store stayed down or a client live", timeout_s=10)
    _wait(lambda: _router_stats()["pending_writes"] == 0, "queued writes never reached Redis")


def test_redis_restarted_empty_then_the_router_restarted(server: LocalServer, redis_server: RedisProcess) -> None:
    """The worst case of the issue: Redis loses everything mid-run, and later the router restarts. The
    router writes its state back when Redis answers again, so the restarted router still knows the
    template and the clients that were live, and serves them without anyone re-registering."""
    live = Outcome()
    for i in range(4):  # instances that stay live across both faults (they have not finished)
        _workflow(server, f"live-{i}", 1, live, finish=False)
    assert live.completed == 4
    outcome = _run_with_fault(server, "empty", _restart_redis(redis_server, 2.0, keep_data=False))
    _assert_clean(outcome)
    _wait(lambda: _router_stats()["reconciles"].get("data_loss", 0) >= 1, "the router never noticed the data loss")
    _wait(lambda: _router_stats()["pending_writes"] == 0, "the write-back never reached Redis")
    assert redis_server.keys() >= 1 + 4  # the template, the live clients (and locations, heartbeats)

    router = get_router(create=False)
    before = ray.get(router.ping.remote())
    ray.kill(router, no_restart=False)
    _wait(lambda: _ping() not in (None, before), "the router did not come back")
    # the live clients are the ingresses' (in memory, and in Redis again): the restarted router counts
    # them once every ingress has synced with it
    _wait(lambda: _router_stats()["live_clients"] == 4, "the live clients were not counted after the restart",
          timeout_s=10)
    for i in range(4):
        status, body, _headers = _call(server, f"live-{i}", "planner", "the second pass")  # the loop goes on
        assert status == 200, body
        assert _finish(server, f"live-{i}")[0] == 200


def _ping() -> str | None:
    try:
        return ray.get(get_router(create=False).ping.remote(), timeout=5)
    except Exception:  # dead or restarting
        return None


def test_a_killed_replica_is_forgotten_at_once_and_its_calls_retried(server: LocalServer) -> None:
    """The victim is a replica the router has calls on when it dies (a fixed choice may be one the
    router sent no client to, and then no call meets its death), so calls in flight on it, or sent to
    it before anyone knows, fail, and the ingress that saw it has the router forget it."""
    router = get_router(create=False)
    killed: list[str] = []

    def kill_replica() -> None:
        deadline = time.monotonic() + 10
        while not any((busy := ray.get(router.replicas.remote())).values()):
            assert time.monotonic() < deadline, "no replica had calls in flight"
            time.sleep(0.05)
        victim = max(busy, key=lambda name: busy[name])
        ray.kill(_engine_actor(victim), no_restart=True)
        killed.append(victim)

    outcome = _run_with_fault(server, "replica", kill_replica)
    _assert_clean(outcome)
    (victim,) = killed
    loads = ray.get(router.replicas.remote())
    assert victim not in loads  # well before the router would prune it as silent (STALE_REPLICA_S)
    _wait(lambda: not any(ray.get(router.replicas.remote()).values()), "a load counter stayed up after the calls")
    server.wait_ready(timeout_s=120)  # Serve replaced it; the replacement starts at 0
    assert sorted(ray.get(router.replicas.remote()).values()) == [0, 0]


def test_the_router_killed_mid_run(server: LocalServer) -> None:
    router = get_router(create=False)
    before = ray.get(router.ping.remote())
    outcome = _run_with_fault(server, "router", lambda: ray.kill(router, no_restart=False))
    _assert_clean(outcome)  # the ingresses route on their own: no call waited for the router
    _wait(lambda: _ping() not in (None, before), "the router did not come back")
    _wait(lambda: _router_stats()["live_clients"] == 0, "finished clients stayed live after the restart")
    # the restarted router met the replicas' event feeds mid-way and had their snapshots repair its view
    _wait(lambda: _router_stats()["actor_calls"].get("cache_snapshot", 0) >= 1, "no replica sent a snapshot")


def test_an_ingress_replica_killed_mid_run(server: LocalServer) -> None:
    """One of the two ingress replicas killed while calls routed through it are in flight (a long call
    of a client keyed to it is running, besides the workflows'). Its clients move to the other
    (Serve's consistent-hash ring), which recalls their state from Redis; the router actor takes the
    silent ingress for dead, so its calls in flight and its clients stop counting, and no replica's
    load and no finished client stays counted.

    The calls in flight on the killed process are answered by Ray Serve's proxy itself: a 500 with a
    text body (`ray/serve/_private/http_util.py` `get_http_response_status` maps the replica's
    RayActorError to 500; proxy middlewares, which could have retried, were removed from HTTPOptions).
    The proxy sometimes keeps instead a request it had for the dead replica until the client gives up.
    The clients send those again, as the OpenAI SDK does with a 500 or a timeout, and kvflow-ray itself
    answers no 500: at most one proxy error per client, and every workflow completes."""
    router = get_router(create=False)
    lost_before = _router_stats()["ingresses_lost"]
    names = {name["name"].rsplit("#", 1)[1]: name for name in ray.util.list_named_actors(all_namespaces=True)
             if name["name"].startswith("SERVE_REPLICA::kvflow#Ingress#")}
    assert len(names) == 2, names
    # a client the proxy keys to one ingress (the route headers name it), then a long call of it
    probe, victim = "", ""
    for i in range(40):
        status, body, headers = _call(server, f"probe-{i}", "planner", "which ingress?")
        assert status == 200, body
        if i == 0:
            victim = headers["x-kvflow-ingress"]
        elif headers["x-kvflow-ingress"] == victim:
            probe = f"probe-{i}"
            break
    assert probe, "no second client keyed to the same ingress in 40"
    long_call: list[int] = []

    def kill_ingress() -> None:
        run = PEER.client(base_url=server.url + "/v1", client_id=probe, register=False)
        body = {"model": "default", "max_tokens": 30_000, "ignore_eos": True, "kvflow": run.metadata("planner"),
                "messages": run.agent("planner").messages([{"role": "user", "content": "a long one"}])}
        caller = threading.Thread(target=lambda: long_call.append(
            _post(server.url + "/v1/chat/completions", body, session=probe)[0]))
        caller.start()
        time.sleep(1.0)  # the long call (seconds of simulated decoding) is under way on the victim
        _wait(lambda: _router_stats()["calls_by_ingress"].get(victim, 0) > 0, "nothing in flight on it",
              timeout_s=10)
        assert not long_call, long_call
        ray.kill(ray.get_actor(names[victim]["name"], namespace=names[victim]["namespace"]), no_restart=True)
        caller.join(timeout=60)

    outcome = _run_with_fault(server, "ingress", kill_ingress, retry_proxy_errors=True)
    print(f"proxy errors: {len(outcome.proxy_errors)} {outcome.proxy_errors[:1]}")
    _assert_clean(outcome, proxy_errors=CLIENTS)
    assert long_call == [500]  # the proxy's: the process answering it died
    _wait(lambda: not any(ray.get(router.replicas.remote()).values()), "a dead ingress's calls stayed counted")
    stats = _router_stats()
    assert stats["ingresses_lost"] == lost_before + 1
    assert stats["calls_in_flight"] == 0 and not stats["calls_by_ingress"]
    for i in range(int(probe.split("-")[1]) + 1):
        assert _finish(server, f"probe-{i}")[0] == 200
    _wait(lambda: _router_stats()["live_clients"] == 0, "a finished client stayed live")
    server.wait_ready(timeout_s=120)  # Serve replaced it


def test_an_outage_past_the_grace_period_answers_503_with_retry_after(
        server: LocalServer, redis_server: RedisProcess) -> None:
    """Past `store_grace_s`, calls that change state get a clear 503 with Retry-After, never a 500; once
    Redis is back they succeed again."""
    redis_server.kill()
    try:
        time.sleep(GRACE_S + 2.0)
        status, body, headers = _call(server, "late", "planner", "during a long outage")
        assert status == 503 and body["error"]["code"] == "store_unavailable" and "retry-after" in headers
        assert "unreachable" in body["error"]["message"] and "Traceback" not in json.dumps(body)
    finally:
        redis_server.start()
    _wait(lambda: _router_stats()["store_up"], "the router never saw Redis come back")
    status, body, _headers = _call(server, "late", "planner", "after the outage")
    assert status == 200, body
    assert _finish(server, "late")[0] == 200


def test_the_template_re_registered_mid_run(server: LocalServer) -> None:
    """A changed template registered while 16 clients run it: the live ones finish on the version they
    started with (no 400), and the next client gets the new one."""
    changed = PEER.spec.to_dict()
    changed["agents"]["planner"]["prompt"] += " Be brief."

    def re_register() -> None:
        status, body, _headers = _post(server.url + "/v1/workflows", changed)
        assert status == 200, body

    _assert_clean(_run_with_fault(server, "reregister", re_register))
    status, body, _headers = _post(server.url + "/v1/workflows", PEER.spec.to_dict())  # back, for the others
    assert status == 200, body


def test_forty_clients_hanging_up_mid_stream(server: LocalServer) -> None:
    """40 streamed calls whose clients disconnect once the stream starts, while 16 workflows run: nothing
    fails, and once the calls are over no replica's load stays counted."""
    address = urllib.parse.urlsplit(server.url)

    def hang_up(i: int) -> None:
        run = PEER.client(base_url=server.url + "/v1", client_id=f"gone-{i}", register=False)
        body = json.dumps({"model": "default", "max_tokens": 64, "ignore_eos": True, "stream": True,
                           "messages": run.agent("planner").messages([{"role": "user", "content": "go"}]),
                           "kvflow": run.metadata("planner")})
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        assert connection.getresponse().status == 200  # the stream has started: the call is running
        connection.close()  # (the simulated engine sends its tokens at the end: this is mid-call)

    def storm() -> None:
        threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(40)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)

    _assert_clean(_run_with_fault(server, "hangups", storm, at_s=1.0))
    router = get_router(create=False)
    _wait(lambda: not any(ray.get(router.replicas.remote()).values()), "a load counter stayed up after the hang-ups")


def test_a_stream_whose_replica_dies_before_it_sent_anything_is_retried(server: LocalServer) -> None:
    """A streamed call whose engine replica is killed before the stream carried anything (the simulated
    engine sends its tokens at the end) is retried elsewhere, unseen: the client reads a whole answer
    and [DONE], no error event; the dead replica is forgotten at once."""
    router = get_router(create=False)

    def running() -> list[str]:  # the engine replicas with a call in flight (Serve's count)
        return [name for name in _engine_replicas() if ray.get(_engine_actor(name).get_num_ongoing_requests.remote())]

    # no engine call left running (the earlier tests' hung-up streams): the one counted below is this one
    _wait(lambda: not running(), "engine calls of earlier tests still running")
    address = urllib.parse.urlsplit(server.url)
    run = PEER.client(base_url=server.url + "/v1", client_id="stream-victim", register=False)
    body = json.dumps({"model": "default", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                       "messages": run.agent("planner").messages([{"role": "user", "content": "go"}]),
                       "kvflow": run.metadata("planner")})
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
    connection.request("POST", "/v1/chat/completions", body,
                       {"Content-Type": "application/json", SESSION_HEADER: "stream-victim"})
    response = connection.getresponse()
    assert response.status == 200
    # the replica running it: the router's choice (x-kvflow-replica), unless Serve found that full
    _wait(lambda: bool(running()), "the stream never reached a replica", timeout_s=10)
    (victim,) = running()
    ray.kill(_engine_actor(victim), no_restart=True)
    events = [line[len("data: "):] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    connection.close()
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert victim not in ray.get(router.replicas.remote())
    _wait(lambda: not any(ray.get(router.replicas.remote()).values()), "a load counter stayed up after the stream")
    server.wait_ready(timeout_s=120)  # Serve replaced it


@contextlib.contextmanager
def _redeployed(server: LocalServer, **changes: Any) -> Iterator[AppConfig]:
    """The module's stack redeployed with `changes` to its config for one test, once its router routes
    to the new replicas only; then as it was (each deploy starts a new router: the PEER template is
    registered again; the last test's replicas stay in its view until they are pruned)."""
    original = server.config
    try:
        server.deploy(original.model_copy(update=changes))
        server.wait_ready(timeout_s=120)
        status, body, _headers = _post(server.url + "/v1/workflows", PEER.spec.to_dict())
        assert status == 200, body
        # the new router restores the old replicas' names from Redis; they go once silent (STALE_REPLICA_S)
        _wait(lambda: set(ray.get(get_router(create=False).replicas.remote())) == set(_engine_replicas()),
              "the replaced replicas stayed in the router's view")
        yield server.config
    finally:
        server.deploy(original)
        server.wait_ready(timeout_s=120)
        status, body, _headers = _post(server.url + "/v1/workflows", PEER.spec.to_dict())
        assert status == 200, body


def test_a_replica_killed_under_a_call_that_spilled_to_it(server: LocalServer) -> None:
    """With one call at a time per replica, a second call of the agent whose prompt replica A holds
    spills to B (the router chose A; Serve found A full). B is killed under it: the call is retried,
    and only B is forgotten. A, which the router chose but which did not fail, stays routable
    throughout, so the calls after it are answered at once, not 503 until A's next heartbeat."""
    with _redeployed(server, max_ongoing_requests=1):
        router = get_router(create=False)
        status, body, headers = _call(server, "spill", "planner", "warm up")
        assert status == 200, body
        chosen = headers["x-kvflow-replica"]
        replicas = _engine_replicas()
        assert chosen in replicas and len(replicas) == 2, (chosen, replicas)
        (other,) = [name for name in replicas if name != chosen]
        answers: list[tuple[int, dict[str, Any], dict[str, str]]] = []

        def long_call() -> None:
            answers.append(_call(server, "spill", "planner", "a long answer", max_tokens=2000))

        actors = {name: _engine_actor(name) for name in replicas}
        threads = [threading.Thread(target=long_call) for _ in range(2)]
        for thread in threads:
            thread.start()
        # both running: one on the chosen replica, the other spilled to the other one (Serve's count)
        _wait(lambda: all(ray.get(a.get_num_ongoing_requests.remote()) == 1 for a in actors.values()),
              "the second call did not spill", timeout_s=10)
        ray.kill(actors[other], no_restart=True)
        seen: list[dict[str, int]] = []
        deadline = time.monotonic() + 3.0  # a replica blamed by the retry is gone from then for DEAD_QUIET_S
        while time.monotonic() < deadline or any(t.is_alive() for t in threads):
            seen.append(ray.get(router.replicas.remote()))
            time.sleep(0.1)
        for thread in threads:
            thread.join()
        assert [a[0] for a in answers] == [200, 200], answers
        assert all(chosen in loads for loads in seen), "the replica the router chose was forgotten"
        assert other not in seen[-1]
        status, body, _headers = _call(server, "spill", "planner", "and now")
        assert status == 200, body
        # the retried call's count moved off the chosen replica: nothing stays counted there
        _wait(lambda: not any(ray.get(router.replicas.remote()).values()), "a load counter stayed up after the calls")


def test_a_dead_actors_error_names_its_replica(server: LocalServer) -> None:
    """What the ingress reads of a call that failed on a dead replica: the error's actor id, which the
    request router recorded for the replica (a real actor, killed, and a call to it)."""

    @ray.remote(num_cpus=0)
    class Doomed:
        def ping(self) -> str:
            return "pong"

    doomed = Doomed.remote()
    assert ray.get(doomed.ping.remote()) == "pong"
    replica_actors.record({"doomed-replica": doomed._actor_id.hex()})
    try:
        ray.kill(doomed, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError) as failed:
            ray.get(doomed.ping.remote(), timeout=30)
        assert replica_actors.replica_of(failed.value) == "doomed-replica"
        assert replica_actors.replica_of(RuntimeError("no actor named")) is None
    finally:
        replica_actors.forget([doomed._actor_id.hex()])
    assert replica_actors.replica_of(failed.value) is None
