"""Dynamic workflows in the spec (docs/design.md §6): `next: one` with weights, `max_iterations`, and the
expected steps that weigh exclusive choices by their probabilities."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow_ray.core.graph import SpecError, WorkflowState, load_spec, parse_spec

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"


def support(weights: dict[str, float] | None = None, max_iterations: int | None = None) -> dict:
    reviewer: dict = {"after": ["billing", "technical"], "join": "any", "next": "one",
                      "weights": {"triage": 1, "done": 3}}
    if max_iterations is not None:
        reviewer["max_iterations"] = max_iterations
    triage: dict = {"after": ["intake", "reviewer"], "join": "any", "next": "one"}
    if weights is not None:
        triage["weights"] = weights
    return {"name": "support", "entry": "intake", "agents": {
        "intake": {}, "triage": triage, "billing": {"after": ["triage"]}, "technical": {"after": ["triage"]},
        "reviewer": reviewer, "done": {"after": ["reviewer"]}}}


def test_priors_normalise_weights_and_default_to_one() -> None:
    spec = parse_spec(support({"billing": 3}))
    assert spec.priors("triage") == {"billing": 0.75, "technical": 0.25}
    assert spec.priors("intake") == {}
    assert spec.dynamic
    assert not load_spec(WORKFLOWS / "peer.yaml").dynamic


@pytest.mark.parametrize(("mutate", "field", "fragment"), [
    (lambda d: d["agents"]["triage"].update(weights={"done": 1}), "agents.triage.weights.done",
     "not a successor of 'triage'"),
    (lambda d: d["agents"]["triage"].pop("next"), "agents.triage.weights", "needs `next: one`"),
    (lambda d: d["agents"]["triage"].update(weights={"billing": 0}), "agents.triage.weights.billing",
     "positive number"),
    (lambda d: d["agents"]["triage"].update(weights={"billing": True}), "agents.triage.weights.billing",
     "positive number"),
    (lambda d: d["agents"]["triage"].update(weights=[1, 2]), "agents.triage.weights", "mapping"),
    (lambda d: d["agents"]["triage"].update(next="some"), "agents.triage.next", "one of all, one"),
    (lambda d: d["agents"]["reviewer"].update(max_iterations=0), "agents.reviewer.max_iterations", ">= 1"),
    (lambda d: d["agents"]["reviewer"].update(max_iterations=1.5), "agents.reviewer.max_iterations", ">= 1"),
])
def test_invalid_dynamic_keys_name_the_field(mutate, field: str, fragment: str) -> None:
    data = support({"billing": 2})
    mutate(data)
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_round_trip_keeps_the_new_keys() -> None:
    spec = parse_spec(support({"billing": 3}, max_iterations=2))
    again = parse_spec(spec.to_dict())
    assert again == spec
    assert again.to_dict()["agents"]["triage"]["weights"] == {"billing": 3.0}
    assert again.agents["reviewer"].max_iterations == 2
    assert "next" not in parse_spec({"name": "x", "agents": {"a": {}}}).to_dict()["agents"]["a"]


def test_the_branch_not_taken_is_no_longer_one_step_away() -> None:
    spec = parse_spec(support({"billing": 3}))
    state = WorkflowState(spec)
    assert state.finish_and_ready("intake") == ["triage"]
    state.start("triage")
    assert state.choices("triage") == []  # still running
    state.finish("triage")
    assert state.choices("triage") == ["billing", "technical"]
    steps = state.steps_to_execution()
    assert steps["billing"] == steps["technical"] == 1  # the graph meaning: either may run next
    state.start("billing")
    steps = state.steps_to_execution()
    assert steps["billing"] == 0
    # technical is reached again only through reviewer -> triage: 3 steps, not 1
    assert steps["technical"] == 3
    assert "technical" not in state.arrived


def test_expected_steps_prefer_the_likelier_alternative() -> None:
    spec = parse_spec(support({"billing": 3}))
    state = WorkflowState(spec)
    state.finish("intake")
    state.start("triage")
    expected = state.expected_steps()
    assert expected["billing"] == pytest.approx(1 / 0.75)  # triage runs: one pass, picked 3 times in 4
    assert expected["technical"] == pytest.approx(1 / 0.25)
    assert expected["billing"] < expected["technical"]
    # a learned model overrides the priors; p = 0 cuts the edge
    learned = state.expected_steps({"triage": {"billing": 0.0, "technical": 1.0}})
    assert learned["technical"] == pytest.approx(1.0)
    assert learned["billing"] == math.inf
    reach = state.reach_probability()
    assert reach["billing"] == pytest.approx(0.75)
    assert reach["triage"] == 1.0


@pytest.mark.parametrize("path", [p for p in sorted(WORKFLOWS.glob("*.yaml")) if not load_spec(p).dynamic])
def test_static_specs_have_expected_steps_equal_to_steps(path: Path) -> None:
    spec = load_spec(path)
    state = WorkflowState(spec)
    for agent in spec.agents:
        assert state.expected_steps() == pytest.approx(state.steps_to_execution())
        state.finish_and_ready(agent)
        state.start(agent)


def test_max_iterations_bounds_a_loop() -> None:
    spec = parse_spec(support({"billing": 3}, max_iterations=2))
    state = WorkflowState(spec, running=[])
    state.start("reviewer")
    state.finish("reviewer")
    state.start("reviewer")
    assert state.exhausted("reviewer")
    assert state.steps_to_execution()["reviewer"] == 0  # running now
    state.finish("reviewer")
    assert state.steps_to_execution()["reviewer"] == math.inf
    state.finish("billing")
    assert not state.ready("reviewer")
    again = WorkflowState.from_dict(spec, json.loads(json.dumps(state.to_dict())))
    assert again.runs == {"reviewer": 2} and again.exhausted("reviewer")
    assert "runs" not in WorkflowState(load_spec(WORKFLOWS / "peer.yaml")).to_dict()


def test_validate_json_adds_expected_steps() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "validate", str(WORKFLOWS / "support_dynamic.yaml"),
                           "--json"], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    expected = out["expected_steps"]
    assert out["steps_to_execution"]["billing"] == out["steps_to_execution"]["account"] == 2
    assert expected["intake"] == 0 and expected["billing"] < expected["technical"] < expected["account"]
    table = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "validate",
                            str(WORKFLOWS / "support_dynamic.yaml")], capture_output=True, text=True, check=True)
    assert "expected-steps" in table.stdout
    static = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "validate", str(WORKFLOWS / "peer.yaml"),
                             "--json"], capture_output=True, text=True, check=True)
    peer = json.loads(static.stdout)
    assert peer["expected_steps"] == peer["steps_to_execution"]


def test_an_exhausted_chooser_leaves_its_loop() -> None:
    """reviewer (max_iterations 2) almost always sends work back; at its limit only the exit remains."""
    data = support({"billing": 1}, max_iterations=2)
    data["agents"]["reviewer"]["weights"] = {"triage": 100, "done": 1}
    spec = parse_spec(data)
    state = WorkflowState(spec, running=[])
    state.start("reviewer")
    state.finish("reviewer")
    assert state.choices("reviewer") == ["triage", "done"]
    state.start("triage")
    state.finish("triage")
    state.start("billing")
    state.finish("billing")
    state.start("reviewer")
    state.finish("reviewer")
    assert state.exhausted("reviewer")
    assert state.choices("reviewer") == ["done"]  # triage would lead back to the exhausted reviewer
