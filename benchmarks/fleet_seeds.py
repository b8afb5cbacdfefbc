"""The memory-bound points of benchmarks/fleet.py over several seeds: how far the workflow router is from
the best peer router on the same kvflow engines (K, the term of issue 29's target T that asks for a 3%
lead), and what memory costs each router.

`fleet.py` runs each point once (seed 0), and one run of a point moves by a percent or two with the
seed. Here every point is run with seeds 0..N-1, the workflow router and the locality-keeping peer
routers (ray-prefix, sglang-cache-aware, dynamo-kv, llmd-precise; pow2 and round-robin are 2-3x slower
at every point of fleet.py), each on kvflow engines and with no capacity limit (`infinite`), and the
workflow router once more with no capacity limit and its memory-bound rule forced on
(`workflow:sticky_pressure=0`: with no device limit it measures no pressure and would balance instead),
which is its placement alone. Per point it prints:
- ours / K per seed, with K the best peer router of that seed, their mean and how many seeds meet
  0.97 x K;
- what memory costs each router: its latency on kvflow engines over the no-capacity bound B (the lowest
  `infinite` latency over these routers, ours with its placement forced included), the mean over seeds;
- our placement alone against B.

Run: python benchmarks/fleet_seeds.py [--quick] [--seeds 5] [--replicas 8] [--jobs 2] [--out DIR]. Progress on
stderr, tables on stdout, fleet_seeds.json and fleet_seeds.png (ours / K per seed at each point) in DIR.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import fleet
import results_file
from tqdm import tqdm

OURS = "workflow"
PLACEMENT = "workflow:sticky_pressure=0"  # the workflow router's memory-bound placement, with no capacity limit
PEERS = ["ray-prefix", "sglang-cache-aware", "dynamo-kv", "llmd-precise"]
POLICY = "kvflow"
LEAD = fleet.LEAD  # T asks for at most this x K (where B + 0.3 (N - B) and 1.01 B are not the binding terms)


def points(replicas: list[int], quick: bool) -> list[dict[str, Any]]:
    """fleet.py's pressure points at pressure >= 2 (where its target applies)."""
    return [{**point, "section": "seeds"} for point in fleet.pressure_sweep(replicas, None, quick)
            if point["pressure"] >= 2]


def jobs(pts: list[dict[str, Any]], seeds: list[int]) -> list[tuple[dict[str, Any], str, str, int]]:
    runs = [(policy, routing) for routing in [OURS, *PEERS] for policy in (POLICY, fleet.BOUND)]
    runs.append((fleet.BOUND, PLACEMENT))
    return [(point, policy, routing, seed) for point in pts for seed in seeds for policy, routing in runs]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point and seed: ours / K, each router over the bound B, our placement alone over B."""
    out = []
    keys = sorted({(r["replicas"], r["regime"], r["pressure"]) for r in rows})
    for replicas, regime, pressure in keys:
        here = [r for r in rows if (r["replicas"], r["regime"], r["pressure"]) == (replicas, regime, pressure)]
        seeds = sorted({r["seed"] for r in here})
        latency = {(r["seed"], r["policy"], r["routing"]): r["latency_s"] for r in here}
        bound = {seed: min(latency[seed, fleet.BOUND, routing] for routing in [OURS, *PEERS, PLACEMENT])
                 for seed in seeds}
        ratios = [latency[seed, POLICY, OURS] / min(latency[seed, POLICY, peer] for peer in PEERS) for seed in seeds]
        placement = [latency[seed, fleet.BOUND, PLACEMENT] / bound[seed] for seed in seeds]
        memory = {routing: statistics.mean(latency[seed, POLICY, routing] / bound[seed] for seed in seeds)
                  for routing in [OURS, *PEERS]}
        out.append({"replicas": replicas, "regime": regime, "pressure": pressure, "rate": here[0]["rate"],
                    "seeds": seeds, "ours_over_k": ratios, "mean_ours_over_k": statistics.mean(ratios),
                    "seeds_within_lead": sum(x <= LEAD for x in ratios), "memory_cost": memory,
                    "placement_over_b": placement, "mean_placement_over_b": statistics.mean(placement)})
    return out


def table(entries: list[dict[str, Any]]) -> str:
    lines = [f"workflow router + {POLICY} against K (the best peer router on {POLICY} engines, per seed); memory's "
             f"cost: each router on {POLICY} / B (the no-capacity bound), mean over seeds; our placement alone / B",
             f"{'replicas':>8} {'regime':<10} {'pressure':>8} | {'ours / K per seed':<36} {'mean':>6} "
             f"{'<=' + str(LEAD):>6} | memory's cost: " + " ".join(f"{r:>18}" for r in [OURS, *PEERS])
             + " | placement / B"]
    for e in entries:
        per_seed = " ".join(f"{x:.3f}" for x in e["ours_over_k"])
        lines.append(f"{e['replicas']:>8} {e['regime']:<10} {e['pressure']:>8g} | {per_seed:<36} "
                     f"{e['mean_ours_over_k']:6.3f} {e['seeds_within_lead']:>3}/{len(e['seeds']):<2} | "
                     + " ".join(f"{e['memory_cost'][r]:>18.3f}" for r in [OURS, *PEERS])
                     + f" | {e['mean_placement_over_b']:.3f}")
    ratios = [x for e in entries for x in e["ours_over_k"]]
    if ratios:
        lines.append(f"over every point and seed: ours / K {statistics.mean(ratios):.3f} "
                     f"(range {min(ratios):.3f}-{max(ratios):.3f}), {sum(x <= LEAD for x in ratios)} of {len(ratios)} "
                     f"runs within {LEAD} x K")
    return "\n".join(lines)


def plot(entries: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{e['replicas']}x {e['regime']}\np{e['pressure']:g}" for e in entries]
    for i, e in enumerate(entries):
        ax.scatter([i] * len(e["ours_over_k"]), e["ours_over_k"], color="tab:blue", s=18)
        ax.scatter([i], [e["mean_ours_over_k"]], color="black", marker="_", s=300)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(LEAD, color="tab:red", lw=0.8, ls="--", label=f"{LEAD} x K (issue 29's lead)")
    ax.set_xticks(range(len(entries)), labels, fontsize=8)
    ax.set_ylabel("workflow router / best peer router\n(mean workflow latency, kvflow engines)")
    ax.legend(fontsize=8)
    results_file.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = results_file.parser(__doc__, "fleet_seeds", "one point (8 replicas, pressure 2 past the knee, 64 "
                                                      "instances), two seeds (a smoke run)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per point")
    ap.add_argument("--replicas", default="8", help="comma-separated replica counts (fleet.py's points at each)")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run at once, one process each (one per core)")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    results_file.require("matplotlib")
    seeds = list(range(2 if args.quick else args.seeds))
    pts = points([8] if args.quick else [int(r) for r in args.replicas.split(",")], args.quick)
    todo = jobs(pts, seeds)
    started = time.perf_counter()
    with tqdm(total=len(todo), disable=args.no_progress, file=sys.stderr, unit="run") as bar:
        rows = [{**row, "seed": job[3]} for job, row in zip(todo, fleet.run_all(todo, args.jobs, bar), strict=True)]
    entries = summary(rows)
    command = "python benchmarks/fleet_seeds.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"generated_by": command,
              "machine": results_file.machine(), "profile": fleet.PROFILE, "wall_s": time.perf_counter() - started,
              "runs": rows, "points": entries}
    print(table(entries))
    results_file.write(args.out, "fleet_seeds", report, lambda path: plot(entries, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
