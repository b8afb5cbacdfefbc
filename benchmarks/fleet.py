"""Routers side by side on a simulated fleet: the workflow router against the routers users would pick
instead (Ray Serve LLM prefix affinity, the SGLang gateway's cache_aware, Dynamo's KV router, llm-d's
precise scorer, pow2, round-robin), every call through the serving router's code (`kvflow-ray sim
--routing`), under each cache policy, where memory binds and where it does not.

1. pressure: the fleet scenario with the applications' prompts at 0.5-8x the fleet's device KV
   (`kvflow-ray sim --scenario fleet --pressure X`: tenants of 4 applications are added until their
   working sets reach it), at 8 and 32 replicas, at a rate below the knee and one past it, every
   router x {lru, hicache, kvflow} and the no-capacity bound. Per point it prints the targets of
   issue 29 from three latencies of the same run: B, the bound (the lowest `infinite` latency over
   every router); K, the best peer router on kvflow engines; N, the best peer-native stack (a peer
   router with lru or hicache); T = max(1.01 B, min(0.97 K, B + 0.3 (N - B))); and the TTFT p90
   target max(0.7 x N's, 1.05 x B's). Below pressure 1 the target is 1.02 x the best baseline.
2. rate: today's fleet (8 tenants x 2 applications per 8 replicas, pressure about 0.25), at 8 and 32
   replicas, over a sweep of arrival rates up to past saturation, every router x {lru, hicache,
   kvflow} and the bound; the workflow router + kvflow against the best baseline at each rate.
3. tune: each baseline with its thresholds swept, at 8 replicas with lru engines, 128 and 512
   instances; the workflow router against the best-tuned of them.
Every run reports mean and p99 workflow latency, TTFT p50/p90, output tokens/s, device and host hit
ratios, prefetch used/wasted, load imbalance (max / mean compute time) and the router's decision cost.

Run: python benchmarks/fleet.py [--quick] [--sections pressure,rate,tune] [--replicas 8,32] [--jobs 2]
[--out DIR]. Progress on stderr, tables on stdout, fleet.json and fleet.png (latency against pressure
and against rate, one curve per router) in DIR (default benchmarks/out, which git ignores; the
committed figures come from --out benchmarks/results).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
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
NATIVE = ["lru", "hicache"]  # the cache policies a peer's own stack runs
BOUND = "infinite"  # no device capacity limit: what is left is compute and queueing
RATES = [1.0, 2.0, 4.0, 8.0, 16.0]  # instances per second per 8 replicas (today's fleet)
# the pressure sweep: working set / fleet device KV, per replica count (past 4x at 32 replicas a run
# holds 2,000+ applications' prompts and takes minutes), and two rates per 8 replicas: below the knee
# and past it (at pressure 2 on 8 replicas: TTFT p90 about 1 s and 8 s)
PRESSURES = {8: [0.5, 1.0, 2.0, 4.0, 8.0], 32: [0.5, 2.0, 4.0]}
PRESSURE_RATES = {"below knee": 2.0, "past knee": 4.0}
PRESSURE_APPS = 4  # applications per tenant
PRESSURE_CLIENTS = 512  # instances per run at 8 replicas; twice that at 32 (as the rate sweep's 1,024)
LEAD = 0.97  # T's term against K, the best peer router on kvflow engines: a 3% lead
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


# ---------------------------------------------------------------------------------------------- runs
def pressure_clients(replicas: int) -> int:
    return PRESSURE_CLIENTS * (2 if replicas > 8 else 1)


def pressure_sweep(replica_counts: list[int], pressures: list[float] | None, quick: bool) -> list[dict[str, Any]]:
    """The pressure sweep's points: per replica count, each regime's rate x each pressure (`pressures`, or
    the sweep's own for that count); `quick`: past the knee only, pressures 0.5 and 2, 64 instances."""
    points = []
    for replicas in replica_counts:
        here = pressures or ([0.5, 2.0] if quick else PRESSURES.get(replicas, PRESSURES[8]))
        regimes = {"past knee": PRESSURE_RATES["past knee"]} if quick else PRESSURE_RATES
        points += [{"section": "pressure", "replicas": replicas, "pressure": pressure, "regime": regime, "rate": rate,
                    "clients": 64 if quick else pressure_clients(replicas)}
                   for regime, rate in regimes.items() for pressure in here]
    return points


def scenario(point: dict[str, Any], seed: int) -> workload.Scenario:
    """The fleet of one point: `pressure` set (the pressure sweep) or today's fleet (the rate sweep)."""
    replicas, scale = point["replicas"], max(1, point["replicas"] // 8)
    if point.get("pressure") is not None:
        return workload.fleet(tenants=None, apps=PRESSURE_APPS, clients=point["clients"], rate=point["rate"] * scale,
                              seed=seed, pressure=point["pressure"],
                              fleet_kv_tokens=replicas * load_profile(PROFILE).gpu_kv_tokens)
    return workload.fleet(tenants=8 * scale, apps=2, clients=point["clients"] * scale, rate=point["rate"] * scale,
                          seed=seed)


def run_one(job: tuple[dict[str, Any], str, str, int]) -> dict[str, Any]:
    """One simulation: (point, cache policy, routing, seed) -> the point's row."""
    point, policy, routing, seed = job
    started = time.perf_counter()
    sc = scenario(point, seed)
    result, _sim = simulate(sc, load_profile(PROFILE), policy, replicas=point["replicas"], routing=routing, seed=seed)
    row = {**point, "policy": policy, "routing": routing, **{k: result[k] for k in KEYS}}
    row["measured_pressure"] = sc.params.get("pressure")
    row["decision_p50_ms"] = result["routing"]["decision_p50_ms"]
    row["decision_p99_ms"] = result["routing"]["decision_p99_ms"]
    row["policy_p99_ms"] = result["routing"]["policy_p99_ms"]
    row["wall_s"] = time.perf_counter() - started
    return row


def grid(points: list[dict[str, Any]], routers: list[str], seed: int) -> list[tuple[dict[str, Any], str, str, int]]:
    """Every point x router x {lru, hicache, kvflow, the bound}."""
    return [(point, policy, routing, seed) for point in points for routing in routers
            for policy in [*POLICIES, BOUND]]


def run_all(jobs: list[tuple[dict[str, Any], str, str, int]], workers: int, bar: tqdm) -> Iterator[dict[str, Any]]:
    """The runs, in order; `workers` processes at once (each simulation is single-threaded)."""
    def label(job: tuple[dict[str, Any], str, str, int]) -> str:
        point, policy, routing, _seed = job
        at = f"pressure {point['pressure']:g}" if point.get("pressure") is not None else f"rate {point['rate']:g}"
        return f"{point['section']} {point['replicas']}x {at} {policy}@{routing}"

    if workers <= 1:
        for job in jobs:
            bar.set_description(label(job))
            yield run_one(job)
            bar.update()
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for job, row in zip(jobs, pool.map(run_one, jobs, chunksize=1), strict=True):
            bar.set_description(label(job))
            yield row
            bar.update()


# ---------------------------------------------------------------------------------------------- targets
def is_ours(row: dict[str, Any]) -> bool:
    return row["routing"].split(":")[0] == "workflow"


def best(rows: list[dict[str, Any]], key: str = "latency_s", **where: Any) -> dict[str, Any]:
    """The row with the lowest `key` among `rows` matching `where` (policy: a name or a list of names;
    peers: True for the peers' routers only)."""
    peers = where.pop("peers", False)
    policies = where.pop("policy", None)
    if isinstance(policies, str):
        policies = [policies]
    pool = [r for r in rows if (not peers or not is_ours(r)) and (policies is None or r["policy"] in policies)]
    return min(pool, key=lambda r: r[key])


def best_baseline(rows: list[dict[str, Any]], key: str = "latency_s") -> dict[str, Any]:
    """The baseline run with the lowest `key` among `rows`: any peer router with a real cache."""
    return best(rows, key, peers=True, policy=POLICIES)


def bound(rows: list[dict[str, Any]], key: str) -> float:
    """The lowest `key` of the no-capacity runs among `rows` (every router's)."""
    return best(rows, key, policy=BOUND)[key]


def targets(here: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 29's targets at one point of the pressure sweep, from its own runs."""
    ours = next(r for r in here if is_ours(r) and r["policy"] == "kvflow")
    b, k, n = best(here, policy=BOUND), best(here, peers=True, policy="kvflow"), best(here, peers=True, policy=NATIVE)
    base = best_baseline(here)
    entry: dict[str, Any] = {
        "replicas": ours["replicas"], "pressure": ours["pressure"], "measured_pressure": ours["measured_pressure"],
        "rate": ours["rate"], "regime": ours["regime"], "workflow": ours["latency_s"], "ttft_p90_s": ours["ttft_p90_s"],
        "B": b["latency_s"], "B_is": f"{b['policy']}@{b['routing']}", "K": k["latency_s"], "K_is": k["routing"],
        "N": n["latency_s"], "N_is": f"{n['policy']}@{n['routing']}",
        "best_baseline": base["latency_s"], "best_baseline_is": f"{base['policy']}@{base['routing']}",
        "decision_p99_ms": ours["decision_p99_ms"], "policy_p99_ms": ours.get("policy_p99_ms"),
    }
    if ours["pressure"] >= 1:
        entry["T"] = max(1.01 * b["latency_s"], min(LEAD * k["latency_s"], b["latency_s"] + 0.3 * (n["latency_s"]
                                                                                                 - b["latency_s"])))
        entry["ttft_target_s"] = max(0.7 * n["ttft_p90_s"], 1.05 * b["ttft_p90_s"])
        entry["met"] = ours["latency_s"] <= entry["T"] and ours["ttft_p90_s"] <= entry["ttft_target_s"]
    else:
        entry["T"] = 1.02 * base["latency_s"]
        entry["ttft_target_s"] = None
        entry["met"] = ours["latency_s"] <= entry["T"]
    return entry


def pressure_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["replicas"], r["regime"], r["pressure"]) for r in rows})
    for replicas, regime, pressure in keys:
        here = [r for r in rows if (r["replicas"], r["regime"], r["pressure"]) == (replicas, regime, pressure)]
        out.append(targets(here))
    return out


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per replicas x rate: workflow + kvflow against the best baseline (with its best cache policy)."""
    out = []
    for replicas in sorted({r["replicas"] for r in rows}):
        for rate in sorted({r["rate"] for r in rows}):
            here = [r for r in rows if r["replicas"] == replicas and r["rate"] == rate]
            ours = next(r for r in here if is_ours(r) and r["policy"] == "kvflow")
            entry: dict[str, Any] = {"replicas": replicas, "rate": rate}
            for key in ("latency_s", "p99_latency_s", "ttft_p90_s"):
                top = best_baseline(here, key)
                entry[key] = {"workflow": ours[key], "best": top[key],
                              "best_is": f"{top['policy']}@{top['routing']}",
                              "ratio": ours[key] / top[key] if top[key] else float("nan"),
                              "bound": bound(here, key)}
            best_hit = max((r for r in here if not is_ours(r) and r["policy"] != BOUND),
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
        ours = next(r for r in here if is_ours(r) and r["policy"] == "lru")
        entry: dict[str, Any] = {"clients": clients}
        for key in ("latency_s", "p99_latency_s"):
            top = best(here, key, peers=True, policy="lru")
            entry[key] = {"workflow": ours[key], "best": top[key], "best_is": top["routing"],
                          "ratio": ours[key] / top[key] if top[key] else float("nan"),
                          "bound": bound(here, key)}
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------- report
def tables(report: dict[str, Any]) -> str:
    lines = []
    if report["pressure"]:
        lines += ["pressure: workflow router + kvflow against issue 29's target T per point (B bound, K best peer "
                  "router on kvflow, N best peer-native stack; below pressure 1, T = 1.02 x the best baseline)",
                  f"{'replicas':>8} {'regime':>10} {'pressure':>8} {'ours':>7} {'T':>7} {'B':>7} {'K':>7} {'N':>7} "
                  f"{'ttft p90':>8} {'target':>7} {'dec p99':>8}  met  K is / N is"]
        for e in report["pressure"]:
            ttft_target = "-" if e["ttft_target_s"] is None else f"{e['ttft_target_s']:.2f}"
            lines.append(f"{e['replicas']:>8} {e['regime']:>10} {e['measured_pressure']:>8.2f} {e['workflow']:>7.1f} "
                         f"{e['T']:>7.1f} {e['B']:>7.1f} {e['K']:>7.1f} {e['N']:>7.1f} {e['ttft_p90_s']:>8.2f} "
                         f"{ttft_target:>7} {e['decision_p99_ms']:>8.3f}  {'yes' if e['met'] else 'NO ':>3}  "
                         f"{e['K_is']} / {e['N_is']}")
    if report["comparison"]:
        lines += ["rate: workflow router + kvflow vs the best baseline at each rate (ratios < 1: workflow better)",
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


def _curves(ax: Any, rows: list[dict[str, Any]], x: str) -> None:
    """Mean latency against `x`, a curve per router (its best cache policy) and the bound."""
    xs = sorted({r[x] for r in rows})
    for routing in ROUTERS:
        points = [(v, min(r["latency_s"] for r in rows if r[x] == v and r["routing"] == routing
                          and r["policy"] != BOUND)) for v in xs]
        ax.plot([a for a, _ in points], [b for _, b in points], "-o" if routing == "workflow" else "--.",
                label=routing)
    ax.plot(xs, [bound([r for r in rows if r[x] == v], "latency_s") for v in xs], ":k", label="no-capacity bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylabel("mean workflow latency (s), best cache policy")
    ax.legend(fontsize=7)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("pressure", key) for key in sorted({(r["replicas"], r["regime"]) for r in report["pressure_runs"]})]
    panels += [("rate", (replicas, None)) for replicas in sorted({r["replicas"] for r in report["sweep"]})]
    cols = min(4, len(panels)) or 1
    rows_of_panels = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(6 * cols, 4.5 * rows_of_panels), squeeze=False)
    for ax, (section, (replicas, regime)) in zip(axes.flat, panels, strict=False):
        if section == "pressure":
            rows = [r for r in report["pressure_runs"] if r["replicas"] == replicas and r["regime"] == regime]
            _curves(ax, rows, "pressure")
            for e in report["pressure"]:
                if e["replicas"] == replicas and e["regime"] == regime:
                    ax.plot([e["pressure"]], [e["T"]], "rv", markersize=6)
            ax.set_xlabel("working set / fleet device KV (red: target T)")
            ax.set_title(f"{replicas} A10G replicas, {regime}", fontsize=10)
        else:
            _curves(ax, [r for r in report["sweep"] if r["replicas"] == replicas], "rate")
            ax.set_xlabel("workflow instances per second (per 8 replicas)")
            ax.set_title(f"{replicas} A10G replicas, today's fleet (pressure about 0.25)", fontsize=10)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    results_file.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = results_file.parser(__doc__, "fleet", "8 replicas, pressure 0.5 and 2 past the knee with 64 instances, two "
                                               "rates, no tuning (a smoke run)")
    ap.add_argument("--sections", default="pressure,rate,tune", help="which sweeps to run (pressure, rate, tune)")
    ap.add_argument("--replicas", default="8,32", help="comma-separated replica counts for the sweeps")
    ap.add_argument("--pressures", default=None,
                    help="comma-separated pressures for every replica count (default: 0.5,1,2,4,8 at 8 replicas, "
                         "0.5,2,4 at 32)")
    ap.add_argument("--clients", type=int, default=256, help="rate sweep: workflow instances per run, per 8 replicas")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="simulations run at once, one process each (one per core)")
    ap.add_argument("--no-tune", action="store_true", help="skip the threshold sweep of the baselines")
    args = ap.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - {"pressure", "rate", "tune"}
    if unknown:
        ap.error(f"--sections: unknown {', '.join(sorted(unknown))} (pressure, rate, tune)")
    if args.no_tune or args.quick:
        sections.discard("tune")
    replica_counts = [8] if args.quick else [int(r) for r in args.replicas.split(",")]
    results_file.require("matplotlib")

    pressures = [float(p) for p in args.pressures.split(",")] if args.pressures else None
    pressure_points = pressure_sweep(replica_counts, pressures, args.quick) if "pressure" in sections else []
    rate_points = []
    if "rate" in sections:
        rates = [2.0, 8.0] if args.quick else RATES
        clients = 64 if args.quick else args.clients
        rate_points = [{"section": "rate", "replicas": replicas, "rate": rate, "clients": clients}
                       for replicas in replica_counts for rate in rates]
    tune_jobs = []
    if "tune" in sections:
        for clients in [128, 512]:
            point = {"section": "tune", "replicas": 8, "rate": 8.0, "clients": clients}
            specs = ["workflow", *[spec for specs in TUNING.values() for spec in specs]]
            tune_jobs += [(point, "lru", spec, args.seed) for spec in specs]
            tune_jobs += [(point, BOUND, routing, args.seed) for routing in ROUTERS]
    jobs = grid(pressure_points, ROUTERS, args.seed) + grid(rate_points, ROUTERS, args.seed) + tune_jobs
    started = time.perf_counter()
    with tqdm(total=len(jobs), disable=args.no_progress, file=sys.stderr, unit="run") as bar:
        rows = list(run_all(jobs, args.jobs, bar))
    pressure_runs = [r for r in rows if r["section"] == "pressure"]
    sweep_runs = [r for r in rows if r["section"] == "rate"]
    tune_runs = [r for r in rows if r["section"] == "tune"]
    report = {"generated_by": "python benchmarks/fleet.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": results_file.machine(), "profile": PROFILE, "wall_s": time.perf_counter() - started,
              "pressure_runs": pressure_runs, "pressure": pressure_table(pressure_runs) if pressure_runs else [],
              "sweep": sweep_runs, "comparison": comparison(sweep_runs) if sweep_runs else [],
              "tune": tune_runs, "tuned": tuned_comparison(tune_runs) if tune_runs else []}
    print(tables(report))
    results_file.write(args.out, "fleet", report, lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
