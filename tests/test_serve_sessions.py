"""Agent sessions through serving (docs/design.md §11): a session's turns, named by the X-Session-ID
header or `kvflow.session`, stay on the replica holding its history and find it in the prefix cache;
the engine predicts each tool pause and reports it on /metrics; the final turn releases the session.
A real local Ray Serve deployment with two CPU-engine replicas (the random model: this is about
routing and cache, not text)."""

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
A = {"Authorization": "Bearer key-a"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(free_port: Callable[[], int]) -> Iterator[Any]:
    pytest.importorskip("ray")
    from kvflow_ray.serve.app import LocalServer
    from kvflow_ray.serve.config import AppConfig

    config = AppConfig(replicas=2, model="random", max_running=4, route_headers=True, api_keys=KEYS)
    with LocalServer(config, port=free_port(), num_cpus=2) as local:
        yield local


def metric(text: str, name: str) -> float:
    """The sum of `name`'s samples in a Prometheus exposition."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
        return response.read().decode()


def turn(url: str, messages: list[dict[str, Any]], headers: dict[str, str],
         kvflow: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    body: dict[str, Any] = {"model": "kvflow-cpu-random", "messages": messages, "max_tokens": 8, "temperature": 0}
    if kvflow is not None:
        body["kvflow"] = kvflow
    status, answer, response_headers = post(url, body, headers)
    assert status == 200, answer
    assert response_headers["x-kvflow-route"] != "plain", dict(response_headers)
    return answer, response_headers["x-kvflow-replica"]


def test_a_session_stays_on_its_replica_reuses_its_history_and_is_released(server: Any) -> None:
    url = server.url
    before = metrics_text(url)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " * 40},
        {"role": "user", "content": "Fix the failing test in parser.py."}]
    replicas, cached, prompts = [], [], []
    for i in range(3):
        last = i == 2
        body, replica = turn(url, messages, {"X-Session-ID": "fix-parser-1", **A},
                             {"expected_pause_s": 0.5, **({"final_turn": True} if last else {})})
        replicas.append(replica)
        if i == 0:  # paused now: its history is retained, in bytes too (replicas report every second)
            deadline = time.monotonic() + 30
            while metric(metrics_text(url), "kvflow_session_retained_bytes") <= 0 and time.monotonic() < deadline:
                time.sleep(0.25)
            paused = metrics_text(url)
            assert metric(paused, "kvflow_session_retained_bytes") > 0
            assert metric(paused, "kvflow_session_pinned_bytes") == 0  # kvflow ranks a pause, never pins it
        usage = body["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        prompts.append(usage["prompt_tokens"])
        # the client "runs the tool", then sends the history back with its result
        call_id = f"call_{i}"
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"] or "",
                      "tool_calls": [{"id": call_id, "type": "function",
                                      "function": {"name": "run_tests", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": f"{i + 1} tests failed"}]
    assert len(set(replicas)) == 1  # the session stayed where its history is
    # every later turn found the earlier turns' prompt in the prefix cache
    assert cached[1] >= prompts[0] - 1 and cached[2] >= prompts[1] - 1
    # two pauses ended (before turns 2 and 3), each predicted and scored; nothing is retained any more
    # (replicas report their metrics with their heartbeat, every second)
    deadline = time.monotonic() + 30
    while True:
        after = metrics_text(url)
        pauses = metric(after, "kvflow_session_pauses_total") - metric(before, "kvflow_session_pauses_total")
        if pauses == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert pauses == 2
    returns = metric(after, "kvflow_session_returns_total") - metric(before, "kvflow_session_returns_total")
    assert returns == 2  # each return is counted by where the history was then
    assert metric(after, "kvflow_session_retained_tokens") == 0
    assert metric(after, "kvflow_session_retained_bytes") == 0


def test_bad_session_fields_are_refused_by_name(server: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "kvflow-cpu-random", "messages": messages, "max_tokens": 2,
            "kvflow": {"session": "s1", "expected_pause_s": -3}}
    status, answer, _ = post(server.url, body, A)
    assert status == 400 and answer["error"]["param"] == "kvflow.expected_pause_s"
    status, answer, _ = post(server.url, {**body, "kvflow": {"session": "bad id/../x"}}, A)
    assert status == 400 and "session" in answer["error"]["param"]


def test_session_specs_load_and_bad_ones_name_the_field(tmp_path: Any) -> None:
    from kvflow_ray.client.sessions import is_session_spec, load_session_spec

    spec = load_session_spec(ROOT / "workflows" / "sessions" / "coder.yaml")
    assert spec.session == "coder" and spec.turns == 4 and {t.name for t in spec.tools} == {"cat", "run_tests", "edit"}
    assert is_session_spec(ROOT / "workflows" / "sessions" / "coder.yaml")
    assert not is_session_spec(ROOT / "workflows" / "peer.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("session: x\nsystem: s\ntask: t\nturns: 0\ntools: [{name: ls}]\n")
    with pytest.raises(ValueError, match="turns"):
        load_session_spec(bad)
    bad.write_text("session: x\nsystem: s\ntask: t\ntools: [{name: 'no spaces allowed'}]\n")
    with pytest.raises(ValueError, match=r"tools\.0\.name"):
        load_session_spec(bad)


def test_kvflow_run_drives_sessions_with_tool_pauses(server: Any, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`kvflow-ray run SESSION.yaml --url`: each session forces a tool call per turn (constrained
    decoding), waits the tool's drawn duration, sends the history back with the result, and ends with
    a final turn; the server keeps each session on one replica and predicts its pauses."""
    import yaml

    from kvflow_ray.cli import main

    spec = yaml.safe_load((ROOT / "workflows" / "sessions" / "coder.yaml").read_text())
    spec["turns"] = 3
    for tool in spec["tools"]:
        tool["duration_s"] = [0.05, 0.2]
    path = tmp_path / "coder.yaml"
    path.write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    rc = main(["run", str(path), "--url", server.url, "--clients", "2", "--key", "key-a", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["errors"] == 0, summary["first_error"]
    assert summary["turns"] == 6 and summary["replicas_per_session"] == 1
    assert summary["pauses"]["ended"] == 4  # two pauses per session, each predicted and scored
    assert summary["cached_ratio"] > 0.3  # later turns find the history in the prefix cache


def test_sessions_are_per_tenant(server: Any) -> None:
    """The same session id under two tenants is two sessions: the second tenant's turn finds none of the
    first tenant's history."""
    messages = [{"role": "system", "content": "You are the billing agent. " * 30},
                {"role": "user", "content": "Reconcile the March invoices."}]
    first, _ = turn(server.url, messages, {"X-Session-ID": "shared-id", **A})
    history = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
               {"role": "user", "content": "Now April."}]
    again, _ = turn(server.url, history, {"X-Session-ID": "shared-id", **A})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    other, _ = turn(server.url, history, {"X-Session-ID": "shared-id", "Authorization": "Bearer key-b"})
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
