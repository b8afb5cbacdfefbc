"""The simulator's O(1) steps are shortcuts, never approximations. Settled admission (an admission
pass that found nothing to admit is not repeated until something it reads changes) and decode runs
(steps of an unchanged decode batch advance totals, not each request) must give exactly what doing
every step in full gives: on several replicas, under memory pressure, with a host tier, prefetch,
status-aware admission and prompts shared by every client. The full runs also check the waiting
queue's index (`core/waiting.py`) against looking every queued request up, before every pass."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvflow_ray.core.scheduler import ReplicaScheduler, resolve_policy
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import summarise
from kvflow_ray.engines.sim.simulator import Simulation
from kvflow_ray.engines.sim.workload import Scenario

SCENARIOS = {
    "concurrent": (lambda: workload.concurrent(tasks=24, fixed=1024, output=64, iterations=2), 4, 5_000),
    "peer": (lambda: workload.peer(clients=32, iterations=2), 3, 1_500),
}


def run(scenario: Scenario, policy: str, replicas: int, capacity: int, *, shortcuts: bool) -> tuple[str, int, int]:
    """The run's results, and how many admission passes and per-request decode steps it did."""
    sim = Simulation(load_profile("a10g-llama3.1-8b"), resolve_policy(policy), replicas=replicas,
                     gpu_capacity=capacity)
    work = {"admission passes": 0, "request decode steps": 0}
    for replica in sim.replicas:
        replica.decode_runs = shortcuts
        scheduler = replica.scheduler
        scheduler.settle_admission = shortcuts and scheduler.settle_admission
        # count the real methods' calls (a spy: they run unchanged)
        scheduler._admit = _counted(scheduler._admit, work, "admission passes",  # type: ignore[method-assign]
                                    check=None if shortcuts else _check_queue(scheduler))
        scheduler.decoded = _counted(scheduler.decoded, work, "request decode steps")  # type: ignore[method-assign]
    for plan in scenario.plans:
        sim.add_client(plan)
    sim.run()
    iterations = [(it.client, it.index, it.start, it.end) for it in sim.iterations]
    return json.dumps([summarise(sim), iterations, sim.trace]), work["admission passes"], work["request decode steps"]


def _counted(method: Callable[..., Any], work: dict[str, int], name: str,
             check: Callable[[], None] | None = None) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        work[name] += 1
        if check is not None:
            check()
        return method(*args, **kwargs)
    return counted


def _check_queue(scheduler: ReplicaScheduler) -> Callable[[], None]:
    """Before each full admission pass: the waiting queue's index against looking every request up."""
    return lambda: scheduler.queue.check(scheduler.waiting)


@pytest.mark.parametrize("policy", ["lru", "hicache", "kvflow", "kvflow-noprefetch"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_shortcuts_change_nothing(name: str, policy: str) -> None:
    make, replicas, capacity = SCENARIOS[name]
    fast, fast_admissions, fast_decodes = run(make(), policy, replicas, capacity, shortcuts=True)
    full, full_admissions, full_decodes = run(make(), policy, replicas, capacity, shortcuts=False)
    assert fast == full
    # and the shortcuts were taken: the equality compares two different paths
    assert fast_admissions < full_admissions
    assert fast_decodes < full_decodes
