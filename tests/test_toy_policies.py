"""A new policy is one class plus one registration: a toy eviction, admission and prefetch policy,
added through the registries alone, run in the simulator and the CPU engine with no engine file
touched (the SGLang plugin's path: tests/sglang/test_toy_policies.py)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator, Sequence
from typing import TypeVar

import pytest
from toy_policies import MostRecentlyUsed, NearestOnly

from kvflow_ray.cli import main
from kvflow_ray.core.admission import ADMISSION, AdmissionPolicy, ArrivalAdmission
from kvflow_ray.core.policies import EVICTION, EvictionPolicy
from kvflow_ray.core.prefetch import PREFETCH, PrefetchPolicy
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.core.scheduler import POLICIES, PolicyConfig, register_policy

R = TypeVar("R")


class NewestFirst(ArrivalAdmission):
    """Admit the newest request first; loads only once admitted; a batch waits for its loads (it
    needs no reports of arrivals and admissions: `ArrivalAdmission` ignores them)."""

    name = "toy-newest-first"
    loads_while_queued = False
    batch_waits_for_loads = True

    def __init__(self) -> None:
        self.calls: list[int] = []  # how many requests were waiting at each call

    def order(self, waiting: Sequence[R], ready: Sequence[R]) -> list[R]:
        self.calls.append(len(waiting))
        return list(reversed(waiting))


ADMITTED: list[NewestFirst] = []
PREFETCHERS: list[NearestOnly] = []


def _mru(context: PolicyContext) -> EvictionPolicy:
    """toy: most recently used first"""
    return MostRecentlyUsed()


def _newest_first(context: PolicyContext) -> AdmissionPolicy:
    """toy: newest request first"""
    ADMITTED.append(NewestFirst())
    return ADMITTED[-1]


def _nearest_only(context: PolicyContext) -> PrefetchPolicy:
    """toy: the nearest agent only"""
    PREFETCHERS.append(NearestOnly())
    return PREFETCHERS[-1]


TOYS = {
    "toy-evict": PolicyConfig("toy-evict", "toy-mru", host_tier=False, prefetch="none", admission="fcfs"),
    "toy-admit": PolicyConfig("toy-admit", "lru", host_tier=False, prefetch="none", admission="toy-newest-first"),
    "toy-prefetch": PolicyConfig("toy-prefetch", "kvflow", host_tier=True, prefetch="toy-nearest-only",
                                 admission="status-aware"),
}


@pytest.fixture()
def toys() -> Iterator[None]:
    EVICTION.register("toy-mru", _mru)
    ADMISSION.register("toy-newest-first", _newest_first)
    PREFETCH.register("toy-nearest-only", _nearest_only)
    for config in TOYS.values():
        register_policy(config)
    ADMITTED.clear()
    PREFETCHERS.clear()
    try:
        yield
    finally:
        for name in TOYS:
            POLICIES.pop(name, None)
        EVICTION.unregister("toy-mru")
        ADMISSION.unregister("toy-newest-first")
        PREFETCH.unregister("toy-nearest-only")


def _sim(*args: str) -> dict[str, dict[str, float]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["sim", *args, "--json"]) == 0
    return json.loads(out.getvalue())["results"]


# ------------------------------------------------------------------------------------------- the simulator
def test_toy_policies_run_in_the_simulator_by_name(toys: None) -> None:
    single = ["--scenario", "single", "--agents", "6", "--fixed", "2048", "--dynamic", "32", "--output", "16",
              "--iterations", "3", "--gpu-kv-tokens", "9000"]
    results = _sim(*single, "--policies", "lru,toy-evict,kvflow-noprefetch,toy-prefetch")
    # six 2k prompts cycling through room for four: LRU evicts each just before its turn; MRU keeps most
    assert results["lru"]["gpu_hit_ratio"] == 0.0 < results["toy-evict"]["gpu_hit_ratio"]
    # the toy prefetcher was asked, chose only agents ahead, and its loads ran
    assert PREFETCHERS and all(p.chosen for p in PREFETCHERS)
    assert results["toy-prefetch"]["prefetch_issued"] > 0 == results["kvflow-noprefetch"]["prefetch_issued"]
    concurrent = _sim("--scenario", "concurrent", "--fixed", "1024", "--tasks", "8", "--gpu-kv-tokens", "6000",
                      "--policies", "lru,toy-admit")
    assert ADMITTED and max(max(a.calls, default=0) for a in ADMITTED) > 1  # it ordered real queues
    assert concurrent["toy-admit"] != concurrent["lru"]  # and the order changed what ran when


def test_an_unknown_or_offline_policy_is_refused_by_name(toys: None) -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        register_policy(PolicyConfig("bad", "nope", host_tier=False, prefetch="none", admission="fcfs"))
    with pytest.raises(ValueError, match="prefetch policy 'steps-ahead' does not take lookahead"):
        PREFETCH.create("steps-ahead", lookahead=3)


# ------------------------------------------------------------------------------------------- the CPU engine
def test_toy_policies_run_in_the_cpu_engine(toys: None) -> None:
    import torch

    from kvflow_ray.engines.base import GenerateRequest, Hints
    from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
    from kvflow_ray.engines.cpu.engine import CpuEngine

    def tokens(n: int, seed: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    model = ModelConfig(n_layers=1, hidden_size=64, n_heads=2, n_kv_heads=1, intermediate_size=128)

    def engine(policy: str, **kw: int) -> CpuEngine:
        return CpuEngine(CpuEngineConfig(model=model, policy=policy, link_gbps=None, **kw))

    # admission: three requests queued together, one runs at a time: the newest finishes first
    with engine("toy-admit", device_kv_tokens=2000, max_running=1) as e:
        order: list[int] = []
        for i in range(3):
            e.submit(GenerateRequest(tokens=tokens(40, i), max_tokens=2), on_done=lambda _r, i=i: order.append(i))
        while e.busy:
            e.step(timeout=0.01)
    assert order == [2, 1, 0]

    # eviction: prompts a, b, c cycling through room for two; MRU keeps a, which LRU evicts before its turn
    prompts = [tokens(150, 10 + i) for i in range(3)]
    hits: dict[str, int] = {}
    for policy in ("lru", "toy-evict"):
        with engine(policy, device_kv_tokens=340) as e:
            results = [e.generate(GenerateRequest(tokens=prompts[i % 3] + tokens(4, 50 + i), max_tokens=2))
                       for i in range(6)]
        hits[policy] = sum(r.gpu_hit_tokens for r in results)
    assert hits["lru"] == 0 < hits["toy-evict"]

    # prefetch: the toy loads the nearest agent's evicted prompt when the hints say it runs next
    with engine("toy-prefetch", device_kv_tokens=340, host_kv_tokens=4000) as e:
        fixed = {f"a{i}": prompts[i] for i in range(3)}
        for step in range(4):
            agent = f"a{step % 3}"
            steps = {a: float((i - step) % 3) for i, a in enumerate(fixed)}
            e.apply_hints(Hints(steps={"wf": steps}, prompts={("wf", a): p for a, p in fixed.items()}))
            while e.busy:
                e.step(timeout=0.01)
            e.generate(GenerateRequest(tokens=fixed[agent] + tokens(4, 90 + step), max_tokens=2, workflow="wf",
                                       agent=agent))
        stats = e.stats()
    assert PREFETCHERS[-1].chosen and stats["prefetch"]["issued"] > 0
