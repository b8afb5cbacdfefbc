#!/usr/bin/env python3
"""Generate the KubeRay RayService's `serveConfigV2` for each Kubernetes overlay from the Ray Serve
config in deploy/ (one source: what `serve run deploy/serve-*.yaml` deploys is what the cluster deploys).

    python deploy/render_k8s.py            # (re)write k8s/overlays/*/serve-config.generated.yaml and
                                           # k8s/base/monitoring.generated.yaml (rules + dashboards)
    python deploy/render_k8s.py --check    # exit 1 when a generated file is missing or stale

Kustomize reads nothing outside its root, so the result is written into each overlay as a JSON patch
(RFC 6902) on the RayService `kvflow` of k8s/base: it sets `spec.serveConfigV2` and the replica counts of
the overlay's first worker group (the group that runs the engine replicas: one engine replica per worker
pod, so the group has as many pods as the Serve config has engine replicas).

In-cluster changes to the deploy file (and nothing else; tests/test_k8s.py checks it):
- every overlay: `http_options.host: 0.0.0.0` (proxies listen on the pod IP), and in the kvflow app's
  args `redis: redis://kvflow-redis:6379/0` (k8s/base/redis.yaml), `api_keys_env: KVFLOW_API_KEYS`
  (keys from the Secret kvflow-api-keys, mounted as that env var in every Ray container) and
  `metrics_token_env: KVFLOW_METRICS_TOKEN` (the /metrics token from the Secret kvflow-metrics-token,
  mounted the same way; the PodMonitor kvflow-serve sends it from that Secret);
- overlay-specific `args` below (OVERLAYS), e.g. CPU-engine threads sized to the worker pods.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
IMPORT_PATH = "kvflow_ray.serve.app:build_app"
HOST = "0.0.0.0"
REDIS_URL = "redis://kvflow-redis:6379/0"  # the Service of k8s/base/redis.yaml, same namespace
API_KEYS_ENV = "KVFLOW_API_KEYS"  # the env var every Ray container gets from the Secret kvflow-api-keys
METRICS_TOKEN_ENV = "KVFLOW_METRICS_TOKEN"  # the same, from the Secret kvflow-metrics-token
GENERATED_NAME = "serve-config.generated.yaml"
ENGINE_GROUP = 0  # index of the engine worker group in spec.rayClusterConfig.workerGroupSpecs


@dataclasses.dataclass(frozen=True)
class Overlay:
    name: str  # k8s/overlays/<name>
    source: str  # the Ray Serve config, relative to the repository root
    args: dict[str, Any]  # more app args for this overlay (AppConfig fields)

    @property
    def path(self) -> Path:
        return ROOT / "k8s" / "overlays" / self.name / GENERATED_NAME


OVERLAYS = (
    # CPU workers have 2 CPUs each (k8s/overlays/cpu-demo/workers.yaml): one engine replica per worker pod,
    # with as many torch threads as the pod has CPUs (the default, os.cpu_count() / replicas, would count
    # the node's cores, not the pod's).
    Overlay("cpu-demo", "deploy/serve-cpu.yaml", {"replica_num_cpus": 2, "threads": 2}),
    # GPU workers: one GPU each; replica_num_gpus/replica_num_cpus come from the deploy file as they are.
    Overlay("gpu", "deploy/serve-sglang.yaml", {}),
)


def _app_config() -> type:
    """kvflow_ray.serve.config.AppConfig (a light import: no Ray), also from a plain checkout."""
    sys.path.insert(0, str(ROOT))
    try:
        from kvflow_ray.serve.config import AppConfig
    finally:
        sys.path.pop(0)
    return AppConfig


def kvflow_app(serve_config: dict[str, Any]) -> dict[str, Any]:
    """The application of `serve_config` that runs kvflow-ray (its import_path is build_app)."""
    apps = [a for a in serve_config.get("applications") or [] if a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"expected exactly one application with import_path {IMPORT_PATH}, found {len(apps)}")
    return apps[0]


def in_cluster_config(serve_config: dict[str, Any], extra_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """`serve_config` (a parsed deploy/serve-*.yaml) as the cluster runs it; the input is not changed."""
    config = copy.deepcopy(serve_config)
    config.setdefault("http_options", {})["host"] = HOST
    app = kvflow_app(config)
    args = app.setdefault("args", {})
    args.update({"redis": REDIS_URL, "api_keys_env": API_KEYS_ENV, "metrics_token_env": METRICS_TOKEN_ENV,
                 **(extra_args or {})})
    unknown = sorted(set(args) - set(_app_config().field_names()))
    if unknown:
        raise ValueError(f"args {unknown} are not fields of kvflow_ray.serve.config.AppConfig")
    return config


def engine_replicas(serve_config: dict[str, Any]) -> int:
    """How many engine replicas the Serve config deploys."""
    args = kvflow_app(serve_config).get("args") or {}
    return int(args.get("replicas", _app_config().model_fields["replicas"].default))


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so serveConfigV2 reads as YAML in the patch."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(overlay: Overlay) -> str:
    """The text of the overlay's generated patch."""
    source = yaml.safe_load((ROOT / overlay.source).read_text())
    config = in_cluster_config(source, overlay.args)
    serve_text = (f"# {overlay.source} with the in-cluster settings of deploy/render_k8s.py\n"
                  + yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    replicas = engine_replicas(config)
    group = f"/spec/rayClusterConfig/workerGroupSpecs/{ENGINE_GROUP}"
    ops = [{"op": "add", "path": "/spec/serveConfigV2", "value": serve_text}]
    ops += [{"op": "add", "path": f"{group}/{key}", "value": replicas}
            for key in ("replicas", "minReplicas", "maxReplicas")]
    header = (f"# generated by deploy/render_k8s.py from {overlay.source} — do not edit\n"
              f"# (edit {overlay.source} or deploy/render_k8s.py, then run: python deploy/render_k8s.py)\n"
              "# JSON patch on the RayService kvflow: its Serve config, and as many engine workers as engine "
              "replicas.\n")
    return header + yaml.dump(ops, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


MONITORING_NAME = "monitoring.generated.yaml"  # in k8s/base
RULES_GLOB = "deploy/prometheus/rules/*.yml"
DASHBOARDS_GLOB = "dashboards/*.json"


def monitoring_path() -> Path:
    return ROOT / "k8s" / "base" / MONITORING_NAME


def render_monitoring() -> str:
    """The Prometheus rules and Grafana dashboards as cluster objects, from the same files the local
    stack uses: a PrometheusRule holding every group of deploy/prometheus/rules (the Prometheus
    Operator's form of a rule file) and a ConfigMap of dashboards/*.json labelled for Grafana's
    dashboard sidecar (`grafana_dashboard: "1"`, kube-prometheus-stack's default)."""
    rule_files = sorted(ROOT.glob(RULES_GLOB))
    dashboards = sorted(ROOT.glob(DASHBOARDS_GLOB))
    if not rule_files or not dashboards:
        raise ValueError(f"nothing to render: {RULES_GLOB} and {DASHBOARDS_GLOB} must both match files")
    groups = [group for path in rule_files for group in yaml.safe_load(path.read_text())["groups"]]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "kvflow"}, "spec": {"groups": groups}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "kvflow-grafana-dashboards", "labels": {"grafana_dashboard": "1"}},
                  "data": {path.name: path.read_text() for path in dashboards}}
    header = (f"# generated by deploy/render_k8s.py from {RULES_GLOB} and {DASHBOARDS_GLOB} — do not edit\n"
              "# (edit those files, then run: python deploy/render_k8s.py)\n")
    return header + yaml.dump_all([rule, config_map], Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                                  allow_unicode=True)


def outputs(overlays: tuple[Overlay, ...] = OVERLAYS) -> list[tuple[Path, str]]:
    """Every generated file and the text it must hold."""
    return [(o.path, render(o)) for o in overlays] + [(monitoring_path(), render_monitoring())]


def stale(overlays: tuple[Overlay, ...] = OVERLAYS) -> list[Path]:
    """Generated files that are missing or differ from what the sources give now."""
    return [path for path, text in outputs(overlays) if not path.is_file() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a generated file is missing or stale")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for path in out_of_date:
            print(f"stale: {path.relative_to(ROOT)} (run: python deploy/render_k8s.py)", file=sys.stderr)
        return 1 if out_of_date else 0
    for path, text in outputs():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
