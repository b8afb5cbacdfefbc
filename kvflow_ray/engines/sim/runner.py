"""Run one scenario under several policies side by side and summarise them (docs/design.md §8 JSON)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from kvflow_ray.core.kv_budget import DEFAULT_SCORER, KvBudget
from kvflow_ray.core.radix import Tag
from kvflow_ray.core.routing import parse_routing
from kvflow_ray.core.scheduler import POLICIES, ReplicaStats, resolve_policy
from kvflow_ray.core.sessions import PauseStats
from kvflow_ray.core.stats import percentile
from kvflow_ray.engines.sim.agentic import SessionClient, largest_need, live_tokens_mean
from kvflow_ray.engines.sim.profile import Profile
from kvflow_ray.engines.sim.simulator import IterationRecord, Simulation
from kvflow_ray.engines.sim.workload import Scenario


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError("--policies: give at least one policy")
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    return list(dict.fromkeys(names))


def parse_routings(text: str) -> list[str]:
    """Comma-separated routing policies, each `name` or `name:option=value...` (`parse_routing`)."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names:
        raise ValueError("--routing: give at least one routing policy")
    for name in names:
        try:
            parse_routing(name)
        except ValueError as exc:
            raise ValueError(f"--routing: {exc}") from None
    return list(dict.fromkeys(names))


def simulate(scenario: Scenario, profile: Profile, policy: str, *, replicas: int = 1, horizon: int = 1,
             max_inflight: int = 4, future: list[Tag] | None = None,
             gpu_capacity: int | None = None, routing: str | None = None,
             seed: int = 0, kv_budget: KvBudget | None = None,
             kv_scorer: str = DEFAULT_SCORER) -> tuple[dict[str, Any], Simulation]:
    sim = Simulation(profile, resolve_policy(policy), replicas=replicas, horizon=horizon, max_inflight=max_inflight,
                     future=future, gpu_capacity=gpu_capacity, routing=routing, seed=seed, kv_budget=kv_budget,
                     kv_scorer=kv_scorer)
    for plan in scenario.plans:
        sim.add_client(plan)
    for session in scenario.sessions:
        client = SessionClient(sim, session, sim.tokens)
        sim.at(session.start_at, client.begin)
    sim.run()
    return summarise(sim), sim


def pressure_capacity(scenario: Scenario, profile: Profile, replicas: int) -> tuple[int, float]:
    """The device pool per replica at which the sessions' live histories (time-averaged, measured in a
    run without capacity limit) are `pressure` times the fleet's device KV; never below what one turn
    needs. Returns (pool tokens, live tokens)."""
    _result, ref = simulate(scenario, profile, "infinite", replicas=replicas)
    live = live_tokens_mean(ref.live_log)
    pressure = float(scenario.params["pressure"])  # type: ignore[arg-type]
    return max(int(live / (pressure * replicas)), largest_need(scenario.sessions) + 1), live


def summarise(sim: Simulation) -> dict[str, Any]:
    result = summarise_run(sim.iterations, [r.stats for r in sim.replicas], sim.now,
                           None if sim.policy.infinite else sim.replicas[0].cache.gpu_capacity)
    if sim.router is not None:
        result.update(fleet_measures(sim))
    if sim.live_log:
        result["pauses"] = pause_measures([r.scheduler.sessions.stats for r in sim.replicas])
    return result


def pause_measures(stats: Sequence[PauseStats]) -> dict[str, float]:
    """Agent sessions' pause predictions against the pauses' true lengths, over every replica."""
    pauses = sum(s.pauses for s in stats)
    errors = [e for s in stats for e in s.errors]
    return {"pauses": pauses,
            "mean_abs_error_s": sum(s.abs_error_s for s in stats) / pauses if pauses else 0.0,
            "p90_abs_error_s": percentile(errors, 0.9, 0.0),
            "mean_signed_error_s": sum(s.signed_error_s for s in stats) / pauses if pauses else 0.0,
            # prefetch due (started) before the client came back, and after it (too late)
            "prefetch_due_early": sum(s.due_before_return for s in stats),
            "prefetch_due_late": sum(s.due_after_return for s in stats),
            # where the history was when the client came back (`PauseStats.returned`)
            "history_at_return": {where: sum(s.returned[where] for s in stats) for where in ("ready", "loading",
                                                                                         "missed")}}


def fleet_measures(sim: Simulation) -> dict[str, Any]:
    """What a routing comparison adds: time to first token, output throughput, how evenly the
    replicas worked (max / mean compute time), and the router's decisions."""
    ttfts = [t for r in sim.replicas for t in r.stats.ttfts]
    busy = [r.busy_s for r in sim.replicas]
    assert sim.router is not None
    core = sim.router.core
    decisions, policy = list(core.decision_seconds), list(core.policy_seconds)
    return {
        "ttft_p90_s": percentile(ttfts, 0.9, 0.0),
        "output_tokens_per_s": sum(r.output_tokens for r in sim.replicas) / sim.now if sim.now else 0.0,
        "imbalance": max(busy) / statistics.fmean(busy) if any(busy) else 1.0,
        "routing": {"decisions": dict(core.decisions), "decision_p50_ms": percentile(decisions, 0.5, 0.0) * 1e3,
                    "decision_p99_ms": percentile(decisions, 0.99, 0.0) * 1e3,
                    # the policy's own `route` (the rest of a decision is the router's bookkeeping and hints)
                    "policy_p50_ms": percentile(policy, 0.5, 0.0) * 1e3,
                    "policy_p99_ms": percentile(policy, 0.99, 0.0) * 1e3},
    }


def summarise_run(iterations: Sequence[IterationRecord], stats: Sequence[ReplicaStats], makespan: float,
                  device_kv_tokens: int | None) -> dict[str, Any]:
    """The docs/design.md §8 result of one policy's run, from any engine."""
    measured = [it.latency for it in iterations if it.measured]
    gpu = sum(s.gpu_tokens for s in stats)
    cpu = sum(s.cpu_tokens for s in stats)
    miss = sum(s.miss_tokens for s in stats)
    total = gpu + cpu + miss
    ttfts = [t for s in stats for t in s.ttfts]
    return {
        "latency_s": statistics.fmean(measured) if measured else 0.0,
        "p99_latency_s": percentile(measured, 0.99, 0.0),
        "gpu_hit_ratio": gpu / total if total else 0.0,
        "cpu_hit_ratio": cpu / total if total else 0.0,
        "recomputed_tokens": miss,
        "loaded_tokens": sum(s.loaded_tokens for s in stats),
        # mean per measured workflow pass of the time its requests waited on KV loading
        "prefetch_stall_s": sum(s.stall_s for s in stats) / len(measured) if measured else 0.0,
        "makespan_s": makespan,
        "workflows_measured": len(measured),
        "prefetch_issued": sum(s.prefetch.issued for s in stats),
        # a prefetch is used once a request's cached prefix includes it, wasted if it left the device first
        "prefetch_used": sum(s.prefetch.used for s in stats),
        "prefetch_wasted": sum(s.prefetch.wasted for s in stats),
        "device_kv_tokens": device_kv_tokens,
        # every measured request's time to first token, and its time in the waiting queue
        "ttft_p50_s": percentile(ttfts, 0.5, 0.0),
        "ttft_p99_s": percentile(ttfts, 0.99, 0.0),
        "wait_p99_s": percentile([w for s in stats for w in s.waits], 0.99, 0.0),
        "max_wait_s": max((s.max_wait_s for s in stats), default=0.0),
    }


def run_policies(scenario: Scenario, profile: Profile, policies: list[str], *, replicas: int = 1,
                 horizon: int = 1, max_inflight: int = 4, gpu_capacity: int | None = None,
                 progress: Callable[[str], None] | None = None, routings: list[str] | None = None,
                 seed: int = 0, kv_budgets: Sequence[KvBudget | None] = (None,),
                 kv_scorer: str = DEFAULT_SCORER) -> dict[str, Any]:
    """Every policy on the same scenario (under every routing policy, when given: results keyed
    `"<policy>@<routing>"`; under each KV budget, when given: `"<policy>+kv<B>"`).
    `belady` needs the future: it replays the arrival order of a reference
    run under the same routing (exact for sequential workflows, an approximation under concurrency)."""
    results: dict[str, Any] = {}
    params = dict(scenario.params)
    if scenario.sessions and params.get("pressure") is not None and gpu_capacity is None:
        gpu_capacity, live = pressure_capacity(scenario, profile, replicas)
        params.update(live_history_tokens=round(live), device_kv_tokens=gpu_capacity,
                      measured_pressure=live / (gpu_capacity * replicas))
    for routing, budget in itertools.product(routings or [None], kv_budgets):
        trace: list[Tag] | None = None
        for policy in policies:
            name = (policy if routing is None else f"{policy}@{routing}") + (f"+kv{budget.tokens}" if budget else "")
            if progress:
                progress(name)
            future = None
            if POLICIES[policy].oracle:
                if trace is None:
                    _, ref = simulate(scenario, profile, "infinite", replicas=replicas, routing=routing, seed=seed,
                                      kv_budget=budget, kv_scorer=kv_scorer)
                    trace = ref.trace
                future = trace
            result, sim = simulate(scenario, profile, policy, replicas=replicas, horizon=horizon,
                                   max_inflight=max_inflight, future=future, gpu_capacity=gpu_capacity,
                                   routing=routing, seed=seed, kv_budget=budget, kv_scorer=kv_scorer)
            if POLICIES[policy].infinite:
                trace = sim.trace
            if budget is not None:
                result["compactions"] = sum(r.compactions for r in sim.replicas)
            results[name] = result
    return {"scenario": scenario.name, "profile": profile.name, "params": params, "results": results}
