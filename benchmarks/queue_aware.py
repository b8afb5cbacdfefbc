"""Queue-aware prefix scheduling side by side: FCFS (`hicache`), status-aware (the same eviction and
host tier with KVFlow's status-aware admission), SGLang's longest-prefix-match order (`lpm`), PEEK's
queue-aware order with demand-first eviction (`queue-aware`), and KVFlow with queue-aware admission
(`kvflow-qa`, against `kvflow`), on the simulator (A10G and H100 profiles) and the CPU engine.

1. burst: 256 calls within a second over 8/16/32 system prompts of 4,096 tokens (the working set at
   0.8x, 1.7x and 3.3x the device pool); the knee is the smallest one that overflows the pool. With
   more than 128 waiting, SGLang's lpm falls back to FCFS: 128 calls at the knee show it ranking.
2. fanout: instances whose planner starts 16 workers with one prompt at once, then an aggregator.
3. fleet burst: 64 instances of 16 tenants' applications (the fleet scenario) starting within a second.
4. control: 128 calls that share nothing.
   Every workload reports TTFT p50/p99, hit ratio, throughput, mean workflow latency and the longest
   wait of any request in the queue (starvation: against FCFS's p99 wait).
5. cost: one admission decision (the order and its first pick) over queues of 100, 1,000 and 10,000.
6. ablations: queue-aware's bound on the pioneers computing at once (`pioneer_tokens`) on the bursts;
   queue-aware without status-aware's queued loads (a load starts only once its request is
   admitted) on the fleet burst.
7. cpu: a burst and a fan-out on the CPU engine (real compute, wall clock).

Run: python benchmarks/queue_aware.py [--quick] [--no-cpu] [--out DIR]. Progress on stderr, tables
on stdout, queue_aware.json and queue_aware.png in DIR (default benchmarks/out, which git ignores; the
committed figures come from --out benchmarks/results).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvflow_ray.core.admission import ADMISSION, QueueAwareAdmission
from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.policies import EVICTION
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.core.scheduler import PolicyConfig, register_policy
from kvflow_ray.core.stats import percentile
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import run_policies

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, wherever it is run from
import results_file

PROFILES = ["a10g-llama3.1-8b", "h100-qwen2.5-32b"]
FCFS = "hicache"
QA = "queue-aware"
# the same eviction and host tier as FCFS, with status-aware admission: the admission order alone differs
register_policy(PolicyConfig("status-aware", "lru", host_tier=True, prefetch="none", admission="status-aware"))
POLICIES = [FCFS, "status-aware", "lpm", "queue-aware", "kvflow", "kvflow-fcfs", "kvflow-qa"]
KEYS = ["latency_s", "ttft_p50_s", "ttft_p99_s", "wait_p99_s", "max_wait_s", "gpu_hit_ratio", "cpu_hit_ratio",
        "recomputed_tokens", "makespan_s"]
BURST_PROMPTS = [8, 16, 32]
LPM_RANKS = 128  # waiting requests up to which SGLang's lpm ranks the queue (above: FCFS)
PIONEER_BUDGETS = [4096, 8192, 16384, None]
CONTROL_WITHIN = 0.03  # the no-sharing control: every metric within this of FCFS
STARVATION_LIMIT = 2.0  # longest wait against FCFS's p99 wait


def workloads(quick: bool) -> list[tuple[str, dict[str, Any], workload.Scenario]]:
    rows: list[tuple[str, dict[str, Any], workload.Scenario]] = []
    for prompts in [16] if quick else BURST_PROMPTS:
        rows.append(("burst", {"prompts": prompts, "requests": 256}, workload.burst(prompts=prompts)))
    rows.append(("burst", {"prompts": 16, "requests": LPM_RANKS}, workload.burst(requests=LPM_RANKS, prompts=16)))
    rows.append(("fanout", {"workers": 16}, workload.fanout(workers=16)))
    rows.append(("fleet burst", {"clients": 64}, workload.fleet(tenants=8, apps=2, clients=64, rate=64.0)))
    rows.append(("control", {"prompts": 128}, workload.burst(requests=128, prompts=128, system=1024)))
    return rows


def output_tokens(scenario: workload.Scenario) -> int:
    return sum(plan.iterations * len(plan.spec.agents) * plan.output for plan in scenario.plans)


def measure(scenario: workload.Scenario, result: dict[str, Any]) -> dict[str, Any]:
    row = {k: result[k] for k in KEYS}
    row["hit_ratio"] = result["gpu_hit_ratio"] + result["cpu_hit_ratio"]
    row["output_tokens_per_s"] = output_tokens(scenario) / result["makespan_s"] if result["makespan_s"] else 0.0
    return row


def sim_rows(profiles: list[str], quick: bool, bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for profile in profiles:
        pool = load_profile(profile).gpu_kv_tokens
        for name, params, scenario in workloads(quick):
            bar.set_description(f"{profile[:4]} {name} {params}")
            out = run_policies(scenario, load_profile(profile), POLICIES)["results"]
            row = {"profile": profile, "workload": name, **params,
                   "results": {p: measure(scenario, out[p]) for p in POLICIES}}
            if name == "burst":
                row["working_set_per_pool"] = params["prompts"] * scenario.params["system"] / pool  # type: ignore[operator]
            rows.append(row)
            bar.update()
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets' figures."""
    knees = []
    for profile in {row["profile"] for row in rows}:
        bursts = [r for r in rows if r["profile"] == profile and r["workload"] == "burst"]
        over = [r for r in bursts if r["working_set_per_pool"] > 1 and r["requests"] > LPM_RANKS]
        if over:
            knee = min(over, key=lambda r: r["working_set_per_pool"])
            res = knee["results"]
            ranked = next(r["results"] for r in bursts
                          if r["requests"] == LPM_RANKS and r["prompts"] == knee["prompts"])
            knees.append({"profile": profile, "prompts": knee["prompts"],
                          "working_set_per_pool": knee["working_set_per_pool"],
                          "ttft_p50_vs_fcfs": res[FCFS]["ttft_p50_s"] / res["queue-aware"]["ttft_p50_s"],
                          "ttft_p50_vs_lpm": res["lpm"]["ttft_p50_s"] / res["queue-aware"]["ttft_p50_s"],
                          "lpm_ranking_ttft_p50_vs_lpm": ranked["lpm"]["ttft_p50_s"] / ranked[QA]["ttft_p50_s"],
                          "lpm_ranking_ttft_p50_vs_fcfs": ranked[FCFS]["ttft_p50_s"] / ranked[QA]["ttft_p50_s"]})
    fanout = [{"profile": r["profile"],
               "kvflow_qa_vs_kvflow": r["results"]["kvflow"]["latency_s"] / r["results"]["kvflow-qa"]["latency_s"]}
              for r in rows if r["workload"] == "fanout"]
    starvation = [{"profile": r["profile"], "workload": r["workload"], "policy": p,
                   "max_wait_vs_fcfs_p99_wait": r["results"][p]["max_wait_s"] / r["results"][FCFS]["wait_p99_s"]}
                  for r in rows for p in ("queue-aware", "kvflow-qa") if r["results"][FCFS]["wait_p99_s"] > 0]
    control = []
    for r in rows:
        if r["workload"] == "control":
            fcfs, qa = r["results"][FCFS], r["results"]["queue-aware"]
            deviation = max(abs(qa[k] / fcfs[k] - 1) for k in ("latency_s", "ttft_p50_s", "ttft_p99_s", "max_wait_s",
                                                               "output_tokens_per_s") if fcfs[k])
            deviation = max(deviation, abs(qa["hit_ratio"] - fcfs["hit_ratio"]))
            control.append({"profile": r["profile"], "max_relative_deviation": deviation})
    return {"knee": knees, "fanout": fanout, "starvation": starvation,
            "worst_starvation": max((s["max_wait_vs_fcfs_p99_wait"] for s in starvation), default=None),
            "control": control}


def ablation_rows(profiles: list[str], quick: bool, bar: tqdm) -> list[dict[str, Any]]:
    """queue-aware with other bounds on the cold shared tokens its pioneers compute at once."""
    rows = []
    for budget in PIONEER_BUDGETS:
        name = f"queue-aware@{budget or 'unbounded'}"
        ADMISSION.register(name, lambda context, b=budget: QueueAwareAdmission(
            context.tree, context.clock, pioneer_tokens=b or 1 << 60))
        register_policy(PolicyConfig(name, "demand-lru", host_tier=True, prefetch="none", admission=name))
        for profile in profiles:
            for prompts in [16] if quick else BURST_PROMPTS:
                bar.set_description(f"ablation {profile[:4]} {name} x{prompts}")
                r = run_policies(workload.burst(prompts=prompts), load_profile(profile), [name])["results"][name]
                rows.append({"pioneer_tokens": budget, "profile": profile, "prompts": prompts,
                             "ttft_p50_s": r["ttft_p50_s"], "max_wait_s": r["max_wait_s"]})
                bar.update()
    return rows


class QueueAwareLoadsWhenAdmitted(QueueAwareAdmission):
    """queue-aware whose queued requests do not start their host -> device loads (nor lock and
    reserve memory for them) before they are admitted."""

    loads_while_queued = False


def queued_loads_rows(profiles: list[str], bar: tqdm) -> list[dict[str, Any]]:
    name = "queue-aware@loads-when-admitted"
    ADMISSION.register(name, lambda context: QueueAwareLoadsWhenAdmitted(context.tree, context.clock))
    register_policy(PolicyConfig(name, "demand-lru", host_tier=True, prefetch="none", admission=name))
    rows = []
    for profile in profiles:
        bar.set_description(f"ablation {profile[:4]} fleet burst {name}")
        scenario = workload.fleet(tenants=8, apps=2, clients=64, rate=64.0)
        out = run_policies(scenario, load_profile(profile), [FCFS, "lpm", QA, name])["results"]
        rows.append({"profile": profile, "results": {p: measure(scenario, out[p]) for p in out}})
        bar.update()
    return rows


def decision_cost(policy: str, queued: int, decisions: int) -> dict[str, float]:
    """One admission decision of `policy` with `queued` requests waiting: its order and the scheduler's
    first pick, on a cache holding half of 50 shared 2,048-token prompts (four in five requests share
    one); p50/p99 over `decisions` decisions, each after one arrival and one departure."""
    rng = random.Random(0)
    systems = [tuple(rng.randrange(1 << 20) for _ in range(2048)) for _ in range(50)]
    cache = TieredCache(1 << 30, EVICTION.create("lru"))
    for prompt in systems[:25]:
        cache.alloc(len(prompt))
        cache.commit(prompt, len(prompt))
    admission = ADMISSION.create(policy, PolicyContext(tree=cache.tree, clock=time.monotonic))
    waiting = []
    for i in range(queued):
        shared = systems[rng.randrange(50)] if i % 5 else ()
        admission.arrived(i, "", shared + tuple(rng.randrange(1 << 20) for _ in range(64)))
        waiting.append(i)
    next(iter(admission.order(waiting, waiting)), None)  # the first walk covers every prefix
    times = []
    for k in range(decisions):
        admission.arrived(queued + k, "", systems[k % 50] + (k,))
        waiting.append(queued + k)
        started = time.perf_counter()
        next(iter(admission.order(waiting, waiting)), None)
        times.append(time.perf_counter() - started)
        admission.done(waiting.pop(0))
    return {"p50_ms": percentile(times, 0.5) * 1e3, "p99_ms": percentile(times, 0.99) * 1e3}


def cost_rows(quick: bool) -> list[dict[str, Any]]:
    return [{"policy": name, "queue": size, **decision_cost(name, size, 50 if quick else 200)}
            for size in ([100, 1000] if quick else [100, 1000, 10_000]) for name in (QA, "lpm")]


def cpu_rows(quick: bool) -> list[dict[str, Any]]:
    from kvflow_ray.engines.cpu.bench import policy_progress, run_cpu_policies
    from kvflow_ray.engines.cpu.config import CpuEngineConfig

    rows = []
    shapes = [("burst", workload.burst(requests=24 if quick else 48, prompts=16, system=1024, question=32,
                                       output=8)),
              ("fanout", workload.fanout(workers=8, clients=2 if quick else 4, fixed=1024, dynamic=32, output=8,
                                         iterations=1))]
    for name, scenario in shapes:
        with policy_progress(f"cpu {name}") as progress:
            out = run_cpu_policies(scenario, CpuEngineConfig(), POLICIES, progress=progress)["results"]
        rows.append({"workload": name, "params": scenario.params,
                     "results": {p: measure(scenario, out[p]) for p in POLICIES}})
    return rows


def tables(report: dict[str, Any]) -> str:
    lines = ["simulator: TTFT p50 / p99 (s), longest wait (s), hit ratio, output tokens/s, "
             "mean workflow latency (s)"]
    for row in report["sim"]:
        extra = (f" (working set {row['working_set_per_pool']:.1f}x the pool)" if "working_set_per_pool" in row
                 else "")
        params = ", ".join(f"{k} {row[k]}" for k in ("requests", "prompts", "workers", "clients") if k in row)
        lines.append(f"{row['profile']} {row['workload']} ({params}){extra}")
        for p, r in row["results"].items():
            lines.append(f"  {p:>13} ttft {r['ttft_p50_s']:7.2f} / {r['ttft_p99_s']:7.2f}  "
                         f"wait max {r['max_wait_s']:7.2f}  hit {r['hit_ratio']:.3f}  "
                         f"{r['output_tokens_per_s']:7.1f} tok/s  latency {r['latency_s']:7.2f}")
    s = report["summary"]
    for k in s["knee"]:
        lines.append(f"knee {k['profile']} ({k['prompts']} prompts, working set {k['working_set_per_pool']:.1f}x the "
                     f"pool): queue-aware TTFT p50 {k['ttft_p50_vs_fcfs']:.2f}x over FCFS, {k['ttft_p50_vs_lpm']:.2f}x "
                     f"over lpm (256 waiting: lpm is FCFS); with {LPM_RANKS} (lpm ranking): "
                     f"{k['lpm_ranking_ttft_p50_vs_fcfs']:.2f}x over FCFS, "
                     f"{k['lpm_ranking_ttft_p50_vs_lpm']:.2f}x over lpm")
    for f in s["fanout"]:
        lines.append(f"fanout {f['profile']}: kvflow-qa {f['kvflow_qa_vs_kvflow']:.2f}x over kvflow (workflow latency)")
    worst = max(s["starvation"], key=lambda x: x["max_wait_vs_fcfs_p99_wait"])
    lines.append(f"starvation: longest wait / FCFS p99 wait at most {s['worst_starvation']:.2f} "
                 f"({worst['policy']}, {worst['profile']} {worst['workload']})")
    for c in s["control"]:
        lines.append(f"control {c['profile']}: queue-aware within {c['max_relative_deviation']:.2%} of FCFS "
                     "on every metric")
    for c in report["cost"]:
        lines.append(f"cost {c['policy']:>11}: one decision over {c['queue']:>6} queued: p50 {c['p50_ms']:.3f} ms, "
                     f"p99 {c['p99_ms']:.3f} ms")
    by_budget: dict[Any, list[float]] = {}
    for a in report["ablation"]:
        by_budget.setdefault(a["pioneer_tokens"], []).append(a["ttft_p50_s"])
    for budget, values in by_budget.items():
        lines.append(f"ablation pioneer_tokens {budget or 'unbounded'}: burst TTFT p50 geomean "
                     f"{math.exp(statistics.fmean(math.log(v) for v in values)):.2f} s")
    for row in report["queued_loads_ablation"]:
        r = row["results"]
        lines.append(f"ablation fleet burst {row['profile']}: TTFT p50 / latency / longest wait (s): " + ", ".join(
            f"{p} {x['ttft_p50_s']:.1f} / {x['latency_s']:.1f} / {x['max_wait_s']:.0f}" for p, x in r.items())
            + f"; FCFS p99 wait {r[FCFS]['wait_p99_s']:.0f}")
    for row in report["cpu"]:
        lines.append(f"cpu {row['workload']}: " + ", ".join(
            f"{p} ttft p50 {r['ttft_p50_s']:.2f} s / latency {r['latency_s']:.2f} s"
            for p, r in row["results"].items()))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["sim"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.1), 4.5))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        ax.bar([x + i * width for x in range(len(rows))],
               [r["results"][FCFS]["ttft_p50_s"] / r["results"][policy]["ttft_p50_s"] for r in rows], width,
               label=policy)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([f"{r['profile'][:4]} {r['workload']}" + (f" {r['prompts']}p" if "prompts" in r else "")
                        for r in rows], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("TTFT p50 speedup over FCFS")
    ax.set_title("queue-aware prefix scheduling: every policy on the same workload", fontsize=10)
    ax.legend(fontsize=7)
    results_file.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = results_file.parser(__doc__, "queue_aware", "the knee burst only, A10G only, small cost sizes (a smoke run)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU engine runs (about 2 minutes)")
    args = ap.parse_args(argv)
    profiles = PROFILES[:1] if args.quick else PROFILES
    results_file.require("matplotlib")
    out = args.out
    started = time.perf_counter()
    bursts = 1 if args.quick else len(BURST_PROMPTS)
    runs = len(profiles) * (bursts + 5) + len(PIONEER_BUDGETS) * len(profiles) * bursts
    with tqdm(total=runs, disable=args.no_progress, file=sys.stderr, unit="run") as bar:
        sim = sim_rows(profiles, args.quick, bar)
        ablation = ablation_rows(profiles, args.quick, bar)
        queued_loads = queued_loads_rows(profiles, bar)
    cost = cost_rows(args.quick)
    cpu = [] if args.no_cpu else cpu_rows(args.quick)
    report = {"generated_by": "python benchmarks/queue_aware.py" + (" --quick" if args.quick else "")
              + (" --no-cpu" if args.no_cpu else ""),
              "machine": results_file.machine(), "wall_s": time.perf_counter() - started, "sim": sim,
              "summary": ratios(sim), "ablation": ablation, "queued_loads_ablation": queued_loads, "cost": cost,
              "cpu": cpu}
    print(tables(report))
    results_file.write(out, "queue_aware", report, lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
