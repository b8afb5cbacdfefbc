"""Prometheus metrics of docs/design.md §9, fed by a real CPU engine, engine snapshots and the router
logic, scraped over real HTTP; and the SGLang plugin's metrics against the serving layer's."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from metrics_http import serve_metrics
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from kvflow_ray.core.snapshot import EngineSnapshot
from kvflow_ray.engines import metric_defs as defs
from kvflow_ray.engines.base import GenerateResult
from kvflow_ray.serve import metrics as serve_metrics_module
from kvflow_ray.serve.metrics import ReplicaMetrics, RouterMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _serve(render: Callable[[], bytes]) -> Iterator[str]:
    with serve_metrics(render) as address:
        yield f"http://{address}/metrics"


def _samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _scrape(url: str) -> Samples:
    return _samples(urllib.request.urlopen(url, timeout=10).read().decode())


@pytest.fixture
def replica_metrics() -> Iterator[tuple[ReplicaMetrics, str]]:
    metrics = ReplicaMetrics("r0")
    yield from ((metrics, url) for url in _serve(metrics.exposition))


def test_replica_metrics_follow_a_real_engine(replica_metrics: tuple[ReplicaMetrics, str]) -> None:
    pytest.importorskip("torch")
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
    from kvflow_ray.router.core import RouterCore
    from kvflow_ray.router.store import MemoryStore

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


RESULT = GenerateResult(tokens=[1], text="x", prompt_tokens=10, gpu_hit_tokens=6, cpu_hit_tokens=2, miss_tokens=2,
                        stall_s=0.01, ttft_s=0.02, latency_s=0.03, finish_reason="length")


def _snapshot(n: int) -> EngineSnapshot:
    """An engine's snapshot after `n` units of work: counters grow with n."""
    return EngineSnapshot(
        waiting=2, running=3, prompt_tokens={"gpu": 100 * n, "cpu": 10 * n, "miss": n},
        loaded_tokens=40 * n, prefetch={"issued": 4 * n, "completed": 3 * n, "used": 2 * n, "wasted": n},
        prefetch_stall_s=0.5 * n,
        evicted_tokens={"gpu": 30 * n, "cpu": 7 * n, "written_back": 20 * n, "dropped": 10 * n},
        cache_tokens={"gpu": 500 + n, "cpu": 900 + n}, capacity_tokens={"gpu": 1000, "cpu": 4000})


def _expected(n: int, replica: str = "r0") -> Samples:
    """The snapshot-derived series of `_snapshot(n)` as the serving layer exposes them."""
    def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted({"replica": replica, **labels}.items()))

    return {
        key("kvflow_prefetch_total", outcome="issued"): 4 * n, key("kvflow_prefetch_total", outcome="completed"): 3 * n,
        key("kvflow_prefetch_total", outcome="used"): 2 * n, key("kvflow_prefetch_total", outcome="wasted"): n,
        key("kvflow_evicted_tokens_total", tier="gpu", reason="written_back"): 20 * n,
        key("kvflow_evicted_tokens_total", tier="gpu", reason="dropped"): 10 * n,
        key("kvflow_evicted_tokens_total", tier="cpu", reason="capacity"): 7 * n,
        key("kvflow_cache_tokens", tier="gpu"): 500 + n, key("kvflow_cache_tokens", tier="cpu"): 900 + n,
        key("kvflow_queue_length"): 2,  # waiting only: the 3 running requests are not queued
    }


def _engine_series(samples: Samples) -> Samples:
    names = {"kvflow_prefetch_total", "kvflow_evicted_tokens_total", "kvflow_cache_tokens", "kvflow_queue_length"}
    return {k: v for k, v in samples.items() if k[0] in names}


def test_the_exposition_of_a_snapshot_shows_its_totals_and_a_later_snapshot_the_new_ones(
        replica_metrics: tuple[ReplicaMetrics, str]) -> None:
    metrics, url = replica_metrics
    # before any snapshot the families are there, at zero (dashboards list replicas by queue length)
    assert _engine_series(_scrape(url)) == {k: 0 for k in _expected(1)}
    metrics.observe_stats(_snapshot(1))
    assert _engine_series(_scrape(url)) == _expected(1)
    metrics.observe_stats(_snapshot(5).to_dict())  # an engine's stats() dict reads the same
    assert _engine_series(_scrape(url)) == _expected(5)
    metrics.observe_stats(_snapshot(5))  # the same totals again: nothing more counted
    assert _engine_series(_scrape(url)) == _expected(5)
    # the prompt tokens and the stall are per request: a snapshot does not move them
    assert not [k for k in _scrape(url) if k[0].startswith(("kvflow_prompt_tokens", "kvflow_prefetch_stall"))]


def test_a_stats_source_is_read_at_every_scrape() -> None:
    n = [1]
    metrics = ReplicaMetrics("r7", stats=lambda: _snapshot(n[0]).to_dict())
    for url in _serve(metrics.exposition):
        assert _engine_series(_scrape(url)) == _expected(1, "r7")
        n[0] = 3
        assert _engine_series(_scrape(url)) == _expected(3, "r7")
    # an engine that reports fewer keys (an older status): the missing counts are 0, not an error
    partial = ReplicaMetrics("r8", stats=lambda: {"waiting": 4, "evicted_tokens": {"gpu": 9, "written_back": 5}})
    samples = _samples(partial.exposition().decode())
    assert samples[("kvflow_evicted_tokens_total", (("reason", "dropped"), ("replica", "r8"), ("tier", "gpu")))] == 4
    assert samples[("kvflow_prefetch_total", (("outcome", "used"), ("replica", "r8")))] == 0
    assert samples[("kvflow_queue_length", (("replica", "r8"),))] == 4


def test_the_serving_layer_builds_every_engine_metric_from_the_shared_definitions() -> None:
    used = serve_metrics_module.PER_RESULT + serve_metrics_module.FROM_SNAPSHOT
    assert sorted(map(id, used)) == sorted(map(id, defs.ENGINE_METRICS))  # the same objects, each once
    metrics = ReplicaMetrics("r0")
    metrics.observe_result(RESULT)
    families = {f.name: f for f in metrics.registry.collect()}
    for d in defs.ENGINE_METRICS:
        family = families[d.name]
        assert (family.type, family.documentation) == (d.kind, d.help)
        if d.buckets:
            les = {s.labels["le"] for s in family.samples if s.name.endswith("_bucket")}
            assert les == {*map(repr, map(float, d.buckets)), "+Inf"}


# The plugin's metrics, built in a fresh process as in an SGLang scheduler (multiprocess mode set up
# before the process starts); the stand-ins of tests/sglang/conftest.py let sglang import on CPU.
PLUGIN_SCENARIO = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parent / "sglang")!r}]
import conftest
from types import SimpleNamespace
from kvflow_ray.engines import metric_defs
from kvflow_ray.engines.sglang import hooks
from kvflow_ray.serve import metrics as serve_metrics
serving = serve_metrics.PER_RESULT + serve_metrics.FROM_SNAPSHOT
assert all(any(d is s for s in serving) for d in hooks.PLUGIN_METRICS), "SGLang and Serve definitions differ"
assert set(hooks._metric_feed().metrics) == set(hooks.PLUGIN_METRICS)

def plugin_snapshot(n, cache_tokens):  # the keys the plugin's state reports
    return {{"waiting": 2, "running": 3, "prompt_tokens": {{"gpu": 100 * n, "cpu": 10 * n, "miss": n}},
             "loaded_tokens": 40 * n, "prefetch": {{"issued": 4 * n, "completed": 3 * n, "used": 2 * n, "wasted": n}},
             "prefetch_stall_s": 0.5 * n, "cache_tokens": cache_tokens, "held": n}}

for n in (1, 5, 5):  # counters fed twice with the same totals count them once
    st = SimpleNamespace(snapshot=lambda waiting, running, cache_tokens, n=n: plugin_snapshot(n, cache_tokens))
    hooks._export_metrics(st, 2, 1, {{"gpu": 500 + n, "cpu": 900 + n}})
hooks._observe_stall(0.0)
hooks._observe_stall(0.3)
"""


def test_sglangs_metrics_are_the_serving_layers_for_the_same_snapshot(tmp_path: Path) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (scripts/install-sglang-cpu.sh)")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", PLUGIN_SCENARIO], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))  # what SGLang's /metrics reads
    text = generate_latest(registry).decode()
    plugin = {f.name: f for f in text_string_to_metric_families(text)}

    serve = ReplicaMetrics("r0")
    serve.observe_result(RESULT)
    serve.observe_stats(_snapshot(5))
    serving = {f.name: f for f in text_string_to_metric_families(serve.exposition().decode())}
    # the same families, kinds and labels (the serving layer adds `replica`), no eviction counts; the
    # per-tenant retained and pinned history gauges have no series until a session pauses (the plugin
    # runs none)
    assert set(plugin) == {d.name for d in defs.ENGINE_METRICS} - {
        defs.EVICTED_TOKENS.name, defs.SESSION_RETAINED.name, defs.SESSION_RETAINED_BYTES.name,
        defs.SESSION_PINNED_BYTES.name}
    for name, family in plugin.items():
        assert family.type == serving[name].type
        assert {frozenset(s.labels) | {"replica"} for s in family.samples} == \
            {frozenset(s.labels) for s in serving[name].samples}
    # the same values for what both read from the snapshot (counters fed up to the latest totals)
    expected = {(name, tuple(pair for pair in labels if pair[0] != "replica")): v
                for (name, labels), v in _expected(5).items() if not name.startswith("kvflow_evicted")}
    assert _engine_series(_samples(text)) == expected
    got = _samples(text)
    assert got[("kvflow_prompt_tokens_total", (("tier", "gpu"),))] == 500
    assert got[("kvflow_prefetch_stall_seconds_count", ())] == 2  # every admission, a 0 stall too
    assert got[("kvflow_prefetch_stall_seconds_bucket", (("le", "0.5"),))] == 2


def test_the_load_generator_waits_for_the_counters_to_cover_every_answer() -> None:
    """Replicas report their counters once a second: the report after a run reads /metrics once the
    prompt-token counters have grown by what the answers reported, not the scrape right after them."""
    from kvflow_ray.client.loadgen import counter_delta, scrape, settled_metrics

    scrapes = 0

    def render() -> bytes:  # the counters catch up on the third scrape
        nonlocal scrapes
        scrapes += 1
        gpu, miss = (300, 100) if scrapes >= 3 else (50, 100)
        return (b"# TYPE kvflow_prompt_tokens_total counter\n"
                + f'kvflow_prompt_tokens_total{{replica="r1",tier="gpu"}} {gpu}\n'.encode()
                + f'kvflow_prompt_tokens_total{{replica="r1",tier="miss"}} {miss}\n'.encode())

    with serve_metrics(render) as where:
        root = f"http://{where}"
        before = {key: 0.0 for key in scrape(root)}  # (a zero baseline)
        after = settled_metrics(root, None, before, answered=400, poll_s=0.01)
        assert counter_delta(before, after, "kvflow_prompt_tokens_total", tier="gpu") == 300
        assert scrapes == 3
        # a server that never catches up: the latest scrape, after the timeout
        late = settled_metrics(root, None, before, answered=10_000, timeout_s=0.05, poll_s=0.01)
        assert counter_delta(before, late, "kvflow_prompt_tokens_total") == 400
