"""Prometheus metrics (DESIGN.md §9): counters end in `_total`, times are seconds.

Each process (a replica, the router) owns a `CollectorRegistry`, so several replicas in one test
process do not collide; `exposition()` renders it for `GET /metrics`. Replicas feed per-request
results and periodic engine stats; the router feeds its decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvflow_ray.engines.base import GenerateResult

# `*_created` series double every family in the exposition and no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class ReplicaMetrics:
    """What one engine replica exports."""

    def __init__(self, replica: str, registry: CollectorRegistry | None = None) -> None:
        self.replica = replica
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("kvflow_prompt_tokens", "Prompt tokens by where their KV came from",
                                     ["replica", "tier"], registry=r)
        self.prefetch = Counter("kvflow_prefetch", "Prefetch loads by outcome", ["replica", "outcome"], registry=r)
        self.stall = Histogram("kvflow_prefetch_stall_seconds", "Time a request waited for its KV to load",
                               ["replica"], buckets=LATENCY_BUCKETS, registry=r)
        self.evicted = Counter("kvflow_evicted_tokens", "Tokens evicted from a tier", ["replica", "tier", "reason"],
                               registry=r)
        self.cache_tokens = Gauge("kvflow_cache_tokens", "Tokens cached per tier", ["replica", "tier"], registry=r)
        self.queue = Gauge("kvflow_queue_length", "Requests waiting or running", ["replica"], registry=r)
        self.ttft = Histogram("kvflow_ttft_seconds", "Time to first token", ["replica"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.latency = Histogram("kvflow_request_latency_seconds", "Request latency", ["replica"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._last: dict[str, float] = {}  # engine counters already exported (stats are cumulative)

    def observe_result(self, result: GenerateResult) -> None:
        for tier, tokens in (("gpu", result.gpu_hit_tokens), ("cpu", result.cpu_hit_tokens),
                             ("miss", result.miss_tokens)):
            self.prompt_tokens.labels(self.replica, tier).inc(tokens)
        self.stall.labels(self.replica).observe(result.stall_s)
        self.ttft.labels(self.replica).observe(result.ttft_s)
        self.latency.labels(self.replica).observe(result.latency_s)

    def observe_stats(self, stats: Mapping[str, Any]) -> None:
        """Engine `stats()` (cumulative): counters advance by what is new since the last call."""
        for tier in ("gpu", "cpu"):
            self.cache_tokens.labels(self.replica, tier).set(stats["cache_tokens"][tier])
        self.queue.labels(self.replica).set(stats["waiting"] + stats["running"])
        evicted = stats["evicted_tokens"]
        self._advance(self.evicted.labels(self.replica, "gpu", "written_back"), "wb", evicted["written_back"])
        self._advance(self.evicted.labels(self.replica, "gpu", "dropped"), "gpu_drop",
                      evicted["gpu"] - evicted["written_back"])
        self._advance(self.evicted.labels(self.replica, "cpu", "capacity"), "cpu", evicted["cpu"])
        for outcome in ("issued", "completed", "used", "wasted"):
            self._advance(self.prefetch.labels(self.replica, outcome), outcome, stats["prefetch"][outcome])

    def _advance(self, counter: Any, key: str, value: float) -> None:
        delta = value - self._last.get(key, 0.0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = max(value, self._last.get(key, 0.0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RouterMetrics:
    """What the workflow router exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvflow_router_decisions", "Routing decisions by outcome", ["outcome"], registry=r)
        self.decision_seconds = Histogram("kvflow_router_decision_seconds", "Time to make one routing decision",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.active = Gauge("kvflow_workflows_active", "Live workflow instances", ["tenant"], registry=r)
        self.deviations = Counter("kvflow_workflow_deviations", "Agent calls the step graph did not expect "
                                  "(served anyway; the live state follows what ran)", ["tenant"], registry=r)
        self.replicas = Gauge("kvflow_router_replicas", "Engine replicas the router routes to (reporting)",
                              registry=r)
        self.replicas_lost = Counter("kvflow_router_replicas_lost", "Replicas dropped after they stopped "
                                     "reporting or failed a call", registry=r)
        self.store_up = Gauge("kvflow_store_up", "1 when the router's state store answers, else 0",
                              ["backend"], registry=r)
        self.store_pending = Gauge("kvflow_store_pending_writes", "State writes queued for the store (grows "
                                   "while it is unreachable)", registry=r)
        self.store_reconciles = Counter("kvflow_store_reconciles", "Times the router wrote its whole state back "
                                        "to the store: after an outage (reconnect) or when it lost data "
                                        "(data_loss)", ["reason"], registry=r)
        self._reconciles: dict[str, int] = {"reconnect": 0, "data_loss": 0}  # exported so far
        for reason in self._reconciles:
            self.store_reconciles.labels(reason)

    def observe_decision(self, outcome: str, seconds: float, tenant: str, deviation: bool) -> None:
        self.decisions.labels(outcome).inc()
        self.decision_seconds.observe(seconds)
        if deviation:
            self.deviations.labels(tenant).inc()

    def set_health(self, replicas: int, backend: str, store_up: bool) -> None:
        self.replicas.set(replicas)
        self.store_up.labels(backend).set(1 if store_up else 0)

    def set_store(self, pending: int, reconciles: Mapping[str, int]) -> None:
        self.store_pending.set(pending)
        for reason, n in reconciles.items():  # the store's running totals, exported as a counter
            self.store_reconciles.labels(reason).inc(n - self._reconciles.get(reason, 0))
            self._reconciles[reason] = n

    def set_active(self, per_tenant: Mapping[str, int]) -> None:
        self.active.clear()
        for tenant, n in per_tenant.items():
            self.active.labels(tenant).set(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    """A collector that yields already-parsed metric families (see `merge_expositions`)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_expositions(texts: Iterable[bytes | str]) -> bytes:
    """One exposition from several processes' (the router's and every replica's): samples of the
    same family are grouped under one HELP/TYPE header, as the text format requires. The replicas'
    series differ by their `replica` label, so no sample collides."""
    merged: dict[str, Metric] = {}
    for text in texts:
        raw = text.decode() if isinstance(text, bytes) else text
        for family in text_string_to_metric_families(raw):
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    registry = CollectorRegistry()
    registry.register(_Families(merged.values()))  # type: ignore[arg-type]
    return generate_latest(registry)
