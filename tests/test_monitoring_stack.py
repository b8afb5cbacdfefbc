"""The local monitoring stack (kvflow_ray/serve/monitoring.py, `kvflow-ray serve --with-monitoring`):
the rendered Prometheus config is valid and points at the app; a real Prometheus started by
`LocalPrometheus` scrapes kvflow metrics, loads every rule and evaluates every recording rule; the CLI
starts Prometheus next to the app, prints its URL and stops both on SIGTERM. With a metrics token
(`--metrics-token`), Prometheus scrapes with it, from a 0600 file, never from its config."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from metrics_http import serve_metrics

from kvflow_ray.commands import serve as serve_command
from kvflow_ray.serve.monitoring import (
    RULES_DIR,
    LocalPrometheus,
    MonitoringError,
    alerting_rules,
    prometheus_api,
    recording_rules,
    render_config,
    scrape_target,
)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "scrape-" + secrets.token_hex(8)


def _get_status(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    return prometheus_api(base, "query", query=expr)["result"]


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


def _rule_groups(base: str) -> dict[str, list[dict[str, Any]]]:
    groups = prometheus_api(base, "rules")["groups"]
    return {group["name"]: group["rules"] for group in groups}


# ---------------------------------------------------------------------------------------------- rendering
def test_rendered_config_points_at_the_app_and_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: scripts/test.sh installs it (apt-get install prometheus)")
    text = render_config("127.0.0.1:8123")
    config = yaml.safe_load(text)
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "kvflow" and job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["127.0.0.1:8123"]}]
    assert config["rule_files"] == [str(RULES_DIR.resolve() / "*.yml")]
    # written anywhere (a temp dir), it still finds the repository's rules
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kvflow-alerts.yml" in done.stdout and "kvflow-recording.yml" in done.stdout, done.stdout

    fast = yaml.safe_load(render_config("127.0.0.1:8123", scrape_interval="1s", evaluation_interval="1s"))
    assert fast["scrape_configs"][0]["scrape_interval"] == "1s" and "scrape_timeout" not in fast["scrape_configs"][0]
    assert fast["global"]["evaluation_interval"] == "1s"
    assert "authorization" not in job  # no metrics token: /metrics is open, Prometheus sends nothing

    # with a metrics token: sent from a file (promtool checks the file exists), never written into the config
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN)
    text = render_config("127.0.0.1:8123", credentials_file=token_file)
    assert TOKEN not in text
    (job,) = yaml.safe_load(text)["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(token_file.resolve())}
    path.write_text(text)
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_metrics_token_flag_sets_the_app_config_and_the_scrape_token(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    config = serve_command.app_config(parser.parse_args(["--metrics-token", TOKEN, "--with-monitoring"]))
    assert config.metrics_token == TOKEN and config.metrics_token_value() == TOKEN
    plain = serve_command.app_config(parser.parse_args([]))
    assert plain.metrics_token is None and plain.metrics_token_value() is None
    with pytest.raises(ValueError, match="--metrics-token"):
        serve_command.app_config(parser.parse_args(["--metrics-token", " "]))
    # from --config: metrics_token_env names the variable that holds it (a Kubernetes Secret mounted as env);
    # --with-monitoring hands Prometheus the same value (metrics_token_value)
    monkeypatch.setenv("KVFLOW_TEST_METRICS_TOKEN", TOKEN)
    config_file = tmp_path / "app.yaml"
    config_file.write_text("metrics_token_env: KVFLOW_TEST_METRICS_TOKEN\n")
    from_env = serve_command.app_config(parser.parse_args(["--config", str(config_file)]))
    assert from_env.metrics_token is None and from_env.metrics_token_value() == TOKEN
    assert TOKEN not in json.dumps(from_env.to_dict()), "the token never travels in Ray's deployment args"


def test_scrape_target_reaches_wildcard_binds_on_loopback() -> None:
    assert scrape_target("127.0.0.1", 8000) == "127.0.0.1:8000"
    assert scrape_target("0.0.0.0", 8000) == "127.0.0.1:8000"
    assert scrape_target("::", 8000) == "[::1]:8000"
    assert scrape_target("10.0.0.5", 9) == "10.0.0.5:9"


def test_missing_prometheus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MonitoringError, match="apt-get install prometheus"):
        LocalPrometheus("127.0.0.1:8000").check()
    with pytest.raises(MonitoringError, match="not installed"):
        LocalPrometheus("127.0.0.1:8000", binary=str(tmp_path / "prometheus")).check()


def test_a_taken_port_is_a_clear_error() -> None:
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: scripts/test.sh installs it (apt-get install prometheus)")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(MonitoringError, match="--prometheus-port"):
            LocalPrometheus("127.0.0.1:8000", port=busy.getsockname()[1]).check()


def test_serve_without_prometheus_fails_fast_with_the_install_hint(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no prometheus there
    done = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "serve", "--with-monitoring", "--port", "1"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "apt-get install prometheus" in done.stderr and done.stdout == ""


def test_the_load_generator_reads_metrics_with_the_token(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvflow-ray run` reads hit ratios from /metrics: it sends --metrics-token, and without the right one
    it stops before the first call with a message that says so."""
    from kvflow_ray.cli import main
    from kvflow_ray.client.loadgen import scrape

    with serve_metrics(lambda: b"kvflow_router_replicas 2\n", token=TOKEN) as address:
        url = f"http://{address}"
        assert scrape(url, TOKEN) == {("kvflow_router_replicas", ()): 2.0}
        with pytest.raises(PermissionError, match="--metrics-token"):
            scrape(url)
        with pytest.raises(PermissionError, match="not it"):
            scrape(url, "an-api-key")
        assert main(["run", str(ROOT / "workflows" / "peer.yaml"), "--url", url]) == 2
        assert "401" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- a real Prometheus
@pytest.fixture
def fake_app() -> Iterator[str]:
    """An HTTP /metrics with the router's and two replicas' real metric families (kvflow_ray/serve/metrics.py),
    merged as the app merges them; every scrape is one more request per replica and routing decision. It
    wants the metrics token TOKEN, as the app started with `--metrics-token TOKEN` does."""
    pytest.importorskip("prometheus_client")
    from kvflow_ray.engines.base import GenerateResult
    from kvflow_ray.serve.metrics import HubMetrics, ReplicaMetrics, RouterMetrics, merge_expositions

    hub, router = HubMetrics(), RouterMetrics()
    replicas = [ReplicaMetrics("r0"), ReplicaMetrics("r1")]
    lock = threading.Lock()
    scrapes = [0]

    def render() -> bytes:
        with lock:
            scrapes[0] += 1
            n = scrapes[0]
            for replica in replicas:
                replica.observe_result(GenerateResult(
                    tokens=[1], text="x", prompt_tokens=100, gpu_hit_tokens=60, cpu_hit_tokens=20, miss_tokens=20,
                    stall_s=0.002, ttft_s=0.03, latency_s=0.2, finish_reason="length"))
                replica.observe_stats({
                    "cache_tokens": {"gpu": 500, "cpu": 900}, "waiting": 0, "running": 1,
                    "evicted_tokens": {"gpu": 10 * n, "written_back": 5 * n, "cpu": 2 * n},
                    "prefetch": {"issued": 2 * n, "completed": 2 * n, "used": n, "wasted": n // 2}})
            router.observe_decision("affinity" if n % 4 else "cold", 0.0004, "default", deviation=False)
            hub.replicas.set(len(replicas))
            hub.store.set("memory", True, 0, {})
            router.set_active({"default": 3})
            return merge_expositions([hub.exposition(), (router.exposition(), {"ingress": "i0"}),
                                      *(r.exposition() for r in replicas)])

    with serve_metrics(render, token=TOKEN) as address:
        assert _get_status(f"http://{address}/metrics") == 401
        yield address


def test_local_prometheus_scrapes_loads_every_rule_and_records(fake_app: str, free_port: Callable[[], int]) -> None:
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: scripts/test.sh installs it (apt-get install prometheus)")
    prometheus = LocalPrometheus(fake_app, port=free_port(), scrape_interval="1s", evaluation_interval="1s",
                                 metrics_token=TOKEN)
    with prometheus:
        assert prometheus.proc is not None and prometheus.workdir is not None
        workdir, proc = prometheus.workdir, prometheus.proc
        base = prometheus.url
        # the token: in a file only its owner reads, named by the config, not in it
        token_file = workdir / "metrics-token"
        assert token_file.read_text() == TOKEN and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert TOKEN not in (workdir / "prometheus.yml").read_text()
        # up only if every scrape carries the token: the endpoint answers 401 without it
        _wait("the kvflow target up", lambda: [s["value"][1] for s in _query(base, 'up{job="kvflow"}')] == ["1"])
        (target,) = prometheus_api(base, "targets", state="active")["activeTargets"]
        assert target["health"] == "up" and target["lastError"] == "", target

        groups = _rule_groups(base)
        assert set(groups) == {"kvflow-recording", "kvflow-alerts"}
        assert {r["name"] for r in groups["kvflow-recording"]} == {name for name, _ in recording_rules()}
        assert {r["name"] for r in groups["kvflow-alerts"]} == {r["alert"] for r in alerting_rules()}

        # every recording rule, as a plain query and as the series Prometheus records, has a number
        missing = {name: expr for name, expr in recording_rules()}

        def all_recorded() -> bool:
            for name, expr in list(missing.items()):
                direct, recorded = _query(base, expr), _query(base, name)
                if direct and recorded and all(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in direct):
                    del missing[name]
            return not missing

        _wait(f"data for every recording rule (missing: {missing})", all_recorded, timeout_s=60)
        unhealthy = [r["name"] for group in _rule_groups(base).values() for r in group if r["health"] != "ok"]
        assert unhealthy == [], unhealthy
        ratios = {s["metric"]["tier"]: float(s["value"][1])
                  for s in _query(base, 'kvflow:prompt_token_hit_ratio:rate5m{replica="r0"}')}
        assert ratios == pytest.approx({"gpu": 0.6, "cpu": 0.2, "miss": 0.2})
        # a healthy stack raises no alert
        assert prometheus_api(base, "alerts")["alerts"] == []
    assert proc.poll() is not None, "prometheus stopped"
    assert not workdir.exists(), "its temporary directory is removed"
    assert not prometheus.ready()


# ---------------------------------------------------------------------------------------------- the CLI
def _pids_with(fragment: str) -> dict[int, list[str]]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(fragment in arg for arg in argv):
            found[int(entry.name)] = argv
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_serve_with_monitoring_starts_prometheus_and_stops_it_on_sigterm(free_port: Callable[[], int],
                                                                           tmp_path: Path) -> None:
    pytest.importorskip("ray")
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: scripts/test.sh installs it (apt-get install prometheus)")
    port, prometheus_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kvflow_ray.cli", "serve", "--with-monitoring", "--port",
                                 str(port), "--prometheus-port", str(prometheus_port), "--replicas", "1",
                                 "--metrics-token", TOKEN],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=ROOT)
    try:
        info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]  # unchanged: the app's URL first
        assert info["url"] == f"http://127.0.0.1:{port}", log.read_text()[-3000:]
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line == f"prometheus: http://127.0.0.1:{prometheus_port}", (line, log.read_text()[-3000:])
        base = line.split(" ", 1)[1]

        (pid, argv), = _pids_with(f"--web.listen-address=127.0.0.1:{prometheus_port}").items()
        config = Path(next(a for a in argv if a.startswith("--config.file=")).split("=", 1)[1])
        (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
        assert job["static_configs"] == [{"targets": [f"127.0.0.1:{port}"]}]
        assert job["authorization"]["type"] == "Bearer"
        assert Path(job["authorization"]["credentials_file"]).resolve() == (config.parent / "metrics-token").resolve()
        assert TOKEN not in config.read_text()
        # the app wants the token on /metrics (and only there); Prometheus sends it
        assert _get_status(info["url"] + "/metrics") == 401
        assert _get_status(info["url"] + "/metrics", token="not-" + TOKEN) == 401
        assert _get_status(info["url"] + "/metrics", token=TOKEN) == 200
        assert _get_status(info["url"] + "/health") == 200

        def target_up() -> bool:
            return [s["value"][1] for s in _query(base, 'up{job="kvflow"}')] == ["1"]

        _wait("Prometheus to scrape the app", target_up, timeout_s=90)
        _wait("kvflow metrics in Prometheus", lambda: bool(_query(base, "kvflow_store_up")), timeout_s=30)
        # the router actor's store and the ingress's (labelled `ingress`), as the dashboards read them
        assert [s["metric"]["backend"] for s in _query(base, "min by (backend) (kvflow_store_up) == 1")] == ["memory"]
        assert len(_query(base, "kvflow_store_up")) == 2
        assert [s["value"][1] for s in _query(base, "kvflow_router_replicas")] == ["1"]
        assert set(_rule_groups(base)) == {"kvflow-recording", "kvflow-alerts"}

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        _wait("prometheus to exit", lambda: not _alive(pid), timeout_s=20)
        assert not config.parent.exists(), "its temporary directory is removed"
        with pytest.raises(OSError):
            urllib.request.urlopen(base + "/-/ready", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for leftover in _pids_with(f"--web.listen-address=127.0.0.1:{prometheus_port}"):
            os.kill(leftover, signal.SIGKILL)
