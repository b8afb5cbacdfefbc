"""Agent sessions across tool pauses (`core.sessions`, `core.session_policies`, the `agentic`
scenario; docs/design.md §11): the pause predictor, the time-to-reuse ranking in the step book, the
peers' session policies on their documented behaviour, and the simulator scenario end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvflow_ray.core.admission import ADMISSION, StatusAwareAdmission
from kvflow_ray.core.cache import TieredCache
from kvflow_ray.core.policies import EVICTION, KVFlowPolicy, StepBook
from kvflow_ray.core.registry import PolicyContext
from kvflow_ray.core.session_policies import ContinuumAdmission, ContinuumPolicy, RetentionPolicy, TLRUPolicy
from kvflow_ray.core.sessions import (
    SESSION_AGENT,
    Forecast,
    LearnedPauses,
    OraclePauses,
    SessionBook,
    SessionTurn,
)
from kvflow_ray.engines.sim.agentic import agentic, agentic_sessions, draw_pause, largest_need
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import run_policies
from tests.test_cache_policies import eviction_order, put

KEY = ("t0", "coder", "run_tests")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------- pause prediction
def test_learned_pauses_start_from_the_hint_or_default_then_learn_the_tool() -> None:
    model = LearnedPauses(default_s=5.0, early_q=0.2)
    assert model.forecast(KEY, None, None).expected == 5.0
    assert model.forecast(KEY, 30.0, None).expected == 30.0  # the client's hint before any observation
    for gap in (10.0, 12.0, 11.0, 90.0, 9.0):
        model.observe(KEY, gap)
    forecast = model.forecast(KEY, 30.0, None)
    assert forecast.expected == 11.0  # the median of the tool's pauses, not the hint
    assert forecast.early == 9.0 and forecast.early <= forecast.expected  # prefetch aims early
    assert model.mean(KEY) == pytest.approx(26.4)
    # another tool of the same agent: its own pauses once seen, the agent's pool before (no hint)
    assert model.forecast(("t0", "coder", "ls"), None, None).expected == 11.0
    model.observe(("t0", "coder", "ls"), 0.2)
    assert model.forecast(("t0", "coder", "ls"), None, None).expected == 0.2
    # another tenant learns nothing from this one
    assert model.forecast(("t1", "coder", "run_tests"), None, None).expected == 5.0


def test_a_pause_that_outlives_its_prediction_is_predicted_from_the_longer_ones() -> None:
    model = LearnedPauses()
    for gap in (1.0, 1.2, 0.8, 60.0, 70.0):
        model.observe(KEY, gap)
    assert model.forecast(KEY, None, None).expected == 1.2
    assert model.forecast(KEY, None, None, elapsed=5.0).expected == 70.0  # only the slow mode is left
    later = model.forecast(KEY, None, None, elapsed=100.0)  # longer than any seen: as long again
    assert later == Forecast(200.0, 100.0)


def test_learned_pauses_are_bounded_per_tool_and_in_keys_per_tenant() -> None:
    model = LearnedPauses(window=4, max_keys=8)
    other = ("t-other", "coder", "run_tests")
    model.observe(other, 7.0)
    for i in range(100):  # one tenant sends many agent and tool names
        model.observe(("t", f"agent{i}", f"tool{i}"), float(i))
    assert model.keys("t") == 8
    assert model.mean(other) == 7.0  # the other tenant's learning is untouched
    assert model.forecast(other, None, None).expected == 7.0
    for gap in (1.0, 2.0, 3.0, 4.0, 100.0):
        model.observe(KEY, gap)
    assert model.mean(KEY) == pytest.approx((2 + 3 + 4 + 100) / 4)  # the last 4 only


def test_the_oracle_knows_the_pause_and_learns_what_nobody_knows_ahead() -> None:
    oracle = OraclePauses()
    assert oracle.forecast(KEY, None, 42.0) == Forecast(42.0, 42.0)
    oracle.observe(KEY, 8.0)
    assert oracle.forecast(KEY, None, None).expected == 8.0  # a planner waiting on sub-agents


# ---------------------------------------------------------------------- time to reuse
def session_book(cap: int | None = None, load_s: float = 0.5) -> tuple[StepBook, SessionBook, LearnedPauses]:
    steps = StepBook(near_horizon=2)
    pauses = LearnedPauses(default_s=5.0)
    return steps, SessionBook(steps, pauses, load_seconds=lambda tokens: load_s, tenant_retain_tokens=cap), pauses


def turn(tool: str = "run_tests", tenant: str = "t0", truth: float | None = None, hint: float | None = None,
         final: bool = False) -> SessionTurn:
    return SessionTurn(tenant=tenant, agent="coder", tool=tool, hint_s=hint, true_pause_s=truth, final=final)


def test_a_running_turn_is_needed_now_and_a_paused_history_is_ranked_by_its_return() -> None:
    steps, book, _ = session_book()
    book.resumed("a", turn(), 0.0)
    assert steps.steps(("a", SESSION_AGENT)) == 0.0
    # a paused at t=0 for a long tool (60 s), b at t=50 for a short one (5 s): at t=50, a returns at
    # 60 and b at 55, so b is nearer, whatever the order they paused in
    book.pause("a", turn(hint=60.0), 1000, 0.0)
    book.pause("b", turn(hint=5.0), 1000, 50.0)
    da, db = steps.steps(("a", SESSION_AGENT)), steps.steps(("b", SESSION_AGENT))
    assert steps.near_horizon < db < da
    # both are ranked in one book with workflow agents: farther than an agent two steps away
    steps.set_steps("wf", {"planner": 2})
    assert steps.steps(("wf", "planner")) < db


def test_prefetch_falls_due_before_the_predicted_return_erring_early() -> None:
    steps, book, _ = session_book(load_s=0.5)
    book.pause("a", turn(hint=10.0), 1000, 0.0)
    state = book.state("a")
    assert state is not None and state.forecast is not None
    # early edge (hint 10 s -> 4 s with early_q 0.2) less twice the copy back and a margin
    assert state.due_at == pytest.approx(state.forecast.early - book.lead(1000))
    assert state.due_at < state.returns_at
    assert book.next_wake() == pytest.approx(state.due_at)
    book.advance(state.due_at)
    assert steps.steps(("a", SESSION_AGENT)) < 1 <= steps.near_horizon  # near: prefetch loads it
    assert ("a", SESSION_AGENT) in steps.near
    # it outlives its prediction: predicted again, ranked farther, no longer near
    book.advance(state.returns_at)
    assert state.returns_at > 10.0
    # the client comes back: the pause is scored and its history is in use
    book.resumed("a", turn(), 12.0)
    assert steps.steps(("a", SESSION_AGENT)) == 0.0
    assert book.stats.pauses == 1 and book.stats.due_before_return == 1
    assert book.stats.abs_error_s == pytest.approx(2.0)


def test_retention_is_bounded_per_tenant() -> None:
    steps, book, _ = session_book(cap=1500)
    book.pause("a", turn(tenant="t0"), 1000, 0.0)
    book.pause("b", turn(tenant="t0"), 1000, 0.0)  # over t0's bound: ranked as unneeded
    book.pause("c", turn(tenant="t1"), 1000, 0.0)  # another tenant's bound is its own
    assert math.isfinite(steps.steps(("a", SESSION_AGENT)))
    assert steps.steps(("b", SESSION_AGENT)) == math.inf
    assert math.isfinite(steps.steps(("c", SESSION_AGENT)))
    assert book.retained == {"t0": 1000, "t1": 1000}
    book.resumed("a", turn(), 1.0)
    assert book.retained == {"t1": 1000}


def test_closing_a_session_forgets_it() -> None:
    _steps, book, _ = session_book()
    book.pause("a", turn(), 1000, 0.0)
    book.close("a")
    assert book.state("a") is None and book.next_wake() is None and not book.retained


def test_the_origin_moves_without_changing_the_order() -> None:
    steps, book, _ = session_book()
    book.pause("a", turn(hint=100.0), 10, 0.0)
    book.pause("b", turn(hint=200.0), 10, 0.0)
    before = steps.steps(("a", SESSION_AGENT)), steps.steps(("b", SESSION_AGENT))
    book.advance(30.0)  # past rebase_s: distances measured from t=30 now
    after = steps.steps(("a", SESSION_AGENT)), steps.steps(("b", SESSION_AGENT))
    assert before[0] < before[1] and after[0] < after[1] and after[0] < before[0]


def test_kvflow_evicts_the_history_returning_last() -> None:
    steps, book, _ = session_book()
    cache = TieredCache(12, KVFlowPolicy(steps))
    for key, seq, hint in (("a", (1, 1, 1, 1), 5.0), ("b", (2, 2, 2, 2), 300.0), ("c", (3, 3, 3, 3), 60.0)):
        put(cache, seq)
        cache.tree.tag_prefix(seq, (key, SESSION_AGENT))
        book.pause(key, turn(hint=hint), 4, 0.0)
    assert eviction_order(cache) == [(2, 2, 2, 2), (3, 3, 3, 3), (1, 1, 1, 1)]


# ---------------------------------------------------------------------- the peers' policies
def test_tlru_defaults_are_lru_and_its_budget_evicts_conversation_tails_first() -> None:
    """SGLang PR #34012: threshold = next_prompt_estimate = 0 keeps L tokens, i.e. nothing is TEL-safe
    (plain LRU); with a budget L + Q̂ - ξ below the history, the tail beyond it goes first."""
    _steps, book, _ = session_book()
    clock = Clock()
    context = PolicyContext(sessions=book, clock=clock)
    old, long_head, long_tail = (9,) * 8, (1, 1, 1, 1), (1, 1, 1, 1, 2, 2, 2, 2)
    for policy, expected in ((EVICTION.create("tlru", context), [old, long_tail, long_head]),
                             (EVICTION.create("tlru", context, threshold=6, next_prompt_estimate=2),
                              [long_tail, old, long_head])):
        cache = TieredCache(16, policy)
        put(cache, old)  # an older conversation in one node, longer than ξ - Q̂
        put(cache, long_tail)
        cache.tree.tag_prefix(long_tail, ("s", SESSION_AGENT))
        book.pause("s", turn(), 8, 0.0)
        cache.match(long_head)  # the long conversation's head was used last
        assert isinstance(policy, TLRUPolicy)
        assert eviction_order(cache)[:3] == expected, policy.threshold


def test_retention_keeps_a_session_until_its_retention_passes() -> None:
    """SGLang PR #27970: priority decays to 0 once retention_seconds passed since the last access."""
    _steps, book, _ = session_book()
    clock = Clock()
    policy = RetentionPolicy(book, clock, retention_s=30.0)
    cache = TieredCache(8, policy)
    put(cache, (1, 1, 1, 1))
    cache.tree.tag_prefix((1, 1, 1, 1), ("s", SESSION_AGENT))
    book.pause("s", turn(), 4, 0.0)
    put(cache, (2, 2, 2, 2))  # untagged, more recent
    clock.now = 10.0
    assert eviction_order(cache)[0] == (2, 2, 2, 2)
    cache = TieredCache(8, policy)
    put(cache, (1, 1, 1, 1))
    cache.tree.tag_prefix((1, 1, 1, 1), ("s", SESSION_AGENT))
    put(cache, (2, 2, 2, 2))
    clock.now = 31.0  # retention passed: plain LRU
    assert eviction_order(cache)[0] == (1, 1, 1, 1)


def test_continuum_pins_short_tools_for_two_seconds_and_orders_jobs_first_come() -> None:
    """Continuum's fork: pin 2 s when the tool's mean duration is <= 2 s (none seen counts as 0), not
    for a slower tool or an unknown one; pinned KV goes last; the queue runs pinned jobs, then jobs by
    their first arrival."""
    _steps, book, pauses = session_book()
    clock = Clock()
    cache = TieredCache(12, ContinuumPolicy(book, clock))
    for key, seq in (("fast", (1, 1, 1, 1)), ("slow", (2, 2, 2, 2)), ("unk", (3, 3, 3, 3))):
        put(cache, seq)
        cache.tree.tag_prefix(seq, (key, SESSION_AGENT))
    pauses.observe(("t0", "coder", "build"), 30.0)
    book.resumed("slow", turn(tool="build"), -5.0)
    for key, tool in (("fast", "ls"), ("slow", "build"), ("unk", "")):
        book.pause(key, turn(tool=tool), 4, 0.0)
    clock.now = 1.0
    order = eviction_order(cache)
    assert order[-1] == (1, 1, 1, 1)  # pinned: last
    clock.now = 3.0  # the pin expired
    cache = TieredCache(12, ContinuumPolicy(book, clock))
    put(cache, (1, 1, 1, 1))
    cache.tree.tag_prefix((1, 1, 1, 1), ("fast", SESSION_AGENT))
    put(cache, (4, 4, 4, 4))
    assert eviction_order(cache)[0] == (1, 1, 1, 1)

    class Req:
        def __init__(self, workflow: str, arrival: float, seq: int) -> None:
            self.workflow, self.arrival, self.seq = workflow, arrival, seq

    book.resumed("late", turn(), 0.5)
    admission = ContinuumAdmission(book, clock)
    clock.now = 1.0
    queue = [Req("late", 0.9, 1), Req("slow", 0.9, 2), Req("fast", 1.0, 3)]
    assert [r.workflow for r in admission.order(queue, [])] == ["fast", "slow", "late"]


def test_pinned_and_retained_history_is_reported_per_tenant() -> None:
    """`SessionBook.report`: per tenant, paused history ranked as needed (retained) and paused history
    the eviction policy holds whatever its rank (pinned: Continuum's pin, SGLang's retention); kvflow
    pins nothing. A tenant's gauge stays, at 0, once its pins end."""
    _steps, book, _ = session_book()
    clock = Clock()
    book.pause("fast", turn(tool="ls", tenant="t0"), 400, 0.0)  # no mean seen: Continuum pins it for 2 s
    book.pause("other", turn(tool="ls", tenant="t1"), 100, 0.0)
    continuum, retention = ContinuumPolicy(book, clock), RetentionPolicy(book, clock, retention_s=30.0)
    clock.now = 1.0
    assert book.report()["pinned_tokens"] == {}  # kvflow's ranking holds nothing
    assert book.report(continuum.pins)["pinned_tokens"] == {"t0": 400, "t1": 100}
    assert book.report()["retained_tokens"] == {"t0": 400, "t1": 100}
    clock.now = 3.0  # Continuum's pins ended; SGLang's retention (30 s) still holds both
    assert book.report(continuum.pins)["pinned_tokens"] == {"t0": 0, "t1": 0}
    assert book.report(retention.pins)["pinned_tokens"] == {"t0": 400, "t1": 100}
    book.resumed("fast", turn(tool="ls", tenant="t0"), 3.0)  # running again: not paused, not pinned
    assert book.report(retention.pins)["pinned_tokens"] == {"t0": 0, "t1": 100}


def test_status_aware_admission_orders_session_turns_by_their_job() -> None:
    _steps, book, _ = session_book()
    book.resumed("old", turn(), 0.0)
    book.resumed("new", turn(), 5.0)

    class Req:
        def __init__(self, workflow: str | None, arrival: float, seq: int) -> None:
            self.workflow, self.arrival, self.seq = workflow, arrival, seq

    queue = [Req("new", 6.0, 1), Req(None, 3.0, 2), Req("old", 7.0, 3)]
    assert [r.seq for r in StatusAwareAdmission(book).order(queue, [])] == [3, 2, 1]
    assert [r.seq for r in StatusAwareAdmission().order(queue, [])] == [1, 2, 3]  # no sessions: arrival

    # kvflow's admission orders by cached prefix, but by job while sessions are live
    cache = TieredCache(100_000, EVICTION.create("lru"))
    cached = list(range(1000, 1300))
    cache.alloc(len(cached))
    cache.commit(cached, len(cached))
    prompts = {1: list(range(2000, 2100)), 2: [*cached, 7], 3: list(range(3000, 3100))}

    def kvflow_order(sessions: SessionBook | None) -> list[int]:
        policy = ADMISSION.create("lpm-status-aware", PolicyContext(tree=cache.tree, sessions=sessions))
        for req in queue:
            policy.arrived(req, "", prompts[req.seq])
        return [r.seq for r in policy.order(queue, [])]

    assert kvflow_order(book) == [3, 2, 1]
    assert kvflow_order(None) == [2, 1, 3]  # the longest cached prefix first


# ---------------------------------------------------------------------- the scenario
def test_agentic_sessions_follow_the_scenario_shape() -> None:
    plans = agentic_sessions(sessions=40, seed=3)
    assert plans == agentic_sessions(sessions=40, seed=3)  # deterministic per seed
    for plan in plans:
        assert 4096 <= len(plan.system) <= 8192 and 5 <= len(plan.turns) <= 30
        assert all(100 <= t.output <= 500 for t in plan.turns)
        assert all(200 <= t.added <= 4000 for t in plan.turns[1:])
        assert plan.turns[-1].tool == "" and all(t.tool for t in plan.turns[:-1])
    starts = [p.start_at for p in plans]
    assert starts == sorted(starts) and starts[0] > 0
    import random
    rng = random.Random(0)
    fast = sorted(draw_pause(rng, "ls") for _ in range(400))
    slow = sorted(draw_pause(rng, "build") for _ in range(400))
    assert fast[200] < 0.5 and slow[200] > 10.0  # bimodal across tools, heavy tails within
    planners = agentic_sessions(sessions=4, variant="planner", seed=3)
    assert all(p.spawn and sum(t.tool == "spawn" for t in p.turns) == 1 for p in planners)


def test_agentic_run_sets_the_pool_by_pressure_and_reports_pauses() -> None:
    scenario = agentic(sessions=12, pressure=2.0, seed=5)
    out = run_policies(scenario, load_profile("h100-llama3.1-8b"), ["lru", "hicache", "kvflow", "pause-oracle"])
    params = out["params"]
    assert params["device_kv_tokens"] >= largest_need(scenario.sessions)
    assert params["measured_pressure"] == pytest.approx(2.0, rel=0.01) or \
        params["device_kv_tokens"] == largest_need(scenario.sessions) + 1
    results = out["results"]
    assert all(r["workflows_measured"] == 12 for r in results.values())  # every job completed
    assert results["lru"]["loaded_tokens"] == 0 and results["hicache"]["loaded_tokens"] > 0
    assert results["kvflow"]["recomputed_tokens"] <= results["lru"]["recomputed_tokens"]
    oracle, learned = results["pause-oracle"]["pauses"], results["kvflow"]["pauses"]
    assert oracle["mean_abs_error_s"] < 1e-6 < learned["mean_abs_error_s"]
    assert oracle["prefetch_due_late"] == 0 and oracle["pauses"] == learned["pauses"] > 0
    # where each history was when its client came back: every ended pause counted once
    for result in results.values():
        assert sum(result["pauses"]["history_at_return"].values()) == oracle["pauses"]
    lru_returns, oracle_returns = results["lru"]["pauses"]["history_at_return"], oracle["history_at_return"]
    assert lru_returns["loading"] == 0  # nothing is ever loaded back without a host tier
    assert oracle_returns["ready"] > lru_returns["ready"]  # prefetched ahead of each return


def test_agentic_planner_variant_completes_every_session() -> None:
    scenario = agentic(sessions=4, pressure=2.0, variant="planner", seed=2)
    out = run_policies(scenario, load_profile("h100-llama3.1-8b"), ["kvflow", "continuum"])
    jobs = 4 + sum(len(p.spawn) for p in scenario.sessions)
    assert all(r["workflows_measured"] == jobs for r in out["results"].values())


def test_sim_cli_runs_the_agentic_scenario() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", "--scenario", "agentic", "--sessions", "6",
                           "--pressure", "2", "--profile", "h100-llama3.1-8b", "--policies", "hicache,kvflow",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["scenario"] == "agentic" and set(out["results"]) == {"hicache", "kvflow"}
    bad = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "sim", "--scenario", "agentic", "--sessions", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--sessions must be at least 1" in bad.stderr


def test_the_retention_bound_reaches_every_engine_from_the_app_config() -> None:
    from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
    from kvflow_ray.engines.cpu.engine import CpuEngine
    from kvflow_ray.engines.sim.serving import SimEngine
    from kvflow_ray.serve.config import AppConfig

    assert AppConfig(session_retain_tokens=5000).session_retain_tokens == 5000
    with pytest.raises(ValueError):
        AppConfig(session_retain_tokens=0)
    with CpuEngine(CpuEngineConfig(model=ModelConfig(), device_kv_tokens=512, host_kv_tokens=1024,
                                   session_retain_tokens=700)) as engine:
        assert engine.scheduler.sessions.tenant_retain_tokens == 700
    sim = SimEngine("h100-llama3.1-8b", session_retain_tokens=900)
    try:
        assert sim.replica.scheduler.sessions.tenant_retain_tokens == 900
    finally:
        sim.close()
