"""Dynamic workflows side by side: lru, hicache, static kvflow, predictive (expected steps from the
transition model learned online, prefetch of likely next agents into free or retired memory only)
and the oracle (Belady eviction over the recorded trace, prefetch of the true next agent), on the
`dynamic` scenario (`kvflow-ray sim --scenario dynamic`: support applications whose triage hands each
ticket to one of K specialists with skewed odds and whose reviewer loops back at random).

1. grid: branches x skew x loop probability x tickets in flight, on the A10G and H100 profiles.
   Reports latency, hit ratios, load stall and prefetch issued/used/wasted per policy; per config, the
   gap static kvflow leaves to the oracle and the share of it predictive closes; predictive over lru.
2. mixes: `adversarial` (the specialists' odds reverse right after the warm-up, against everything
   learned): predictive against hicache; `drift` (they reverse halfway): how many instances after the
   change predictive's latency is back within 5% of its settled latency.
3. static: the README's paper grids (Fig. 5 and Fig. 8 as run there; Fig. 6 with `--quick`'s reduction):
   predictive against static kvflow on workflows without choices.
4. cpu: two configs on the CPU engine (real compute, wall clock), lru/hicache/kvflow/predictive.

Run: python benchmarks/dynamic.py [--quick] [--no-cpu] [--out DIR]. Progress on stderr, tables on
stdout, dynamic.json and dynamic.png in DIR (default benchmarks/out, which git ignores; the committed
figures come from --out benchmarks/results).
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvflow_ray.core.scheduler import resolve_policy
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import run_policies, simulate, summarise
from kvflow_ray.engines.sim.simulator import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, wherever it is run from
import paper_figures  # the README's paper grids, as that benchmark builds them
import results_file

PROFILES = ["a10g-llama3.1-8b", "h100-qwen2.5-32b"]
POLICIES = ["lru", "hicache", "kvflow", "predictive", "oracle"]
CPU_POLICIES = ["lru", "hicache", "kvflow", "predictive"]
GRID = {"branches": [3, 6], "skew": [0.5, 2.0], "loop_p": [0.2, 0.5], "clients": [2, 4, 8], "fixed": [2048, 4096]}
QUICK_GRID = {"branches": [6], "skew": [0.5, 2.0], "loop_p": [0.3], "clients": [4, 8], "fixed": [4096]}
KEYS = ["latency_s", "p99_latency_s", "gpu_hit_ratio", "cpu_hit_ratio", "prefetch_stall_s", "prefetch_issued",
        "prefetch_used", "prefetch_wasted"]
GAP_FLOOR = 0.05  # configs where static kvflow is at least this far behind the oracle


def grid_rows(profiles: list[str], grid: dict[str, list[Any]], bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for profile in profiles:
        for branches, skew, loop_p, clients, fixed in itertools.product(*grid.values()):
            config = {"profile": profile, "branches": branches, "skew": skew, "loop_p": loop_p, "clients": clients,
                      "fixed": fixed}
            bar.set_description(f"grid {profile[:4]} K={branches} s={skew} p={loop_p} x{clients} f={fixed}")
            scenario = workload.dynamic(branches=branches, skew=skew, loop_p=loop_p, clients=clients, fixed=fixed)
            out = run_policies(scenario, load_profile(profile), POLICIES)["results"]
            rows.append({**config, "results": {p: {k: out[p][k] for k in KEYS} for p in POLICIES}})
            bar.update()
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets' figures over the grid."""
    gaps = []
    for row in rows:
        r = row["results"]
        kv, pred, oracle = (r[p]["latency_s"] for p in ("kvflow", "predictive", "oracle"))
        gap = kv / oracle - 1
        if gap >= GAP_FLOOR:
            gaps.append({k: row[k] for k in ("profile", "branches", "skew", "loop_p", "clients", "fixed")}
                        | {"kvflow_vs_oracle": kv / oracle, "closed": (kv - pred) / (kv - oracle)})
    speedups = [row["results"]["lru"]["latency_s"] / row["results"]["predictive"]["latency_s"] for row in rows]
    issued = sum(row["results"]["predictive"]["prefetch_issued"] for row in rows)
    used = sum(row["results"]["predictive"]["prefetch_used"] for row in rows)
    kv_issued = sum(row["results"]["kvflow"]["prefetch_issued"] for row in rows)
    kv_used = sum(row["results"]["kvflow"]["prefetch_used"] for row in rows)
    vs_kvflow = [row["results"]["predictive"]["latency_s"] / row["results"]["kvflow"]["latency_s"] for row in rows]
    return {
        "configs": len(rows),
        "gap_configs": gaps,
        "min_gap_closed": min((g["closed"] for g in gaps), default=None),
        "predictive_vs_lru": {"geomean": statistics.geometric_mean(speedups), "min": min(speedups),
                              "max": max(speedups)},
        "predictive_vs_kvflow_latency": {"geomean": statistics.geometric_mean(vs_kvflow), "max": max(vs_kvflow),
                                         "min": min(vs_kvflow)},
        "prefetch_used_per_issued": {"predictive": used / issued if issued else None,
                                     "kvflow": kv_used / kv_issued if kv_issued else None},
    }


def adversarial_rows(profiles: list[str], quick: bool, bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    configs = [(6, 2.0, 0.3, 8)] if quick else [(3, 2.0, 0.3, 8), (6, 2.0, 0.3, 8), (6, 2.0, 0.5, 16)]
    for profile in profiles:
        for branches, skew, loop_p, clients in configs:
            bar.set_description(f"adversarial {profile[:4]} K={branches} x{clients}")
            scenario = workload.dynamic(branches=branches, skew=skew, loop_p=loop_p, clients=clients,
                                        mix="adversarial")
            out = run_policies(scenario, load_profile(profile), ["hicache", "kvflow", "predictive"])["results"]
            rows.append({"profile": profile, "branches": branches, "skew": skew, "loop_p": loop_p,
                         "clients": clients, "results": {p: {k: out[p][k] for k in KEYS} for p in out},
                         "predictive_vs_hicache": out["predictive"]["latency_s"] / out["hicache"]["latency_s"]})
            bar.update()
    return rows


def recovery(latencies: list[float], change: int, window: int = 25, within: float = 0.05) -> dict[str, Any]:
    """Instances (in start order) after `change` until the rolling mean of `window` latencies is back
    within `within` of the settled latency (the mean of the last third of the run)."""
    settled = statistics.fmean(latencies[len(latencies) - (len(latencies) - change) // 3:])
    for k in range(0, len(latencies) - change - window + 1):
        if statistics.fmean(latencies[change + k:change + k + window]) <= settled * (1 + within):
            return {"instances": k, "settled_s": settled}
    return {"instances": None, "settled_s": settled}


def learning_curve(scenario: workload.Scenario, profile: str,
                   every_s: float = 1.0) -> tuple[Simulation, list[tuple[int, str | None]]]:
    """Predictive on a one-application drifting scenario, probing the learned model every `every_s`
    simulated seconds: (the finished run, [(instances started, the model's favourite specialist)])."""
    plan = scenario.plans[0]
    sim = Simulation(load_profile(profile), resolve_policy("predictive"))
    for p in scenario.plans:
        sim.add_client(p)
    curve: list[tuple[int, str | None]] = []

    def probe() -> None:
        branching = sim.branching_of(plan)
        model = sim.forecast.book.models.get((plan.salt, plan.spec.name))
        if branching is not None:
            odds = model.choice(plan.spec, "triage") if model is not None else {}
            curve.append((branching.instances, max(odds, key=odds.__getitem__) if odds else None))
        if sim.pending_events():
            sim.at(sim.now + every_s, probe)

    sim.at(every_s, probe)
    sim.run()
    return sim, curve


def drift_rows(profiles: list[str], quick: bool, bar: tqdm) -> list[dict[str, Any]]:
    """One application (one model to learn), 4 tickets in flight, many tickets each; the specialists'
    odds reverse halfway. Latency recovery per policy, and how many instances the learned model takes
    to name the new favourite specialist (for good: at every probe after)."""
    rows = []
    iterations = 30 if quick else 80
    for profile in profiles:
        bar.set_description(f"drift {profile[:4]}")
        scenario = workload.dynamic(branches=6, skew=2.0, loop_p=0.3, clients=4, apps=1, fixed=6144,
                                    iterations=iterations, mix="drift")
        plan = scenario.plans[0]
        assert plan.branching is not None and plan.branching.later is not None
        change = plan.branching.switch_at
        later = plan.branching.later["triage"]
        favourite = max(later, key=later.__getitem__)
        row: dict[str, Any] = {"profile": profile, "instances": len(scenario.plans) * (iterations + plan.warmup),
                               "change_at": change, "results": {}}
        for policy in ("hicache", "kvflow", "predictive"):
            if policy == "predictive":
                sim, curve = learning_curve(scenario, profile)
                result = summarise(sim)
                after = [(n, fav) for n, fav in curve if n > change]
                wrong = [n for n, fav in after if fav != favourite]
                row["model_learns_new_favourite_after"] = (max(wrong) - change if wrong else 0) if after else None
            else:
                result, sim = simulate(scenario, load_profile(profile), policy)
            latencies = [it.latency for it in sorted(sim.iterations, key=lambda it: it.start)]
            row["results"][policy] = {"latency_s": result["latency_s"], **recovery(latencies, change)}
        rows.append(row)
        bar.update()
    return rows


def static_rows(quick: bool, bar: tqdm) -> list[dict[str, Any]]:
    """Predictive against static kvflow on the paper grids (no `next: one` agents anywhere)."""
    configs = paper_figures.build_configs(["fig5", "fig8"], quick=quick, tiny=False)
    configs += paper_figures.build_configs(["fig6"], quick=True, tiny=False)
    rows = []
    for config in configs:
        bar.set_description(f"static {config.figure} {config.profile[:4]} {config.label}")
        out = run_policies(config.make(), load_profile(config.profile), ["kvflow", "predictive"])["results"]
        rows.append({"figure": config.figure, "profile": config.profile, "label": config.label,
                     "kvflow_s": out["kvflow"]["latency_s"], "predictive_s": out["predictive"]["latency_s"],
                     "ratio": out["predictive"]["latency_s"] / out["kvflow"]["latency_s"]})
        bar.update()
    return rows


def cpu_rows(quick: bool) -> list[dict[str, Any]]:
    from kvflow_ray.engines.cpu.bench import policy_progress, run_cpu_policies
    from kvflow_ray.engines.cpu.config import CpuEngineConfig

    rows = []
    configs = [(4, 1.5, 4)] if quick else [(4, 1.5, 4), (6, 0.5, 4)]
    for branches, skew, clients in configs:
        scenario = workload.dynamic(branches=branches, skew=skew, loop_p=0.3, clients=clients, apps=2, fixed=1024,
                                    dynamic=32, output=8, iterations=3 if quick else 6)
        with policy_progress(f"cpu dynamic K={branches}") as progress:
            out = run_cpu_policies(scenario, CpuEngineConfig(), CPU_POLICIES, progress=progress)["results"]
        rows.append({"branches": branches, "skew": skew, "clients": clients,
                     "results": {p: {k: out[p][k] for k in KEYS} for p in CPU_POLICIES}})
    return rows


def tables(report: dict[str, Any]) -> str:
    lines = ["grid: mean workflow latency (s) per policy; prefetch used/issued of kvflow and predictive",
             f"{'profile':>8} {'K':>2} {'skew':>4} {'loop':>4} {'x':>3} {'fixed':>5} "
             + " ".join(f"{p:>10}" for p in POLICIES)
             + "   kvflow pf    pred pf"]
    for row in report["grid"]:
        r = row["results"]
        pf = "  ".join(f"{r[p]['prefetch_used']:>4}/{r[p]['prefetch_issued']:<4}" for p in ("kvflow", "predictive"))
        lines.append(f"{row['profile'][:8]:>8} {row['branches']:>2} {row['skew']:>4g} {row['loop_p']:>4g} "
                     f"{row['clients']:>3} {row['fixed']:>5} "
                     + " ".join(f"{r[p]['latency_s']:>10.2f}" for p in POLICIES) + f"   {pf}")
    s = report["summary"]
    lines.append(f"configs where static kvflow is >= {GAP_FLOOR:.0%} behind the oracle: {len(s['gap_configs'])}; "
                 f"least share of the gap predictive closes: "
                 + ("-" if s["min_gap_closed"] is None else f"{s['min_gap_closed']:.0%}"))
    for g in s["gap_configs"]:
        lines.append(f"  {g['profile'][:8]} K={g['branches']} skew={g['skew']:g} loop={g['loop_p']:g} "
                     f"x{g['clients']} fixed {g['fixed']}: kvflow/oracle {g['kvflow_vs_oracle']:.3f}, "
                     f"closed {g['closed']:.0%}")
    v = s["predictive_vs_lru"]
    lines.append(f"predictive over lru: geomean {v['geomean']:.2f}x (min {v['min']:.2f}x, max {v['max']:.2f}x); "
                 f"predictive / kvflow latency: geomean {s['predictive_vs_kvflow_latency']['geomean']:.3f}, "
                 f"max {s['predictive_vs_kvflow_latency']['max']:.3f}")
    pf = s["prefetch_used_per_issued"]
    lines.append(f"prefetch used / issued over the grid: predictive {pf['predictive']:.2f}, kvflow {pf['kvflow']:.2f}")
    for row in report["adversarial"]:
        lines.append(f"adversarial {row['profile'][:8]} K={row['branches']} x{row['clients']}: predictive / hicache "
                     f"{row['predictive_vs_hicache']:.3f}")
    for row in report["drift"]:
        cells = ", ".join(f"{p} {r['latency_s']:.1f} s (back within 5% after "
                          f"{'-' if r['instances'] is None else r['instances']} instances)"
                          for p, r in row["results"].items())
        lines.append(f"drift {row['profile'][:8]} (change at instance {row['change_at']} of {row['instances']}): "
                     f"{cells}; the learned model names the new favourite for good "
                     f"{row['model_learns_new_favourite_after']} instances after the change")
    if report["static"]:
        worst = max(report["static"], key=lambda r: r["ratio"])
        lines.append(f"static paper grids: predictive / kvflow latency at most {worst['ratio']:.4f} "
                     f"({worst['figure']} {worst['profile']} {worst['label']}; {len(report['static'])} configs)")
    for row in report["cpu"]:
        r = row["results"]
        lines.append(f"cpu engine K={row['branches']} skew={row['skew']:g} x{row['clients']}: "
                     + ", ".join(f"{p} {r[p]['latency_s']:.2f} s" for p in CPU_POLICIES))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["grid"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.3), 4.5))
    x = range(len(rows))
    for policy in POLICIES:
        ax.plot(x, [r["results"]["lru"]["latency_s"] / r["results"][policy]["latency_s"] for r in rows],
                "-o" if policy == "predictive" else "--.", label=policy)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['profile'][:4]} K{r['branches']} s{r['skew']:g} p{r['loop_p']:g} x{r['clients']} "
                        f"f{r['fixed']}"
                        for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("speedup over lru (mean workflow latency)")
    ax.set_title("dynamic workflows: every policy on the same scenario", fontsize=10)
    ax.legend(fontsize=7)
    results_file.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = results_file.parser(__doc__, "dynamic", "a reduced grid, A10G only, quick static grids (a smoke run)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU engine runs (about 4 minutes)")
    args = ap.parse_args(argv)
    profiles = PROFILES[:1] if args.quick else PROFILES
    grid = QUICK_GRID if args.quick else GRID
    static_configs = len(paper_figures.build_configs(["fig5", "fig8"], quick=args.quick, tiny=False)) + \
        len(paper_figures.build_configs(["fig6"], quick=True, tiny=False))
    runs = (len(profiles) * math.prod(map(len, grid.values())) + len(profiles) * (1 if args.quick else 3)
            + len(profiles) + static_configs)
    results_file.require("matplotlib")
    out = args.out
    started = time.perf_counter()
    with tqdm(total=runs, disable=args.no_progress, file=sys.stderr, unit="config") as bar:
        rows = grid_rows(profiles, grid, bar)
        adversarial = adversarial_rows(profiles, args.quick, bar)
        drift = drift_rows(profiles, args.quick, bar)
        static = static_rows(args.quick, bar)
    cpu = [] if args.no_cpu else cpu_rows(args.quick)
    report = {"generated_by": "python benchmarks/dynamic.py" + (" --quick" if args.quick else "")
              + (" --no-cpu" if args.no_cpu else ""),
              "machine": results_file.machine(), "wall_s": time.perf_counter() - started, "grid": rows,
              "summary": summary(rows), "adversarial": adversarial, "drift": drift, "static": static, "cpu": cpu}
    print(tables(report))
    results_file.write(out, "dynamic", report, lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
