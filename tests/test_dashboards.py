"""The Grafana dashboards (dashboards/): the checked-in JSON is what dashboards/build.py builds, it fits
the dashboard schema subset we emit (dashboards/schema.json), and every panel is well formed: a title,
a description, the datasource variable, a unit, a legend on every query, unique ids and refIds, no
overlapping grid positions; queries name only metric families the project exports (docs/design.md §9) and
only template variables the dashboard defines, in the forms the end-to-end test substitutes. With
promtool on the machine every query is also parsed as PromQL. Fast: no services.
"""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
FIX = "python dashboards/build.py"

# The series Prometheus scrapes from kvflow-ray (kvflow_ray/serve/metrics.py; the SGLang plugin exports
# a subset of the same names without the `replica` label).
HISTOGRAMS = ("kvflow_prefetch_stall_seconds", "kvflow_ttft_seconds", "kvflow_request_latency_seconds",
              "kvflow_router_decision_seconds")
KNOWN_SERIES = frozenset({
    "kvflow_prompt_tokens_total", "kvflow_prefetch_total", "kvflow_evicted_tokens_total", "kvflow_cache_tokens",
    "kvflow_queue_length", "kvflow_router_decisions_total", "kvflow_workflows_active",
    "kvflow_workflow_deviations_total", "kvflow_router_replicas", "kvflow_router_replicas_lost_total",
    "kvflow_store_up", "kvflow_store_pending_writes", "kvflow_store_reconciles_total",
    "kvflow_prediction_accuracy", "kvflow_predictions", "kvflow_session_pauses_total",
    "kvflow_session_pause_error_seconds_total", "kvflow_session_prefetch_total", "kvflow_session_retained_tokens",
    "kvflow_session_retained_bytes", "kvflow_session_pinned_bytes", "kvflow_session_returns_total",
    "kvflow_reused_tokens_total", "kvflow_reuse_layer_tokens_total", "kvflow_segment_kv_bytes",
    "kvflow_kv_compactions_total", "kvflow_kv_dropped_tokens_total", "kvflow_kv_compaction_seconds_total",
    *(h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")),
})
METRIC = re.compile(r"kvflow_[a-z_]+")
# Grafana's own variables; every other `$name` must be a template variable of the dashboard.
BUILTIN_VARIABLES = {"__rate_interval"}
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
# The only ways a query may use a variable (tests/test_ops_e2e.py substitutes exactly these).
ALLOWED_USES = ('replica=~"$replica"', 'tenant=~"$tenant"', "[$__rate_interval]")


def load_build() -> ModuleType:
    """dashboards/build.py as other tests load it: by path, not registered in sys.modules."""
    spec = importlib.util.spec_from_file_location("kvflow_dashboards_under_test", DASHBOARDS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build()
FILES = sorted(build.build())


def checked_in(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS / name).read_text())


def panels(name: str) -> list[dict[str, Any]]:
    return checked_in(name)["panels"]


def test_checked_in_json_is_what_the_code_builds() -> None:
    assert FILES == ["kvflow-overview.json", "kvflow-workflows.json"]
    stale = build.stale()
    assert not stale, f"stale dashboards {stale}: regenerate with `{FIX}` and commit the JSON"


def test_check_flag_fails_on_stale_json_and_names_the_fix(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--check"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    copy = tmp_path / "dashboards"
    copy.mkdir()
    shutil.copy(DASHBOARDS / "build.py", copy / "build.py")
    for name in FILES:
        shutil.copy(DASHBOARDS / name, copy / name)
    model = checked_in(FILES[0])
    model["title"] = "edited by hand"
    (copy / FILES[0]).write_text(json.dumps(model, indent=2) + "\n")
    stale = subprocess.run([sys.executable, str(copy / "build.py"), "--check"], capture_output=True, text=True)
    assert stale.returncode == 1
    assert FILES[0] in stale.stderr and FIX in stale.stderr
    assert "edited by hand" in stale.stdout  # the diff
    rebuilt = subprocess.run([sys.executable, str(copy / "build.py")], capture_output=True, text=True)
    assert rebuilt.returncode == 0
    assert (copy / FILES[0]).read_text() == (DASHBOARDS / FILES[0]).read_text()


@pytest.mark.parametrize("name", FILES)
def test_dashboard_fits_the_schema(name: str) -> None:
    schema = json.loads((DASHBOARDS / "schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft202012Validator(schema).iter_errors(checked_in(name))]
    assert not errors, "\n".join(errors)


def test_schema_rejects_a_panel_without_unit_or_datasource() -> None:
    schema = json.loads((DASHBOARDS / "schema.json").read_text())
    model = checked_in(FILES[0])
    del model["panels"][0]["fieldConfig"]["defaults"]["unit"]
    del model["panels"][1]["datasource"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(model, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("name", FILES)
def test_dashboard_settings(name: str) -> None:
    model = checked_in(name)
    assert model["uid"] == name.removesuffix(".json")
    assert model["schemaVersion"] >= 39
    assert model["time"] == {"from": "now-15m", "to": "now"}
    assert model["refresh"] == "10s"
    assert model["tags"] == ["kvflow"]
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    replica = variables["replica"]
    assert replica["definition"] == "label_values(kvflow_queue_length, replica)"
    assert replica["multi"] and replica["includeAll"] and replica["allValue"] == ".*"
    if model["uid"] == "kvflow-workflows":
        tenant = variables["tenant"]
        assert tenant["definition"] == "label_values(kvflow_workflows_active, tenant)"
        assert tenant["multi"] and tenant["includeAll"] and tenant["allValue"] == ".*"


@pytest.mark.parametrize("name", FILES)
def test_every_panel_is_complete(name: str) -> None:
    for panel in panels(name):
        where = f"{name} panel {panel.get('id')} {panel.get('title')!r}"
        assert panel["title"].strip(), where
        assert panel["description"].strip(), where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["fieldConfig"]["defaults"]["unit"], where
        assert panel["targets"], where
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{where}: duplicate refId {ref_ids}"
        for target in panel["targets"]:
            assert target["legendFormat"].strip(), f"{where}: target {target['refId']} has no legend"
            assert target["datasource"] == panel["datasource"], where


@pytest.mark.parametrize("name", FILES)
def test_panel_ids_are_unique_and_the_grid_has_no_overlap(name: str) -> None:
    ps = panels(name)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}: {ids}"
    cells: dict[tuple[int, int], str] = {}
    for p in ps:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, f"{p['title']!r} leaves the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r} at x={x} y={y}"
                cells[(x, y)] = p["title"]


@pytest.mark.parametrize("name", FILES)
def test_queries_name_only_exported_metrics(name: str) -> None:
    for panel in panels(name):
        for target in panel["targets"]:
            used = METRIC.findall(target["expr"])
            assert used, f"{panel['title']!r}: no kvflow metric in {target['expr']}"
            unknown = set(used) - KNOWN_SERIES
            assert not unknown, f"{panel['title']!r} queries unknown series {sorted(unknown)}"


def test_known_series_are_what_the_metrics_module_exports() -> None:
    """The list above against kvflow_ray/serve/metrics.py itself, so a renamed metric fails here too."""
    pytest.importorskip("prometheus_client")
    from kvflow_ray.serve.metrics import HubMetrics, ReplicaMetrics, RouterMetrics

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {family.name + suffix
                for registry in (ReplicaMetrics("r0").registry, RouterMetrics().registry, HubMetrics().registry)
                for family in registry.collect() for suffix in suffixes[family.type]}
    assert exported >= KNOWN_SERIES, sorted(KNOWN_SERIES - exported)


@pytest.mark.parametrize("name", FILES)
def test_queries_use_only_defined_variables_in_the_substituted_forms(name: str) -> None:
    model = checked_in(name)
    defined = {v["name"] for v in model["templating"]["list"]}
    for panel in model["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            undefined = set(VARIABLE.findall(expr)) - defined - BUILTIN_VARIABLES
            assert not undefined, f"{panel['title']!r} uses undefined variables {undefined}: {expr}"
            rest = expr
            for use in ALLOWED_USES:
                rest = rest.replace(use, "")
            assert "$" not in rest, f"{panel['title']!r}: a variable outside {ALLOWED_USES}: {expr}"


def test_expressions_lists_every_query() -> None:
    listed = build.expressions()
    in_files = [(checked_in(n)["uid"], p["title"], t["expr"]) for n in FILES for p in panels(n) for t in p["targets"]]
    assert listed == in_files
    assert {uid for uid, _, _ in listed} == {"kvflow-overview", "kvflow-workflows"}


def test_headline_stats_and_thresholds() -> None:
    def by_title(name: str) -> dict[str, dict[str, Any]]:
        return {(p["type"], p["title"]): p for p in panels(name)}

    overview = by_title("kvflow-overview.json")
    for title in ("Device hit ratio (fleet)", "Prefetch used ratio", "Prefetch stall p99", "Replicas reporting",
                  "Store up"):
        assert ("stat", title) in overview, title

    def steps(panel: dict[str, Any]) -> list[tuple[Any, str]]:
        return [(s["value"], s["color"]) for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    hit = overview[("stat", "Device hit ratio (fleet)")]
    assert hit["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert steps(hit) == [(None, "red"), (0.3, "yellow"), (0.6, "green")]
    stall = overview[("stat", "Prefetch stall p99")]
    assert stall["fieldConfig"]["defaults"]["unit"] == "s"
    assert steps(stall) == [(None, "green"), (0.1, "yellow"), (0.5, "red")]
    assert steps(overview[("stat", "Store up")]) == [(None, "red"), (1, "green")]
    workflows = by_title("kvflow-workflows.json")
    assert ("timeseries", "Active workflows by tenant") in workflows
    assert ("timeseries", "Deviations by tenant") in workflows


def test_series_that_appear_only_after_an_event_fall_back_to_zero() -> None:
    """Deviations, lost replicas, active workflows and routing decisions have no series until something
    happens; a query on them alone must still return data (tests/test_ops_e2e.py requires it)."""
    for uid, title, expr in build.expressions():
        for metric in ("kvflow_workflow_deviations_total", "kvflow_router_replicas_lost_total",
                       "kvflow_workflows_active", "kvflow_router_decisions_total"):
            if metric in expr and "_bucket" not in expr:
                assert re.search(r"\bor on\(\) (vector\(0\)|label_replace\(vector\(0\))", expr), (uid, title, expr)


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """promtool parses each query (with variables as Grafana sends them at 'All') as a recording rule."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (scripts/test.sh installs the prometheus package)")
    exprs = sorted({expr.replace("$__rate_interval", "1m").replace("$replica", ".*").replace("$tenant", ".*")
                    for _, _, expr in build.expressions()})
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"kvflow_dashboard_query_{i}", "expr": expr} for i, expr in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout
