"""Server CPU per agent call, in every process, side by side in one run: kvflow-ray against a bare Ray
Serve application making the same hops.

- bare: Serve's HTTP proxy -> a FastAPI ingress deployment (parses the OpenAI body, calls the engine
  through a deployment handle) -> an engine deployment that answers a fixed completion at once.
- kvflow: `kvflow-ray serve` on the simulated engine with engine time made negligible (`time_scale`
  1e-4: a simulated second lasts 0.1 ms), the workflow router, API keys (tenants) and metrics on;
  every call is an agent call of a live workflow client (PEER's agents in turn).

Each at 1 and 2 ingress replicas, with the same engine replicas, clients, calls and bodies. Both
applications run at once (the bare one under /bare), and after a warm-up the measured calls go in
alternating rounds, bare then kvflow then kvflow then bare, …, so that drift on a shared machine
falls on both alike. The CPU time (user + system) of every process is read before and after each
round and summed per application (the proxy, controller, GCS and raylet count toward the round's
application): per process, CPU ms per call; per setup, calls/s and the server total (every process but the
load-generating driver); and kvflow's total over the bare application's at the same ingress count.
The simulated engine's own compute (its clock thread's CPU, `kvflow_engine_compute_cpu_seconds_total`
in /metrics) is reported apart, and the total without it is what issue 30's target reads (at most
1.15x the bare application, whose engine computes nothing). The driver's CPU is reported too: on a
small machine the client competes with the servers, and calls/s says what is left.

Run: python benchmarks/serve_overhead.py [--quick] [--calls N] [--rounds R] [--clients K] [--out DIR]
(serve_overhead.json in DIR; default benchmarks/out, which git ignores).
"""

# no `from __future__ import annotations`: FastAPI reads the bare ingress's handler annotations as objects
import argparse
import contextlib
import http.client
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import results_file  # benchmarks/, beside this script
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations here
from local_cluster import Processes, free_port  # beside this script

from kvflow_ray.client.workflow import SESSION_HEADER
from kvflow_ray.router.settings import SYNC_S

ROOT = Path(__file__).resolve().parents[1]
TENANT_KEY = "bench-key"
BODY_CHARS = 600  # the user message: a few hundred tokens through the byte tokenizer
MAX_TOKENS = 8
AGENTS = ("planner", "executor", "expresser", "reviewer")  # PEER, in the order its graph runs them
# per application: Ray actor class -> the label its process gets (engine and ingress replicas are numbered)
SHARED = (("ServeController", "serve-controller"), ("ProxyActor", "serve-proxy"))
LABELS = {"bare": (("ServeReplica:bare:Engine", "engine"), ("ServeReplica:bare:Ingress", "ingress"), *SHARED),
          "kvflow": (("WorkflowRouterActor", "router"), ("ServeReplica:kvflow:EngineReplica", "engine"),
                     ("ServeReplica:kvflow:Ingress", "ingress"), *SHARED)}
BARE_PREFIX = "/bare"
BACKGROUND = {"serve-controller", "gcs_server", "raylet"}  # Ray's own, not on a call's path


# ---------------------------------------------------------------------------------------------- the bare app
def bare_app(engine_replicas: int, ingress_replicas: int) -> Any:
    """Proxy -> FastAPI ingress -> engine: the hops a serving app makes, doing nothing else."""
    from ray import serve

    api = FastAPI()

    @serve.deployment(name="Engine", num_replicas=engine_replicas, max_ongoing_requests=64,
                      ray_actor_options={"num_cpus": 0})
    class Engine:
        async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
            return {"text": "ok " * MAX_TOKENS, "prompt_tokens": len(request["prompt"]),
                    "completion_tokens": MAX_TOKENS}

    @serve.deployment(name="Ingress", num_replicas=ingress_replicas, max_ongoing_requests=1024,
                      ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Ingress:
        def __init__(self, engine: Any) -> None:
            self.engine = engine

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            prompt = "".join(m["content"] for m in body["messages"])
            out = await self.engine.generate.remote({"prompt": prompt, "max_tokens": body["max_tokens"]})
            return {"id": "chatcmpl-bare", "object": "chat.completion", "model": body.get("model", "bare"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": out["prompt_tokens"], "completion_tokens": out["completion_tokens"],
                              "total_tokens": out["prompt_tokens"] + out["completion_tokens"]}}

    return Ingress.bind(Engine.bind())


# ---------------------------------------------------------------------------------------------- load
def chat_body(client: str | None, agent: str, index: int) -> bytes:
    task = f"task {index}: " + "x" * BODY_CHARS
    body: dict[str, Any] = {"model": "default", "max_tokens": MAX_TOKENS,
                            "messages": [{"role": "user", "content": task}]}
    if client is not None:
        body["kvflow"] = {"client_id": client, "workflow": "peer", "agent": agent}
    return json.dumps(body).encode()


def drive(port: int, clients: int, calls: int, workflow: bool, prefix: str) -> tuple[float, int]:
    """`calls` chat completions from `clients` threads over keep-alive connections, to the bare
    application (under BARE_PREFIX) or, with `workflow`, to kvflow-ray: each client calls PEER's
    agents in turn. Returns (wall seconds, failures)."""
    path = "/v1/chat/completions" if workflow else BARE_PREFIX + "/v1/chat/completions"
    per_client = max(1, calls // clients)
    failures = [0] * clients
    base = {"Content-Type": "application/json", "Authorization": f"Bearer {TENANT_KEY}"}

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        session = f"{prefix}-{k}"
        name = session if workflow else None
        # a client's session header, as the SDK sends it (kvflow-ray keys its calls to one ingress by it)
        headers = {**base, SESSION_HEADER: session}
        for i in range(per_client):
            conn.request("POST", path, chat_body(name, AGENTS[i % len(AGENTS)], i), headers)
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                failures[k] += 1
        conn.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, sum(failures)


def register_peer(port: int) -> None:
    spec = (ROOT / "workflows" / "peer.yaml").read_text()
    import yaml

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/workflows", json.dumps(yaml.safe_load(spec)).encode(),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {TENANT_KEY}"})
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"registering peer failed: {response.status} {body[:200]!r}")


def measure(port: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both applications (deployed), in alternating rounds; per application, its summed windows."""
    from kvflow_ray.client.loadgen import counter_delta, scrape
    from kvflow_ray.serve.metrics import COMPUTE_CPU
    from kvflow_ray.serve.replica import REPORT_PERIOD_S

    procs = {app: Processes(labels, numbered=("engine", "ingress")) for app, labels in LABELS.items()}
    root = f"http://127.0.0.1:{port}"  # kvflow-ray's /metrics (read between rounds, not in them)
    for app in procs:
        drive(port, args.clients, args.warmup, app == "kvflow", f"{app}-warm")
    time.sleep(REPORT_PERIOD_S * 1.5)  # the warm-up's compute reported, so the count starts clean
    metrics_before = scrape(root)
    cpu: dict[str, dict[str, float]] = {app: {} for app in procs}
    wall = dict.fromkeys(procs, 0.0)
    failures = dict.fromkeys(procs, 0)
    per_round = max(1, args.calls // args.rounds // args.clients) * args.clients
    for round_ in range(args.rounds):
        for app in (procs if round_ % 2 == 0 else reversed(procs)):
            before = procs[app].usage()[1]
            seconds, failed = drive(port, args.clients, per_round, app == "kvflow", f"{app}-{round_}")
            after = procs[app].usage()[1]
            wall[app] += seconds
            failures[app] += failed
            for label in after.keys() & before.keys():
                cpu[app][label] = cpu[app].get(label, 0.0) + after[label] - before[label]
    time.sleep(REPORT_PERIOD_S * 1.5)  # the last round's compute reported (the engines idle meanwhile)
    # the simulated engines' own compute; the bare engine computes nothing
    compute = {"bare": 0.0, "kvflow": counter_delta(metrics_before, scrape(root), COMPUTE_CPU + "_total")}
    calls = per_round * args.rounds
    out = {}
    for app in procs:
        per_call = {label: round(1e3 * seconds / calls, 3) for label, seconds in sorted(cpu[app].items())}
        server = sum(v for k, v in per_call.items() if k != "driver")
        on_path = sum(v for k, v in per_call.items() if k != "driver" and k not in BACKGROUND)
        compute_ms = 1e3 * compute[app] / calls
        out[app] = {"calls": calls, "failures": failures[app], "wall_s": round(wall[app], 2),
                    "calls_per_s": round(calls / wall[app], 1), "cpu_ms_per_call": per_call,
                    "server_cpu_ms_per_call": round(server, 3), "on_path_cpu_ms_per_call": round(on_path, 3),
                    "engine_compute_ms_per_call": round(compute_ms, 3),
                    "serving_cpu_ms_per_call": round(server - compute_ms, 3)}
    return out


@contextlib.contextmanager
def cluster(num_cpus: int, port: int) -> Iterator[None]:
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        ray.shutdown()


def wait_http(port: int, path: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", path, chat_body(None, "planner", 0),
                         {"Content-Type": "application/json", "Authorization": f"Bearer {TENANT_KEY}"})
            if conn.getresponse().status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"no 200 from {path} within {timeout_s:.0f} s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    sys.path.insert(0, str(ROOT))
    from kvflow_ray.serve.app import APP_NAME, LocalServer
    from kvflow_ray.serve.config import AppConfig
    from kvflow_ray.serve.router_actor import stop_router

    port = free_port()
    results: dict[str, Any] = {}
    with cluster(2, port):
        for ingress in args.ingress:
            print(f"bare app and kvflow-ray, {ingress} ingress replica(s) each, {args.rounds} rounds",
                  file=sys.stderr)
            serve.run(bare_app(args.engine_replicas, ingress), name="bare", route_prefix=BARE_PREFIX,
                      blocking=False)
            wait_http(port, BARE_PREFIX + "/v1/chat/completions")
            config = AppConfig(engine="sim", replicas=args.engine_replicas, ingress_replicas=ingress,
                               time_scale=1e-4, api_keys={TENANT_KEY: "acme"}, replica_num_cpus=0,
                               ingress_sync_s=args.ingress_sync_s)
            server = LocalServer(config, port=port)
            server.deploy(config)
            server.wait_ready()
            register_peer(port)
            measured = measure(port, args)
            measured["kvflow"]["router_calls_per_agent_call"] = _router_stats()
            for app, result in measured.items():
                results[f"{app}/{ingress}"] = result
            serve.delete("bare")
            serve.delete(APP_NAME)
            stop_router()  # detached: it would outlive the app and idle through the next setup
    ratios = {}
    for ingress in args.ingress:
        bare, ours = results[f"bare/{ingress}"], results[f"kvflow/{ingress}"]
        ratios[str(ingress)] = {
            "serving_cpu": round(ours["serving_cpu_ms_per_call"] / bare["serving_cpu_ms_per_call"], 3),
            "server_cpu": round(ours["server_cpu_ms_per_call"] / bare["server_cpu_ms_per_call"], 3),
            "on_path_cpu": round(ours["on_path_cpu_ms_per_call"] / bare["on_path_cpu_ms_per_call"], 3),
            "calls_per_s": round(ours["calls_per_s"] / bare["calls_per_s"], 3)}
    return {"generated_by": "python benchmarks/serve_overhead.py " + " ".join(sys.argv[1:]),
            "machine": results_file.machine(),
            "setup": {"engine_replicas": args.engine_replicas, "clients": args.clients, "calls": args.calls,
                      "rounds": args.rounds, "ingress_sync_s": args.ingress_sync_s,
                      "warmup": args.warmup, "body_chars": BODY_CHARS, "max_tokens": MAX_TOKENS},
            "results": results, "kvflow_over_bare": ratios}


# router-actor methods an agent call can wait for: a template the ingress holds no copy of, a
# registration, a replica that failed a call (`serve/ingress_router.py`); the rest (syncs, the
# replicas' reports, events and hint polls) run beside the calls
ON_PATH = ("get_template", "put_template", "remove_replica")


def _router_stats() -> dict[str, Any]:
    """The router actor's call counts per agent call: those a call can wait for, and all."""
    import ray

    from kvflow_ray.serve.router_actor import get_router

    stats = ray.get(get_router(create=False).stats.remote())
    starts = max(1, stats["start_calls"])
    calls = stats["actor_calls"]
    return {"start_calls": stats["start_calls"], "actor_calls": calls,
            "on_path_actor_calls_per_agent_call": round(sum(calls.get(m, 0) for m in ON_PATH) / starts, 4),
            "actor_calls_per_agent_call": round(sum(calls.values()) / starts, 3)}


def print_table(report: dict[str, Any]) -> None:
    rows = report["results"]
    labels = sorted({label for r in rows.values() for label in r["cpu_ms_per_call"]})
    print(f"{'CPU ms per call':<18}" + "".join(f"{name:>14}" for name in rows))
    for label in labels:
        cells = (r["cpu_ms_per_call"].get(label, float("nan")) for r in rows.values())
        print(f"{label:<18}" + "".join(f"{v:>14.3f}" for v in cells))
    print(f"{'server total':<18}" + "".join(f"{r['server_cpu_ms_per_call']:>14.3f}" for r in rows.values()))
    print(f"{'on the path':<18}" + "".join(f"{r['on_path_cpu_ms_per_call']:>14.3f}" for r in rows.values()))
    print(f"{'engine compute':<18}" + "".join(f"{r['engine_compute_ms_per_call']:>14.3f}" for r in rows.values()))
    print(f"{'serving (no eng.)':<18}" + "".join(f"{r['serving_cpu_ms_per_call']:>14.3f}" for r in rows.values()))
    print(f"{'calls/s':<18}" + "".join(f"{r['calls_per_s']:>14.1f}" for r in rows.values()))
    for ingress, ratio in report["kvflow_over_bare"].items():
        print(f"kvflow / bare at {ingress} ingress: serving CPU without engine compute {ratio['serving_cpu']:.2f}x "
              f"(target <= 1.15x), server CPU {ratio['server_cpu']:.2f}x, on the path {ratio['on_path_cpu']:.2f}x, "
              f"calls/s {ratio['calls_per_s']:.2f}x")
    for name, row in rows.items():
        actor = row.get("router_calls_per_agent_call")
        if actor:
            print(f"router actor at {name}: {actor['on_path_actor_calls_per_agent_call']} calls per agent call on "
                  f"its path (target <= 0.1), {actor['actor_calls_per_agent_call']} in all (syncs, replicas' "
                  "reports, events and hint polls)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200 calls in 2 rounds, 1 ingress replica (a smoke run)")
    ap.add_argument("--calls", type=int, default=1000, help="measured calls per setup (default 1000)")
    ap.add_argument("--warmup", type=int, default=100, help="calls before measuring (default 100)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds the calls are split into (default 6)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--engine-replicas", type=int, default=2)
    ap.add_argument("--ingress", default="1,2", help="ingress replica counts to measure (default 1,2)")
    ap.add_argument("--ingress-sync-s", type=float, default=SYNC_S,
                    help=f"kvflow-ray's ingress sync period (serving's ingress_sync_s, default {SYNC_S})")
    results_file.add_out_argument(ap, "serve_overhead.json")
    args = ap.parse_args(argv)
    args.ingress = [int(n) for n in args.ingress.split(",")]
    if args.quick:
        args.calls, args.warmup, args.ingress, args.rounds = 200, 40, [1], 2
    report = run(args)
    print_table(report)
    results_file.write_json(args.out, "serve_overhead", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
