"""Dynamic workflows, issue 17: the transition model (`core.predict`), the predictors behind the
registry, the router learning online and keeping its models in the store (real Redis too), the
simulator's dynamic scenario and the rule that a demand load never waits behind a prefetch."""

from __future__ import annotations

import json
import math
import queue
import time
from collections.abc import Iterator

import pytest
import torch

from kvflow_ray.core.graph import WorkflowState, parse_spec
from kvflow_ray.core.predict import PREDICTION, Forecaster, TransitionBook, TransitionModel
from kvflow_ray.core.prefetch import PREFETCH
from kvflow_ray.core.radix import RadixNode
from kvflow_ray.core.scheduler import POLICIES, engine_policies
from kvflow_ray.engines.cpu.kv_pool import CopyJob, CopyStream, KVPool
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import run_policies, simulate
from kvflow_ray.router.core import RouterCore
from kvflow_ray.router.store import MemoryStore, RedisStore, Store

SUPPORT = {"name": "support", "entry": "intake", "agents": {
    "intake": {"prompt": "intake"},
    "triage": {"prompt": "triage", "after": ["intake", "reviewer"], "join": "any", "next": "one",
               "weights": {"billing": 1, "technical": 1}},
    "billing": {"prompt": "billing", "after": ["triage"]},
    "technical": {"prompt": "technical", "after": ["triage"]},
    "reviewer": {"prompt": "reviewer", "after": ["billing", "technical"], "join": "any", "next": "one"},
    "done": {"prompt": "done", "after": ["reviewer"]},
}}


def walk(model: TransitionModel, spec, path: list[str]) -> None:
    """Feed one instance's agent starts to the model, as a driver does (`TransitionBook.started`)."""
    book = TransitionBook()
    book.models[("t", spec.name)] = model
    state, history = WorkflowState(spec, running=[]), []
    for agent in path:
        history = book.started("t", spec.name, state, history, agent)
        state.start(agent)
        state.finish(agent)


def test_the_model_starts_from_the_spec_and_learns_the_real_odds() -> None:
    spec = parse_spec(SUPPORT)
    model = TransitionModel()
    assert model.choice(spec, "triage") == {"billing": 0.5, "technical": 0.5}  # cold: the spec's weights
    for _ in range(30):
        walk(model, spec, ["intake", "triage", "technical", "reviewer", "done"])
    odds = model.choice(spec, "triage")
    assert odds["technical"] > 0.9 > 0.1 > odds["billing"]
    assert model.choice(spec, "reviewer")["done"] > 0.9
    # the learned odds move the expected steps: technical is now the nearer alternative
    state = WorkflowState(spec)
    state.finish("intake")
    state.start("triage")
    steps = state.expected_steps(model.transitions(spec, ["intake", "triage"]))
    assert steps["technical"] < 1.2 < 5 < steps["billing"]


def test_the_model_follows_a_drifting_mix() -> None:
    spec = parse_spec(SUPPORT)
    model = TransitionModel()
    for _ in range(50):
        walk(model, spec, ["intake", "triage", "technical", "reviewer", "done"])
    swung_after = next((n for n in range(1, 40)
                        if walk(model, spec, ["intake", "triage", "billing", "reviewer", "done"]) is None
                        and model.choice(spec, "triage")["billing"] > 0.5), None)
    assert swung_after is not None and swung_after <= 20, "decayed counts let the model swing within tens of instances"


def test_loop_passes_are_told_apart() -> None:
    """The reviewer sends work back on its first pass and passes it on the second: the narrow context
    (its pass in the instance) learns that, where the agent alone would say 50/50."""
    spec = parse_spec(SUPPORT)
    model = TransitionModel()
    for _ in range(30):
        walk(model, spec, ["intake", "triage", "billing", "reviewer", "triage", "billing", "reviewer", "done"])
    first = model.choice(spec, "reviewer", ["intake", "triage", "billing", "reviewer"])
    second = model.choice(spec, "reviewer", ["intake", "triage", "billing", "reviewer", "triage", "billing",
                                             "reviewer"])
    assert first["triage"] > 0.8 and second["done"] > 0.8
    assert 0.3 < model.choice(spec, "reviewer")["done"] < 0.7


def test_models_are_bounded_and_survive_a_round_trip() -> None:
    spec = parse_spec(SUPPORT)
    model = TransitionModel(max_contexts=3)
    for _ in range(5):
        walk(model, spec, ["intake", "triage", "technical", "reviewer", "triage", "billing", "reviewer", "done"])
    assert len(model.counts) <= 3
    again = TransitionModel().load(json.loads(json.dumps(model.to_dict())))
    assert again.counts == model.counts and again.accuracy == model.accuracy
    # a malformed document from the store is skipped, not trusted
    junk = TransitionModel().load({"counts": {"triage": {"billing": "lots"}, "x": 3}, "accuracy": [1, -2]})
    assert junk.counts == {"triage": {}} and junk.accuracy.total_1 == 0
    book = TransitionBook(max_models=2)
    for t in ("a", "b", "c"):
        book.model(t, "support")
    assert list(book.models) == [("b", "support"), ("c", "support")]


def test_accuracy_counts_one_and_two_steps_ahead() -> None:
    spec = parse_spec(SUPPORT)
    model = TransitionModel()
    for _ in range(20):
        walk(model, spec, ["intake", "triage", "technical", "reviewer", "done"])
    acc = model.accuracy
    assert acc.total_1 > 0 and acc.total_2 > 0
    assert acc.ratio(1) > 0.8 and acc.ratio(2) > 0.7


def test_predictors_are_registered_and_graph_keeps_the_old_steps() -> None:
    spec = parse_spec(SUPPORT)
    state = WorkflowState(spec)
    assert {"graph", "priors", "learned", "oracle"} <= set(PREDICTION.names())
    assert Forecaster("graph").steps("t", "support", state, []) == state.steps_to_execution()
    assert Forecaster("priors").steps("t", "support", state, []) == state.expected_steps()
    assert not Forecaster("graph").learns and Forecaster("learned").learns
    assert POLICIES["predictive"].prediction == "learned" and "predictive" in engine_policies()
    assert "oracle" not in engine_policies()  # it reads the recorded future


def test_likely_next_prefetch_reaches_a_likely_alternative_only() -> None:
    policy = PREFETCH.create("likely-next", settings={"horizon": 1})
    assert policy.horizon == pytest.approx(1 / 0.6)  # E = 1/p: chosen with probability >= 0.6

    class Book:
        from kvflow_ray.core.policies import NearMap
        near = NearMap()

    Book.near[("w", "billing")] = 1 / 0.75
    Book.near[("w", "technical")] = 1 / 0.25
    assert [tag for tag, _ in policy.choose(Book)] == [("w", "billing")]


# ------------------------------------------------------------------------------------------- the router
@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushdb()
    yield RedisStore(url)


def ticket(core: RouterCore, tenant: str, client: str, specialist: str) -> dict[str, float]:
    """One ticket through the router; the steps the replicas were told right after triage started."""
    told: dict[str, float] = {}
    for agent in ["intake", "triage", specialist, "reviewer", "done"]:
        route = core.start_call(tenant, client, agent, workflow="support")
        if agent == "triage":
            told = route.hints[0][1].steps[f"{tenant}/{client}"]
        core.end_call(tenant, client, agent, route.replica)
    core.finish_client(tenant, client)
    return told


def test_the_router_learns_per_tenant_and_keeps_models_in_the_store(store: Store) -> None:
    core = RouterCore(store, prediction="learned")
    core.add_replica("r1")
    for tenant in ("acme", "globex"):
        core.put_template(tenant, SUPPORT)
    first = ticket(core, "acme", "c0", "technical")
    assert first["technical"] == first["billing"] == 2.0  # cold: the spec's 50/50
    for n in range(1, 20):
        steps = ticket(core, "acme", f"c{n}", "technical")
    assert steps["technical"] < 1.2 and steps["billing"] > 5
    # globex's template of the same name learned nothing from acme's calls
    assert ticket(core, "globex", "c0", "billing")["technical"] == 2.0
    hits, total = core.prediction_accuracy()["1"]
    assert total > 0 and hits / total > 0.7
    saved = store.get_model("acme", "support")
    assert saved is not None and saved["counts"]["triage"]["technical"] > 5
    # a restarted router reads the model back on first use
    restarted = RouterCore(store, prediction="learned")
    restarted.add_replica("r1")
    assert ticket(restarted, "acme", "c99", "technical")["technical"] < 1.2


def test_the_router_default_keeps_graph_steps(store: Store) -> None:
    core = RouterCore(store)
    core.add_replica("r1")
    core.put_template("acme", SUPPORT)
    for n in range(5):
        steps = ticket(core, "acme", f"c{n}", "technical")
    assert steps["technical"] == steps["billing"] == 1  # every alternative one step away
    assert store.get_model("acme", "support") is None


# ------------------------------------------------------------------------------------------- the simulator
def test_the_dynamic_scenario_is_deterministic_and_the_same_choices_reach_every_policy() -> None:
    scenario = workload.dynamic(branches=4, clients=4, apps=2, fixed=1024, iterations=4)
    profile = load_profile("a10g-llama3.1-8b")
    runs = {p: simulate(scenario, profile, p)[1] for p in ("lru", "kvflow", "predictive")}
    paths = {p: sorted(sim.trace) for p, sim in runs.items()}
    assert paths["lru"] == paths["kvflow"] == paths["predictive"]
    agents = {agent for _, agent in paths["lru"]}
    assert {"intake", "triage", "reviewer", "finalize"} <= agents and any(a.startswith("specialist") for a in agents)
    assert simulate(scenario, profile, "kvflow")[0] == simulate(scenario, profile, "kvflow")[0]


def test_the_oracle_and_the_predictive_policy_run_side_by_side() -> None:
    scenario = workload.dynamic(branches=6, clients=4, apps=4, fixed=4096, skew=0.5, iterations=6)
    out = run_policies(scenario, load_profile("a10g-llama3.1-8b"), ["kvflow", "predictive", "oracle"])
    res = out["results"]
    for name in ("kvflow", "predictive", "oracle"):
        r = res[name]
        assert r["prefetch_used"] + r["prefetch_wasted"] <= r["prefetch_issued"]
    # static kvflow protects and prefetches every alternative; predictive only the likely one
    assert res["predictive"]["prefetch_wasted"] < res["kvflow"]["prefetch_wasted"]


def test_a_demand_load_goes_ahead_of_queued_prefetches_in_the_simulator() -> None:
    scenario = workload.single(agents=2, fixed=64, iterations=1)
    _, sim = simulate(scenario, load_profile("a10g-llama3.1-8b"), "kvflow")
    replica = sim.replicas[0]
    landed: list[str] = []
    replica.scheduler.load_done = lambda nodes, prefetch: landed.append(nodes[0].key[0])  # type: ignore[method-assign]
    node = {name: RadixNode(key=(i,), parent=None) for i, name in enumerate(["p1", "p2", "demand"])}
    sim.at(sim.now, lambda: (replica.load([node["p1"]], 4096, True), replica.load([node["p2"]], 4096, True),
                             replica.load([node["demand"]], 4096, False)))
    sim.run()
    assert landed == [0, 2, 1]  # p1 was already copying; the demand load overtook p2


def test_a_demand_copy_goes_ahead_of_queued_prefetches_on_the_cpu_copy_stream() -> None:
    done: queue.Queue[CopyJob] = queue.Queue()
    stream = CopyStream("h2d", link_gbps=0.01, done=done)  # 10 MB/s: each copy below takes ~50 ms
    src = KVPool("host", 4096, n_layers=1, n_kv_heads=1, head_dim=64, dtype=torch.float32)
    dst = KVPool("device", 4096, n_layers=1, n_kv_heads=1, head_dim=64, dtype=torch.float32)
    slots = torch.arange(1024)
    order: list[str] = []
    try:
        jobs = {name: CopyJob(src, slots, dst, slots, (lambda n=name: order.append(n)), speculative=speculative)
                for name, speculative in [("first", True), ("p2", True), ("p3", True), ("demand", False)]}
        stream.submit(jobs["first"])
        while not jobs["first"].started:  # copying: the rest queue behind it
            time.sleep(0.001)
        for name in ("p2", "p3", "demand"):
            stream.submit(jobs[name])
        deadline = time.monotonic() + 30
        while len(order) < 4 and time.monotonic() < deadline:
            done.get(timeout=30).on_done()
    finally:
        stream.close()
    assert order[0] == "first" and order[1] == "demand" and sorted(order[2:]) == ["p2", "p3"]
    assert math.isfinite(stream.busy_s)


def test_kvflow_run_walks_one_alternative_per_choice() -> None:
    """`kvflow-ray run`'s walk of a dynamic workflow: exactly one specialist per triage, drawn by the
    spec's weights, loops ending at random; the same generator state gives the same walk."""
    import random
    from pathlib import Path

    from kvflow_ray.client.loadgen import iteration_stages
    from kvflow_ray.client.workflow import Workflow

    workflow = Workflow.from_yaml(Path(__file__).resolve().parent.parent / "workflows" / "support_dynamic.yaml")
    specialists = {"billing", "technical", "account"}
    seen: dict[str, int] = {}
    for seed in range(200):
        stages = iteration_stages(workflow, random.Random(seed))
        assert all(len(stage) == 1 for stage in stages)
        walk = [stage[0] for stage in stages]
        assert walk[:2] == ["intake", "triage"] and walk[-1] == "finalize"
        assert walk.count("reviewer") <= 4  # max_iterations
        for i, agent in enumerate(walk):
            if agent == "triage":
                assert walk[i + 1] in specialists
                seen[walk[i + 1]] = seen.get(walk[i + 1], 0) + 1
        assert iteration_stages(workflow, random.Random(seed)) == stages
    assert seen["billing"] > seen["technical"] > seen["account"]  # weights 6 : 3 : 1


def test_only_the_oracle_reads_the_true_choices() -> None:
    """The simulator hands every predictor the draws its clients will make; a learned (or graph, or
    priors) predictor must rank by what it knows, never by them."""
    from kvflow_ray.engines.sim.simulator import KnownChoices

    spec = parse_spec(SUPPORT)
    state = WorkflowState(spec)
    state.finish("intake")
    state.start("triage")
    truth = KnownChoices({"triage": "technical", "reviewer": "done"})
    for name in ("graph", "priors", "learned"):
        forecast = Forecaster(name)
        assert forecast.steps("t", "support", state, ["intake", "triage"], truth) == \
            forecast.steps("t", "support", state, ["intake", "triage"])
    oracle = Forecaster("oracle").steps("t", "support", state, ["intake", "triage"], truth)
    assert oracle["technical"] == 1.0 and oracle["billing"] == math.inf
