"""Check a workflow spec and print each agent's steps-to-execution for a live state.

The state is built by replaying, in order: every --finished agent (started, then finished), then
every --running agent (started). With neither flag, the workflow's start agents are running.
An invalid spec or an unknown agent name exits with status 2.

examples:
  kvflow-ray validate workflows/peer.yaml
  kvflow-ray validate workflows/peer.yaml --finished planner --running executor --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvflow_ray.core.graph import SpecError, WorkflowSpec, WorkflowState, load_spec

EXIT_INVALID = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workflow", metavar="WORKFLOW.yaml", help="workflow spec file (.yaml, .yml or .json)")
    # action="extend" accepts both `--running a b` and `--running a --running b`.
    parser.add_argument(
        "--running",
        metavar="AGENT",
        nargs="+",
        action="extend",
        default=[],
        help="agents executing now (default: the workflow's start agents)",
    )
    parser.add_argument(
        "--finished",
        metavar="AGENT",
        nargs="+",
        action="extend",
        default=[],
        help="agents that completed in this instance, in order",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_state(spec: WorkflowSpec, running: list[str], finished: list[str]) -> WorkflowState:
    """Replay the CLI flags into a live state. Unknown names raise SpecError naming the flag, so the
    user sees which flag to fix rather than a bare lookup error."""
    for flag, names in (("--finished", finished), ("--running", running)):
        for name in names:
            if name not in spec.agents:
                raise SpecError(flag, f"unknown agent {name!r} (agents: {', '.join(spec.agents)})")
    if not running and not finished:
        return WorkflowState(spec)
    state = WorkflowState(spec, running=[])
    for name in finished:
        state.start(name)  # a finished agent ran first; starting it also consumes its own arrivals
        state.finish(name)
    for name in running:
        state.start(name)
    return state


def _symbol_inf() -> str:
    # '∞' reads best, but a non-UTF-8 console (e.g. some Windows code pages) cannot encode it.
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "∞".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "inf"
    return "∞"


def format_table(spec: WorkflowSpec, state: WorkflowState, steps: dict[str, float]) -> str:
    """One row per agent; a spec with `next: one` agents adds each one's choice and the expected steps
    under its weights."""
    inf_text = _symbol_inf()
    header: tuple[str, ...] = ("agent", "join", "after", "steps-to-execution")
    rows: list[tuple[str, ...]] = [
        (
            name,
            agent.join,
            ", ".join(agent.after) or "-",
            inf_text if math.isinf(steps[name]) else str(int(steps[name])),
        )
        for name, agent in spec.agents.items()
    ]
    if spec.dynamic:
        expected = state.expected_steps()
        header = (*header, "next", "expected-steps")
        rows = [(*row, agent.next, inf_text if math.isinf(expected[name]) else f"{expected[name]:.2f}")
                for row, (name, agent) in zip(rows, spec.agents.items(), strict=True)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"workflow {spec.name!r}: valid, {len(spec.agents)} agents, start: {', '.join(spec.start_agents())}",
        f"running: {', '.join(a for a in spec.agents if a in state.running) or '-'}",
        "",
    ]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.workflow)
        state = build_state(spec, list(args.running), list(args.finished))
    except SpecError as exc:
        if args.json:
            print(json.dumps({"valid": False, "error": str(exc)}))
        else:
            print(f"kvflow-ray validate: {args.workflow}: {exc}", file=sys.stderr)
        return EXIT_INVALID

    steps = state.steps_to_execution()
    if args.json:
        out: dict[str, Any] = {
            "valid": True,
            "name": spec.name,
            "steps_to_execution": {a: None if math.isinf(v) else int(v) for a, v in steps.items()},
            "expected_steps": {a: None if math.isinf(v) else round(v, 6) for a, v in state.expected_steps().items()},
        }
        print(json.dumps(out))
    else:
        print(format_table(spec, state, steps))
    return 0
