"""Workflow-aware routing vs Ray Serve's default routing, same load, one run; and the router's
decision latency with 1,000 concurrent clients.

Part 1 (end to end): local Ray, 2 CPU-engine replicas, the same multi-application PEER load
through the OpenAI SDK (`kvflow-ray run`'s load generator), first with the routing policy's choice
honoured (`request_router=kvflow`, results under "workflow"), then with Serve's default
power-of-two-choices router (`request_router=serve`, under "default"); under the kvflow cache
policy (host tier, prefetch) and under lru (device only, like an engine without a host tier). Each
application has its own prompt preamble, so where an agent runs decides whether its prompt is
already cached there.

Part 2 (router only): an ingress's router (`IngressRouter`, syncing with the router actor) with 1,000
live clients (PEER, 2 replicas), all calling start_call / end_call concurrently from one event loop;
reports the decision time and what a call waits for its route, p50 / p99, with the embedded store
and with Redis (when redis-server is installed).

Writes serve_routing.json into --out (default benchmarks/out; serve_routing_sim.json with --engine sim:
the same comparison on simulated A10G replicas, where compute is a GPU profile's, not this machine's CPU).
    python benchmarks/serve_routing.py [--quick]
    python benchmarks/serve_routing.py --engine sim --applications 16 --clients 32 --skip-router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_file  # benchmarks/, beside this script
from local_cluster import free_port  # beside this script

from kvflow_ray.router.settings import SYNC_S

ROOT = Path(__file__).resolve().parents[1]


def device_kv_tokens(config: Any) -> int:
    """The device pool each replica ends up with (the engine's default unless the config sets one)."""
    if config.device_kv_tokens is not None:
        return int(config.device_kv_tokens)
    if config.engine == "sim":
        from kvflow_ray.engines.sim.profile import load_profile

        return load_profile(config.profile).gpu_kv_tokens
    from kvflow_ray.engines.cpu.config import CpuEngineConfig

    return CpuEngineConfig().device_kv_tokens


def routing_comparison(args: argparse.Namespace) -> dict[str, Any]:
    from kvflow_ray.client import Workflow
    from kvflow_ray.client.loadgen import LoadConfig, application_variants, run_load, summarise
    from kvflow_ray.serve.app import LocalServer
    from kvflow_ray.serve.config import AppConfig

    peer = Workflow.from_yaml(ROOT / "workflows" / "peer.yaml")
    apps = application_variants(peer, args.applications, args.preamble_chars)
    load = LoadConfig(clients=args.clients, iterations=args.iterations, max_tokens=args.max_tokens,
                      task_chars=args.task_chars)
    if args.engine == "sim":  # simulated GPUs: compute costs no CPU here, so more replicas fit
        base = AppConfig(engine="sim", replicas=args.replicas, profile=args.profile, time_scale=args.time_scale,
                         route_headers=True)
    else:
        base = AppConfig(replicas=args.replicas, threads=1, route_headers=True, model=args.model)
    out: dict[str, Any] = {"setup": {"replicas": base.replicas, "engine": base.engine, "model": base.model_name(),
                                     "time_scale": base.time_scale if base.engine == "sim" else None,
                                     "device_kv_tokens": device_kv_tokens(base), "workflow": "peer",
                                     "applications": args.applications, "preamble_chars": args.preamble_chars,
                                     "clients": args.clients, "iterations": args.iterations,
                                     "max_tokens": args.max_tokens, "task_chars": args.task_chars},
                           "results": {}, "ratios": {}}
    server = LocalServer(base, port=free_port(), num_cpus=2)
    try:
        server.start()
        for policy in args.policies.split(","):
            out["results"][policy] = {}
            # workflow: the routing policy's choice honoured; default: Serve's own request router
            for routing, request_router in (("workflow", "kvflow"), ("default", "serve")):
                server.deploy(AppConfig(**{**base.to_dict(), "request_router": request_router, "policy": policy}))
                server.wait_ready()
                print(f"policy={policy} request_router={request_router}", file=sys.stderr)
                result = run_load(apps, server.url, load)
                summary = summarise(result, apps[0], load)
                summary["workflow"] = "peer"
                out["results"][policy][routing] = summary
            w, d = out["results"][policy]["workflow"], out["results"][policy]["default"]
            out["ratios"][policy] = {
                "gpu_hit_ratio": round(w["gpu_hit_ratio"] / d["gpu_hit_ratio"], 3) if d["gpu_hit_ratio"] else None,
                "p50_latency_speedup": round(d["latency_s"]["p50"] / w["latency_s"]["p50"], 3),
                "p99_latency_speedup": round(d["latency_s"]["p99"] / w["latency_s"]["p99"], 3),
                "mean_latency_speedup": round(d["latency_s"]["mean"] / w["latency_s"]["mean"], 3),
            }
    finally:
        server.stop()
    return out


async def _decisions(router: Any, hub: Any, clients: int, iterations: int, think_s: float, tag: str) -> list[float]:
    """Every client loops over PEER; between its calls it 'runs the agent' for ~think_s (uniform
    0.5-1.5x), so the router sees the arrival pattern of real agent calls (0: back to back). `router`:
    an ingress's `IngressRouter`, syncing with the router actor `hub` meanwhile, as in serving."""
    import random

    order = ["planner", "executor", "expresser", "reviewer"]
    trips: list[float] = []
    await router.ready()
    await router.template("bench", "peer")  # the ingress's copy, as its first call of the template takes it

    async def one(i: int) -> None:
        cid = f"{tag}{i}"
        rng = random.Random(i)
        await asyncio.sleep(rng.uniform(0, think_s))  # clients do not start in lockstep
        for _ in range(iterations):
            for agent in order:
                started = time.perf_counter()
                await router.recall("bench", cid)  # as the ingress does (a Redis read for a client new here)
                route = router.start_call("bench", cid, agent, workflow="peer", prefix_hash=f"h{agent}",
                                          prefix_tokens=400)
                trips.append(time.perf_counter() - started)
                await asyncio.sleep(rng.uniform(0.5 * think_s, 1.5 * think_s) if think_s else 0)
                router.end_call("bench", cid, agent, route.replica)

    async def heartbeats() -> None:  # the replicas' reports (stand-ins here), or the router forgets them
        while True:
            await asyncio.gather(hub.report.remote("r1"), hub.report.remote("r2"))
            await asyncio.sleep(1.0)

    beating = asyncio.ensure_future(heartbeats())
    await asyncio.gather(*(one(i) for i in range(clients)))
    beating.cancel()
    return trips


def decision_latency(args: argparse.Namespace) -> dict[str, Any]:
    """An ingress's router with `--router-clients` live PEER clients (2 replicas), calling from one
    event loop as an ingress's requests do: the decision time (all of `RouterCore.start_call`) and
    what a call waits for its route (the decision, plus a Redis read for a client new to the ingress)."""
    import ray

    from kvflow_ray.core.graph import load_spec
    from kvflow_ray.core.stats import percentile
    from kvflow_ray.router.settings import RouterSettings
    from kvflow_ray.serve.ingress_router import IngressRouter
    from kvflow_ray.serve.router_actor import get_router, stop_router

    spec = load_spec(ROOT / "workflows" / "peer.yaml").to_dict()
    stores: dict[str, str | None] = {"embedded": None}
    redis_proc = None
    if shutil.which("redis-server"):
        port = free_port()
        redis_proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", tempfile.mkdtemp()],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(0.5)
        stores["redis"] = f"redis://127.0.0.1:{port}/0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    out: dict[str, Any] = {"clients": args.router_clients, "calls_per_client": 4 * args.router_iterations,
                           "where": "an ingress's router (no actor call per decision)"}
    try:
        for name, url in stores.items():
            settings = RouterSettings(store_url=url)
            hub = get_router(settings)
            ray.get([hub.add_replica.remote("r1"), hub.add_replica.remote("r2")])
            ray.get(hub.put_template.remote("bench", spec))
            for agent, replica in (("planner", "r1"), ("executor", "r2"), ("expresser", "r1"), ("reviewer", "r2")):
                ray.get(hub.cache_events.remote(replica, [("stored", "gpu", f"h{agent}", 400)]))
            out[name] = {}
            for mode, think in (("paced", args.think_s), ("saturated", 0.0)):
                print(f"router decisions, {name} store, {args.router_clients} clients, {mode}", file=sys.stderr)
                router = IngressRouter(settings, f"bench-{mode}")
                started = time.perf_counter()
                trips = asyncio.run(_decisions(router, hub, args.router_clients, args.router_iterations, think, mode))
                wall = time.perf_counter() - started
                inside = list(router.core.decision_seconds)[-len(trips):]
                out[name][mode] = {
                    "think_s": think, "decisions": len(trips), "decisions_per_s": round(len(trips) / wall, 1),
                    "decision_ms": {"p50": round(1e3 * percentile(inside, 0.5), 4),
                                    "p99": round(1e3 * percentile(inside, 0.99), 4)},
                    "route_wait_ms": {"p50": round(1e3 * percentile(trips, 0.5), 3),
                                      "p99": round(1e3 * percentile(trips, 0.99), 3)}}
            stop_router()
    finally:
        ray.shutdown()
        if redis_proc is not None:
            redis_proc.terminate()
    return out


PARITY_ROUTERS = "workflow,sglang-cache-aware,dynamo-kv,ray-prefix"


def sim_parity(args: argparse.Namespace) -> dict[str, Any]:
    """One fleet scenario through serving (simulated replicas, each routing policy by its name in the
    serve config) and through the simulator (`kvflow-ray sim --routing`): device and host hit ratios
    side by side per router. The simulator's own workflow clients drive both (`client.replay`)."""
    from kvflow_ray.client.loadgen import counter_delta, scrape, settled_metrics
    from kvflow_ray.client.replay import HttpHost
    from kvflow_ray.engines.sim import workload
    from kvflow_ray.engines.sim.profile import load_profile
    from kvflow_ray.engines.sim.runner import simulate
    from kvflow_ray.router.core import split_workflow_key
    from kvflow_ray.serve.app import LocalServer
    from kvflow_ray.serve.config import AppConfig

    scenario = workload.fleet(tenants=args.parity_tenants, apps=2, clients=args.parity_clients,
                              rate=args.parity_rate, seed=args.seed)
    profile = load_profile(args.profile)
    keys = {tenant: f"key-{tenant}" for tenant in sorted({split_workflow_key(p.key)[0] for p in scenario.plans})}
    routers = args.parity_routers.split(",")
    base = AppConfig(engine="sim", replicas=args.replicas, profile=args.profile, time_scale=args.time_scale,
                     policy=args.parity_policy, api_keys={key: tenant for tenant, key in keys.items()},
                     routing=routers[0], ingress_sync_s=args.ingress_sync_s)
    out: dict[str, Any] = {"setup": {"scenario": scenario.params, "replicas": args.replicas, "profile": args.profile,
                                     "policy": args.parity_policy, "time_scale": args.time_scale,
                                     "ingress_sync_s": args.ingress_sync_s, "repeats": args.parity_repeats},
                           "routers": {}}
    # every router at one ingress replica; the first (the default) at two as well: each ingress decides
    # for the clients keyed to it, from the fleet the router actor relays, so a second must not change
    # them. Those two are measured `parity_repeats` times, alternately (wall-clock timing moves a run's
    # ratios by a point or two), and compared by their means.
    first = routers[0]
    counts = [1, *(n for n in args.parity_ingress if n != 1)]
    runs = [(first, n) for _ in range(args.parity_repeats) for n in counts] + [(r, 1) for r in routers[1:]]
    sims: dict[str, dict[str, Any]] = {}  # routing -> the simulator's result (deterministic: once each)
    measured: dict[str, list[dict[str, Any]]] = {}
    with LocalServer(base, port=free_port(), num_cpus=2) as server:
        for routing, ingress in runs:
            print(f"parity: {routing}, {ingress} ingress replica(s)", file=sys.stderr)
            if routing not in sims:
                sims[routing] = simulate(scenario, profile, args.parity_policy, replicas=args.replicas,
                                         routing=routing, seed=args.seed)[0]
            server.deploy(AppConfig(**{**base.to_dict(), "routing": routing, "ingress_replicas": ingress}))
            server.wait_ready()
            before = scrape(server.url)
            replay = HttpHost(server.url, keys, time_scale=args.time_scale, seed=args.seed).run(scenario.plans)
            after = settled_metrics(server.url, None, before, replay.prompt_tokens)
            tiers = {tier: counter_delta(before, after, "kvflow_prompt_tokens_total", tier=tier)
                     for tier in ("gpu", "cpu", "miss")}
            total = sum(tiers.values()) or float("nan")
            decisions = {outcome: counter_delta(before, after, "kvflow_router_decisions_total", outcome=outcome)
                         for outcome in ("affinity", "balanced", "cold")}
            measured.setdefault(routing if ingress == 1 else f"{routing}@{ingress}-ingress", []).append({
                "gpu_hit_ratio": round(tiers["gpu"] / total, 4), "cpu_hit_ratio": round(tiers["cpu"] / total, 4),
                "affinity_share": round(decisions["affinity"] / (sum(decisions.values()) or float("nan")), 4),
                "decisions": {outcome: int(n) for outcome, n in decisions.items()},
                "calls": replay.calls, "failures": len(replay.failures), "wall_s": round(replay.wall_s, 1),
                "first_failure": replay.failures[0] if replay.failures else None})
    for name, results in measured.items():
        sim = sims[name.split("@")[0]]
        served = {key: round(_mean(results, key), 4)
                  for key in ("gpu_hit_ratio", "cpu_hit_ratio", "affinity_share")}
        served.update(calls=sum(r["calls"] for r in results), failures=sum(r["failures"] for r in results),
                      wall_s=round(sum(r["wall_s"] for r in results), 1))
        if len(results) > 1:
            served["runs"] = [{k: r[k] for k in ("gpu_hit_ratio", "affinity_share", "decisions")} for r in results]
        simulated = {"gpu_hit_ratio": round(sim["gpu_hit_ratio"], 4), "cpu_hit_ratio": round(sim["cpu_hit_ratio"], 4)}
        out["routers"][name] = {
            "serving": served, "sim": simulated,
            "gpu_hit_gap_points": round(100 * (served["gpu_hit_ratio"] - simulated["gpu_hit_ratio"]), 2),
            "first_failure": next((r["first_failure"] for r in results if r["first_failure"]), None)}
    one = measured[first]
    for n in counts[1:]:
        many = measured[f"{first}@{n}-ingress"]
        out[f"{n}_ingress_vs_1_points"] = {
            key: round(100 * (_mean(many, key) - _mean(one, key)), 2) for key in ("gpu_hit_ratio", "affinity_share")}
        out[f"{n}_ingress_vs_1_standard_error_points"] = {
            key: round(100 * math.sqrt(_var(many, key) / len(many) + _var(one, key) / len(one)), 2)
            for key in ("gpu_hit_ratio", "affinity_share")} if min(len(many), len(one)) > 1 else None
    return out


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def _var(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.variance([r[key] for r in runs])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small load (smoke test)")
    parser.add_argument("--engine", choices=("cpu", "sim"), default="cpu",
                        help="cpu: real compute (2 replicas on this machine); sim: simulated GPUs from --profile")
    parser.add_argument("--replicas", type=int, default=None, help="default: 2 (cpu), 4 (sim)")
    parser.add_argument("--model", default="random",
                        help="--engine cpu: the model (default random: routing, not the text, is measured here, "
                             "and its compute leaves the two cores to the serving stack; smollm2-135m for real text)")
    parser.add_argument("--profile", default="a10g-llama3.1-8b", help="--engine sim: GPU cost profile")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="--engine sim: wall seconds per simulated second (latencies are reported in wall s; "
                             "default 0.25, 0.1 with --sim-parity --quick)")
    parser.add_argument("--policies", default="kvflow,lru",
                        help="engine cache policies to compare the routings under (default kvflow,lru)")
    parser.add_argument("--applications", type=int, default=6)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--task-chars", type=int, default=200)
    parser.add_argument("--preamble-chars", type=int, default=2400)
    parser.add_argument("--router-clients", type=int, default=1000)
    parser.add_argument("--router-iterations", type=int, default=2)
    parser.add_argument("--think-s", type=float, default=2.0,
                        help="mean time a client's agent runs between its router calls (paced run)")
    parser.add_argument("--sim-parity", action="store_true",
                        help="only the parity run: one fleet scenario through serving (--engine sim replicas) and "
                             "through the simulator, per router (serve_routing_parity.json)")
    parser.add_argument("--parity-routers", default=PARITY_ROUTERS, help=f"default {PARITY_ROUTERS}")
    parser.add_argument("--parity-policy", default="kvflow", help="the engines' cache policy in the parity run")
    parser.add_argument("--parity-tenants", type=int, default=4)
    parser.add_argument("--parity-clients", type=int, default=48, help="workflow instances of the parity scenario")
    parser.add_argument("--parity-rate", type=float, default=1.0, help="instances per simulated second")
    parser.add_argument("--parity-repeats", type=int, default=10,
                        help="runs of the first router at each ingress count, compared by their means, with the "
                             "standard error of the difference (default 10: a run's ratios move by a point or two)")
    parser.add_argument("--ingress-sync-s", type=float, default=SYNC_S,
                        help=f"the ingresses' sync period in the parity run (ingress_sync_s, default {SYNC_S})")
    parser.add_argument("--parity-ingress", default="1,2",
                        help="ingress replica counts the first parity router also runs at (default 1,2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-e2e", action="store_true", help="only the router decision latency")
    parser.add_argument("--skip-router", action="store_true", help="only the end-to-end routing comparison")
    results_file.add_out_argument(parser, "serve_routing.json (serve_routing_sim.json with --engine sim, "
                                          "serve_router.json with --skip-e2e)")
    args = parser.parse_args()
    if args.replicas is None:
        args.replicas = 4 if args.engine == "sim" else 2
    if args.quick:
        args.applications, args.clients, args.iterations, args.router_clients = 2, 2, 2, 50
    if args.time_scale is None:
        args.time_scale = 0.1 if args.sim_parity and args.quick else 0.25
    if args.sim_parity:
        args.parity_ingress = [int(n) for n in args.parity_ingress.split(",")]
        if args.quick:
            args.parity_clients, args.parity_routers, args.parity_ingress = 12, "workflow,sglang-cache-aware", [1]
            # two runs of the first router, compared by their mean: one run of 64 calls moved by up to 5.6 points
            args.parity_repeats = 2
        parity = sim_parity(args)
        print(json.dumps(parity, indent=2))
        results_file.write_json(args.out, "serve_routing_parity", parity)
        return 0
    report: dict[str, Any] = {}
    if not args.skip_e2e:
        report["routing"] = routing_comparison(args)
    if not args.skip_router:
        report["router_decision_latency"] = decision_latency(args)
    print(json.dumps(report, indent=2))
    # the decision latency alone: serve_router.json; the routing comparison: serve_routing(_sim).json
    name = "serve_router" if args.skip_e2e else "serve_routing_sim" if args.engine == "sim" else "serve_routing"
    results_file.write_json(args.out, name, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
