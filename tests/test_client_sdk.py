"""The client SDK over real HTTP with the real OpenAI SDK: a stand-in server records what arrives and
answers in the OpenAI format (the real ingress arrives with the Ray Serve app)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")

from kvflow_ray.client import Workflow
from kvflow_ray.core.graph import UnknownAgentError
from kvflow_ray.engines.base import GenerateResult
from kvflow_ray.serve.openai_api import ApiError, parse_request, response_body

REPO = Path(__file__).resolve().parents[1]
PROXY_ERRORS: Counter[str] = Counter()  # path -> how many requests to it the stand-in answers as a dead replica's


@pytest.fixture
def server() -> Iterator[tuple[str, list[tuple[str, dict[str, str], Any]]]]:
    seen: list[tuple[str, dict[str, str], Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            if PROXY_ERRORS[self.path] > 0:  # as Ray Serve's proxy answers when the ingress died mid-request
                PROXY_ERRORS[self.path] -= 1
                self.send_response(500)
                self.send_header("Content-Length", "21")
                self.end_headers()
                self.wfile.write(b"Internal Server Error")
                return
            status, out = 200, {}
            if self.path == "/v1/chat/completions":
                try:
                    req = parse_request(body, chat=True)
                    result = GenerateResult(tokens=[111, 107], text="ok", prompt_tokens=30, gpu_hit_tokens=10,
                                            cpu_hit_tokens=0, miss_tokens=20, stall_s=0, ttft_s=0, latency_s=0,
                                            finish_reason="length")
                    out = response_body(result, chat=True, model=req.model or "m")
                except ApiError as err:
                    status, out = err.status, err.body()
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_agent_calls_carry_metadata_and_the_instance_is_finished(server: tuple[str, list]) -> None:
    url, seen = server
    wf = Workflow.from_yaml(REPO / "workflows" / "peer.yaml")
    with wf.client(base_url=url, api_key="key-a", client_id="run-1") as run:
        reply = run.agent("planner").chat([{"role": "user", "content": "task"}], max_tokens=4)
        assert reply.choices[0].message.content == "ok" and reply.usage.prompt_tokens == 30
        assert run.agent("executor").text([{"role": "user", "content": "go"}]) == "ok"
    paths = [p for p, _h, _b in seen]
    assert paths == ["/v1/workflows", "/v1/chat/completions", "/v1/chat/completions", "/v1/clients/run-1/finish"]
    assert seen[0][2]["name"] == "peer" and "planner" in seen[0][2]["agents"]
    _path, headers, body = seen[1]
    assert headers["authorization"] == "Bearer key-a"
    assert body["kvflow"] == {"client_id": "run-1", "workflow": "peer", "agent": "planner"}
    assert body["messages"][0] == {"role": "system", "content": wf.spec.agents["planner"].prompt}
    assert body["messages"][1] == {"role": "user", "content": "task"} and body["max_tokens"] == 4
    with pytest.raises(UnknownAgentError):
        run.agent("ghost")


def test_server_errors_surface_as_openai_errors(server: tuple[str, list]) -> None:
    import openai

    url, _seen = server
    run = Workflow.from_yaml(REPO / "workflows" / "peer.yaml").client(base_url=url, register=False)
    with pytest.raises(openai.BadRequestError, match="between 1 and"):
        run.agent("planner").chat([{"role": "user", "content": "x"}], max_tokens=0)
    run.finish()
    run.finish()  # idempotent: one finish request


def test_a_run_builds_the_sdk_reply_models_before_threads_share_it() -> None:
    """The SDK builds its pydantic models on first use, not thread-safely; a run builds every model a
    completion reply holds first, so threads parsing their first replies find them complete. A fresh
    interpreter, so no earlier test has built them."""
    script = """
from openai.types.chat import ChatCompletion
from openai.types.chat.chat_completion import Choice
from openai.types.completion_usage import CompletionUsage
assert not ChatCompletion.__pydantic_complete__  # the SDK defers the build
from kvflow_ray.client.workflow import build_openai_response_types
built = build_openai_response_types()
assert {ChatCompletion, Choice, CompletionUsage} <= set(built), built
assert all(kind.__pydantic_complete__ for kind in built)
print(len(built))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) >= 3


def test_a_dead_ingress_replicas_500_is_sent_again(server: tuple[str, list]) -> None:
    """By default a run retries as the OpenAI SDK does, agent calls and finish alike (finishing is
    idempotent); with max_retries=0 the first failure surfaces."""
    import openai

    url, seen = server
    PROXY_ERRORS.update({"/v1/chat/completions": 1, "/v1/clients/again/finish": 1})
    try:
        wf = Workflow.from_yaml(REPO / "workflows" / "peer.yaml")
        with wf.client(base_url=url, client_id="again", register=False) as run:
            assert run.agent("planner").text([{"role": "user", "content": "task"}]) == "ok"
        assert [path for path, _h, _b in seen] == ["/v1/chat/completions"] * 2 + ["/v1/clients/again/finish"] * 2
        PROXY_ERRORS["/v1/chat/completions"] = 1
        strict = wf.client(base_url=url, client_id="strict", register=False, max_retries=0)
        with pytest.raises(openai.InternalServerError):
            strict.agent("planner").text([{"role": "user", "content": "task"}])
    finally:
        PROXY_ERRORS.clear()
