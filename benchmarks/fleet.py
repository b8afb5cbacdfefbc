"""Routers side by side on a simulated fleet: the workflow router against the routers users would pick
instead (Ray Serve LLM prefix affinity, the SGLang gateway's cache_aware, Dynamo's KV router, llm-d's
precise scorer, pow2, round-robin), every call through the serving router's code (`kvflow-ray sim
--routing`), under each cache policy, over a sweep of arrival rates up to past saturation.

1. sweep: the fleet scenario (8 tenants x 2 applications per 8 replicas, a mix of workflow shapes,
   each application with its own prompts over a shared preamble; Poisson arrivals), at 8 and 32
   replicas (tenants, instances and rates scaled with the fleet), every router x {lru, hicache,
   kvflow}. Reports mean and p99 workflow latency, TTFT p50/p90, output tokens/s, device and host
   hit ratios, prefetch used/wasted, load imbalance (max / mean compute time) and the router's
   decision cost; and, per rate, the workflow router + kvflow against the best baseline (each
   baseline with its best cache policy there).
2. tune: each baseline with its thresholds swept, at 8 replicas with lru engines, 128 and 512
   instances; the workflow router against the best-tuned of them.
3. bound: at every point of both, the `infinite` policy (no device capacity limit) under the workflow
   router and under Dynamo's: the latency no eviction or placement of prefixes can beat by much, so
   "best baseline / bound" says how much room any router has left.

Run: python benchmarks/fleet.py [--quick] [--replicas 8,32] [--out DIR]. Progress on stderr, tables on
stdout, fleet.json and fleet.png (latency against rate, one curve per router) in DIR (default
benchmarks/out, which git ignores; the committed figures come from --out benchmarks/results).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import results_file
from tqdm import tqdm

from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import simulate

PROFILE = "a10g-llama3.1-8b"
BASELINES = ["ray-prefix", "sglang-cache-aware", "dynamo-kv", "llmd-precise", "pow2", "round-robin"]
ROUTERS = ["workflow", *BASELINES]
POLICIES = ["lru", "hicache", "kvflow"]
BOUND = "infinite"  # no device capacity limit: what is left is compute and queueing
BOUND_ROUTERS = ["workflow", "dynamo-kv"]
RATES = [1.0, 2.0, 4.0, 8.0, 16.0]  # instances per second per 8 replicas
# each baseline's thresholds, swept (its defaults first)
TUNING = {
    "ray-prefix": ["ray-prefix", "ray-prefix:imbalanced_threshold=10", "ray-prefix:imbalanced_threshold=4",
                   "ray-prefix:match_rate_threshold=0.3"],
    "sglang-cache-aware": ["sglang-cache-aware", "sglang-cache-aware:balance_abs_threshold=32",
                           "sglang-cache-aware:balance_abs_threshold=8",
                           "sglang-cache-aware:balance_abs_threshold=8:balance_rel_threshold=1.1",
                           "sglang-cache-aware:cache_threshold=0.5"],
    "dynamo-kv": ["dynamo-kv", "dynamo-kv:overlap_score_credit=1.5", "dynamo-kv:prefill_load_scale=2",
                  "dynamo-kv:prefill_load_scale=4", "dynamo-kv:prefill_load_scale=0.5"],
    "llmd-precise": ["llmd-precise", "llmd-precise:prefix_weight=3:kv_cache_weight=2:queue_weight=2",
                     "llmd-precise:prefix_weight=4"],
    "pow2": ["pow2"],
    "round-robin": ["round-robin"],
}
KEYS = ["latency_s", "p99_latency_s", "ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "gpu_hit_ratio",
        "cpu_hit_ratio", "prefetch_used", "prefetch_wasted", "imbalance"]


def scenario(replicas: int, rate: float, clients: int, seed: int) -> workload.Scenario:
    scale = max(1, replicas // 8)
    return workload.fleet(tenants=8 * scale, apps=2, clients=clients * scale, rate=rate * scale, seed=seed)


def run_one(replicas: int, rate: float, clients: int, policy: str, routing: str, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    result, _sim = simulate(scenario(replicas, rate, clients, seed), load_profile(PROFILE), policy,
                            replicas=replicas, routing=routing, seed=seed)
    row = {k: result[k] for k in KEYS}
    row["decision_p50_ms"] = result["routing"]["decision_p50_ms"]
    row["decision_p99_ms"] = result["routing"]["decision_p99_ms"]
    row["wall_s"] = time.perf_counter() - started
    return row


def sweep(replica_counts: list[int], rates: list[float], clients: int, seed: int,
          bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for replicas in replica_counts:
        for rate in rates:
            runs = [(policy, routing) for routing in ROUTERS for policy in POLICIES]
            for policy, routing in runs + [(BOUND, routing) for routing in BOUND_ROUTERS]:
                bar.set_description(f"sweep {replicas}x rate {rate:g} {policy}@{routing}")
                rows.append({"replicas": replicas, "rate": rate, "policy": policy, "routing": routing,
                             **run_one(replicas, rate, clients, policy, routing, seed)})
                bar.update()
    return rows


def tune(instances: list[int], rate: float, seed: int, bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for clients in instances:
        runs = [("lru", "workflow"), *[("lru", spec) for specs in TUNING.values() for spec in specs]]
        for policy, routing in runs + [(BOUND, routing) for routing in BOUND_ROUTERS]:
            bar.set_description(f"tune {clients} instances {policy}@{routing}")
            rows.append({"clients": clients, "rate": rate, "policy": policy, "routing": routing,
                         **run_one(8, rate, clients, policy, routing, seed)})
            bar.update()
    return rows


def best_baseline(rows: list[dict[str, Any]], key: str = "latency_s") -> dict[str, Any]:
    """The baseline run with the lowest `key` among `rows` (any router but the workflow router, with a
    real cache: the bound's runs are not baselines)."""
    return min((r for r in rows if not r["routing"].startswith("workflow") and r["policy"] != BOUND),
               key=lambda r: r[key])


def bound(rows: list[dict[str, Any]], key: str) -> float:
    """The lowest `key` of the no-capacity runs among `rows`."""
    return min(r[key] for r in rows if r["policy"] == BOUND)


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per replicas x rate: workflow + kvflow against the best baseline (with its best cache policy)."""
    out = []
    for replicas in sorted({r["replicas"] for r in rows}):
        for rate in sorted({r["rate"] for r in rows}):
            here = [r for r in rows if r["replicas"] == replicas and r["rate"] == rate]
            ours = next(r for r in here if r["routing"] == "workflow" and r["policy"] == "kvflow")
            entry: dict[str, Any] = {"replicas": replicas, "rate": rate}
            for key in ("latency_s", "p99_latency_s", "ttft_p90_s"):
                best = best_baseline(here, key)
                entry[key] = {"workflow": ours[key], "best": best[key],
                              "best_is": f"{best['policy']}@{best['routing']}",
                              "ratio": ours[key] / best[key] if best[key] else float("nan"),
                              "bound": bound(here, key)}
            best_hit = max((r for r in here if r["routing"] != "workflow" and r["policy"] != BOUND),
                           key=lambda r: r["gpu_hit_ratio"] + r["cpu_hit_ratio"])
            entry["hit_ratio"] = {"workflow": ours["gpu_hit_ratio"] + ours["cpu_hit_ratio"],
                                  "best": best_hit["gpu_hit_ratio"] + best_hit["cpu_hit_ratio"],
                                  "best_is": f"{best_hit['policy']}@{best_hit['routing']}"}
            out.append(entry)
    return out


def tuned_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for clients in sorted({r["clients"] for r in rows}):
        here = [r for r in rows if r["clients"] == clients]
        ours = next(r for r in here if r["routing"] == "workflow" and r["policy"] == "lru")
        entry: dict[str, Any] = {"clients": clients}
        for key in ("latency_s", "p99_latency_s"):
            best = best_baseline(here, key)
            entry[key] = {"workflow": ours[key], "best": best[key], "best_is": best["routing"],
                          "ratio": ours[key] / best[key] if best[key] else float("nan"),
                          "bound": bound(here, key)}
        out.append(entry)
    return out


def tables(report: dict[str, Any]) -> str:
    lines = ["sweep: workflow router + kvflow vs the best baseline at each rate (ratios < 1: workflow better)",
             f"{'replicas':>8} {'rate':>6} {'mean':>18} {'p99':>18} {'ttft p90':>18} {'hit':>12} "
             f"{'bound mean':>10}  best baseline (mean)"]
    for e in report["comparison"]:
        cells = [f"{e[k]['workflow']:.1f}/{e[k]['best']:.1f}={e[k]['ratio']:.2f}"
                 for k in ("latency_s", "p99_latency_s")]
        ttft = e["ttft_p90_s"]
        cells.append(f"{ttft['workflow']:.2f}/{ttft['best']:.2f}={ttft['ratio']:.2f}")
        hit = e["hit_ratio"]
        lines.append(f"{e['replicas']:>8} {e['rate']:>6g} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} "
                     f"{hit['workflow']:5.3f}/{hit['best']:5.3f} {e['latency_s']['bound']:>10.1f}  "
                     f"{e['latency_s']['best_is']}")
    if report.get("tuned"):
        lines.append("tune (8 replicas, lru): workflow router vs the best-tuned baseline")
        for e in report["tuned"]:
            m, p = e["latency_s"], e["p99_latency_s"]
            lines.append(f"  {e['clients']:>5} instances: mean {m['workflow']:.2f} vs {m['best']:.2f} ({m['best_is']}) "
                         f"= {m['ratio']:.2f}; p99 {p['workflow']:.2f} vs {p['best']:.2f} ({p['best_is']}) "
                         f"= {p['ratio']:.2f}; no-capacity bound mean {m['bound']:.2f}, p99 {p['bound']:.2f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(7 * len(counts), 4.5), squeeze=False)
    for ax, replicas in zip(axes[0], counts, strict=True):
        for routing in ROUTERS:
            points = []
            for rate in sorted({r["rate"] for r in rows}):
                here = [r for r in rows if r["replicas"] == replicas and r["rate"] == rate
                        and r["routing"] == routing and r["policy"] != BOUND]
                if here:
                    points.append((rate, min(r["latency_s"] for r in here)))  # its best cache policy
            style = "-o" if routing == "workflow" else "--."
            ax.plot([a for a, _ in points], [b for _, b in points], style, label=routing)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("workflow instances per second (per 8 replicas)")
        ax.set_ylabel("mean workflow latency (s), best cache policy")
        ax.set_title(f"{replicas} simulated A10G replicas", fontsize=10)
        ax.legend(fontsize=7)
    results_file.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = results_file.parser(__doc__, "fleet", "8 replicas, two rates, 64 instances, no tuning (a smoke run)")
    ap.add_argument("--replicas", default="8,32", help="comma-separated replica counts for the sweep")
    ap.add_argument("--clients", type=int, default=256, help="workflow instances per run, per 8 replicas")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tune", action="store_true", help="skip the threshold sweep of the baselines")
    args = ap.parse_args(argv)
    replica_counts = [8] if args.quick else [int(r) for r in args.replicas.split(",")]
    rates = [2.0, 8.0] if args.quick else RATES
    clients = 64 if args.quick else args.clients
    tuning = not (args.quick or args.no_tune)
    instances = [128, 512]
    runs = len(replica_counts) * len(rates) * (len(ROUTERS) * len(POLICIES) + len(BOUND_ROUTERS))
    if tuning:
        runs += len(instances) * (1 + sum(map(len, TUNING.values())) + len(BOUND_ROUTERS))
    results_file.require("matplotlib")
    out = args.out
    started = time.perf_counter()
    with tqdm(total=runs, disable=args.no_progress, file=sys.stderr, unit="run") as bar:
        rows = sweep(replica_counts, rates, clients, args.seed, bar)
        tuned = tune(instances, 8.0, args.seed, bar) if tuning else []
    report = {"generated_by": "python benchmarks/fleet.py" + (" --quick" if args.quick else ""),
              "machine": results_file.machine(), "profile": PROFILE, "wall_s": time.perf_counter() - started,
              "sweep": rows, "comparison": comparison(rows), "tune": tuned,
              "tuned": tuned_comparison(tuned) if tuned else []}
    print(tables(report))
    results_file.write(out, "fleet", report, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
