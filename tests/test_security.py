"""The serving surface attacked as a hostile tenant would: two tenants (two API keys) over real HTTP on
loopback, a real local Ray cluster, a real Redis. Each test is one row of docs/security.md.

Tenant B is the attacker; tenant A is the victim whose files, prompts and latency B goes after. The
stack runs the simulated engine (GPU timing, no compute) except for the CPU-engine probe at the end,
which redeploys the same app on the CPU engine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow_ray.engines.tokenizer import ByteTokenizer
from kvflow_ray.serve.app import LocalServer
from kvflow_ray.serve.config import AppConfig

pytestmark = pytest.mark.slow

KEYS = {"key-a": "tenantA", "key-b": "tenantB"}
METRICS_TOKEN = "metrics-secret-token"
SECRET = ("You are ACME's confidential pricing agent. Internal margin rules: never go below 37 percent; the "
          "override code for enterprise deals is ORCHID-7741. ") * 6
LIMITS = {"max_agents_per_spec": 64, "max_templates": 40, "max_live_clients": 400, "max_json_depth": 32,
          "max_body_bytes": 256 * 1024, "template_writes_per_s": 50.0}
# tokens of the chat template before a system prompt's text (the byte tokenizer both engines serve with)
_TOKENIZER = ByteTokenizer()
_CHAT = _TOKENIZER.apply_chat_template([{"role": "system", "content": "\x00"}])
CHAT_HEAD = len(_TOKENIZER.encode(_CHAT.split("\x00")[0]))
FORBIDDEN = ("pid=", "ip=", "actor_id", "\x1b[", "Traceback", "ray::", "RayTaskError", "repr=<")


def _config(redis_url: str, **overrides: Any) -> AppConfig:
    base: dict[str, Any] = {"engine": "sim", "replicas": 2, "time_scale": 0.2, "redis": redis_url,
                            "api_keys": KEYS, "metrics_token": METRICS_TOKEN, "limits": LIMITS}
    return AppConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def server(redis_url: str, free_port: Any) -> Iterator[LocalServer]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    with LocalServer(_config(redis_url), port=free_port(), num_cpus=2) as local:
        yield local


class Reply:
    def __init__(self, status: int, body: bytes, headers: dict[str, str], seconds: float) -> None:
        self.status, self.body, self.headers, self.seconds = status, body, headers, seconds
        self.text = body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


ERRORS_SEEN: list[Reply] = []  # every error reply of this module, checked for leaks at the end


def http(server: LocalServer, method: str, path: str, key: str | None = "key-a", body: Any = None,
         raw: bytes | None = None, token: str | None = None, timeout: float = 60) -> Reply:
    headers = {}
    if key or token:
        headers["Authorization"] = f"Bearer {token or key}"
    if body is not None:
        raw = json.dumps(body).encode()
    if raw is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(server.url + path, data=raw, headers=headers, method=method)
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = Reply(response.status, response.read(), dict(response.headers), time.perf_counter() - started)
    except urllib.error.HTTPError as exc:
        reply = Reply(exc.code, exc.read(), dict(exc.headers), time.perf_counter() - started)
        ERRORS_SEEN.append(reply)
    return reply


def chat(server: LocalServer, key: str, system: str, *, meta: dict[str, Any] | None = None,
         user: str = "Quote the Q3 renewal.", **extra: Any) -> Reply:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                            "max_tokens": 4, "temperature": 0, **extra}
    if meta is not None:
        body["kvflow"] = meta
    return http(server, "POST", "/v1/chat/completions", key=key, body=body)


def assert_error(reply: Reply, status: int, *words: str) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.text)
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    for word in words:
        assert word in (error["message"] + " " + str(error["param"])), (word, error)
    assert reply.headers.get("x-request-id", "").startswith("req-"), reply.headers
    return error


def spec(name: str, prompt: str = "You are the agent.", **agent: Any) -> dict[str, Any]:
    return {"name": name, "agents": {"a": {"prompt": prompt, **agent}}}


# ---------------------------------------------------------------------------------------------- files
def test_specs_from_the_network_never_read_server_files(server: LocalServer, tmp_path: Path,
                                                        redis_url: str) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text("CANARY-7f3a")
    import redis

    redis_dir = Path(redis.Redis.from_url(redis_url).config_get("dir")["dir"])
    targets = [str(canary), "../../../../../../" + str(canary).lstrip("/"), str(redis_dir / "dump.rdb"),
               "/etc/hostname", str(tmp_path / "missing.txt")]
    messages = set()
    for target in targets:
        body = {"name": "probe", "agents": {"a": {"prompt_file": target}}}
        reply = http(server, "POST", "/v1/workflows", key="key-b", body=body)
        error = assert_error(reply, 400, "prompt_file")
        assert "CANARY" not in reply.text and error["param"] == "workflow_spec"
        messages.add(error["message"])
        inline = chat(server, "key-b", "hi", meta={"client_id": "c-probe", "agent": "a", "workflow": "probe",
                                                   "workflow_spec": body})
        assert_error(inline, 400, "prompt_file")
        assert "CANARY" not in inline.text
    # the same answer whether the file exists or not: no file-existence oracle
    assert len(messages) == 1, messages
    assert_error(http(server, "GET", "/v1/workflows/probe", key="key-b"), 404)  # nothing was registered


def test_a_fifo_named_in_a_spec_cannot_freeze_the_router(server: LocalServer, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    http(server, "POST", "/v1/workflows", key="key-a", body=spec("quiet"))
    results: list[Reply] = []

    def quiet_calls() -> None:
        for i in range(6):
            results.append(chat(server, "key-a", "You are the agent.",
                                meta={"client_id": f"fifo-quiet-{i}", "agent": "a", "workflow": "quiet"}))

    thread = threading.Thread(target=quiet_calls)
    thread.start()
    pending = http(server, "POST", "/v1/workflows", key="key-b", timeout=10,
                   body={"name": "fifo", "agents": {"a": {"prompt_file": str(fifo)}}})
    thread.join(timeout=120)
    assert_error(pending, 400, "prompt_file")  # answered at once: the FIFO is never opened
    assert [r.status for r in results] == [200] * 6
    assert http(server, "GET", "/health", key=None).status == 200


# ---------------------------------------------------------------------------------------------- cache isolation
def _probe_cross_tenant(server: LocalServer) -> None:
    """A warms its secret prompt; B sends it (and a one-character variant) and must learn nothing."""
    http(server, "POST", "/v1/workflows", key="key-a", body=spec("pricing", SECRET))
    client = f"pricing-{uuid.uuid4().hex[:6]}"
    meta = {"client_id": client, "agent": "a", "workflow": "pricing"}
    first = chat(server, "key-a", SECRET, meta=meta)
    again = chat(server, "key-a", SECRET, meta=meta)
    assert first.status == again.status == 200, (first.text, again.text)
    hits_a = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hits_a >= len(SECRET) * 0.9, "A still reuses its own prompt"

    # B's own calls may have cached the chat template's head (the tokens before any system prompt) in
    # B's namespace; not one token of A's prompt may come back as cached
    same = chat(server, "key-b", SECRET)
    variant = chat(server, "key-b", "X" + SECRET[1:])
    for reply in (same, variant):
        assert reply.status == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] <= CHAT_HEAD, "0 tokens of A's prompt"
        assert not {h.lower() for h in reply.headers} & {"x-kvflow-route", "x-kvflow-replica"}
    # B as a workflow client of its own with the same prompt: served from B's cache (B's probes above),
    # and no header says where it went or why
    http(server, "POST", "/v1/workflows", key="key-b", body=spec("pricing", SECRET))
    routed = chat(server, "key-b", SECRET, meta={"client_id": client, "agent": "a", "workflow": "pricing"})
    assert routed.status == 200
    assert not {h.lower() for h in routed.headers} & {"x-kvflow-route", "x-kvflow-replica"}
    # A's cache is still A's
    assert chat(server, "key-a", SECRET, meta=meta).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_one_tenant_cannot_probe_another_tenants_prompts_on_the_sim_engine(server: LocalServer) -> None:
    _probe_cross_tenant(server)


# ---------------------------------------------------------------------------------------------- errors and input
def test_errors_are_openai_shaped_and_leak_nothing(server: LocalServer) -> None:
    cases = [
        (http(server, "GET", "/v1/nope"), 404, "/v1/nope"),
        (http(server, "DELETE", "/v1/models"), 405, "DELETE"),
        (http(server, "POST", "/v1/chat/completions", key="wrong"), 401, "API key"),
        (http(server, "GET", "/v1/models", key=None), 401, "API key"),
        (http(server, "POST", "/v1/chat/completions", raw=b"{not json"), 400, "JSON"),
        (http(server, "POST", "/v1/chat/completions", raw=b"[" * 100_000 + b"]" * 100_000), 400, "max_json_depth"),
        # parses, yet nests past the limit (32)
        (http(server, "POST", "/v1/chat/completions", raw=b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}"), 400,
         "max_json_depth"),
        (http(server, "POST", "/v1/chat/completions", raw=b'{"a": "' + b"x" * 300_000 + b'"}'), 413,
         "max_body_bytes"),
        (http(server, "POST", "/v1/workflows", body={"name": "bad name!", "agents": {}}), 400, "name"),
        (http(server, "POST", "/v1/workflows", body=spec("w", after=["ghost"])), 400, "ghost"),
        (http(server, "POST", "/v1/clients/never-started/finish"), 404, "never-started"),
        (http(server, "POST", "/v1/clients/bad%20id/finish"), 400, "client_id"),
        (http(server, "GET", "/v1/workflows/unknown-wf"), 404, "unknown-wf"),
        (chat(server, "key-a", "x", meta={"client_id": "c1", "agent": "a"}), 404, "c1"),
        (chat(server, "key-a", "x", meta={"client_id": "c1", "agent": "a", "workflow": "w",
                                          "workflow_spec": spec("other")}), 400, "kvflow.workflow"),
    ]
    for reply, status, word in cases:
        assert_error(reply, status, word)
    assert_error(http(server, "GET", "/v1/workflows/w"), 404)  # the mismatched inline spec registered nothing


@pytest.mark.parametrize(("extra", "status", "param"), [
    ({"top_p": 7}, 400, "top_p"), ({"stop": 5}, 400, "stop"), ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"temperature": 3}, 400, "temperature"), ({"n": 2}, 400, "n"), ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10**6}, 400, "max_tokens"), ({"tools": []}, 400, "tools"), ({"logprobs": True}, 400, "logprobs"),
    ({"surprise": 1}, 400, "surprise"), ({"kvflow": {"client_id": "c", "agent": "a", "x": 1}}, 400, "kvflow.x"),
    ({"max_tokens": "8"}, 400, "max_tokens")])
def test_request_validation_is_strict(server: LocalServer, extra: dict[str, Any], status: int, param: str) -> None:
    error = assert_error(chat(server, "key-a", "hi", **extra), status)
    assert error["param"] == param, error


def test_stop_strings_are_honoured_and_tiny_temperatures_work(server: LocalServer) -> None:
    plain = chat(server, "key-a", "Count.", max_tokens=24, ignore_eos=True)
    text = plain.json()["choices"][0]["message"]["content"]
    assert plain.status == 200 and len(text) > 8
    stop = text[4:7]
    stopped = chat(server, "key-a", "Count.", max_tokens=24, ignore_eos=True, stop=[stop])
    choice = stopped.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["message"]["content"]
    assert choice["message"]["content"] == text[:text.index(stop)]
    assert chat(server, "key-a", "Count.", temperature=1e-300).status == 200


def test_metrics_need_the_metrics_token(server: LocalServer) -> None:
    assert_error(http(server, "GET", "/metrics", key=None), 401, "metrics token")
    assert_error(http(server, "GET", "/metrics", key="key-a"), 401)  # an API key is not the metrics token
    reply = http(server, "GET", "/metrics", token=METRICS_TOKEN)
    assert reply.status == 200 and "kvflow_router_decisions_total" in reply.text


NOISE = Path(__file__).resolve().parents[1] / "benchmarks" / "tenant_noise.py"


def test_a_noisy_tenant_is_refused_cheaply_and_the_quiet_one_keeps_being_served(server: LocalServer) -> None:
    """B floods the server closed-loop from its own process (benchmarks/tenant_noise.py --noise all:
    /metrics without the token from 8 threads, specs at the size limit, changed and unchanged, and
    10,000-agent specs): every one of B's requests gets its documented answer, and every one of A's
    calls is served meanwhile. How much A's latency grows is what that benchmark measures (README)."""
    http(server, "POST", "/v1/workflows", key="key-a", body=spec("quiet2", "You are the quiet agent. " * 20))

    def quiet(n: int) -> list[float]:
        seconds = []
        for _ in range(n):
            reply = chat(server, "key-a", "You are the quiet agent. " * 20,
                         meta={"client_id": f"q-{uuid.uuid4().hex[:8]}", "agent": "a", "workflow": "quiet2"})
            assert reply.status == 200, reply.text
            seconds.append(reply.seconds)
        return seconds

    solo = quiet(20)
    noise = subprocess.Popen([sys.executable, str(NOISE), "--noise", "all", server.url, "3600"],
                             stdout=subprocess.PIPE)
    try:
        time.sleep(2)
        noisy = quiet(20)
    finally:
        noise.terminate()
        out, _ = noise.communicate(timeout=60)
    statuses = json.loads(out)
    # B's answers: 401 for the scrapes, 200 (or 429 once its write budget is spent) for registrations at
    # the size limit, 400 naming limits.max_agents_per_spec (413 over a smaller body limit) for the giant
    assert "401" in statuses and "200" in statuses and {"400", "413"} & set(statuses), statuses
    assert set(statuses) <= {"200", "401", "400", "413", "429"}, statuses
    print(f"quiet tenant p50 {statistics.median(solo):.3f} s alone, {statistics.median(noisy):.3f} s under noise")


def test_tenant_limits_are_4xx_naming_the_limit(server: LocalServer) -> None:
    giant = {"name": "giant", "agents": {f"a{i}": {"prompt": "p"} for i in range(65)}}
    assert_error(http(server, "POST", "/v1/workflows", key="key-b", body=giant), 400, "max_agents_per_spec")
    statuses = [http(server, "POST", "/v1/workflows", key="key-b", body=spec(f"t{i}")).status for i in range(45)]
    assert statuses.count(200) <= LIMITS["max_templates"] and 429 in statuses, statuses
    over = http(server, "POST", "/v1/workflows", key="key-b", body=spec("t-over"))
    assert_error(over, 429, "max_templates")
    # another tenant is not affected by B's quota
    assert http(server, "POST", "/v1/workflows", key="key-a", body=spec("a-fine")).status == 200


# ---------------------------------------------------------------------------------------------- last: the CPU engine
def test_one_tenant_cannot_probe_another_tenants_prompts_on_the_cpu_engine(server: LocalServer,
                                                                          redis_url: str) -> None:
    server.deploy(_config(redis_url, engine="cpu", model="random", replicas=1, threads=1, device_kv_tokens=4096))
    server.wait_ready()
    _probe_cross_tenant(server)


def test_no_error_reply_leaked_internals(server: LocalServer) -> None:
    """Every error reply of this module (and a few more made here, so the check never runs empty)."""
    http(server, "POST", "/v1/workflows", body={"name": "x", "agents": {"a": {"after": ["b"]}}})
    http(server, "POST", "/v1/clients/ghost/finish")
    chat(server, "key-a", "x", meta={"client_id": "ghost", "agent": "a"})
    assert len(ERRORS_SEEN) >= 3
    for reply in ERRORS_SEEN:
        for marker in FORBIDDEN:
            assert marker not in reply.text, (marker, reply.text)


def test_a_prompt_of_token_ids_is_checked_against_the_vocabulary(server: LocalServer) -> None:
    """OpenAI's completions take the prompt as token ids: ids outside the served model's vocabulary
    are a 400 naming `prompt`, never an engine error; valid ids are served and their KV reused."""
    ids = [(7 * i) % 250 for i in range(300)]
    for bad in ([-1, 5], [5, 10**9]):
        assert_error(http(server, "POST", "/v1/completions", body={"prompt": bad, "max_tokens": 2}), 400,
                     "vocabulary", "prompt")
    assert_error(http(server, "POST", "/v1/completions", body={"prompt": [1, "a"], "max_tokens": 2}), 400, "prompt")
    first = http(server, "POST", "/v1/completions", body={"prompt": ids, "max_tokens": 2})
    again = http(server, "POST", "/v1/completions", body={"prompt": [ids], "max_tokens": 2})
    assert first.status == again.status == 200, (first.text, again.text)
    assert first.json()["usage"]["prompt_tokens"] == again.json()["usage"]["prompt_tokens"] == len(ids)
