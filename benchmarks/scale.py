"""How the policy brain's cost grows with the fleet: per-decision work should grow with what changed,
not with everything. Pure Python, no Ray, one process; lru and kvflow side by side in one run.

1. eviction: one `TieredCache.make_room` decision (evicting one leaf, right after one workflow's
   steps changed) vs device leaves (1k, 10k, 100k), with the incremental eviction index and with a
   full rescan of every device leaf (what the cache did before the index; too slow past 10k); 10
   leaves per workflow (agents' prompt tails), and 100 at 100k leaves to show a big workflow's re-rank.
2. prefetch: planning after one hint (one workflow's steps change) vs live workflows (100, 1k, 10k),
   through `PrefetchCandidates` (what the scheduler uses) and straight over the step book (before).
3. simulator: wall time of the concurrent scenario (every workflow a 10-agent loop, 1,024-token
   prompts, 4 passes) vs workflows (30 → 1,000) on 8 replicas and vs replicas (1 → 64), up to
   10,000 workflows on 64 replicas, lru and kvflow.
4. router: `RouterCore` start+end pairs/s and `finish_client` p99 vs live clients (1k → 100k) on 8
   replicas, vs replicas (2 → 32) at 10k clients, and at 100k clients × 32 replicas (no Ray; the
   in-process store behind the write queue the router actor uses, flushed, and every replica's merged
   hints pulled, once per 100 pairs, as the actor's maintenance task and batched wakeups do when
   serving; that work is timed too).
5. admission: one queue-aware admission decision (its order over the waiting queue and the first
   pick, after one arrival) vs queued requests (100, 1k, 10k): `queue_aware.decision_cost`.

Run: python benchmarks/scale.py [--quick] [--out DIR]. Progress on stderr, a table on stdout, JSON
and a log-log plot (cost vs size) in DIR (default benchmarks/out, which git ignores; the committed
figures come from --out benchmarks/results).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import queue_aware  # the admission decision's cost, measured as that benchmark does
import results_file
from tqdm import tqdm

from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.policies import StepBook, make_eviction_policy
from kvflow_ray.core.prefetch import PrefetchCandidates, StepsAheadPrefetch, plan_prefetch
from kvflow_ray.core.stats import percentile
from kvflow_ray.engines.base import CacheEvent
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import simulate
from kvflow_ray.router.core import RouterCore
from kvflow_ray.router.store import BufferedStore, MemoryStore

PAGE = 16  # tokens per leaf


def _percentiles(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(samples, 0.5) * 1e3, "p99_ms": percentile(samples, 0.99) * 1e3}


# ---------------------------------------------------------------------------------------------- 1. eviction
def eviction(policy: str, leaves: int, *, index: bool, decisions: int, per_workflow: int = 10) -> dict[str, float]:
    """`leaves` device leaves under a shared 32-token preamble, `per_workflow` of them tagged by each
    workflow (one agent prompt's tail each); each decision follows one workflow's steps update (whose
    leaves it re-ranks) and evicts one leaf (a new one replaces it)."""
    book = StepBook()
    cache = TieredCache(leaves * PAGE + 64, make_eviction_policy(policy, book), cpu_capacity=0)
    if not index:
        cache.index = None
    rng = random.Random(0)
    preamble = tuple(range(100_000, 100_032))
    workflows = max(1, leaves // per_workflow)
    for i in range(leaves):
        seq = preamble + (i,) * PAGE
        new = len(seq) if i == 0 else PAGE
        cache.alloc(new)
        cache.commit(seq, new)
        cache.tree.tag_prefix(seq, (f"w{i % workflows}", f"a{i}"))
    for w in range(workflows):
        book.set_steps(f"w{w}", {f"a{i}": rng.choice([0, 1, 2, 3]) for i in range(w, leaves, workflows)})
    cache.make_room(cache.free_tokens + PAGE)  # the first decision builds the index
    times = []
    for k in range(decisions):
        w = rng.randrange(workflows)
        book.set_steps(f"w{w}", {f"a{i}": rng.choice([0, 1, 2, 3]) for i in range(w, leaves, workflows)})
        started = time.perf_counter()
        cache.make_room(cache.free_tokens + PAGE)
        times.append(time.perf_counter() - started)
        seq = preamble + (leaves + k,) * PAGE
        cache.alloc(PAGE)
        cache.commit(seq, PAGE)
    return _percentiles(times)


# ---------------------------------------------------------------------------------------------- 2. prefetch
def prefetch(live: int, *, candidates: bool, hints: int) -> dict[str, float]:
    """`live` workflows of 4 agents, 2 near execution each; 1 in 8 has its prompts cached here (on the
    device), the rest live on other replicas. Each hint moves one workflow one step; planning follows."""
    book = StepBook()
    cache = TieredCache(1 << 22, make_eviction_policy("kvflow", book), cpu_capacity=1 << 22, host_tier=True)
    rng = random.Random(1)
    for w in range(live):
        for a in range(4):
            prompt = (w, a, *range(62))
            book.register_prompt((f"w{w}", f"a{a}"), prompt)
            if w % 8 == 0:
                cache.alloc(len(prompt))
                cache.commit(prompt, len(prompt))
        book.set_steps(f"w{w}", {f"a{a}": float((a - w) % 4) for a in range(4)})
    policy = StepsAheadPrefetch(horizon=1, max_inflight=4)
    source = PrefetchCandidates(book, cache.tree) if candidates else book
    if isinstance(source, PrefetchCandidates):  # the first plan looks every agent up once
        source.refresh()
    plan_prefetch(cache, policy, source, 0)
    times = []
    for k in range(hints):
        w = rng.randrange(live)
        book.set_steps(f"w{w}", {f"a{a}": float((a - w - k) % 4) for a in range(4)})
        started = time.perf_counter()
        if isinstance(source, PrefetchCandidates):
            source.refresh()
        plan_prefetch(cache, policy, source, 0)
        times.append(time.perf_counter() - started)
    return _percentiles(times)


# ---------------------------------------------------------------------------------------------- 3. simulator
def simulator(policy: str, tasks: int, replicas: int) -> dict[str, float]:
    started = time.perf_counter()
    result, _sim = simulate(workload.concurrent(tasks=tasks, fixed=1024), load_profile("a10g-llama3.1-8b"), policy,
                            replicas=replicas)
    return {"wall_s": time.perf_counter() - started, "latency_s": result["latency_s"]}


# ---------------------------------------------------------------------------------------------- 4. router
SPEC = {"name": "loop", "entry": "planner", "agents": {
    "planner": {"prompt": "You plan.", "after": ["reviewer"]}, "executor": {"prompt": "You do.", "after": ["planner"]},
    "reviewer": {"prompt": "You check.", "after": ["executor"]}}}
AGENTS = ("planner", "executor", "reviewer")


def router(clients: int, replicas: int, *, pairs: int) -> dict[str, float]:
    store = BufferedStore(MemoryStore(ttl_s=3600))  # as the router actor runs it: writes queue, a task flushes
    core = RouterCore(store)
    for r in range(replicas):
        core.add_replica(f"r{r}")
        core.cache_events(f"r{r}", [CacheEvent("stored", "gpu", f"p{a}-{r}", 64) for a in AGENTS])
    tenants = [f"t{t}" for t in range(-(-clients // 5000))]  # within each tenant's live-client limit
    for tenant in tenants:
        core.put_template(tenant, SPEC)

    def tenant(c: int) -> str:
        return tenants[c % len(tenants)]

    for c in range(clients):
        route = core.start_call(tenant(c), f"c{c}", "planner", workflow="loop",
                                prefix_hash=f"pplanner-{c % replicas}", prefix_tokens=64)
        core.end_call(tenant(c), f"c{c}", "planner", route.replica)
        if c % 1000 == 999:
            store.flush()
    store.flush()
    for r in range(replicas):
        core.take_hints(f"r{r}")
    rng = random.Random(2)
    step = dict(zip(AGENTS, AGENTS[1:] + AGENTS[:1], strict=True))
    current = {c: "planner" for c in range(clients)}
    started = time.perf_counter()
    for i in range(pairs):
        c = rng.randrange(clients)
        agent = current[c] = step[current[c]]
        route = core.start_call(tenant(c), f"c{c}", agent, prefix_hash=f"p{agent}-{c % replicas}", prefix_tokens=64)
        core.end_call(tenant(c), f"c{c}", agent, route.replica)
        if i % 100 == 99:  # the actor's periodic work, batched as when serving: flush the store's latest
            store.flush()  # writes, the replicas pull their merged hints
            for r in range(replicas):
                core.take_hints(f"r{r}")
    elapsed = time.perf_counter() - started
    finish = []
    for c in rng.sample(range(clients), min(clients, 500)):
        t = time.perf_counter()
        core.finish_client(tenant(c), f"c{c}")
        finish.append(time.perf_counter() - t)
    return {"pairs_per_s": pairs / elapsed, **{f"finish_{k}": v for k, v in _percentiles(finish).items()}}


# ---------------------------------------------------------------------------------------------- running
def grid(quick: bool) -> list[tuple[str, dict[str, Any], Callable[[], dict[str, float]]]]:
    runs: list[tuple[str, dict[str, Any], Callable[[], dict[str, float]]]] = []
    decisions = 50 if quick else 300
    for leaves in ((1000, 10_000) if quick else (1000, 10_000, 100_000)):
        for policy in ("lru", "kvflow"):
            runs.append(("eviction", {"policy": policy, "leaves": leaves, "index": True},
                         lambda p=policy, n=leaves: eviction(p, n, index=True, decisions=decisions)))
            if leaves <= 10_000:
                runs.append(("eviction", {"policy": policy, "leaves": leaves, "index": False},
                             lambda p=policy, n=leaves: eviction(p, n, index=False, decisions=decisions)))
            elif policy == "kvflow":
                runs.append(("eviction", {"policy": policy, "leaves": leaves, "index": True, "per_workflow": 100},
                             lambda n=leaves: eviction("kvflow", n, index=True, decisions=decisions, per_workflow=100)))
    for live in ((100, 1000) if quick else (100, 1000, 10_000)):
        for candidates in (True, False):
            runs.append(("prefetch", {"live_workflows": live, "candidates": candidates},
                         lambda n=live, c=candidates: prefetch(n, candidates=c, hints=50 if quick else 300)))
    sims = [(30, 8)] if quick else [(30, 8), (100, 8), (300, 8), (1000, 8), (100, 1), (100, 64), (1000, 64),
                                    (10_000, 64)]
    for tasks, replicas in sims:
        for policy in ("lru", "kvflow"):
            runs.append(("simulator", {"policy": policy, "workflows": tasks, "replicas": replicas},
                         lambda p=policy, t=tasks, r=replicas: simulator(p, t, r)))
    for queued in ((100, 1000) if quick else (100, 1000, 10_000)):
        runs.append(("admission", {"policy": "queue-aware", "queued": queued},
                     lambda n=queued: queue_aware.decision_cost("queue-aware", n, 50 if quick else 300)))
    router_grid = ([(1000, 8)] if quick else
                   [(1000, 8), (10_000, 8), (100_000, 8), (10_000, 2), (10_000, 32), (100_000, 32)])
    for clients, replicas in router_grid:
        runs.append(("router", {"clients": clients, "replicas": replicas},
                     lambda c=clients, r=replicas: router(c, r, pairs=500 if quick else 20_000)))
    return runs


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        params = " ".join(f"{k}={v}" for k, v in row["params"].items())
        values = " ".join(f"{k}={v:.4g}" for k, v in row["result"].items())
        lines.append(f"{row['bench']:<10} {params:<48} {values}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    panels = [("eviction", "leaves", "p99_ms", ("policy", "index"), "eviction decision p99 (ms)"),
              ("prefetch", "live_workflows", "p99_ms", ("candidates",), "prefetch plan per hint p99 (ms)"),
              ("simulator", "workflows", "wall_s", ("policy",), "simulator wall (s), 8 replicas"),
              ("router", "clients", "finish_p99_ms", (), "router finish p99 (ms), 8 replicas"),
              ("admission", "queued", "p99_ms", ("policy",), "admission decision p99 (ms)")]
    for ax, (bench, x, y, series, title) in zip(axes, panels, strict=True):
        groups: dict[str, list[tuple[float, float]]] = {}
        for row in rows:
            p = row["params"]
            if row["bench"] != bench or (bench in ("simulator", "router") and p.get("replicas") != 8):
                continue
            if "per_workflow" in p:  # the big-workflow point is in the table, not on the lines
                continue
            label = ", ".join(f"{k}={p[k]}" for k in series) or bench
            groups.setdefault(label, []).append((p[x], row["result"][y]))
        for label, points in groups.items():
            points.sort()
            ax.plot([a for a, _ in points], [b for _, b in points], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    results_file.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = results_file.parser(__doc__, "scale", "small sizes only (a smoke run, about 20 s)")
    args = ap.parse_args(argv)
    results_file.require("matplotlib")
    out = args.out
    runs = grid(args.quick)
    rows = []
    with tqdm(total=len(runs), disable=args.no_progress, file=sys.stderr, unit="run") as bar:
        for bench, params, fn in runs:
            bar.set_description(f"{bench} {params}")
            rows.append({"bench": bench, "params": params, "result": fn()})
            bar.update()
    print(table(rows))
    report = {"generated_by": "python benchmarks/scale.py" + (" --quick" if args.quick else ""),
              "machine": results_file.machine(), "rows": rows}
    results_file.write(out, "scale", report, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
