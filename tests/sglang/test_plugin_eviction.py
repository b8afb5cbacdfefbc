"""KVFlow eviction order inside SGLang's own trees (docs/design.md §3), with the plugin registered.

Every cache here is SGLang 0.5.23's (the unified tree on its Python core, and the legacy
`RadixCache`) with real CPU pools; requests go through SGLang's `Req` and `checkpoint`, which is
where the plugin tags fixed prompts. Steps-to-execution come from `kvflow_ray.core.graph` and reach
the plugin through the same control path the router uses (`Scheduler.kvflow_apply_hints`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_caches as sc

from kvflow_ray.core.graph import WorkflowState, parse_spec
from kvflow_ray.engines.sglang import protocol
from kvflow_ray.engines.sglang.state import TAGS_ATTR, reset_state, state

FIXED, DYNAMIC, PREAMBLE = 40, 8, 24


def prompt(agent_index: int, preamble: bool = False) -> list[int]:
    head = list(range(10_000, 10_000 + PREAMBLE)) if preamble else []
    return head + [1000 * (agent_index + 1) + j for j in range(FIXED)]


def suffix(agent_index: int, call: int = 0) -> list[int]:
    return [500_000 + 1000 * agent_index + 100 * call + j for j in range(DYNAMIC)]


def hints(rig: sc.CacheRig, steps: dict[str, dict[str, float]],
          prompts: dict[tuple[str, str], list[int]] | None = None, retire: tuple[str, ...] = ()) -> None:
    """What the router sends, through the scheduler method `collective_rpc` calls."""
    rig.hints(protocol.encode_hints(steps, prompts or {}, retire))


def eviction_order(rig: sc.CacheRig, calls: dict[str, list[int]], fixed: dict[str, list[int]]) -> list[str]:
    """Evict a few tokens at a time and record when each agent's cached call shrinks, as
    '<agent>/dynamic' (its suffix went) and '<agent>/fixed' (its own fixed prompt went)."""
    order: list[str] = []
    while rig.evictable() > 0:
        assert rig.evict(4) > 0
        for agent, tokens in calls.items():
            matched = rig.matched(tokens)
            if matched < len(tokens) and f"{agent}/dynamic" not in order:
                order.append(f"{agent}/dynamic")
            if matched < len(fixed[agent]) and f"{agent}/fixed" not in order:
                order.append(f"{agent}/fixed")
    return order


def steps_of(spec: dict, running: list[str]) -> dict[str, float]:
    return WorkflowState(parse_spec(spec), running=running).steps_to_execution()


SEQUENTIAL = {"name": "seq", "agents": {"planner": {}, "searcher": {"after": ["planner"]},
                                         "executor": {"after": ["searcher"]}, "expresser": {"after": ["executor"]}}}


@pytest.fixture(params=sc.TREES)
def rig(request: pytest.FixtureRequest, sglang_plugin: None) -> sc.CacheRig:
    reset_state()
    return sc.build(request.param, "kvflow")


def serve_agents(rig: sc.CacheRig, client: str, agents: list[str], preamble: bool = False,
                 serve_order: list[str] | None = None) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    fixed = {a: prompt(i, preamble) for i, a in enumerate(agents)}
    calls = {a: fixed[a] + suffix(i) for i, a in enumerate(agents)}
    for agent in serve_order or agents:
        rig.serve(calls[agent], client, agent, fixed=len(fixed[agent]))
    return fixed, calls


def test_sequential_workflow_evicts_suffixes_then_farthest_agent_first(rig: sc.CacheRig) -> None:
    agents = ["planner", "searcher", "executor", "expresser"]
    steps = steps_of(SEQUENTIAL, running=["planner"])
    assert steps == {"planner": 0, "searcher": 1, "executor": 2, "expresser": 3}
    hints(rig, {"c1": steps})
    # served newest-last in the order LRU would keep best: expresser ran most recently
    fixed, calls = serve_agents(rig, "c1", agents)
    order = eviction_order(rig, calls, fixed)
    dynamic = [e for e in order if e.endswith("/dynamic")]
    assert order[:4] == dynamic, "dynamic suffixes go before any fixed prompt"
    assert [e for e in order if e.endswith("/fixed")] == [
        "expresser/fixed", "executor/fixed", "searcher/fixed", "planner/fixed"]


def fixed_eviction_order(tree: str, client: str, steps: dict[str, float], serve_order: list[str]) -> list[str]:
    """On a fresh kvflow cache: send `steps`, serve one call per agent in `serve_order` (later =
    more recently used), evict everything; the order in which the agents' fixed prompts went."""
    reset_state()
    rig = sc.build(tree, "kvflow")
    hints(rig, {client: steps})
    agents = sorted(serve_order)
    fixed, calls = serve_agents(rig, client, agents, serve_order=serve_order)
    return [e.removesuffix("/fixed") for e in eviction_order(rig, calls, fixed) if e.endswith("/fixed")]


def test_barrier_and_branch_steps_order_eviction(rig: sc.CacheRig) -> None:
    """Barrier: Executor1 at 1, Executor2 at 2, Expresser (join: all) at 3. With `join: any`
    Expresser is at 2 and ties with Executor2, so the least recently used of the two goes first."""
    spec = {"name": "fan", "agents": {
        "planner": {}, "executor1": {"after": ["planner"]}, "helper": {"after": ["planner"]},
        "executor2": {"after": ["helper"]}, "expresser": {"after": ["executor1", "executor2"]}}}
    steps = steps_of(spec, running=["planner"])
    assert (steps["executor1"], steps["executor2"], steps["expresser"]) == (1, 2, 3)
    agents = ["executor1", "executor2", "expresser"]
    assert fixed_eviction_order(rig.tree, "c1", {a: steps[a] for a in agents},
                                ["expresser", "executor2", "executor1"]) == ["expresser", "executor2", "executor1"]

    spec["agents"]["expresser"]["join"] = "any"
    steps = steps_of(spec, running=["planner"])
    assert steps["expresser"] == 2
    # executor2 served first, so it is the least recently used of the two at distance 2
    assert fixed_eviction_order(rig.tree, "c2", {a: steps[a] for a in agents},
                                ["executor2", "expresser", "executor1"]) == ["executor2", "expresser", "executor1"]


def test_loop_orders_eviction_against_recency(rig: sc.CacheRig) -> None:
    """Loop Planner → Executor → Expresser → Reviewer → Planner with Executor running: Expresser 1,
    Reviewer 2, Planner 3. Planner's prompt, used most recently (LRU would keep it longest), is the
    first fixed prompt to go; Expresser's, used longest ago, the last."""
    spec = {"name": "loop", "entry": "planner", "agents": {
        "planner": {"after": ["reviewer"]}, "executor": {"after": ["planner"]},
        "expresser": {"after": ["executor"]}, "reviewer": {"after": ["expresser"]}}}
    steps = steps_of(spec, running=["executor"])
    assert (steps["expresser"], steps["reviewer"], steps["planner"]) == (1, 2, 3)
    agents = ["planner", "expresser", "reviewer"]
    assert fixed_eviction_order(rig.tree, "c1", {a: steps[a] for a in agents},
                                ["expresser", "reviewer", "planner"]) == ["planner", "reviewer", "expresser"]


def test_barrier_memory_keeps_the_join_agent_near(rig: sc.CacheRig) -> None:
    """Diamond A → {B, C} → D (`join: all`) with B finished and C running: D = 1 (B already
    arrived), A and B = ∞. D's prompt outlives A's and B's although it was used first."""
    spec = {"name": "diamond", "agents": {"a": {}, "b": {"after": ["a"]}, "c": {"after": ["a"]},
                                          "d": {"after": ["b", "c"]}}}
    state = WorkflowState(parse_spec(spec))  # a runs
    for op, agent in [("finish", "a"), ("start", "b"), ("start", "c"), ("finish", "b")]:
        getattr(state, op)(agent)
    steps = state.steps_to_execution()
    assert steps == {"a": float("inf"), "b": float("inf"), "c": 0, "d": 1}
    order = fixed_eviction_order(rig.tree, "c1", steps, ["d", "a", "b", "c"])
    assert order[-2:] == ["d", "c"] and set(order[:2]) == {"a", "b"}
    assert order[:2] == ["a", "b"], "A and B tie at infinity: least recently used first"


def test_shared_preamble_kept_while_any_near_agent_uses_it(rig: sc.CacheRig) -> None:
    """Two instances of one template share a preamble node (min over its users). Instance c1's
    agent is about to run, c2's are far: c2's prompts go, the preamble stays; once c1 retires,
    the preamble goes like everything else of a finished workflow."""
    hints(rig, {"c1": {"writer": 0}, "c2": {"writer": 5, "editor": 6}})
    preamble = list(range(10_000, 10_000 + PREAMBLE))
    c1_writer = prompt(0, preamble=True)
    c2_writer = preamble + [70_000 + j for j in range(FIXED)]
    c2_editor = preamble + [80_000 + j for j in range(FIXED)]
    rig.serve(c1_writer + suffix(0), "c1", "writer", fixed=len(c1_writer))
    rig.serve(c2_writer + suffix(1), "c2", "writer", fixed=len(c2_writer))
    rig.serve(c2_editor + suffix(2), "c2", "editor", fixed=len(c2_editor))
    shared = rig.node(rig.match(preamble).last_device_node)
    assert getattr(shared, TAGS_ATTR) == {("c1", "writer"), ("c2", "writer"), ("c2", "editor")}

    freed = rig.evict(3 * DYNAMIC + 2 * FIXED)  # everything but c1's prompt and the preamble
    assert freed >= 3 * DYNAMIC + 2 * FIXED
    assert rig.matched(c1_writer) == len(c1_writer)
    assert rig.matched(c2_writer) == PREAMBLE and rig.matched(c2_editor) == PREAMBLE

    hints(rig, {}, retire=("c1",))  # c1 finished: its nodes rank as untagged (+inf) now
    rig.serve(c2_editor + suffix(3), "c2", "editor", fixed=len(c2_editor))  # c2 live again, far away
    rig.evict(FIXED)
    assert rig.matched(c1_writer) == PREAMBLE, "the retired workflow's prompt goes before a live one"
    assert rig.matched(c2_editor) >= len(c2_editor)


def test_plain_requests_are_untagged_and_go_first(rig: sc.CacheRig) -> None:
    hints(rig, {"c1": {"a": 4}})
    agent_call = prompt(0) + suffix(0)
    rig.serve(agent_call, "c1", "a", fixed=FIXED)
    plain = [900_000 + j for j in range(FIXED)]
    rig.serve(plain)  # newer than the agent's call; LRU would evict the agent's prompt first
    assert not getattr(rig.node(rig.match(plain).last_device_node), TAGS_ATTR, None)
    rig.evict(DYNAMIC + FIXED)
    assert rig.matched(plain) == 0
    assert rig.matched(agent_call) == FIXED


def test_prefetch_budget_counts_only_what_is_needed_later_than_the_agent(rig: sc.CacheRig) -> None:
    """`farther_evictable`: device tokens whose distance under the eviction policy (through the node
    view, cached per node) is farther than the agent to load; suffixes are untagged (+inf)."""
    hints(rig, {"c1": {"a": 0, "b": 3}})
    serve_agents(rig, "c1", ["a", "b"])
    root = rig.cache.tree_core.root_node if rig.tree == "unified" else rig.cache.root_node
    st = state()
    assert st.farther_evictable(root, 1) == FIXED + 2 * DYNAMIC  # b's prompt and both suffixes
    assert st.farther_evictable(root, 5) == 2 * DYNAMIC
    hints(rig, {"c1": {"a": 4, "b": 3}})  # a new book version: cached distances are recomputed
    assert st.farther_evictable(root, 1) == 2 * FIXED + 2 * DYNAMIC


# ------------------------------------------------------------------------------- lru is unchanged

LRU_SCENARIO = """
import json, sys
sys.path[:0] = {paths!r}
import conftest  # the torchvision stand-in, nothing else
{register}
import sglang_caches as sc
out = {{}}
for tree in sc.TREES:
    rig = sc.build(tree, "lru")
    calls = [[1000 * (i + 1) + j for j in range(40)] + [5000 + 100 * i + j for j in range(8)] for i in range(4)]
    for i, call in enumerate(calls):
        rig.serve(call, "c1", f"agent{{i}}", fixed=40)
    rig.serve(calls[0][:20] + [7, 7, 7])  # a split inside agent0's prompt
    trace = []
    while rig.evictable() > 0:
        rig.evict(5)
        trace.append([rig.matched(call) for call in calls])
    out[tree] = trace
print(json.dumps(out))
"""


def _lru_trace(register: bool) -> dict[str, list[list[int]]]:
    here = Path(__file__).parent
    code = LRU_SCENARIO.format(
        paths=[str(here), str(here.parent.parent)],
        register=("from kvflow_ray.engines.sglang import plugin\nplugin.register()\n"
                  "from sglang.srt.plugins.hook_registry import HookRegistry\nHookRegistry.apply_hooks()"
                  if register else ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lru_behaviour_is_unchanged_when_kvflow_is_not_selected() -> None:
    """The same requests on `lru` caches, in a process with the plugin's hooks installed and in one
    without the plugin at all, evict exactly the same tokens at every step."""
    with_plugin, without = _lru_trace(register=True), _lru_trace(register=False)
    assert with_plugin == without
    for tree in sc.TREES:
        trace = with_plugin[tree]
        assert len(trace) >= 4 and trace[-1] == [0, 0, 0, 0]
        # plain LRU: the last request touched agent0's call (it split it), so agent1's is the least
        # recently used and shrinks first, though under kvflow it would be as near as the others
        first_change = next(step for step in trace if step != [48, 48, 48, 48])
        assert first_change[1] < 48 and first_change[0] == first_change[2] == first_change[3] == 48


# ------------------------------------------------------------------------------- under pressure

LOOP = {"name": "loop4", "entry": "planner", "agents": {
    "planner": {"after": ["reviewer"]}, "executor": {"after": ["planner"]},
    "expresser": {"after": ["executor"]}, "reviewer": {"after": ["expresser"]}}}


def run_loop(tree: str, policy: str, iterations: int = 3) -> list[int]:
    """A 4-agent loop whose prompts do not all fit: the 152-token pool holds the running call (48
    tokens) and two of the other fixed prompts (80), not all three (120). Before each
    call the workflow layer sends the new steps-to-execution (as the router does); SGLang evicts on
    its own allocation path (`evict_from_tree_cache`). Returns the cached prefix of every call."""
    reset_state()
    rig = sc.build(tree, policy, kv_tokens=3 * (FIXED + DYNAMIC) + DYNAMIC)
    spec = parse_spec(LOOP)
    agents = ["planner", "executor", "expresser", "reviewer"]
    state = WorkflowState(spec, running=[])
    hits = []
    for it in range(iterations):
        for i, agent in enumerate(agents):
            state.start(agent)
            hints(rig, {"c1": state.steps_to_execution()})
            call = prompt(i) + suffix(i, it)
            hits.append(rig.matched(call))
            rig.serve(call, "c1", agent, fixed=FIXED)
            state.finish(agent)
    return hits


@pytest.mark.parametrize("tree", sc.TREES)
def test_under_memory_pressure_kvflow_keeps_the_next_agents_prompt(sglang_plugin: None, tree: str) -> None:
    """A loop is LRU's worst case: the agent that ran longest ago runs next, so LRU evicts exactly
    the prompt about to be needed. KVFlow evicts the agent that just ran (it is the farthest)."""
    kvflow, lru = run_loop(tree, "kvflow"), run_loop(tree, "lru")
    warm = slice(4, None)  # the first iteration is cold for both
    assert all(hit == 0 for hit in lru[warm]), lru
    kvflow_hits = [hit for hit in kvflow[warm] if hit >= FIXED]
    # Besides the running call, the pool holds two of the other three prompts, so even the offline
    # optimum (Belady) finds at most every other call's prompt cached: kvflow reaches it
    assert len(kvflow_hits) >= len(kvflow[warm]) // 2, kvflow
