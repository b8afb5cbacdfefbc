"""A quiet tenant's agent-call latency alone and next to a noisy tenant, one run, side by side.

The stack: local Ray, the app on simulated A10G replicas (`engine: sim`, so engine compute costs no
CPU here), two tenants, a metrics token, the default limits. Tenant A (quiet) makes sequential agent
calls and we take its p50/p99. Tenant B (noisy) runs in another process at the lowest CPU priority (on
a shared machine an attacker's client would otherwise take the cores the server is measured on) and
floods the server closed-loop with one kind of noise at a time, then all at once:
- `scrape`: 8 threads GET /metrics without the token (401);
- `register`: 2 threads POST workflow specs at the size limit, one changing every time (writes, then
  429 once the write budget is spent), one re-posting the same body;
- `giant`: 1 thread POST a 10,000-agent spec (400 naming limits.max_agents_per_spec);
- `all`: everything together.
Reports each ratio (noisy p99 / solo p99) and writes tenant_noise.json into --out (default benchmarks/out).

    python benchmarks/tenant_noise.py [--calls 60] [--replicas 2]
    python benchmarks/tenant_noise.py --noise all URL SECONDS     # the noise alone, against a server
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import results_file  # benchmarks/, beside this script
from local_cluster import free_port  # beside this script

from kvflow_ray.core.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("scrape", "register", "giant", "all")
QUIET_PROMPT = "You are the quiet agent. " * 20


# ---------------------------------------------------------------------------------------------- the noise
def _send(url: str, path: str, data: bytes | None = None, key: str | None = "key-b") -> int:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers),
                                    timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code
    except OSError:
        return 0


def _at_limit(start: str, agents: int = 64) -> bytes:
    spec: dict[str, Any] = {"a0": {"prompt": start}}
    spec.update({f"a{i}": {"prompt": f"agent {i} " + "x" * 3000, "after": [f"a{i - 1}"]} for i in range(1, agents)})
    return json.dumps({"name": "noisy", "agents": spec}).encode()


def noise(url: str, kind: str, seconds: float, statuses: dict[str, int], lock: threading.Lock) -> None:
    """Flood `url` as tenant B (key `key-b`) for `seconds`, counting each status answered in `statuses`."""
    os.nice(19)
    deadline = time.monotonic() + seconds

    def loop(path: str, bodies: list[bytes | None], key: str | None) -> None:
        n = 0
        while time.monotonic() < deadline:
            status = _send(url, path, bodies[n % len(bodies)], key)
            n += 1
            with lock:
                statuses[str(status)] = statuses.get(str(status), 0) + 1

    giant = json.dumps({"name": "giant", "agents": {f"a{i}": {"prompt": "p"} for i in range(10_000)}}).encode()
    plans: list[tuple[str, list[bytes | None], str | None]] = []
    if kind in ("scrape", "all"):
        plans += [("/metrics", [None], None)] * 8
    if kind in ("register", "all"):
        plans += [("/v1/workflows", [_at_limit(f"start {n}") for n in range(8)], "key-b"),
                  ("/v1/workflows", [_at_limit("start")], "key-b")]
    if kind in ("giant", "all"):
        plans += [("/v1/workflows", [giant], "key-b")]
    threads = [threading.Thread(target=loop, args=plan) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def start_noise(url: str, kind: str, seconds: float) -> subprocess.Popen[bytes]:
    """The noise in its own process (its statuses as JSON on stdout when it ends)."""
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--noise", kind, url, str(seconds)],
                            stdout=subprocess.PIPE)


# ---------------------------------------------------------------------------------------------- the quiet tenant
def quiet_calls(url: str, n: int, key: str = "key-a", workflow: str = "quiet") -> list[float]:
    """`n` sequential agent calls of tenant A, each a new client of `workflow`; their latencies."""
    seconds = []
    for _ in range(n):
        body = {"messages": [{"role": "system", "content": QUIET_PROMPT}, {"role": "user", "content": "go"}],
                "max_tokens": 4, "temperature": 0,
                "kvflow": {"client_id": f"q-{uuid.uuid4().hex[:10]}", "agent": "a", "workflow": workflow}}
        started = time.perf_counter()
        status = _send(url, "/v1/chat/completions", json.dumps(body).encode(), key)
        if status != 200:
            raise RuntimeError(f"a quiet call failed with HTTP {status}")
        seconds.append(time.perf_counter() - started)
    return seconds


def register_quiet(url: str, key: str = "key-a", workflow: str = "quiet") -> None:
    body = {"name": workflow, "agents": {"a": {"prompt": QUIET_PROMPT}}}
    if _send(url, "/v1/workflows", json.dumps(body).encode(), key) != 200:
        raise RuntimeError("could not register the quiet workflow")


def p99(seconds: list[float]) -> float:
    return percentile(seconds, 0.99)


def measure(url: str, kind: str, calls: int) -> dict[str, Any]:
    proc = start_noise(url, kind, 3600)
    try:
        time.sleep(2)  # the noise at full strength
        seconds = quiet_calls(url, calls)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    return {"p50_s": percentile(seconds, 0.5), "p99_s": p99(seconds),
            "noise_statuses": json.loads(out or b"{}")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", nargs=3, metavar=("KIND", "URL", "SECONDS"),
                        help=f"only generate noise of KIND ({', '.join(KINDS)}) against URL for SECONDS")
    parser.add_argument("--calls", type=int, default=60, help="quiet calls per measurement (default 60)")
    parser.add_argument("--replicas", type=int, default=2, help="simulated engine replicas (default 2)")
    results_file.add_out_argument(parser, "tenant_noise.json")
    args = parser.parse_args()
    if args.noise:
        kind, url, seconds = args.noise
        if kind not in KINDS:
            parser.error(f"--noise KIND must be one of {', '.join(KINDS)}")
        statuses: dict[str, int] = {}
        lock = threading.Lock()

        def report(*_: object) -> None:
            with lock:
                print(json.dumps(statuses), flush=True)
            os._exit(0)

        signal.signal(signal.SIGTERM, report)
        noise(url, kind, float(seconds), statuses, lock)
        report()
        return 0

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from kvflow_ray.serve.app import LocalServer
    from kvflow_ray.serve.config import AppConfig

    port = free_port()
    config = AppConfig(engine="sim", replicas=args.replicas, time_scale=0.2, metrics_token="bench-metrics-token",
                       api_keys={"key-a": "tenantA", "key-b": "tenantB"})
    out: dict[str, Any] = {"setup": {"engine": "sim", "replicas": args.replicas, "time_scale": 0.2,
                                     "calls": args.calls, "cores": os.cpu_count()}, "results": {}, "ratios": {}}
    with LocalServer(config, port=port, num_cpus=2) as server:
        register_quiet(server.url)
        quiet_calls(server.url, 10)  # warm
        solo = quiet_calls(server.url, args.calls)
        out["results"]["solo"] = {"p50_s": percentile(solo, 0.5), "p99_s": p99(solo)}
        print(f"solo: p50 {out['results']['solo']['p50_s']:.3f} s  p99 {out['results']['solo']['p99_s']:.3f} s",
              file=sys.stderr)
        for kind in KINDS:
            result = out["results"][kind] = measure(server.url, kind, args.calls)
            out["ratios"][kind] = {"p50": result["p50_s"] / out["results"]["solo"]["p50_s"],
                                   "p99": result["p99_s"] / out["results"]["solo"]["p99_s"]}
            print(f"{kind}: p50 {result['p50_s']:.3f} s  p99 {result['p99_s']:.3f} s  "
                  f"(p99 {out['ratios'][kind]['p99']:.2f}x solo)  noise answered {result['noise_statuses']}",
                  file=sys.stderr)
    results_file.write_json(args.out, "tenant_noise", out)
    print(json.dumps(out["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
