"""Tests for the Agent Step Graph (docs/design.md §3 semantics, §6 spec validation, §8 `validate` CLI)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow_ray.core.graph import (
    KEY_PART_RE,
    AgentSpec,
    SpecError,
    UnknownAgentError,
    WorkflowSpec,
    WorkflowState,
    is_name,
    load_spec,
    loads_spec,
    parse_spec,
)

INF = math.inf
REPO_ROOT = Path(__file__).resolve().parents[1]


def chain(*names: str, join: str = "all", loop: bool = False) -> dict[str, Any]:
    """Spec data for a -> b -> c ...; with loop=True the last feeds the first and the first is entry."""
    agents: dict[str, Any] = {}
    for i, name in enumerate(names):
        after = [names[i - 1]] if i else ([names[-1]] if loop else [])
        agents[name] = {"after": after, "join": join}
    data: dict[str, Any] = {"name": "chain", "agents": agents}
    if loop:
        data["entry"] = names[0]
    return data


def barrier(join: str) -> WorkflowSpec:
    return parse_spec(
        {
            "name": "barrier",
            "agents": {
                "planner": {},
                "executor1": {"after": ["planner"]},
                "x": {"after": ["planner"]},
                "executor2": {"after": ["x"]},
                "expresser": {"after": ["executor1", "executor2"], "join": join},
            },
        }
    )


def diamond() -> WorkflowSpec:
    return parse_spec(
        {
            "name": "diamond",
            "agents": {"A": {}, "B": {"after": ["A"]}, "C": {"after": ["A"]}, "D": {"after": ["B", "C"]}},
        }
    )


# ---------------------------------------------------------------------------------------------------
# docs/design.md §3 examples


def test_sequential() -> None:
    spec = parse_spec(chain("planner", "searcher", "executor", "expresser"))
    state = WorkflowState(spec)  # start agent (planner) running
    assert state.running == {"planner"}
    assert state.steps_to_execution() == {"planner": 0, "searcher": 1, "executor": 2, "expresser": 3}


def test_barrier_join_all_waits_for_slowest() -> None:
    e = WorkflowState(barrier("all")).steps_to_execution()
    assert e["executor1"] == 1
    assert e["executor2"] == 2
    assert e["expresser"] == 3


def test_branch_join_any_takes_fastest() -> None:
    e = WorkflowState(barrier("any")).steps_to_execution()
    assert (e["executor1"], e["executor2"], e["expresser"]) == (1, 2, 2)


def test_loop() -> None:
    spec = parse_spec(chain("planner", "executor", "expresser", "reviewer", loop=True))
    state = WorkflowState(spec, running=["executor"])
    assert state.steps_to_execution() == {"planner": 3, "executor": 0, "expresser": 1, "reviewer": 2}


def test_loop_keeps_cycling_after_finish() -> None:
    spec = parse_spec(chain("planner", "executor", "expresser", "reviewer", loop=True))
    state = WorkflowState(spec)
    assert state.steps_to_execution() == {"planner": 0, "executor": 1, "expresser": 2, "reviewer": 3}
    state.finish("planner")
    assert state.steps_to_execution() == {"planner": 4, "executor": 1, "expresser": 2, "reviewer": 3}
    state.start("executor")
    assert state.steps_to_execution() == {"planner": 3, "executor": 0, "expresser": 1, "reviewer": 2}


def test_diamond_barrier_remembers_arrivals() -> None:
    state = WorkflowState(diamond())
    state.finish("A")
    state.start("B")
    state.start("C")
    state.finish("B")
    assert state.steps_to_execution() == {"A": INF, "B": INF, "C": 0, "D": 1}


def test_barrier_all_arrived_is_ready() -> None:
    state = WorkflowState(diamond())
    for op, agent in [("finish", "A"), ("start", "B"), ("start", "C"), ("finish", "B"), ("finish", "C")]:
        getattr(state, op)(agent)
    assert state.steps_to_execution()["D"] == 1
    state.start("D")  # consumes the arrivals
    assert state.arrived.get("D") is None
    assert state.steps_to_execution() == {"A": INF, "B": INF, "C": INF, "D": 0}


def test_finish_and_ready_is_the_walk_step() -> None:
    state = WorkflowState(diamond())
    assert state.finish_and_ready("A") == ["B", "C"]  # file order
    state.start("B")
    state.start("C")
    assert state.finish_and_ready("B") == []  # D's barrier still waits for C
    assert state.finish_and_ready("C") == ["D"]
    # join any: the first arrival makes the successor ready, a later one does not start it twice
    state = WorkflowState(barrier("any"), running=["executor1", "executor2"])
    assert state.finish_and_ready("executor1") == ["expresser"]
    state.start("expresser")
    assert state.finish_and_ready("executor2") == []
    # a loop reports its return to the entry; starting it is the caller's call
    loop = WorkflowState(parse_spec(chain("p", "r", loop=True)))
    assert loop.finish_and_ready("p") == ["r"]
    loop.start("r")
    assert loop.finish_and_ready("r") == ["p"] and loop.running == set()


def test_finished_sequential_successor_is_next() -> None:
    spec = parse_spec(chain("a", "b", "c"))
    state = WorkflowState(spec)
    state.finish("a")
    assert state.steps_to_execution() == {"a": INF, "b": 1, "c": 2}


def test_join_any_with_arrived_predecessor_is_ready() -> None:
    # Interpretation beyond §3's examples: once any predecessor of a `join: any` agent has arrived,
    # it runs next (E = 1) rather than being treated as unreachable.
    spec = parse_spec(chain("a", "b", join="any"))
    state = WorkflowState(spec)
    state.finish("a")
    assert state.steps_to_execution() == {"a": INF, "b": 1}


def test_nothing_running_is_all_inf() -> None:
    state = WorkflowState(parse_spec(chain("a", "b")), running=[])
    assert state.steps_to_execution() == {"a": INF, "b": INF}


def test_loop_of_barriers_without_running_agent_stays_inf() -> None:
    # Greatest fixed point: a cycle that nothing feeds must not invent finite values.
    spec = parse_spec(
        {
            "name": "cyc",
            "entry": "a",
            "agents": {"a": {"after": ["b"]}, "b": {"after": ["a"], "join": "any"}},
        }
    )
    assert WorkflowState(spec, running=[]).steps_to_execution() == {"a": INF, "b": INF}


def test_self_loop() -> None:
    spec = parse_spec({"name": "self", "agents": {"a": {}, "b": {"after": ["a", "b"], "join": "any"}}})
    state = WorkflowState(spec)
    state.finish("a")
    state.start("b")
    state.finish("b")
    assert state.steps_to_execution() == {"a": INF, "b": 1}


def test_copy_is_independent() -> None:
    state = WorkflowState(diamond())
    state.finish("A")
    clone = state.copy()
    clone.start("B")
    clone.finish("B")
    assert state.running == set()
    assert state.arrived == {"B": {"A"}, "C": {"A"}}
    assert clone.arrived == {"C": {"A"}, "D": {"B"}}
    assert clone.spec is state.spec


def test_state_dict_round_trip() -> None:
    state = WorkflowState(diamond())
    state.finish("A")
    state.start("B")
    restored = WorkflowState.from_dict(state.spec, json.loads(json.dumps(state.to_dict())))
    assert restored.running == state.running
    assert restored.arrived == state.arrived
    assert restored.steps_to_execution() == state.steps_to_execution()


def test_successors_and_start_agents() -> None:
    spec = diamond()
    assert spec.successors("A") == ("B", "C")
    assert spec.successors("D") == ()
    assert spec.start_agents() == ("A",)
    loop = parse_spec(chain("p", "e", loop=True))
    assert loop.start_agents() == ("p",)
    multi = parse_spec({"name": "m", "agents": {"a": {}, "b": {}, "c": {"after": ["a", "b"]}}})
    assert multi.start_agents() == ("a", "b")
    assert WorkflowState(multi).running == {"a", "b"}


# ---------------------------------------------------------------------------------------------------
# Unknown agents in live-state operations


def test_unknown_agent_error() -> None:
    state = WorkflowState(diamond())
    with pytest.raises(UnknownAgentError) as info:
        state.start("Z")
    message = str(info.value)
    assert "'Z'" in message and "'diamond'" in message
    assert info.value.agent == "Z" and info.value.workflow == "diamond"
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownAgentError):
        state.finish("Z")
    with pytest.raises(UnknownAgentError):
        WorkflowState(diamond(), running=["Z"])
    with pytest.raises(UnknownAgentError):
        diamond().successors("Z")


# ---------------------------------------------------------------------------------------------------
# Spec validation: each invalid case names its field


def valid_data() -> dict[str, Any]:
    return {
        "name": "peer",
        "entry": "planner",
        "agents": {
            "planner": {"prompt": "You are the Planner", "after": ["reviewer"]},
            "executor": {"after": ["planner"]},
            "expresser": {"after": ["executor"]},
            "reviewer": {"after": ["expresser"]},
            "summarizer": {"after": ["executor", "reviewer"], "join": "any"},
        },
    }


def expect_error(data: object, field: str, fragment: str = "", base_dir: Path | None = None) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(data, base_dir=base_dir)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(f"{field}: ")
    assert fragment in str(info.value)
    return info.value


def test_valid_design_example() -> None:
    spec = parse_spec(valid_data())
    assert spec.name == "peer" and spec.entry == "planner"
    assert list(spec.agents) == ["planner", "executor", "expresser", "reviewer", "summarizer"]
    assert spec.agents["summarizer"] == AgentSpec("summarizer", None, ("executor", "reviewer"), "any")
    assert spec.agents["planner"].prompt == "You are the Planner"
    assert spec.agents["executor"].join == "all"


def test_error_top_level_not_mapping() -> None:
    expect_error(["name", "x"], "spec", "mapping")
    expect_error(None, "spec", "empty")


def test_error_unknown_top_level_key() -> None:
    data = valid_data() | {"version": 2}
    expect_error(data, "version", "unknown key 'version' (allowed: name, entry, agents, description, task, reuse)")


def test_error_name_missing() -> None:
    data = valid_data()
    del data["name"]
    expect_error(data, "name", "required")


@pytest.mark.parametrize("bad", ["has space", "", "x" * 65, "slash/name", 42])
def test_error_bad_workflow_name(bad: object) -> None:
    expect_error(valid_data() | {"name": bad}, "name")


@pytest.mark.parametrize("name", ["a", "x" * 64, "Peer_v2.1-beta"])
def test_spec_names_fit_store_keys_with_a_version(name: str) -> None:
    # a replaced template is kept as `name@version`: every spec name must leave that a valid key part
    assert is_name(name) and is_name(f"{name}@{'f' * 16}", KEY_PART_RE)
    assert not is_name(f"{name}@{'f' * 16}")  # '@' is the version separator, never part of a spec name


@pytest.mark.parametrize("bad", ["a:b", "a b", "*", "", "x" * 129, None, 7])
def test_key_part_rule_rejects_what_could_escape_a_namespace(bad: object) -> None:
    assert not is_name(bad, KEY_PART_RE) and not is_name(bad)


def test_error_agents_missing() -> None:
    data = valid_data()
    del data["agents"]
    expect_error(data, "agents", "required")


def test_error_agents_empty() -> None:
    expect_error({"name": "x", "agents": {}}, "agents", "at least one agent")


def test_error_agents_not_mapping() -> None:
    expect_error({"name": "x", "agents": ["a", "b"]}, "agents", "mapping")


def test_error_bad_agent_name() -> None:
    expect_error({"name": "x", "agents": {"bad name": {}}}, "agents.bad name", "invalid name")


def test_error_non_string_agent_name() -> None:
    # YAML turns an unquoted `on:` key into True.
    expect_error(loads_spec_data("name: x\nagents:\n  on: {}\n"), "agents.True", "must be a string")


def loads_spec_data(text: str) -> object:
    import yaml

    return yaml.safe_load(text)


def test_error_agent_not_mapping() -> None:
    expect_error({"name": "x", "agents": {"a": "prompt"}}, "agents.a", "mapping")


def test_agent_with_null_body_is_defaults() -> None:
    spec = loads_spec("name: x\nagents:\n  a:\n  b: {after: [a]}\n")
    assert spec.agents["a"] == AgentSpec("a")


def test_error_unknown_agent_key() -> None:
    data = valid_data()
    data["agents"]["executor"]["foo"] = 1
    expect_error(
        data,
        "agents.executor.foo",
        "unknown key 'foo' (allowed: prompt, prompt_file, after, join, next, weights, max_iterations, description)",
    )


def test_error_prompt_not_string() -> None:
    data = valid_data()
    data["agents"]["planner"]["prompt"] = 12
    expect_error(data, "agents.planner.prompt", "string")


def test_error_prompt_file_not_string() -> None:
    data = valid_data()
    data["agents"]["executor"]["prompt_file"] = ["a.txt"]
    expect_error(data, "agents.executor.prompt_file", "string")


def test_error_prompt_and_prompt_file() -> None:
    data = valid_data()
    data["agents"]["planner"]["prompt_file"] = "p.txt"
    expect_error(data, "agents.planner.prompt_file", "prompt")


def test_error_prompt_file_missing(tmp_path: Path) -> None:
    data = valid_data()
    data["agents"]["executor"]["prompt_file"] = "nope.txt"
    err = expect_error(data, "agents.executor.prompt_file", "nope.txt", base_dir=tmp_path)
    assert str(tmp_path) in str(err)


def test_error_after_not_list() -> None:
    data = valid_data()
    data["agents"]["executor"]["after"] = "planner"
    expect_error(data, "agents.executor.after", "list")


def test_error_after_item_not_string() -> None:
    data = valid_data()
    data["agents"]["executor"]["after"] = ["planner", 3]
    expect_error(data, "agents.executor.after[1]", "string")


def test_error_after_unknown_agent() -> None:
    data = valid_data()
    data["agents"]["executor"]["after"] = ["planner", "ghost"]
    err = expect_error(data, "agents.executor.after[1]")
    assert str(err) == "agents.executor.after[1]: unknown agent 'ghost'"


def test_error_after_duplicate() -> None:
    data = valid_data()
    data["agents"]["executor"]["after"] = ["planner", "planner"]
    expect_error(data, "agents.executor.after[1]", "duplicate")


@pytest.mark.parametrize("bad", ["some", "ALL", 1, None])
def test_error_bad_join(bad: object) -> None:
    data = valid_data()
    data["agents"]["summarizer"]["join"] = bad
    expect_error(data, "agents.summarizer.join", "all, any")


def test_error_entry_unknown() -> None:
    expect_error(valid_data() | {"entry": "ghost"}, "entry", "unknown agent 'ghost'")


def test_error_entry_not_string() -> None:
    expect_error(valid_data() | {"entry": ["planner"]}, "entry", "string")


def test_error_entry_required_for_loop() -> None:
    data = valid_data()
    del data["entry"]
    err = expect_error(data, "entry")
    assert str(err) == "entry: required when every agent has a predecessor (the workflow is a loop)"


def test_error_unreachable_agent_with_entry() -> None:
    data = valid_data()
    data["agents"]["orphan"] = {}  # no `after`, but the workflow starts at its entry only
    expect_error(data, "agents.orphan", "unreachable from the entry")


def test_error_unreachable_cycle_without_entry() -> None:
    data = {"name": "x", "agents": {"a": {}, "b": {"after": ["c"]}, "c": {"after": ["b"]}}}
    expect_error(data, "agents.b", "unreachable from the entry")


def test_error_description_not_string() -> None:
    expect_error(valid_data() | {"description": 5}, "description", "string")
    data = valid_data()
    data["agents"]["planner"]["description"] = {"a": 1}
    expect_error(data, "agents.planner.description", "string")


def test_task_is_an_optional_string_that_round_trips() -> None:
    spec = parse_spec(valid_data() | {"task": "What is 2 + 2?"})
    assert spec.task == "What is 2 + 2?" and parse_spec(spec.to_dict()) == spec
    assert parse_spec(valid_data()).task is None and "task" not in parse_spec(valid_data()).to_dict()
    expect_error(valid_data() | {"task": ["a"]}, "task", "string")


def test_error_duplicate_yaml_key() -> None:
    with pytest.raises(SpecError) as info:
        loads_spec("name: x\nagents:\n  a: {}\n  a: {after: [a]}\n")
    assert info.value.field == "file" and "duplicate key 'a'" in str(info.value)


def test_error_invalid_yaml() -> None:
    with pytest.raises(SpecError) as info:
        loads_spec("name: [unclosed\n")
    assert info.value.field == "file"


def test_error_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "missing.yaml")
    assert info.value.field == "file" and "missing.yaml" in str(info.value)


def test_error_invalid_json_file(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text('{"name": ')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.field == "file" and "JSON" in str(info.value)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(SpecError) as info:
        WorkflowSpec("w", None, {"a": AgentSpec("a", after=("zzz",))})
    assert info.value.field == "agents.a.after[0]"
    with pytest.raises(SpecError):
        AgentSpec("a", join="maybe")


# ---------------------------------------------------------------------------------------------------
# Loading


PEER_YAML = """\
name: peer
entry: planner
agents:
  planner:
    prompt_file: prompts/planner.txt
    after: [reviewer]
  executor:  {after: [planner]}
  expresser: {after: [executor]}
  reviewer:  {after: [expresser]}
  summarizer: {after: [executor, reviewer], join: any}
"""


def write_peer(tmp_path: Path) -> Path:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "planner.txt").write_text("You are the Planner.\n", encoding="utf-8")
    path = tmp_path / "peer.yaml"
    path.write_text(PEER_YAML, encoding="utf-8")
    return path


def test_load_yaml_with_relative_prompt_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_peer(tmp_path)
    monkeypatch.chdir("/")  # the prompt file must resolve against the spec's folder, not the cwd
    spec = load_spec(str(path))
    assert spec.agents["planner"].prompt == "You are the Planner.\n"
    assert spec.agents["summarizer"].join == "any"
    assert spec.successors("executor") == ("expresser", "summarizer")


def test_loads_spec_base_dir(tmp_path: Path) -> None:
    write_peer(tmp_path)
    spec = loads_spec(PEER_YAML, base_dir=tmp_path)
    assert spec.agents["planner"].prompt == "You are the Planner.\n"


def test_load_json_and_yml(tmp_path: Path) -> None:
    data = valid_data()
    (tmp_path / "w.json").write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "w.yml").write_text(json.dumps(data), encoding="utf-8")  # YAML parser reads JSON too
    from_json = load_spec(tmp_path / "w.json")
    assert from_json == parse_spec(data)
    assert load_spec(tmp_path / "w.yml") == from_json
    assert loads_spec(json.dumps(data)) == from_json


def test_to_dict_round_trip(tmp_path: Path) -> None:
    spec = load_spec(write_peer(tmp_path))
    data = spec.to_dict()
    again = parse_spec(json.loads(json.dumps(data)))
    assert again == spec
    assert again.to_dict() == data
    described = parse_spec(valid_data() | {"description": "demo"})
    assert parse_spec(described.to_dict()) == described


# ---------------------------------------------------------------------------------------------------
# CLI: `kvflow-ray validate`


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvflow_ray.cli", "validate", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
    )


def test_cli_valid_json_default_state(tmp_path: Path) -> None:
    proc = run_cli(str(write_peer(tmp_path)), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "valid": True,
        "name": "peer",
        "steps_to_execution": {"planner": 0, "executor": 1, "expresser": 2, "reviewer": 3, "summarizer": 2},
        "expected_steps": {"planner": 0, "executor": 1, "expresser": 2, "reviewer": 3, "summarizer": 2},
    }


def test_cli_running_and_finished(tmp_path: Path) -> None:
    path = tmp_path / "diamond.yaml"
    path.write_text(json.dumps(diamond().to_dict()), encoding="utf-8")
    proc = run_cli(str(path), "--finished", "A", "B", "--running", "C", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps_to_execution"] == {"A": None, "B": None, "C": 0, "D": 1}


def test_cli_table(tmp_path: Path) -> None:
    proc = run_cli(str(write_peer(tmp_path)), "--running", "executor")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split()[:2] == ["summarizer", "any"] for line in lines if line.strip())
    assert any(line.startswith("planner") and line.rstrip().endswith("3") for line in lines)


def test_cli_invalid_spec(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nagents:\n  a: {}\n  b: {after: [ghost]}\n", encoding="utf-8")
    proc = run_cli(str(path), "--json")
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"valid": False, "error": "agents.b.after[0]: unknown agent 'ghost'"}
    proc = run_cli(str(path))
    assert proc.returncode == 2
    assert "agents.b.after[0]" in proc.stderr and proc.stdout == ""


def test_cli_unknown_running_agent(tmp_path: Path) -> None:
    proc = run_cli(str(write_peer(tmp_path)), "--running", "ghost", "--json")
    assert proc.returncode == 2
    out = json.loads(proc.stdout)
    assert out["valid"] is False and out["error"].startswith("--running: unknown agent 'ghost'")


def test_cli_unknown_finished_agent(tmp_path: Path) -> None:
    proc = run_cli(str(write_peer(tmp_path)), "--finished", "ghost", "--json")
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"].startswith("--finished: unknown agent 'ghost'")


def test_cli_missing_file(tmp_path: Path) -> None:
    proc = run_cli(str(tmp_path / "nope.yaml"), "--json")
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"].startswith("file: ")


# ---------------------------------------------------------------------------------------------------
# Property tests


@st.composite
def graph_specs(draw: st.DrawFn) -> dict[str, Any]:
    """Random valid spec data: a spanning tree from agent a0 guarantees reachability; extra edges in
    any direction add barriers, branches and loops."""
    n = draw(st.integers(min_value=1, max_value=8))
    names = [f"a{i}" for i in range(n)]
    preds: list[set[int]] = [set() for _ in range(n)]
    for i in range(1, n):
        preds[i].add(draw(st.integers(0, i - 1)))
    for src, dst in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n)):
        preds[dst].add(src)
    joins = draw(st.lists(st.sampled_from(["all", "any"]), min_size=n, max_size=n))
    agents = {names[i]: {"after": [names[j] for j in sorted(preds[i])], "join": joins[i]} for i in range(n)}
    data: dict[str, Any] = {"name": "rand", "agents": agents}
    if preds[0]:
        data["entry"] = "a0"  # a0 is in a loop, so the spec needs an explicit entry
    return data


ops_strategy = st.lists(st.tuples(st.sampled_from(["start", "finish"]), st.integers(0, 7)), max_size=20)


def replay(spec: WorkflowSpec, running: list[int], ops: list[tuple[str, int]]) -> WorkflowState:
    names = list(spec.agents)
    state = WorkflowState(spec, running=[names[i % len(names)] for i in running])
    for op, i in ops:
        getattr(state, op)(names[i % len(names)])
    return state


def expected_from(state: WorkflowState, e: dict[str, float], name: str) -> float:
    """The §3 recurrence for one agent, given everyone's E."""
    if name in state.running:
        return 0
    agent = state.spec.agents[name]
    if not agent.after:
        return INF
    arrived = state.arrived.get(name, set())
    if agent.join == "all":
        pending = [u for u in agent.after if u not in arrived]
        return max(e[u] for u in pending) + 1 if pending else 1
    return 1 if arrived else min(e[u] for u in agent.after) + 1


def reference_steps(state: WorkflowState) -> dict[str, float]:
    """Straightforward Jacobi iteration from E = ∞, len(agents) + 1 rounds: the greatest fixed point."""
    e: dict[str, float] = {a: (0 if a in state.running else INF) for a in state.spec.agents}
    for _ in range(len(e) + 1):
        new = {a: expected_from(state, e, a) for a in e}
        if new == e:
            break
        e = new
    return e


@settings(max_examples=300, deadline=None)
@given(graph_specs(), st.lists(st.integers(0, 7), max_size=3), ops_strategy)
def test_property_recurrence_and_greatest_fixed_point(
    data: dict[str, Any], running: list[int], ops: list[tuple[str, int]]
) -> None:
    spec = parse_spec(data)
    state = replay(spec, running, ops)
    e = state.steps_to_execution()
    assert list(e) == list(spec.agents)
    for name in spec.agents:
        assert e[name] == expected_from(state, e, name), name
        assert e[name] == INF or (isinstance(e[name], int) and 0 <= e[name] <= len(spec.agents))
    assert e == reference_steps(state)
    # Computing E must not change the state.
    assert state.steps_to_execution() == e


@settings(max_examples=300, deadline=None)
@given(graph_specs(), st.lists(st.integers(0, 7), max_size=3), ops_strategy)
def test_property_any_join_never_later_than_all_join(
    data: dict[str, Any], running: list[int], ops: list[tuple[str, int]]
) -> None:
    def with_join(join: str) -> WorkflowSpec:
        agents = {k: v | {"join": join} for k, v in data["agents"].items()}
        return parse_spec(data | {"agents": agents})

    e_any = replay(with_join("any"), running, ops).steps_to_execution()
    e_all = replay(with_join("all"), running, ops).steps_to_execution()
    for name in e_any:
        assert e_any[name] <= e_all[name], name


@settings(max_examples=100, deadline=None)
@given(graph_specs(), st.lists(st.integers(0, 7), max_size=3), ops_strategy)
def test_property_copy_and_to_dict(
    data: dict[str, Any], running: list[int], ops: list[tuple[str, int]]
) -> None:
    spec = parse_spec(data)
    assert parse_spec(spec.to_dict()) == spec
    state = replay(spec, running, ops)
    clone = state.copy()
    restored = WorkflowState.from_dict(spec, state.to_dict())
    assert clone.steps_to_execution() == restored.steps_to_execution() == state.steps_to_execution()


def test_readme_style_yaml_text() -> None:
    spec = loads_spec(
        textwrap.dedent("""\
        name: sequential
        agents:
          planner: {prompt: "You are the Planner"}
          searcher: {after: [planner]}
        """)
    )
    assert WorkflowState(spec).steps_to_execution() == {"planner": 0, "searcher": 1}
