"""Prometheus metrics (docs/design.md §9): counters end in `_total`, times are seconds.

Each process (a replica, the router) owns a `CollectorRegistry`, so several replicas in one test
process do not collide; `exposition()` renders it for `GET /metrics`. A replica's engine series
come from `engines.metric_defs` (the definitions SGLang's `/metrics` uses too): the per-request ones
are observed from each result, the rest are read from the engine's latest snapshot when the
registry is collected. The router feeds its decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvflow_ray.core.snapshot import EngineSnapshot
from kvflow_ray.engines import metric_defs as defs
from kvflow_ray.engines.base import GenerateResult

# `*_created` series double every family in the exposition and no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)

# Prompt tokens are counted from each result, as the stall is: a request's tiers then show in the
# same exposition as its latency. The engine snapshot's prompt_tokens are the same per-request sums.
PER_RESULT = (defs.PROMPT_TOKENS, defs.PREFETCH_STALL)
FROM_SNAPSHOT = tuple(d for d in defs.ENGINE_METRICS if d.read is not None and d not in PER_RESULT)

COMPUTE_CPU = "kvflow_engine_compute_cpu_seconds"  # (a counter: exposed with _total) engines that measure it
StatsSource = Callable[[], "Mapping[str, Any] | EngineSnapshot"]


def as_snapshot(stats: Mapping[str, Any] | EngineSnapshot) -> EngineSnapshot:
    """An engine's `stats()` (the snapshot's dict form plus engine-specific keys) as a snapshot."""
    return stats if isinstance(stats, EngineSnapshot) else EngineSnapshot.from_dict(stats)


class SnapshotCollector:
    """The snapshot-derived series of one replica, computed when the registry is collected from
    the snapshot `source` returns then: counters are the engine's cumulative totals as they stand."""

    def __init__(self, replica: str, source: StatsSource) -> None:
        self.replica = replica
        self.source = source

    def _families(self, snapshot: EngineSnapshot | None) -> Iterator[Metric]:
        for d in FROM_SNAPSHOT:
            kind = CounterMetricFamily if d.kind == "counter" else GaugeMetricFamily
            family = kind(d.name, d.help, labels=("replica", *d.labels))
            if snapshot is not None:
                for labels, value in d.values(snapshot).items():
                    family.add_metric((self.replica, *labels), value)
            yield family
        compute = CounterMetricFamily(COMPUTE_CPU, "CPU time of the engine's own compute threads (the rest of "
                                      "the replica's CPU is serving overhead)", labels=("replica",))
        if snapshot is not None and snapshot.compute_cpu_s is not None:
            compute.add_metric((self.replica,), snapshot.compute_cpu_s)
        yield compute

    def describe(self) -> Iterable[Metric]:
        """The family names, without reading the engine (the registry checks them for collisions)."""
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(as_snapshot(self.source())))


class ReplicaMetrics:
    """What one engine replica exports. `stats`: the engine's `stats()`, called at every
    collection; without it the collector reads the last snapshot given to `observe_stats`."""

    def __init__(self, replica: str, registry: CollectorRegistry | None = None,
                 stats: StatsSource | None = None) -> None:
        self.replica = replica
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._snapshot = EngineSnapshot()  # an engine that has not reported: nothing counted yet
        self.prompt_tokens = defs.make_metric(defs.PROMPT_TOKENS, ("replica",), r)
        self.stall = defs.make_metric(defs.PREFETCH_STALL, ("replica",), r)
        self.engine = SnapshotCollector(replica, stats or (lambda: self._snapshot))
        r.register(self.engine)  # type: ignore[arg-type]
        self.ttft = Histogram("kvflow_ttft_seconds", "Time to first token", ["replica"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.latency = Histogram("kvflow_request_latency_seconds", "Request latency", ["replica"],
                                 buckets=LATENCY_BUCKETS, registry=r)

    def observe_result(self, result: GenerateResult) -> None:
        for tier, tokens in (("gpu", result.gpu_hit_tokens), ("cpu", result.cpu_hit_tokens),
                             ("miss", result.miss_tokens)):
            self.prompt_tokens.labels(self.replica, tier).inc(tokens)
        self.stall.labels(self.replica).observe(result.stall_s)
        self.ttft.labels(self.replica).observe(result.ttft_s)
        self.latency.labels(self.replica).observe(result.latency_s)

    def observe_stats(self, stats: Mapping[str, Any] | EngineSnapshot) -> None:
        """The engine's latest `stats()` (cumulative), read at the next collection when this
        object was built without a `stats` source."""
        self._snapshot = as_snapshot(stats)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class StoreMetrics:
    """The health of one process's state store (the router actor's, each ingress's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
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

    def set(self, backend: str, up: bool, pending: int, reconciles: Mapping[str, int]) -> None:
        self.store_up.labels(backend).set(1 if up else 0)
        self.store_pending.set(pending)
        for reason, n in reconciles.items():  # the store's running totals, exported as a counter
            self.store_reconciles.labels(reason).inc(n - self._reconciles.get(reason, 0))
            self._reconciles[reason] = n


class RouterMetrics:
    """What an ingress replica's routing exports (the router actor labels each ingress's series with
    `ingress` when it merges them: dashboards sum over it)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvflow_router_decisions", "Routing decisions by outcome", ["outcome"], registry=r)
        self.decision_seconds = Histogram("kvflow_router_decision_seconds", "Time to make one routing decision",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.active = Gauge("kvflow_workflows_active", "Live workflow instances", ["tenant"], registry=r)
        self.deviations = Counter("kvflow_workflow_deviations", "Agent calls the step graph did not expect "
                                  "(served anyway; the live state follows what ran)", ["tenant"], registry=r)
        self.prediction_accuracy = Gauge("kvflow_prediction_accuracy", "How often the learned transition models' "
                                         "most likely next agent was the one that ran, one and two steps ahead "
                                         "(dynamic workflows under the predictive policy)", ["steps"], registry=r)
        self.predictions = Gauge("kvflow_predictions", "Next-agent predictions scored so far (the "
                                 "accuracy's denominator)", ["steps"], registry=r)
        self.store = StoreMetrics(r)

    def observe_decision(self, outcome: str, seconds: float, tenant: str, deviation: bool) -> None:
        self.decisions.labels(outcome).inc()
        self.decision_seconds.observe(seconds)
        if deviation:
            self.deviations.labels(tenant).inc()

    def set_prediction(self, scored: Mapping[str, tuple[int, int]]) -> None:
        """`scored`: steps ahead -> (hits, predictions), as `RouterCore.prediction_accuracy` counts them."""
        for steps, (hits, total) in scored.items():
            self.predictions.labels(steps).set(total)
            if total:
                self.prediction_accuracy.labels(steps).set(hits / total)

    def set_active(self, per_tenant: Mapping[str, int]) -> None:
        self.active.clear()
        for tenant, n in per_tenant.items():
            self.active.labels(tenant).set(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class HubMetrics:
    """What the router actor exports of its own: the replicas it routes to, and its store."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.replicas = Gauge("kvflow_router_replicas", "Engine replicas the router routes to (reporting)",
                              registry=r)
        self.replicas_lost = Counter("kvflow_router_replicas_lost", "Replicas dropped after they stopped "
                                     "reporting or failed a call", registry=r)
        self.store = StoreMetrics(r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    """A collector that yields already-parsed metric families (see `merge_expositions`)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_expositions(texts: Iterable[bytes | str | tuple[bytes | str, Mapping[str, str]]]) -> bytes:
    """One exposition from several processes' (the router's, the ingresses' and every replica's):
    samples of the same family are grouped under one HELP/TYPE header, as the text format requires.
    The replicas' series differ by their `replica` label; a (text, labels) pair gets `labels` added
    to each of its samples (the ingresses': `ingress`), so no sample collides."""
    merged: dict[str, Metric] = {}
    for item in texts:
        text, labels = item if isinstance(item, tuple) else (item, {})
        raw = text.decode() if isinstance(text, bytes) else text
        for family in text_string_to_metric_families(raw):
            if labels:
                family.samples = [s._replace(labels={**s.labels, **labels}) for s in family.samples]
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    registry = CollectorRegistry()
    registry.register(_Families(merged.values()))  # type: ignore[arg-type]
    return generate_latest(registry)
