"""The README's main job, as a user runs it: `kvflow-ray run` with no server given starts the embedded
default (local Ray, 2 CPU-engine replicas, in-process router store), drives PEER workflows through
the OpenAI SDK, prints its report and stops everything again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvflow_ray.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize(("args", "message"), [
    (["run", "workflows/peer.yaml", "--url", "http://127.0.0.1:9"], "cannot reach a server at http://127.0.0.1:9"),
    (["run", "workflows/peer.yaml", "--policy", "fifo"], "policy 'fifo' cannot run on the cpu engine"),
    (["serve", "--policy", "fifo"], "policy 'fifo' cannot run on the cpu engine"),
    (["serve", "--engine", "sim", "--policy", "belady"], "policy 'belady' cannot run on the sim engine"),
    (["serve", "--config", "no/such/file.yaml"], "cannot read --config no/such/file.yaml"),
])
def test_cli_failures_a_user_can_cause_are_one_line_before_ray_starts(args: list[str], message: str) -> None:
    done = run_cli(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_run_starts_the_embedded_default_and_reports(free_port: Callable[[], int]) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "kvflow_ray.cli", "run", str(ROOT / "workflows" / "peer.yaml"), "--clients", "3",
         "--iterations", "2", "--max-tokens", "4", "--port", str(free_port()), "--json"],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    # a failed call exits 1 with the report on stdout: show its first error, not only the server log
    assert done.returncode == 0, done.stdout[-2000:] + "\n" + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["calls"] == 3 * 2 * 4 and report["errors"] == 0
    assert report["latency_s"]["p50"] > 0 and report["latency_s"]["p99"] >= report["latency_s"]["p50"]
    # (the >= 90% affinity acceptance is tested with more calls in test_serve_e2e; here, a sane report)
    assert 0 < report["gpu_hit_ratio"] <= 1 and 0 < report["affinity_ratio_after_warmup"] <= 1
    assert sum(report["router_decisions"].values()) == report["calls"]
    assert "starting the embedded server" in done.stderr
    # the default model's answers, one per role: real text (SmolLM2's), not bytes of a random model
    assert list(report["answers"]) == ["planner", "executor", "expresser", "reviewer"]
    assert all(re.search(r"[A-Za-z]{3,}", answer) for answer in report["answers"].values()), report["answers"]


@pytest.mark.slow
def test_serve_prints_its_url_serves_and_stops_on_sigterm(free_port: Callable[[], int]) -> None:
    import signal
    import urllib.request

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvflow_ray.cli", "serve", "--port", str(free_port()),
                             "--replicas", "1", "--api-key", "right-key=team"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]  # printed once the app is healthy
        info = json.loads(line)
        with urllib.request.urlopen(info["url"] + "/health", timeout=10) as response:
            assert json.loads(response.read())["status"] == "ok"
        # the default model is the real one: a question a small instruct model answers, through its chat template
        headers = {"Authorization": "Bearer right-key", "Content-Type": "application/json"}
        with urllib.request.urlopen(urllib.request.Request(info["url"] + "/v1/models", headers=headers),
                                    timeout=10) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == ["smollm2-135m"]
        body = {"model": "smollm2-135m", "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        request = urllib.request.Request(info["url"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers=headers)
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        # a wrong key, or none, is one line naming the fix, before any load runs
        for key in (["--key", "wrong-key"], []):
            done = run_cli("run", str(ROOT / "workflows" / "peer.yaml"), "--url", info["url"], *key)
            assert done.returncode == 2 and "pass a key it knows with --key" in done.stderr
            assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
