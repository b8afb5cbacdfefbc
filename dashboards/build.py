"""Grafana dashboards for kvflow-ray, generated from code (docs/design.md §9 metrics).

    python dashboards/build.py          # rewrite dashboards/*.json from this file
    python dashboards/build.py --check  # exit 1 if the checked-in JSON is not what this file builds

Plain Python builders (no Grafana SDK): the JSON is a small, stable subset of Grafana's dashboard
model (schemaVersion 39), so the output does not move with an SDK release and the project needs no
extra dependency to regenerate or test it.

Expressions use template variables only as `replica=~"$replica"`, `tenant=~"$tenant"` and
`[$__rate_interval]`; `expressions()` lists every panel query for tests that evaluate them against a
real Prometheus. Every query must return data on a healthy running deployment: ratios divide by
`clamp_min(..., 1e-9)` and series that exist only after an event (deviations, lost replicas, a
tenant with a live workflow, a first routing decision) fall back to `or on() vector(0)`.

This file is loaded by path (importlib) from tests, without being registered in `sys.modules`, so it
deliberately avoids `from __future__ import annotations` (dataclasses would fail to resolve string
annotations then) and imports nothing from the project.
"""

import argparse
import difflib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39
GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
REPLICA = 'replica=~"$replica"'
TENANT = 'tenant=~"$tenant"'
EPSILON = "1e-9"

Steps = tuple[tuple[float | None, str], ...]
# Threshold steps: (lower bound, colour); the first step's bound is None (from -inf).
HIT_RATIO_STEPS: Steps = ((None, "red"), (0.3, "yellow"), (0.6, "green"))
STALL_STEPS: Steps = ((None, "green"), (0.1, "yellow"), (0.5, "red"))
UP_STEPS: Steps = ((None, "red"), (1, "green"))
NEUTRAL_STEPS: Steps = ((None, "green"),)


# ------------------------------------------------------------------------------------------- PromQL
def selector(metric: str, *matchers: str) -> str:
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def rate(metric: str, *matchers: str) -> str:
    return f"rate({selector(metric, *matchers)}{RATE})"


def sum_by(labels: Sequence[str], expr: str) -> str:
    return f"sum by ({', '.join(labels)}) ({expr})" if labels else f"sum({expr})"


def ratio(numerator: str, denominator: str, ignoring: Sequence[str] = ()) -> str:
    """numerator / denominator, 0 (not empty, not NaN) when the denominator is 0."""
    match = f" ignoring({', '.join(ignoring)}) group_left()" if ignoring else ""
    return f"{numerator} /{match} clamp_min({denominator}, {EPSILON})"


def quantile(q: float, histogram: str, *matchers: str, by: Sequence[str] = ()) -> str:
    return f"histogram_quantile({q}, {sum_by(['le', *by], rate(histogram + '_bucket', *matchers))})"


def mean(histogram: str, *matchers: str, by: Sequence[str] = ()) -> str:
    return ratio(sum_by(by, rate(histogram + "_sum", *matchers)), sum_by(by, rate(histogram + "_count", *matchers)))


def or_zero(expr: str, label: str | None = None, value: str = "(none)") -> str:
    """`expr`, or a single 0 when it has no series (a counter or gauge that appears only after an
    event); `label` gives the fallback series that label, so a legend on it still reads."""
    zero = f'label_replace(vector(0), "{label}", "{value}", "", "")' if label else "vector(0)"
    return f"({expr}) or on() {zero}"


# ------------------------------------------------------------------------------------------- panels
@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    kind: str  # "stat" | "timeseries"
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    width: int
    height: int
    steps: Steps = NEUTRAL_STEPS
    threshold_style: str = "off"  # timeseries: draw the thresholds ("off", "line", "dashed", "line+area")
    min: float | None = None
    max: float | None = None
    soft_max: float | None = None
    stacking: str = "none"  # timeseries: "none" | "normal"
    axis_label: str = ""
    step_line: bool = False
    mappings: tuple[tuple[int, str, str], ...] = ()  # (value, text, colour)


def stat(title: str, description: str, unit: str, *targets: Target, steps: Steps = NEUTRAL_STEPS,
         width: int = 4, height: int = 4, **kw: Any) -> Panel:
    return Panel("stat", title, description, unit, tuple(targets), width, height, steps=steps, **kw)


def timeseries(title: str, description: str, unit: str, *targets: Target, width: int = 8, height: int = 8,
               **kw: Any) -> Panel:
    return Panel("timeseries", title, description, unit, tuple(targets), width, height, **kw)


def _thresholds(steps: Steps) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


def _mappings(panel: Panel) -> list[dict[str, Any]]:
    if not panel.mappings:
        return []
    options = {str(value): {"color": color, "index": i, "text": text}
               for i, (value, text, color) in enumerate(panel.mappings)}
    return [{"type": "value", "options": options}]


def _targets(panel: Panel) -> list[dict[str, Any]]:
    return [{"datasource": DATASOURCE, "editorMode": "code", "expr": t.expr, "legendFormat": t.legend,
             "range": True, "refId": chr(ord("A") + i)} for i, t in enumerate(panel.targets)]


def render_panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, "thresholds": _thresholds(panel.steps),
                                "mappings": _mappings(panel)}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        options: dict[str, Any] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value" if panel.steps == NEUTRAL_STEPS else "background",  # colour only what has levels
            "graphMode": "area", "justifyMode": "auto", "orientation": "auto",
            "textMode": "auto", "wideLayout": True, "showPercentChange": False,
        }
    else:
        custom: dict[str, Any] = {
            "drawStyle": "line", "lineInterpolation": "stepAfter" if panel.step_line else "linear",
            "lineWidth": 1, "fillOpacity": 25 if panel.stacking != "none" else 10, "showPoints": "never",
            "spanNulls": False, "axisLabel": panel.axis_label, "axisSoftMin": 0,
            "stacking": {"mode": panel.stacking, "group": "A"},
            "thresholdsStyle": {"mode": panel.threshold_style},
        }
        if panel.soft_max is not None:
            custom["axisSoftMax"] = panel.soft_max
        defaults["color"] = {"mode": "palette-classic"}
        defaults["custom"] = custom
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": _targets(panel),
    }


def layout(rows: Iterable[Sequence[Panel]]) -> list[dict[str, Any]]:
    """Rows of panels, left to right; a row is as tall as its tallest panel. Ids count from 1."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row in rows:
        if sum(p.width for p in row) > GRID_WIDTH:
            raise ValueError(f"row wider than {GRID_WIDTH}: {[p.title for p in row]}")
        x = 0
        for panel in row:
            panels.append(render_panel(panel, len(panels) + 1, x, y))
            x += panel.width
        y += max(p.height for p in row)
    return panels


# ---------------------------------------------------------------------------------------- variables
def datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
            "regex": "", "skipUrlSync": False}


def label_variable(name: str, label: str, metric: str) -> dict[str, Any]:
    """A multi-value variable over one label's values, 'All' = `.*` (matches an absent label too)."""
    query = f"label_values({metric}, {name})"
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE, "definition": query,
            "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0, "includeAll": True,
            "allValue": ".*", "multi": True, "options": [], "refresh": 2, "regex": "", "skipUrlSync": False,
            "sort": 1}


def dashboard(uid: str, title: str, description: str, variables: list[dict[str, Any]],
              rows: Iterable[Sequence[Panel]]) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvflow"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "timezone": "browser",
        "time": {"from": "now-15m", "to": "now"},
        "timepicker": {},
        "refresh": "10s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "links": [{"title": "kvflow dashboards", "type": "dashboards", "tags": ["kvflow"], "asDropdown": False,
                   "includeVars": True, "keepTime": True, "icon": "external link", "targetBlank": False,
                   "tooltip": "", "url": ""}],
        "templating": {"list": variables},
        "panels": layout(rows),
    }


# ---------------------------------------------------------------------------------------- queries
PROMPT = "kvflow_prompt_tokens_total"
PREFETCH = "kvflow_prefetch_total"
DECISIONS = "kvflow_router_decisions_total"


def device_hit_ratio(by: Sequence[str] = ()) -> str:
    return ratio(sum_by(by, rate(PROMPT, REPLICA, 'tier="gpu"')), sum_by(by, rate(PROMPT, REPLICA)))


def prefetch_ratio(outcome: str, by: Sequence[str] = ()) -> str:
    return ratio(sum_by(by, rate(PREFETCH, REPLICA, f'outcome="{outcome}"')),
                 sum_by(by, rate(PREFETCH, REPLICA, 'outcome="completed"')))


def tier_share(by: Sequence[str] = ()) -> str:
    """Each tier's share of prompt tokens (gpu + cpu + miss = 1), per `by` group."""
    return ratio(sum_by([*by, "tier"], rate(PROMPT, REPLICA)), sum_by(by, rate(PROMPT, REPLICA)), ignoring=["tier"])


def outcome_share() -> str:
    return or_zero(ratio(sum_by(["outcome"], rate(DECISIONS)), sum_by((), rate(DECISIONS)), ignoring=["outcome"]),
                   label="outcome")


def percentiles(histogram: str, name: str, qs: Sequence[float] = (0.5, 0.95, 0.99),
                matchers: Sequence[str] = (REPLICA,)) -> list[Target]:
    return [Target(quantile(q, histogram, *matchers), f"{name} p{round(q * 100)}") for q in qs]


def active_by_tenant(*matchers: str) -> str:
    return or_zero(sum_by(["tenant"], selector("kvflow_workflows_active", *matchers)), label="tenant")


# every ingress learns its own models: the fleet's accuracy weighs each by the predictions it scored
PREDICTION_ACCURACY = ratio(sum_by(["steps"], "kvflow_prediction_accuracy * kvflow_predictions"),
                            sum_by(["steps"], selector("kvflow_predictions")))
DEVIATIONS_BY_TENANT = or_zero(sum_by(["tenant"], rate("kvflow_workflow_deviations_total", TENANT)), label="tenant")
REQUEST_RATE = rate("kvflow_request_latency_seconds_count", REPLICA)


# ---------------------------------------------------------------------------------------- dashboards
def overview() -> dict[str, Any]:
    headline = [
        stat("Request rate", "Requests finished per second by the selected replicas.", "reqps",
             Target(sum_by((), REQUEST_RATE), "requests/s")),
        stat("Device hit ratio (fleet)", "Share of prompt tokens whose KV was already on the GPU. Red under 30 %, "
             "yellow under 60 %. 0 with no traffic.", "percentunit",
             Target(device_hit_ratio(), "device hit ratio"), steps=HIT_RATIO_STEPS, min=0, max=1),
        stat("Prefetch used ratio", "Completed prefetches that a request then used (used / completed). Low means "
             "prefetch bandwidth is spent on KV nobody reads; 0 when nothing was prefetched.", "percentunit",
             Target(prefetch_ratio("used"), "used / completed"), steps=HIT_RATIO_STEPS, min=0),
        stat("Prefetch stall p99", "99th percentile of the time a request waited for its KV to load from the CPU "
             "tier. Yellow over 100 ms, red over 500 ms. Empty (NaN) with no traffic.", "s",
             Target(quantile(0.99, "kvflow_prefetch_stall_seconds", REPLICA), "stall p99"), steps=STALL_STEPS),
        stat("Replicas reporting", "Engine replicas the router currently routes to (they report load). Red at 0.",
             "short", Target("max(kvflow_router_replicas)", "replicas"), steps=UP_STEPS),
        stat("Store up", "Whether the router's state store (Redis or in-memory) answers a ping at each scrape.",
             "none", Target("min by (backend) (kvflow_store_up)", "{{backend}}"), steps=UP_STEPS,
             mappings=((0, "DOWN", "red"), (1, "UP", "green"))),
    ]
    traffic = [
        timeseries("Request rate by replica", "Requests finished per second, per engine replica.", "reqps",
                   Target(sum_by(["replica"], REQUEST_RATE), "{{replica}}")),
        timeseries("Time to first token", "TTFT percentiles over the selected replicas (from the histogram).",
                   "s", *percentiles("kvflow_ttft_seconds", "TTFT")),
        timeseries("Request latency", "End-to-end request latency percentiles over the selected replicas.", "s",
                   *percentiles("kvflow_request_latency_seconds", "latency")),
    ]
    hits = [
        timeseries("Prompt-token source share by replica", "Per replica, where prompt tokens' KV came from: gpu "
                   "(device hit), cpu (loaded from the host tier) or miss (recomputed). The three add up to 1.",
                   "percentunit", Target(tier_share(["replica"]), "{{replica}} {{tier}}"), width=12, min=0,
                   soft_max=1),
        timeseries("Prompt tokens by source (fleet)", "Prompt tokens per second over the selected replicas, "
                   "stacked by where their KV came from.", "short",
                   Target(sum_by(["tier"], rate(PROMPT, REPLICA)), "{{tier}}"), width=12, stacking="normal",
                   axis_label="tokens/s"),
    ]
    prefetch = [
        timeseries("Prefetch outcomes", "Prefetch loads per second by outcome: issued, completed (KV on the "
                   "device), used (a request read it), wasted (evicted before any request read it).", "ops",
                   Target(sum_by(["outcome"], rate(PREFETCH, REPLICA)), "{{outcome}}")),
        timeseries("Prefetch used / wasted ratio", "Per replica, used / completed and wasted / completed. "
                   "Used near 1 and wasted near 0 means prefetch predicts well.", "percentunit",
                   Target(prefetch_ratio("used", ["replica"]), "{{replica}} used"),
                   Target(prefetch_ratio("wasted", ["replica"]), "{{replica}} wasted"), min=0, soft_max=1),
        timeseries("Prefetch stall", "Time requests waited for KV loads, per replica: p99 and mean. The dashed "
                   "lines mark 100 ms (yellow) and 500 ms (red).", "s",
                   Target(quantile(0.99, "kvflow_prefetch_stall_seconds", REPLICA, by=["replica"]),
                          "{{replica}} p99"),
                   Target(mean("kvflow_prefetch_stall_seconds", REPLICA, by=["replica"]), "{{replica}} mean"),
                   steps=STALL_STEPS, threshold_style="dashed"),
    ]
    cache = [
        timeseries("Evictions by tier and reason", "Tokens evicted per second. gpu written_back: moved to the "
                   "CPU tier; gpu dropped: discarded; cpu capacity: the host tier was full.", "short",
                   Target(sum_by(["tier", "reason"], rate("kvflow_evicted_tokens_total", REPLICA)),
                          "{{tier}} {{reason}}"), stacking="normal", axis_label="tokens/s"),
        timeseries("Cache occupancy", "Tokens held in each tier, per replica.", "short",
                   Target(sum_by(["replica", "tier"], selector("kvflow_cache_tokens", REPLICA)),
                          "{{replica}} {{tier}}"), axis_label="tokens"),
        timeseries("Queue length by replica", "Requests waiting for admission on each replica (running ones not "
                   "counted); a replica far above the others is a hot spot the router should balance away.", "short",
                   Target(sum_by(["replica"], selector("kvflow_queue_length", REPLICA)), "{{replica}}")),
    ]
    router = [
        timeseries("Active workflows by tenant", "Live workflow instances the router tracks, per tenant; "
                   "'(none)' when no workflow is live.", "short", Target(active_by_tenant(), "{{tenant}}"),
                   stacking="normal"),
        timeseries("Router decisions by outcome", "Routing decisions per second: affinity (sent to the replica "
                   "holding the prefix), balanced (moved off a busy holder), cold (no replica held it).", "ops",
                   Target(or_zero(sum_by(["outcome"], rate(DECISIONS)), label="outcome"), "{{outcome}}"),
                   stacking="normal"),
        timeseries("Router decision latency", "Time the router takes to pick a replica for one call.", "s",
                   *percentiles("kvflow_router_decision_seconds", "decision", (0.5, 0.99), matchers=())),
    ]
    health = [
        timeseries("Replicas", "Replicas the router routes to, replicas exporting metrics (selected), and "
                   "replicas the router dropped in the interval (stopped reporting or failed a call).", "short",
                   Target("max(kvflow_router_replicas)", "reporting to the router"),
                   Target(f"count(count by (replica) ({selector('kvflow_queue_length', REPLICA)}))",
                          "exporting metrics"),
                   Target(or_zero(f"sum(increase(kvflow_router_replicas_lost_total{RATE}))"), "lost"),
                   width=8, step_line=True),
        timeseries("Store up", "1 while the router's state store answers, 0 while it does not (the router "
                   "serves from memory and queues its writes meanwhile).", "none",
                   Target("min by (backend) (kvflow_store_up)", "{{backend}}"), width=8, steps=UP_STEPS,
                   threshold_style="line", min=0, max=1, step_line=True),
        timeseries("Store writes waiting, write-backs", "State writes queued for the store (they pile up while "
                   "it is unreachable), and times the router wrote its whole state back to it: after an outage "
                   "(reconnect) or when it came back without its data (data_loss).", "short",
                   Target("max(kvflow_store_pending_writes)", "writes waiting"),
                   Target(or_zero(f"sum by (reason) (increase(kvflow_store_reconciles_total{RATE}))", label="reason"),
                          "write-back: {{reason}}"),
                   width=8, step_line=True),
    ]
    return dashboard(
        "kvflow-overview", "kvflow overview",
        "Fleet health of kvflow-ray: traffic and latency, KV hit ratio by tier, prefetch effectiveness and "
        "stalls, evictions and occupancy, routing.",
        [datasource_variable(), label_variable("replica", "Replica", "kvflow_queue_length")],
        [headline, traffic, hits, prefetch, cache, router, health],
    )


def workflows() -> dict[str, Any]:
    routed = sum_by((), rate(DECISIONS))
    headline = [
        stat("Active workflows", "Live workflow instances of the selected tenants.", "short",
             Target(or_zero(sum_by((), selector("kvflow_workflows_active", TENANT))), "active")),
        stat("Deviation rate", "Agent calls per second of the selected tenants that the step graph did not "
             "expect (served anyway). Persistent deviations mean the workflow definition is out of date.", "ops",
             Target(or_zero(sum_by((), rate("kvflow_workflow_deviations_total", TENANT))), "deviations/s")),
        stat("Routed calls", "Calls per second the router placed (all tenants).", "reqps",
             Target(or_zero(routed), "calls/s")),
        stat("Affinity share", "Share of routing decisions sent to the replica already holding the call's "
             "prefix (all tenants).", "percentunit",
             Target(or_zero(ratio(sum_by((), rate(DECISIONS, 'outcome="affinity"')), routed)), "affinity"),
             steps=HIT_RATIO_STEPS, min=0, max=1),
        stat("Device hit ratio (fleet)", "Share of prompt tokens whose KV was already on the GPU, over the "
             "selected replicas (all tenants). Red under 30 %, yellow under 60 %.", "percentunit",
             Target(device_hit_ratio(), "device hit ratio"), steps=HIT_RATIO_STEPS, min=0, max=1),
        stat("Request latency p99", "99th percentile end-to-end latency over the selected replicas.", "s",
             Target(quantile(0.99, "kvflow_request_latency_seconds", REPLICA), "p99")),
    ]
    tenants = [
        timeseries("Active workflows by tenant", "Live workflow instances per tenant; '(none)' when no "
                   "workflow is live.", "short", Target(active_by_tenant(TENANT), "{{tenant}}"), width=12,
                   stacking="normal"),
        timeseries("Deviations by tenant", "Unexpected agent calls per second, per tenant; '(none)' until a "
                   "deviation has happened.", "ops", Target(DEVIATIONS_BY_TENANT, "{{tenant}}"), width=12),
    ]
    routing = [
        timeseries("Router outcome share", "Share of routing decisions by outcome (all tenants): affinity is "
                   "what workflow-aware routing aims for; cold means no replica held the prefix.", "percentunit",
                   Target(outcome_share(), "{{outcome}}"), width=12, stacking="normal", min=0, soft_max=1),
        timeseries("Prompt-token source share (fleet)", "Where prompt tokens' KV came from over the selected "
                   "replicas: gpu (device hit), cpu (host tier), miss (recomputed).", "percentunit",
                   Target(tier_share(), "{{tier}}"), width=12, stacking="normal", min=0, soft_max=1),
    ]
    latency = [
        timeseries("Latency", "Time to first token and end-to-end latency (p50, p99) over the selected "
                   "replicas. The metrics carry no tenant label: this is the fleet view.", "s",
                   *percentiles("kvflow_ttft_seconds", "TTFT", (0.5, 0.99)),
                   *percentiles("kvflow_request_latency_seconds", "latency", (0.5, 0.99)), width=12),
        timeseries("Routed calls by outcome", "Routing decisions per second by outcome (all tenants).", "reqps",
                   Target(or_zero(sum_by(["outcome"], rate(DECISIONS)), label="outcome"), "{{outcome}}"),
                   width=12, stacking="normal"),
    ]
    prediction = [
        timeseries("Next-agent prediction accuracy", "Dynamic workflows under the predictive policy: how often "
                   "the router's learned transition models named the agent that ran next, one and two steps "
                   "ahead (all tenants); '(none)' while no dynamic workflow has been scored. Falling accuracy "
                   "means the applications changed how they choose; the models follow within tens of instances.",
                   "percentunit", Target(or_zero(PREDICTION_ACCURACY, label="steps"), "{{steps}} step(s) ahead"),
                   width=24, min=0, soft_max=1),
    ]
    pauses = sum_by((), rate("kvflow_session_pauses_total", REPLICA))
    sessions = [
        timeseries("Session pause-prediction error", "Agent sessions in tool pauses: mean |predicted - actual| "
                   "pause length over the selected replicas (all tenants); '(none)' until a pause has ended. "
                   "Large errors on one tool mean its durations are bimodal: prefetch still errs early.", "s",
                   Target(or_zero(ratio(sum_by((), rate("kvflow_session_pause_error_seconds_total", REPLICA)),
                                        pauses)), "mean error"), width=8, min=0),
        timeseries("Session prefetch timing", "Per second: paused histories whose prefetch fell due before the "
                   "client came back (due early) or after (due late); and where each history was when its client "
                   "came back: all on the device (ready), part still loading (the prefetch arrived late), or part "
                   "on the host or gone (missed).", "ops",
                   Target(or_zero(sum_by(["timing"], rate("kvflow_session_prefetch_total", REPLICA)),
                                  label="timing"), "due {{timing}}"),
                   Target(or_zero(sum_by(["history"], rate("kvflow_session_returns_total", REPLICA)),
                                  label="history"), "returned: {{history}}"), width=8),
        timeseries("Retained and pinned session history by tenant", "KV bytes of paused sessions' histories, per "
                   "tenant: retained (ranked as needed, bounded by tenant_retain_tokens; kvflow never pins) and "
                   "pinned (held whatever its rank: Continuum's pins, SGLang's retention_seconds).", "bytes",
                   Target(or_zero(sum_by(["tenant"], selector("kvflow_session_retained_bytes", REPLICA, TENANT)),
                                  label="tenant"), "{{tenant}} retained"),
                   Target(or_zero(sum_by(["tenant"], selector("kvflow_session_pinned_bytes", REPLICA, TENANT)),
                                  label="tenant"), "{{tenant}} pinned"), width=8, stacking="normal"),
    ]
    layer_tokens = "kvflow_reuse_layer_tokens_total"
    reuse = [
        timeseries("Reports reused beyond the prefix", "Prompt tokens per second whose KV was placed from an earlier "
                   "agent's kept output instead of computed (workflows that opt in with `reuse`, docs/design.md "
                   "§12), beside those computed; approximate KV, never counted as cached.", "short",
                   Target(or_zero(sum_by((), rate("kvflow_reused_tokens_total", REPLICA))), "reused"),
                   Target(or_zero(sum_by((), rate("kvflow_prompt_tokens_total", REPLICA, 'tier="miss"'))),
                          "computed or reused"), width=12),
        timeseries("Computed share of reusing prompts", "Computed / dense (token, layer) pairs of the prompts that "
                   "reused kept outputs (1 minus the compute reuse saved): what the reuse method (position, epic, "
                   "blend) still computed; 0 while no prompt reused.", "percentunit",
                   Target(or_zero(ratio(sum_by((), rate(layer_tokens, REPLICA, 'kind="computed"')),
                                        sum_by((), rate(layer_tokens, REPLICA, 'kind="dense"'))), label=None),
                          "computed share"), width=12, min=0, soft_max=1),
    ]
    budgets = [
        timeseries("KV dropped by budgets", "Private KV tokens per second that budgeted requests dropped at their "
                   "compactions (kvflow.kv_budget or tenant_kv_budget, docs/design.md §13): slots the pool got back "
                   "for other requests; 0 while no request runs under a budget.", "short",
                   Target(or_zero(sum_by((), rate("kvflow_kv_dropped_tokens_total", REPLICA))), "dropped"), width=12),
        timeseries("Compaction time share", "Engine seconds spent scoring and compacting budgeted requests' KV, per "
                   "second of wall time (the budget's overhead; its gain is more requests running at once).",
                   "percentunit", Target(or_zero(sum_by((), rate("kvflow_kv_compaction_seconds_total", REPLICA))),
                                         "compacting"), width=12, min=0),
    ]
    return dashboard(
        "kvflow-workflows", "kvflow workflows",
        "Per-tenant workflow view: live workflows and step-graph deviations by tenant (the router's tenant-labelled "
        "metrics), with the fleet's routing outcomes, device hit ratio and latency alongside (no tenant label).",
        [datasource_variable(), label_variable("replica", "Replica", "kvflow_queue_length"),
         label_variable("tenant", "Tenant", "kvflow_workflows_active")],
        [headline, tenants, routing, latency, prediction, sessions, reuse, budgets],
    )


# ------------------------------------------------------------------------------------------- output
def build() -> dict[str, dict[str, Any]]:
    """File name (in dashboards/) -> dashboard model."""
    return {f"{d['uid']}.json": d for d in (overview(), workflows())}


def render(model: dict[str, Any]) -> str:
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


def expressions() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every query of every panel."""
    return [(d["uid"], p["title"], t["expr"]) for d in build().values() for p in d["panels"] for t in p["targets"]]


def stale(directory: Path = HERE) -> list[str]:
    """The generated files whose checked-in text differs from what this code builds (or that are missing)."""
    out = []
    for name, model in build().items():
        path = directory / name
        if not path.exists() or path.read_text() != render(model):
            out.append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON files are stale; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            path = HERE / name
            old = path.read_text().splitlines(keepends=True) if path.exists() else []
            new = render(build()[name]).splitlines(keepends=True)
            sys.stdout.writelines(difflib.unified_diff(old, new, f"{name} (checked in)", f"{name} (built)", n=1))
        if names:
            print(f"stale: {', '.join(names)}; run: python dashboards/build.py", file=sys.stderr)
            return 1
        print("dashboards up to date")
        return 0
    for name, model in build().items():
        (HERE / name).write_text(render(model))
        print(f"wrote dashboards/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
