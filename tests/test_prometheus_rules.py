"""deploy/prometheus/: the config and rule files pass `promtool check`, the alert unit tests
(deploy/prometheus/tests/*.yml) pass `promtool test rules`, every alert carries what an on-call
reader needs, and the rules name only metrics the app exports (kvflow_ray/serve/metrics.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvflow_ray.serve.monitoring import PROMETHEUS_DIR, alerting_rules, recording_rules

ROOT = Path(__file__).resolve().parents[1]
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
TEST_FILES = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))

# What /metrics serves (docs/design.md §9, kvflow_ray/serve/metrics.py), histograms as their scraped series.
HISTOGRAMS = ("kvflow_prefetch_stall_seconds", "kvflow_ttft_seconds", "kvflow_request_latency_seconds",
              "kvflow_router_decision_seconds")
EXPORTED = {
    "kvflow_prompt_tokens_total", "kvflow_prefetch_total", "kvflow_evicted_tokens_total", "kvflow_cache_tokens",
    "kvflow_queue_length", "kvflow_router_decisions_total", "kvflow_workflows_active",
    "kvflow_workflow_deviations_total", "kvflow_router_replicas", "kvflow_router_replicas_lost_total",
    "kvflow_store_up",
    *(f"{name}_{suffix}" for name in HISTOGRAMS for suffix in ("bucket", "sum", "count")),
}
METRIC = re.compile(r"\bkvflow_[a-z_]+")
RECORDED = re.compile(r"\bkvflow:[a-z0-9_]+:[a-z0-9_]+")


def _promtool(*args: str) -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: scripts/test.sh installs it (apt-get install prometheus)")
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"promtool {' '.join(args)} failed ({done.returncode}):\n{output}")
    return output


def test_files_are_there() -> None:
    assert (PROMETHEUS_DIR / "prometheus.yml").is_file()
    assert [p.name for p in RULE_FILES] == ["kvflow-alerts.yml", "kvflow-recording.yml"]
    assert TEST_FILES


def test_promtool_check_config() -> None:
    output = _promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    for path in RULE_FILES:  # the config's rule_files glob finds the rules
        assert path.name in output, output


def test_promtool_check_rules() -> None:
    _promtool("check", "rules", *map(str, RULE_FILES))


def test_promtool_unit_tests_pass() -> None:
    output = _promtool("test", "rules", *map(str, TEST_FILES))
    assert "SUCCESS" in output, output


def test_shipped_config_scrapes_the_local_app() -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rules/*.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "kvflow" and job["metrics_path"] == "/metrics" and job["scrape_interval"] == "5s"
    assert job["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]


def test_groups_and_names() -> None:
    groups = {path.name: [g["name"] for g in yaml.safe_load(path.read_text())["groups"]] for path in RULE_FILES}
    assert groups == {"kvflow-alerts.yml": ["kvflow-alerts"], "kvflow-recording.yml": ["kvflow-recording"]}
    records = [name for name, _expr in recording_rules()]
    assert len(records) == len(set(records))
    for name in records:
        assert RECORDED.fullmatch(name), f"{name}: not kvflow:<what>:<window>"
    for needed in ("kvflow:prompt_token_hit_ratio:rate5m", "kvflow:prompt_token_hit_ratio_fleet:rate5m",
                   "kvflow:prefetch_used_ratio:rate5m", "kvflow:prefetch_stall_seconds:p99_5m",
                   "kvflow:ttft_seconds:p99_5m", "kvflow:request_latency_seconds:p99_5m",
                   "kvflow:router_decision_seconds:p99_5m"):
        assert needed in records
    alerts = [rule["alert"] for rule in alerting_rules()]
    assert len(alerts) == len(set(alerts))
    assert {"KVFlowHitRatioCollapse", "KVFlowPrefetchStallHigh", "KVFlowReplicaDown", "KVFlowEndpointDown",
            "KVFlowRedisUnreachable", "KVFlowRouterDecisionSlow"} <= set(alerts)


def test_every_alert_has_severity_and_annotations() -> None:
    for rule in alerting_rules():
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in ("critical", "warning", "info"), name
        annotations = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert str(annotations.get(key, "")).strip(), f"{name}: no {key} annotation"
        assert "\n" not in annotations["runbook"].strip(), f"{name}: the runbook is one line"
        anchor = "docs/serving.md#" + name.lower()
        assert anchor in annotations["runbook"], f"{name}: the runbook points to {anchor}"


def test_every_alert_has_a_unit_test_firing_and_quiet() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = {rule["alert"] for rule in alerting_rules()}
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested quiet"


def test_recorded_series_the_alerts_use_are_unit_tested() -> None:
    tested = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("promql_expr_test", []):
                tested.update(RECORDED.findall(check["expr"]))
    used = {name for rule in alerting_rules() for name in RECORDED.findall(rule["expr"])}
    assert used, "the alerts use recording rules"
    assert used <= tested, f"recording rules the alerts read without a promql_expr_test: {used - tested}"


def test_rules_name_only_exported_metrics_and_recorded_series() -> None:
    records = {name for name, _expr in recording_rules()}
    for name, expr in recording_rules():
        assert not RECORDED.findall(expr), f"{name}: reads another rule's output (must query raw series)"
        unknown = set(METRIC.findall(expr)) - EXPORTED
        assert not unknown, f"{name}: unknown metrics {unknown}"
    for rule in alerting_rules():
        texts = [rule["expr"], *map(str, rule.get("annotations", {}).values())]
        for text in texts:
            unknown = set(METRIC.findall(text)) - EXPORTED
            assert not unknown, f"{rule['alert']}: unknown metrics {unknown}"
            unrecorded = set(RECORDED.findall(text)) - records
            assert not unrecorded, f"{rule['alert']}: unknown recorded series {unrecorded}"


def test_recording_rules_helper_reads_the_yaml() -> None:
    rules = recording_rules()
    assert rules and all(isinstance(name, str) and isinstance(expr, str) and expr for name, expr in rules)
    raw = yaml.safe_load((PROMETHEUS_DIR / "rules" / "kvflow-recording.yml").read_text())
    assert [name for name, _ in rules] == [r["record"] for r in raw["groups"][0]["rules"]]
    assert dict(rules)["kvflow:prompt_tokens:rate5m"] == "sum by (replica, tier) (rate(kvflow_prompt_tokens_total[5m]))"
