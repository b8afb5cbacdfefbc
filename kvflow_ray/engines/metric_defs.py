"""The engine metrics of docs/design.md §9, each declared once: its name, help, kind, labels, buckets and
how its values come from an `EngineSnapshot`. The serving layer (`serve.metrics.ReplicaMetrics`,
which adds a `replica` label in front) and the SGLang plugin (SGLang's `/metrics`) both build their
metrics from these objects, so a series means the same on both.

This module imports no prometheus_client: the SGLang plugin imports it in the scheduler process
before SGLang sets up Prometheus multiprocess mode, and a metric created then would keep
single-process storage that SGLang's `/metrics` never reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvflow_ray.core.snapshot import EngineSnapshot

Kind = Literal["counter", "gauge", "histogram"]
Values = dict[tuple[str, ...], float]

# covers a page-sized load (milliseconds) up to a long-context reload; 0.5 s is the stall alert's threshold
STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class MetricDef:
    """One engine metric. `name` is the family name as prometheus_client spells it: a counter's
    series is `name + "_total"`, a histogram's `name + "_bucket" | "_sum" | "_count"`.

    `read` gives its values from a snapshot; a metric without it (the stall histogram) is observed
    per request by whoever sees the request."""

    name: str
    help: str
    kind: Kind
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    read: Callable[[EngineSnapshot], Values] | None = None
    # how SGLang's multiprocess collector combines the scheduler processes' values of a gauge
    multiprocess_mode: str = "all"

    def values(self, snapshot: EngineSnapshot) -> Values:
        """Label values -> value, for a metric read from the snapshot."""
        if self.read is None:
            raise ValueError(f"{self.name} is observed per request, not read from a snapshot")
        return self.read(snapshot)


def _by(mapping: Mapping[str, Any], keys: Iterable[str]) -> Values:
    # nested dicts may come from an older writer without some keys: those count as 0
    return {(key,): float(mapping.get(key, 0)) for key in keys}


def _evicted(s: EngineSnapshot) -> Values:
    e = s.evicted_tokens
    gpu, written_back = float(e.get("gpu", 0)), float(e.get("written_back", 0))
    # device evictions not written back first lost their KV; derived from the total because not
    # every engine reports `dropped` (the SGLang status leaves it out)
    return {("gpu", "written_back"): written_back, ("gpu", "dropped"): max(gpu - written_back, 0.0),
            ("cpu", "capacity"): float(e.get("cpu", 0))}


def _cached(s: EngineSnapshot) -> Values:
    # a tier the engine does not have (SGLang without HiCache: no cpu) has no series rather than a 0
    return {(tier,): float(s.cache_tokens[tier]) for tier in ("gpu", "cpu") if tier in s.cache_tokens}


PROMPT_TOKENS = MetricDef(
    "kvflow_prompt_tokens", "Prompt tokens by where their KV came from", "counter", ("tier",),
    read=lambda s: _by(s.prompt_tokens, ("gpu", "cpu", "miss")))
PREFETCH = MetricDef(
    "kvflow_prefetch", "Prefetch loads by outcome", "counter", ("outcome",),
    read=lambda s: _by(s.prefetch, ("issued", "completed", "used", "wasted")))
EVICTED_TOKENS = MetricDef(
    "kvflow_evicted_tokens", "Tokens evicted from a tier", "counter", ("tier", "reason"),
    read=_evicted)
# Gauges: every TP rank's scheduler holds the same tree and the same waiting queue, so SGLang's
# `/metrics` reports one rank's value (the largest live one), not their sum.
CACHE_TOKENS = MetricDef(
    "kvflow_cache_tokens", "Tokens cached per tier", "gauge", ("tier",),
    read=_cached, multiprocess_mode="livemax")
QUEUE_LENGTH = MetricDef(
    "kvflow_queue_length", "Requests waiting for admission (not those running)", "gauge",
    read=lambda s: {(): float(s.waiting)}, multiprocess_mode="livemax")
PREFETCH_STALL = MetricDef(
    "kvflow_prefetch_stall_seconds", "Time an admitted request waited for its KV to load to the device "
    "(0 when it did not wait)", "histogram", buckets=STALL_BUCKETS)

# Agent sessions in tool pauses (docs/design.md §11); an engine without sessions reports zeros.
SESSION_PAUSES = MetricDef(
    "kvflow_session_pauses", "Tool pauses of agent sessions that ended (the client came back)", "counter",
    read=lambda s: {(): float(s.sessions.get("pauses", 0))})
SESSION_PAUSE_ERROR = MetricDef(
    "kvflow_session_pause_error_seconds", "Sum over ended pauses of |predicted - actual| pause length "
    "(divide by kvflow_session_pauses_total for the mean error)", "counter",
    read=lambda s: {(): float(s.sessions.get("abs_error_s", 0.0))})
SESSION_PREFETCH = MetricDef(
    "kvflow_session_prefetch", "Paused histories whose prefetch fell due before the client came back (early) "
    "or not (late)", "counter", ("timing",),
    read=lambda s: {("early",): float(s.sessions.get("due_early", 0)), ("late",): float(s.sessions.get("due_late", 0))})
SESSION_RETURNS = MetricDef(
    "kvflow_session_returns", "Paused sessions whose client came back, by where the history was then: all on "
    "the device (ready: kept, or its prefetch had landed), part of it still loading (the prefetch arrived "
    "late), or part of it on the host or gone (missed: loaded on demand or computed again)", "counter",
    ("history",), read=lambda s: {(where,): float(n) for where, n in s.sessions.get("returned", {}).items()})


def _per_tenant(key: str, scale: Callable[[EngineSnapshot], float] = lambda s: 1.0) -> Callable[[EngineSnapshot], Any]:
    """A per-tenant session gauge's reading: `sessions[key]` by tenant, times `scale(snapshot)`."""
    return lambda s: {(tenant,): float(n) * scale(s) for tenant, n in s.sessions.get(key, {}).items()}


SESSION_RETAINED = MetricDef(
    "kvflow_session_retained_tokens", "History tokens of paused sessions ranked as needed, per tenant (bounded "
    "by tenant_retain_tokens)", "gauge", ("tenant",), read=_per_tenant("retained_tokens"),
    multiprocess_mode="livemax")
SESSION_RETAINED_BYTES = MetricDef(
    "kvflow_session_retained_bytes", "KV bytes of the paused session histories ranked as needed, per tenant "
    "(kvflow_session_retained_tokens x the engine's KV bytes per token; 0 where the engine does not say)",
    "gauge", ("tenant",), read=_per_tenant("retained_tokens", lambda s: s.kv_bytes_per_token),
    multiprocess_mode="livemax")
SESSION_PINNED_BYTES = MetricDef(
    "kvflow_session_pinned_bytes", "KV bytes of the paused session histories the eviction policy holds whatever "
    "their rank, per tenant (Continuum's pins, SGLang's retention_seconds; kvflow pins nothing)",
    "gauge", ("tenant",), read=_per_tenant("pinned_tokens", lambda s: s.kv_bytes_per_token),
    multiprocess_mode="livemax")

# Reuse of kept outputs beyond the prefix (docs/design.md §12); an engine without it reports zeros.
REUSED_TOKENS = MetricDef(
    "kvflow_reused_tokens", "Prompt tokens whose KV was placed from a kept agent output and not recomputed "
    "(approximate KV; also counted in kvflow_prompt_tokens_total{tier=\"miss\"})", "counter",
    read=lambda s: {(): float(s.reuse.get("reused_tokens", 0))})
REUSE_LAYER_TOKENS = MetricDef(
    "kvflow_reuse_layer_tokens", "(token, layer) pairs of prompts that reused kept outputs: computed, and what "
    "a dense prefill computes (1 - computed / dense: the compute reuse saved)", "counter", ("kind",),
    read=lambda s: {("computed",): float(s.reuse.get("layer_tokens", 0)),
                    ("dense",): float(s.reuse.get("dense_layer_tokens", 0))})
SEGMENT_KV_BYTES = MetricDef(
    "kvflow_segment_kv_bytes", "KV bytes of the agent outputs kept for reuse", "gauge",
    read=lambda s: {(): float(s.reuse.get("segment_kv_bytes", 0))}, multiprocess_mode="livemax")

# Per-request KV budgets (docs/design.md §13); an engine without them reports zeros.
KV_COMPACTIONS = MetricDef(
    "kvflow_kv_compactions", "Compactions of budgeted requests' private KV (each keeps B tokens of B + Δ)",
    "counter", read=lambda s: {(): float(s.kv_budget.get("compactions", 0))})
KV_DROPPED_TOKENS = MetricDef(
    "kvflow_kv_dropped_tokens", "Private KV tokens budgeted requests dropped at compactions (slots back to the "
    "pool)", "counter", read=lambda s: {(): float(s.kv_budget.get("dropped_tokens", 0))})
KV_COMPACTION_SECONDS = MetricDef(
    "kvflow_kv_compaction_seconds", "Engine time spent scoring and compacting budgeted requests' KV", "counter",
    read=lambda s: {(): float(s.kv_budget.get("compaction_s", 0.0))})

# Every engine metric, in exposition order.
ENGINE_METRICS: tuple[MetricDef, ...] = (PROMPT_TOKENS, PREFETCH, PREFETCH_STALL, EVICTED_TOKENS, CACHE_TOKENS,
                                         QUEUE_LENGTH, SESSION_PAUSES, SESSION_PAUSE_ERROR, SESSION_PREFETCH,
                                         SESSION_RETURNS, REUSED_TOKENS, REUSE_LAYER_TOKENS, SEGMENT_KV_BYTES,
                                         SESSION_RETAINED, SESSION_RETAINED_BYTES,
                                         SESSION_PINNED_BYTES, KV_COMPACTIONS, KV_DROPPED_TOKENS, KV_COMPACTION_SECONDS)


def make_metric(definition: MetricDef, extra_labels: tuple[str, ...] = (), registry: Any = None) -> Any:
    """The prometheus_client object of `definition`, with `extra_labels` before its own (the
    serving layer's `replica`); registered in `registry`, or prometheus_client's default registry
    (the one SGLang's multiprocess mode writes to its files) when None."""
    from prometheus_client import Counter, Gauge, Histogram  # at call time: see the module docstring

    labels = [*extra_labels, *definition.labels]
    kwargs: dict[str, Any] = {} if registry is None else {"registry": registry}
    if definition.kind == "counter":
        return Counter(definition.name, definition.help, labels, **kwargs)
    if definition.kind == "gauge":
        return Gauge(definition.name, definition.help, labels, multiprocess_mode=definition.multiprocess_mode,
                     **kwargs)
    return Histogram(definition.name, definition.help, labels, buckets=definition.buckets, **kwargs)


class SnapshotFeed:
    """Feeds live prometheus_client metric objects (built from the definitions above) from
    successive snapshots: gauges take the snapshot's value; counters, which can only be
    incremented, advance by how far the snapshot's cumulative total passed the highest total fed
    so far. For a registry that cannot read a snapshot at scrape time (SGLang's multiprocess mode
    reads only values the process wrote to its files)."""

    def __init__(self, metrics: Mapping[MetricDef, Any]) -> None:
        self.metrics = metrics
        self._fed: dict[tuple[str, tuple[str, ...]], float] = {}  # counter totals already added

    def feed(self, snapshot: EngineSnapshot) -> None:
        for definition, metric in self.metrics.items():
            if definition.read is None:
                continue
            for labels, value in definition.values(snapshot).items():
                child = metric.labels(*labels) if labels else metric
                if definition.kind == "gauge":
                    child.set(value)
                    continue
                key = (definition.name, labels)
                fed = self._fed.get(key, 0.0)
                if value > fed:
                    child.inc(value - fed)
                    self._fed[key] = value
