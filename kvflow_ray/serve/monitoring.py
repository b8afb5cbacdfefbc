"""The monitoring stack: the repository's Prometheus config and rules (deploy/prometheus/), and a local
Prometheus for `kvflow-ray serve --with-monitoring` (docs/serving.md, "Monitoring").

`LocalPrometheus` runs the `prometheus` binary on PATH (Debian: `apt-get install prometheus`) on
127.0.0.1 with a config rendered from deploy/prometheus/prometheus.yml: the one scrape target
replaced by the app's host:port, the rule files referenced by absolute path. Its data lives in a
temporary directory, removed when it stops. When the app protects /metrics with a metrics token
(`--metrics-token`), the token goes into a file in that directory (mode 0600) and the scrape config
sends it as `Authorization: Bearer <token>` through `credentials_file`, so it is never in the config.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES_DIR = PROMETHEUS_DIR / "rules"
CONFIG_FILE = PROMETHEUS_DIR / "prometheus.yml"
JOB = "kvflow"
INSTALL_HINT = ("install it: `sudo apt-get install prometheus` (Debian/Ubuntu; stop the service it enables "
                "if you do not want it: `sudo systemctl disable --now prometheus`), or put the binary from "
                "https://prometheus.io/download/ on PATH")


class MonitoringError(RuntimeError):
    """The local Prometheus cannot run (not installed, port taken, failed to start)."""


def _rules_dir(rules_dir: Path | None) -> Path:
    path = Path(rules_dir) if rules_dir is not None else RULES_DIR
    if not path.is_dir():
        raise MonitoringError(f"no Prometheus rules at {path}: they ship in the kvflow-ray repository "
                              "(deploy/prometheus/rules); run from a checkout")
    return path


def _rules(rules_dir: Path | None, kind: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(_rules_dir(rules_dir).glob("*.yml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            out.extend(rule for rule in group.get("rules", []) if kind in rule)
    return out


def recording_rules(rules_dir: Path | None = None) -> list[tuple[str, str]]:
    """(record name, PromQL expression) of every recording rule, in file order. Each expression reads
    only scraped `kvflow_*` series, so it can be queried on a Prometheus that has no rules loaded."""
    return [(rule["record"], rule["expr"].strip()) for rule in _rules(rules_dir, "record")]


def alerting_rules(rules_dir: Path | None = None) -> list[dict[str, Any]]:
    """Every alerting rule as written (alert, expr, for, labels, annotations)."""
    return _rules(rules_dir, "alert")


def scrape_target(host: str, port: int) -> str:
    """host:port Prometheus should scrape for an app bound to `host` (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def render_config(target: str, rules_dir: Path | None = None, *, scrape_interval: str | None = None,
                  evaluation_interval: str | None = None, credentials_file: Path | None = None) -> str:
    """deploy/prometheus/prometheus.yml with job `kvflow` scraping `target` (host:port) and the rule
    files as an absolute glob; optional shorter intervals (tests). With `credentials_file` (a file
    holding the app's metrics token) every scrape sends `Authorization: Bearer <its content>`."""
    rules = _rules_dir(rules_dir).resolve()
    config = yaml.safe_load(CONFIG_FILE.read_text())
    config["rule_files"] = [str(rules / "*.yml")]
    jobs = [job for job in config.get("scrape_configs", []) if job.get("job_name") == JOB]
    if len(jobs) != 1:
        raise MonitoringError(f"{CONFIG_FILE}: expected one scrape config with job_name {JOB!r}")
    job = jobs[0]
    job["static_configs"] = [{"targets": [target]}]
    if scrape_interval is not None:
        job["scrape_interval"] = scrape_interval
        job.pop("scrape_timeout", None)  # Prometheus then caps it at the interval
    if evaluation_interval is not None:
        config.setdefault("global", {})["evaluation_interval"] = evaluation_interval
    if credentials_file is not None:
        # the file, not the token itself: the rendered config can be read, logged or shown by /config
        job["authorization"] = {"type": "Bearer", "credentials_file": str(Path(credentials_file).resolve())}
    header = f"# rendered by kvflow_ray.serve.monitoring from {CONFIG_FILE}\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def prometheus_api(base_url: str, path: str, **params: str) -> Any:
    """`data` of a Prometheus HTTP API call (`query`, `rules`, `alerts`, ...) on `base_url`. A failed
    call (a bad query is a 400 that carries Prometheus's message) raises MonitoringError with it."""
    url = f"{base_url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    if body.get("status") != "success":
        raise MonitoringError(f"{path} {params}: {body.get('error')}")
    return body["data"]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _setpriv_pdeathsig() -> str | None:
    """util-linux `setpriv` when it has --pdeathsig (2.33+; the signal survives its exec of Prometheus)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    try:
        done = subprocess.run([setpriv, "--help"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return setpriv if "--pdeathsig" in done.stdout else None


class LocalPrometheus:
    """Prometheus on `host`:`port` scraping `target`, as a context manager.

    `check()` fails fast (binary missing, port taken) before anything starts; `start()` waits until
    Prometheus answers /-/ready. Output goes to `prometheus.log` in its temporary directory (quoted in
    errors). With `metrics_token`, the app's /metrics token, Prometheus sends it with every scrape (read
    from a 0600 file in that directory). Started from the main thread where util-linux `setpriv
    --pdeathsig` exists (Linux), the child gets a parent-death signal, so it does not outlive a killed
    `kvflow-ray serve` (from another thread it would die with that thread, so it is not used there).
    """

    def __init__(self, target: str, *, port: int = 9090, host: str = "127.0.0.1", binary: str | None = None,
                 rules_dir: Path | None = None, scrape_interval: str | None = None,
                 evaluation_interval: str | None = None, metrics_token: str | None = None) -> None:
        self.target, self.port, self.host = target, port, host
        self.metrics_token = metrics_token or None
        self.binary = binary
        self.rules_dir = rules_dir
        self.scrape_interval, self.evaluation_interval = scrape_interval, evaluation_interval
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def check(self) -> str:
        """The binary to run; raises MonitoringError when Prometheus cannot start here."""
        binary = self.binary or shutil.which("prometheus")
        if binary is None or not os.access(binary, os.X_OK):
            raise MonitoringError(f"prometheus is not installed ({self.binary or 'not on PATH'}): {INSTALL_HINT}")
        _rules_dir(self.rules_dir)
        if not _port_free(self.host, self.port):
            raise MonitoringError(f"port {self.port} on {self.host} is in use (another Prometheus?): "
                                  "choose another with --prometheus-port")
        return binary

    def start(self, timeout_s: float = 60.0) -> LocalPrometheus:
        binary = self.check()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvflow-prometheus-"))
        credentials = None
        if self.metrics_token is not None:
            credentials = self.workdir / "metrics-token"
            # created 0600 (not chmod-ed after writing): no moment where another user could read it
            fd = os.open(credentials, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as token_file:
                token_file.write(self.metrics_token)
        config = self.workdir / "prometheus.yml"
        config.write_text(render_config(self.target, self.rules_dir, scrape_interval=self.scrape_interval,
                                        evaluation_interval=self.evaluation_interval, credentials_file=credentials))
        command = [binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                   f"--web.listen-address={self.host}:{self.port}"]
        setpriv = _setpriv_pdeathsig()
        if setpriv is not None and threading.current_thread() is threading.main_thread():
            command = [setpriv, "--pdeathsig", "TERM", "--", *command]  # TERM it when we die, even by SIGKILL
        with open(self.workdir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with status {self.proc.returncode}" if self.proc.poll() is not None
                       else f"not ready within {timeout_s:.0f} s")
                log_tail = self.log()[-2000:]
                self.stop()
                raise MonitoringError(f"prometheus on {self.url} {why}:\n{log_tail}")
            time.sleep(0.2)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        return prometheus_api(self.url, path, **params)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query: its result vector."""
        return self.api("query", query=expr)["result"]

    def log(self) -> str:
        if self.workdir is None:
            return ""
        try:
            return (self.workdir / "prometheus.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
