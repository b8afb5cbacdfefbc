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
        for wall_clock in ("decision_p50_ms", "decision_p99_ms", "policy_p50_ms", "policy_p99_ms"):
            result["routing"].pop(wall_clock)
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


def _working_set(s: workload.Scenario) -> int:
    """The distinct fixed-prompt tokens of a fleet's applications (each counted once)."""
    seen: dict[tuple[str, str], set[int]] = {}
    for p in s.plans:
        app = (p.salt, p.key.split("/")[1].rsplit("-", 1)[0])
        seen.setdefault(app, set()).update(t for prompt in p.prompts.values() for t in prompt)
    return sum(len(tokens) for tokens in seen.values())


@pytest.mark.parametrize("pressure", [0.5, 2.0, 8.0])
def test_fleet_pressure_sets_the_working_set_over_the_fleets_device_kv(pressure: float) -> None:
    fleet_kv = 8 * 39_585
    s = workload.fleet(tenants=None, apps=4, clients=2000, rate=4.0, seed=5, pressure=pressure,
                       fleet_kv_tokens=fleet_kv)
    # applications are added until their working sets reach the pressure: at most one more than it takes
    assert s.params["pressure"] == pytest.approx(pressure, rel=0.05)
    assert s.params["working_set_tokens"] >= pressure * fleet_kv
    assert s.params["tenants"] >= (pressure * fleet_kv) // (4 * 16 * 1024)  # apps hold at most 16k tokens each
    # the instances draw their applications from all of them, and the working set is what the prompts hold
    assert _working_set(s) <= s.params["working_set_tokens"]
    # with --tenants, the applications are those, their prompts scaled to the pressure
    fixed = workload.fleet(tenants=3, apps=2, clients=600, rate=4.0, seed=5, pressure=pressure,
                           fleet_kv_tokens=fleet_kv)
    assert fixed.params["tenants"] == 3 and fixed.params["pressure"] == pytest.approx(pressure, rel=0.01)
    assert len({p.key.split("/")[1].rsplit("-", 1)[0] + p.salt for p in fixed.plans}) == 6


def test_fleet_without_pressure_is_unchanged_and_reports_its_ratio() -> None:
    plain = workload.fleet(tenants=8, apps=2, clients=100, rate=2.0, seed=1)
    known = workload.fleet(tenants=8, apps=2, clients=100, rate=2.0, seed=1, fleet_kv_tokens=8 * 39_585)
    def shape(s: workload.Scenario) -> list[tuple[str, float, dict[str, tuple[int, ...]]]]:
        return [(p.key, p.start_at, p.prompts) for p in s.plans]

    assert shape(plain) == shape(known)
    assert plain.params["pressure"] is None and 0.1 < known.params["pressure"] < 0.5  # today's fleet
    with pytest.raises(ValueError, match="--pressure needs the fleet's device KV"):
        workload.fleet(tenants=None, pressure=2.0)
    with pytest.raises(ValueError, match="--pressure must be positive"):
        workload.fleet(tenants=None, pressure=0.0, fleet_kv_tokens=1000)
    with pytest.raises(ValueError, match="unknown fleet preset"):
        workload.fleet(preset="nope")


def test_tools_preset_sends_4_to_16k_token_system_prompts() -> None:
    s = workload.fleet(tenants=None, apps=4, clients=300, rate=4.0, seed=2, preset="tools", pressure=1.0,
                       fleet_kv_tokens=8 * 39_585)
    lengths = {len(prompt) for p in s.plans for prompt in p.prompts.values()}
    assert min(lengths) >= 4096 * 0.95 and max(lengths) <= 16384 * 1.05
    assert max(lengths) - min(lengths) > 4096  # spread over the range, not one size
    # applications of up to 10 agents x 16k tokens are added whole: the last one may overshoot by half the fleet
    assert s.params["preset"] == "tools" and 1.0 <= s.params["pressure"] <= 1.5


def test_cli_fleet_pressure_prints_the_ratio_and_refuses_misuse() -> None:
    out = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", "--scenario", "fleet", "--pressure", "2",
                          "--apps", "4", "--clients", "24", "--rate", "4", "--replicas", "4", "--policies", "kvflow",
                          "--routing", "workflow,llmd-precise"],
                         capture_output=True, text=True, timeout=300, check=True)
    assert "x the fleet's device KV" in out.stdout and "2.0" in out.stdout.split("x the fleet's")[0].split()[-1]
    for args, message in [(["--scenario", "peer", "--pressure", "2"], "--pressure goes with --scenario fleet"),
                          (["--scenario", "fleet", "--preset", "llmd", "--pressure", "2"],
                           "--pressure does not go with --preset llmd")]:
        bad = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", *args], capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr


def test_under_pressure_the_workflow_router_keeps_each_application_on_fewer_replicas() -> None:
    """The memory-bound fleet, simulated: the workflow router runs each application's calls on fewer
    replicas than the load-only pow2 does, and computes less of its prompts again."""
    s = workload.fleet(tenants=None, apps=4, clients=96, rate=4.0, seed=3, pressure=2.0, fleet_kv_tokens=4 * 39_585)

    def spread(routing: str) -> tuple[float, int]:
        sim = Simulation(load_profile("a10g-llama3.1-8b"), resolve_policy("kvflow"), replicas=4, routing=routing,
                         seed=3)
        for plan in s.plans:
            sim.add_client(plan)
        assert sim.router is not None
        core, start_call = sim.router.core, sim.router.core.start_call
        places: dict[str, set[str]] = {}

        def observed(tenant: str, client: str, agent: str, **kw: Any) -> Any:
            route = start_call(tenant, client, agent, **kw)
            places.setdefault(f"{tenant}/{client.rsplit('-', 1)[0]}", set()).add(route.replica)  # its application
            return route

        core.start_call = observed  # type: ignore[method-assign]
        sim.run()
        return sum(map(len, places.values())) / len(places), summarise(sim)["recomputed_tokens"]

    ours, theirs = spread("workflow"), spread("pow2")
    assert ours[0] < theirs[0] and ours[1] < theirs[1]


def test_replicas_prefetch_tenants_prompts_in_their_namespace() -> None:
    """Tenants' workflows live in their tenant's cache namespace. A replica first told of a workflow
    learns that namespace with its steps, whether or not the template carries prompt text (the
    simulator's prompts are tokens), so KVFlow's prefetch finds the prompts where the requests put them."""
    scenario = workload.fleet(tenants=None, apps=2, clients=96, rate=0.5, seed=0, pressure=2.0,
                              fleet_kv_tokens=2 * 12_000)
    sim = Simulation(load_profile("a10g-llama3.1-8b"), resolve_policy("kvflow"), replicas=2, gpu_capacity=12_000,
                     routing="workflow")
    namespaces: dict[str, set[str]] = {}  # workflow -> the namespaces replicas held for it when told its steps
    for replica in sim.replicas:
        apply = replica.scheduler.apply_hints

        def spy_apply(steps: Any, *args: Any, replica: Any = replica, apply: Any = apply, **kwargs: Any) -> None:
            apply(steps, *args, **kwargs)
            for workflow in steps:
                namespaces.setdefault(workflow, set()).add(replica.book.salt(workflow))

        replica.scheduler.apply_hints = spy_apply  # type: ignore[method-assign]
    for plan in scenario.plans:
        sim.add_client(plan)
    sim.run()
    salts = {plan.key: plan.salt for plan in scenario.plans}
    assert len(set(salts.values())) > 1 and namespaces.keys() == salts.keys()
    assert all(held == {salts[workflow]} for workflow, held in namespaces.items())
    result = summarise(sim)
    assert result["prefetch_issued"] > 0 and result["prefetch_used"] > 0
