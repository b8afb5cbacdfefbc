"""The simulator routes every call through the serving router (`engines/sim/routed.py`): the same
`RouterCore` and `core.routing` policies, cache events and hints flowing as when serving, runs
deterministic per seed."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvflow_ray.core.scheduler import resolve_policy
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import simulate, summarise
from kvflow_ray.engines.sim.simulator import Simulation


def scenario() -> workload.Scenario:
    return workload.concurrent(tasks=12, fixed=1024, output=32, iterations=1)


@pytest.mark.parametrize("routing", ["pow2", "dynamo-kv", "llmd-precise"])
def test_runs_are_deterministic_per_seed(routing: str) -> None:
    def run(seed: int) -> str:
        result, sim = simulate(scenario(), load_profile("a10g-llama3.1-8b"), "kvflow", replicas=3,
                               gpu_capacity=8_000, routing=routing, seed=seed)
        result["routing"].pop("decision_p50_ms")
        result["routing"].pop("decision_p99_ms")
        return json.dumps([result, [(it.client, it.start, it.end) for it in sim.iterations], sim.trace])

    assert run(1) == run(1)


def test_hints_reach_only_the_replicas_the_router_names() -> None:
    sim = Simulation(load_profile("a10g-llama3.1-8b"), resolve_policy("kvflow"), replicas=4, gpu_capacity=8_000,
                     routing="workflow")
    served: set[tuple[int, str]] = set()
    told: set[tuple[int, str]] = set()
    for replica in sim.replicas:
        submit, apply = replica.submit, replica.scheduler.apply_hints

        def spy_submit(req: Any, replica: Any = replica, submit: Any = submit) -> None:
            served.add((replica.index, req.workflow))
            submit(req)

        def spy_apply(steps: Any, *args: Any, replica: Any = replica, apply: Any = apply, **kwargs: Any) -> None:
            told.update((replica.index, workflow) for workflow in steps)
            apply(steps, *args, **kwargs)

        replica.submit = spy_submit  # type: ignore[method-assign]
        replica.scheduler.apply_hints = spy_apply  # type: ignore[method-assign]
    plans = scenario().plans
    for plan in plans:
        sim.add_client(plan)
    sim.run()
    assert served <= told  # a replica serving a workflow's call has heard of the workflow
    assert len(told) < len(sim.replicas) * len(plans)  # and the others were not all told (no broadcast)
    result = summarise(sim)
    assert result["workflows_measured"] == len(plans)
    assert sum(result["routing"]["decisions"].values()) == len(sim.trace)


def test_cache_events_reach_the_routers_indexes() -> None:
    _result, sim = simulate(scenario(), load_profile("a10g-llama3.1-8b"), "kvflow", replicas=2,
                            gpu_capacity=30_000, routing="dynamo-kv")
    assert sim.router is not None
    core = sim.router.core
    for name, replica in sim.router.replicas.items():
        # what the replica holds on the device, the router's block index counts too (within a block per node)
        held = replica.cache.tree.gpu_tokens // core.fleet.blocks.block
        assert 0 < core.fleet.blocks.device_blocks(name) <= held
    assert core.sizes()["locations"] > 0  # the fixed prompts' locations, from the same events


def test_cli_compares_routings_side_by_side() -> None:
    out = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", "--scenario", "peer", "--clients", "8",
                          "--iterations", "1", "--replicas", "2", "--policies", "lru,kvflow",
                          "--routing", "workflow,sglang-cache-aware", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    results = json.loads(out.stdout)["results"]
    assert set(results) == {"lru@workflow", "kvflow@workflow", "lru@sglang-cache-aware",
                            "kvflow@sglang-cache-aware"}
    assert all(sum(r["routing"]["decisions"].values()) > 0 for r in results.values())
    bad = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", "--scenario", "peer", "--routing", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown routing policy 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_fleet_workload_is_seeded_poisson_over_tenants_and_shapes() -> None:
    a, b = workload.fleet(tenants=4, apps=2, clients=400, rate=5.0, seed=3), workload.fleet(
        tenants=4, apps=2, clients=400, rate=5.0, seed=3)
    assert [(p.key, p.start_at, p.prompts) for p in a.plans] == [(p.key, p.start_at, p.prompts) for p in b.plans]
    starts = [p.start_at for p in a.plans]
    assert starts == sorted(starts) and 400 / starts[-1] == pytest.approx(5.0, rel=0.2)  # the rate, roughly
    assert {p.spec.name for p in a.plans} == {"peer", "team", "triage", "chain"}
    # tenants share nothing: each is a cache namespace, and no two applications share a prompt token
    assert all(p.salt == p.key.split("/")[0] for p in a.plans)
    apps = {(p.salt, p.key.split("/")[1].rsplit("-", 1)[0]): p.prompts for p in a.plans}
    firsts = [next(iter(prompts.values()))[0] for prompts in apps.values()]
    assert len(set(firsts)) == len(apps) == 8
    # inside an application, the agents' prompts share its preamble
    prompts = list(next(iter(apps.values())).values())
    assert prompts[0][:64] == prompts[1][:64] and prompts[0] != prompts[1]


def test_llmd_preset_is_their_benchmark_shape() -> None:
    s = workload.llmd(clients=300, rate=20.0)
    assert {len(p.prompts["user"]) for p in s.plans} == {6000}
    assert {(p.dynamic, p.output) for p in s.plans} == {(1200, 1000)}
    assert len({p.prompts["user"] for p in s.plans}) <= 150
