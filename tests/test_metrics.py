"""Prometheus metrics of DESIGN.md §9, fed by a real CPU engine and the router logic, scraped over real HTTP."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator

import pytest
from metrics_http import serve_metrics
from prometheus_client.parser import text_string_to_metric_families

from kvflow_ray.serve.metrics import ReplicaMetrics, RouterMetrics

torch = pytest.importorskip("torch")


def _serve(render: Callable[[], bytes]) -> Iterator[str]:
    with serve_metrics(render) as address:
        yield f"http://{address}/metrics"


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def replica_metrics() -> Iterator[tuple[ReplicaMetrics, str]]:
    metrics = ReplicaMetrics("r0")
    yield from ((metrics, url) for url in _serve(metrics.exposition))


def test_replica_metrics_follow_a_real_engine(replica_metrics: tuple[ReplicaMetrics, str]) -> None:
    from kvflow_ray.engines.base import GenerateRequest
    from kvflow_ray.engines.cpu.config import CpuEngineConfig
    from kvflow_ray.engines.cpu.engine import CpuEngine

    metrics, url = replica_metrics
    prompt = tuple(range(10, 210))
    with CpuEngine(CpuEngineConfig(policy="hicache", device_kv_tokens=300, host_kv_tokens=4000,
                                   link_gbps=None)) as engine:
        for i in range(4):  # each filler pushes `prompt` to the host tier; the next call loads it back
            tokens = prompt if i % 2 == 0 else tuple((7 * j + i) % 256 for j in range(240))
            metrics.observe_result(engine.generate(GenerateRequest(tokens=tokens, max_tokens=3, ignore_eos=True)))
            metrics.observe_stats(engine.stats())
        stats = engine.stats()
    samples = _scrape(url)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"replica": "r0", **labels}.items())))]

    assert value("kvflow_prompt_tokens_total", tier="miss") > 0
    assert value("kvflow_prompt_tokens_total", tier="cpu") > 0  # the prompt came back from the host tier
    total = sum(value("kvflow_prompt_tokens_total", tier=t) for t in ("gpu", "cpu", "miss"))
    assert total == sum(stats["prompt_tokens"].values())
    assert value("kvflow_evicted_tokens_total", tier="gpu", reason="written_back") == \
        stats["evicted_tokens"]["written_back"] > 0
    assert value("kvflow_cache_tokens", tier="gpu") == stats["cache_tokens"]["gpu"]
    assert value("kvflow_queue_length") == 0
    assert value("kvflow_request_latency_seconds_count") == 4
    assert value("kvflow_ttft_seconds_count") == 4
    assert value("kvflow_prefetch_stall_seconds_count") == 4
    # stats are cumulative: observing them again adds nothing
    metrics.observe_stats(stats)
    assert _scrape(url)[("kvflow_evicted_tokens_total", (("reason", "written_back"), ("replica", "r0"),
                                                         ("tier", "gpu")))] == stats["evicted_tokens"]["written_back"]


def test_router_metrics_follow_the_router() -> None:
    from kvflow_ray.serve.router_core import RouterCore
    from kvflow_ray.serve.store import MemoryStore

    core = RouterCore(MemoryStore())
    core.add_replica("r1")
    core.put_template("acme", {"name": "duo", "entry": "a", "agents": {"a": {"after": ["b"]}, "b": {"after": ["a"]}}})
    metrics = RouterMetrics()
    for client, agent in (("c1", "a"), ("c2", "a"), ("c1", "a")):  # c1 calls `a` twice in a row: a deviation
        route = core.start_call("acme", client, agent, workflow="duo")
        core.end_call("acme", client, agent, route.replica)
        metrics.observe_decision(route.outcome, core.decision_seconds[-1], "acme", route.deviation)
    metrics.set_active(core.active_clients())
    for url in _serve(metrics.exposition):
        samples = _scrape(url)
        assert samples[("kvflow_router_decisions_total", (("outcome", "cold"),))] == 3
        assert samples[("kvflow_router_decision_seconds_count", ())] == 3
        assert samples[("kvflow_workflows_active", (("tenant", "acme"),))] == 2
        assert samples[("kvflow_workflow_deviations_total", (("tenant", "acme"),))] == 1
