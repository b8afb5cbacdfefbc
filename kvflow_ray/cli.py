"""The `kvflow-ray` command. Each subcommand lives in `kvflow_ray/commands/<name>.py` and exposes
`add_arguments(parser)` and `run(args) -> int` so this file stays a thin dispatcher."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Modules are imported lazily so `kvflow-ray validate` never pays for
# the simulator (or, later, torch / ray).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("kvflow_ray.commands.validate", "check a workflow spec and print steps-to-execution"),
    "sim": ("kvflow_ray.commands.sim", "run a scenario on the discrete-event simulator, policies side by side"),
    "bench": ("kvflow_ray.commands.bench", "benchmarks on a real engine (cpu), calibration and simulator fidelity"),
    "serve": ("kvflow_ray.commands.serve", "serve workflows: OpenAI-compatible API on Ray Serve, workflow router"),
    "run": ("kvflow_ray.commands.run", "drive a workflow against a server with concurrent clients; report"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow-ray",
        description="Workflow-aware KV cache management (KVFlow) for LLM multi-agent workflows.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
