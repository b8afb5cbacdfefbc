"""Every query an operator will look at, evaluated for real: local Ray with 2 CPU-engine replicas and a
real redis-server, driven by the load generator, scraped by a real Prometheus that loads the
project's own rule files. Every PromQL expression of every dashboard panel and every recording rule
must return data, and Prometheus must evaluate every rule (recording and alerting) without error.
`/metrics` is protected by a metrics token from the environment (`metrics_token_env`, as the Kubernetes
Secret provides it), which Prometheus sends; without it a scrape is refused.
"""

from __future__ import annotations

import importlib.util
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from kvflow_ray.client import Workflow  # noqa: E402
from kvflow_ray.client.loadgen import LoadConfig, run_load, summarise  # noqa: E402
from kvflow_ray.serve.app import LocalServer  # noqa: E402
from kvflow_ray.serve.config import AppConfig  # noqa: E402
from kvflow_ray.serve.monitoring import RULES_DIR, recording_rules  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PEER = Workflow.from_yaml(ROOT / "workflows" / "peer.yaml")
METRICS_TOKEN_ENV = "KVFLOW_TEST_OPS_METRICS_TOKEN"
METRICS_TOKEN = "ops-" + secrets.token_hex(8)


def _dashboards() -> Any:
    spec = importlib.util.spec_from_file_location("kvflow_dashboards", ROOT / "dashboards" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def instantiate(expr: str) -> str:
    """A dashboard expression as Grafana sends it with every variable at 'All'."""
    return (expr.replace("$__rate_interval", "1m").replace("${replica}", ".*").replace("$replica", ".*")
            .replace("${tenant}", ".*").replace("$tenant", ".*"))


@pytest.fixture(scope="module")
def stack(redis_url: str, free_port: Callable[[], int], prometheus_factory: Any) -> Iterator[tuple[LocalServer, Any]]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    with pytest.MonkeyPatch.context() as env:
        # set before Ray starts, so its workers (the ingress) inherit it, as the Ray pods get the Secret
        env.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN)
        # a small device pool, so eviction, the host tier and prefetch all show up in the series
        config = AppConfig(model="random", replicas=2, redis=redis_url, api_keys={"key-acme": "acme"},
                           device_kv_tokens=1536, host_kv_tokens=16384, max_running=8, threads=1,
                           metrics_token_env=METRICS_TOKEN_ENV)
        with LocalServer(config, port=free_port(), num_cpus=2) as server:
            prometheus = prometheus_factory(urllib.parse.urlsplit(server.url).netloc,  # loads RULES_DIR
                                            metrics_token=METRICS_TOKEN)
            load = LoadConfig(clients=4, iterations=2, max_tokens=8, task_chars=300, api_key="key-acme",
                              metrics_token=METRICS_TOKEN)  # it reads hit ratios from /metrics
            result = run_load(PEER, server.url, load, progress=False)
            summary = summarise(result, PEER, load)
            assert summary["errors"] == 0, summary["first_error"]
            yield server, prometheus


def _wait_for_data(prometheus: Any, exprs: dict[str, str], timeout_s: float = 90) -> dict[str, str]:
    """Queries (expr -> where it comes from) that still return no data after `timeout_s`."""
    missing = dict(exprs)
    deadline = time.monotonic() + timeout_s
    while missing and time.monotonic() < deadline:
        for expr in list(missing):
            if prometheus.query(expr):
                del missing[expr]
        if missing:
            time.sleep(2)
    return missing


def test_every_dashboard_and_recording_rule_query_returns_data(stack: tuple[LocalServer, Any]) -> None:
    _server, prometheus = stack
    exprs: dict[str, str] = {}
    for uid, title, expr in _dashboards().expressions():
        exprs[instantiate(expr)] = f"dashboard {uid}: {title}"
    rules = recording_rules()
    assert rules, "no recording rules found"
    for record, expr in rules:
        exprs[expr] = f"recording rule {record} (its expression)"
        exprs[record] = f"recording rule {record} (the recorded series)"
    assert len(exprs) > 20
    missing = _wait_for_data(prometheus, exprs)
    assert not missing, "no data for:\n" + "\n".join(f"  {where}: {expr}" for expr, where in missing.items())


def test_prometheus_evaluates_every_rule_without_error(stack: tuple[LocalServer, Any]) -> None:
    _server, prometheus = stack
    deadline = time.monotonic() + 30
    while True:
        groups = prometheus.api("rules")["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        if rules and all(rule.get("lastEvaluation", "").startswith("20") for rule in rules):
            break
        assert time.monotonic() < deadline, "Prometheus did not evaluate the rules"
        time.sleep(1)
    files = {Path(group["file"]).name for group in groups}
    assert files == {p.name for p in RULES_DIR.glob("*.yml")}
    bad = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    assert not bad, bad
    alerts = {rule["name"]: rule["state"] for rule in rules if rule["type"] == "alerting"}
    assert {"KVFlowHitRatioCollapse", "KVFlowPrefetchStallHigh", "KVFlowRedisUnreachable",
            "KVFlowRouterDecisionSlow"} <= set(alerts)
    # a healthy stack: Redis answers, both replicas report, so those alerts are quiet
    assert alerts["KVFlowRedisUnreachable"] == "inactive"
    assert prometheus.query('kvflow_store_up{backend="redis"}')[0]["value"][1] == "1"
    assert prometheus.query("kvflow_router_replicas")[0]["value"][1] == "2"


def _metrics_status(server: LocalServer, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(server.url + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_metrics_need_the_token_prometheus_sends(stack: tuple[LocalServer, Any]) -> None:
    server, prometheus = stack
    assert _metrics_status(server, METRICS_TOKEN) == 200
    assert _metrics_status(server, None) == 401
    assert _metrics_status(server, "key-acme") == 401  # an API key is not the metrics token
    (target,) = prometheus.api("targets", state="active")["activeTargets"]
    assert target["health"] == "up" and target["lastError"] == "", target
