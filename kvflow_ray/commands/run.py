"""Drive a workflow against a kvflow-ray server with concurrent clients and report latency, hit
ratios and routing.

Each client is one running instance of the workflow (its own client id); it walks the step graph
for --iterations passes, calling each agent through the OpenAI SDK with the kvflow metadata, then
finishes. Reported: workflow-iteration latency (mean, p50, p99), agent-call latency, the share of
prompt tokens served from the device (gpu_hit_ratio) and host (cpu_hit_ratio) tiers, and the share
of agent calls after each client's first pass that the router sent to a replica holding their
prefix (affinity_ratio_after_warmup).

Without --url it starts the embedded default first (local Ray, CPU-engine replicas, in-process
router store; no GPU, no Redis) and stops it afterwards.

A session spec (a YAML file with a top-level `session`, e.g. workflows/sessions/coder.yaml) runs agent
sessions instead: each client is one session whose turns call tools (the client waits each tool's
drawn duration, then sends the history back with its result); reported: job completion time, turn
latency, the tool pauses and how well the server predicted them, and where prompt tokens came from.

Examples:
  kvflow-ray run workflows/peer.yaml --clients 8 --iterations 2
  kvflow-ray run workflows/sessions/coder.yaml --clients 4
  kvflow-ray run workflows/peer.yaml --url http://127.0.0.1:8000 --clients 16 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvflow_ray.commands.serve import add_server_arguments, app_config
from kvflow_ray.core.graph import SpecError
from kvflow_ray.core.reuse import parse_reuse

T = TypeVar("T")
ANSWER_CHARS = 160  # of each agent's answer in the text report (--json has them whole)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workflow", type=Path, help="workflow spec (YAML or JSON), or a session spec (YAML)")
    parser.add_argument("--url", default=None, help="server root, e.g. http://127.0.0.1:8000 "
                        "(default: start the embedded server for this run)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent workflow instances (default 4)")
    parser.add_argument("--iterations", type=int, default=2, help="passes of the workflow per client (default 2)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output tokens per agent call at most (default 64; answers end earlier at the end of "
                             "sequence)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --max-tokens per call (equal work per call, as the benchmarks do)")
    parser.add_argument("--task", default=None,
                        help="the request each workflow client sends (default: the workflow's `task`, else "
                             "synthetic text)")
    parser.add_argument("--applications", type=int, default=1,
                        help="run N applications built on the workflow, each with its own prompt preamble "
                             "(client i runs application i mod N): the multi-tenant case (default 1)")
    parser.add_argument("--preamble-chars", type=int, default=1200,
                        help="length of each application's preamble with --applications > 1 (default 1200)")
    parser.add_argument("--reuse", default=None, metavar="METHOD",
                        help="reuse earlier agents' outputs in later prompts beyond the prefix: exact (none), "
                             "position, epic:k=16, blend:r=0.15 (default: the workflow's `reuse`, else the tenant's "
                             "default, exact; docs/design.md §12)")
    parser.add_argument("--reads", choices=("previous", "predecessors"), default=None,
                        help="what a call's message carries: the previous agent's output (its first 200 characters) "
                             "or each predecessor's whole output (default: predecessors for a workflow with `reuse`)")
    parser.add_argument("--key", default=None, help="bearer API key")
    parser.add_argument("--metrics-token", default=None, metavar="TOKEN",
                        help="the /metrics token (`kvflow-ray serve --metrics-token`): the report's hit ratios "
                             "and routing counts come from /metrics. With --url, the token that server wants; "
                             "without, the embedded server is started with it")
    parser.add_argument("--port", type=int, default=8000, help="port of the embedded server (default 8000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    group = parser.add_argument_group("embedded server (without --url)")
    add_server_arguments(group)  # type: ignore[arg-type]


def format_summary(s: dict) -> str:
    lat, call = s["latency_s"], s["call_latency_s"]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    secs = lambda v: "n/a" if v is None or v != v else f"{v:.2f} s"  # noqa: E731 (v != v: NaN, no calls)
    lines = [
        f"workflow {s['workflow']}: {s['clients']} clients x {s['iterations']} iterations, {s['calls']} agent calls "
        f"({s['errors']} failed) in {s['wall_s']:.1f} s",
        f"  workflow latency   mean {secs(lat['mean'])}   p50 {secs(lat['p50'])}   p99 {secs(lat['p99'])}",
        f"  agent-call latency mean {secs(call['mean'])}   p50 {secs(call['p50'])}   p99 {secs(call['p99'])}",
        f"  prompt tokens from device {pct(s['gpu_hit_ratio'])}, from host {pct(s['cpu_hit_ratio'])}, "
        f"cached (usage) {pct(s['cached_ratio'])}"
        + (f", reused beyond the prefix {pct(s['reused_ratio'])} (computed {s['recomputed_prompt_tokens']:,} "
           "prompt tokens)" if s.get("reused_ratio") else ""),
        f"  routed to the prefix holder after warm-up: {pct(s['affinity_ratio_after_warmup'])}   router decisions "
        + ", ".join(f"{k} {v}" for k, v in s["router_decisions"].items())
        + "   prefetches " + ", ".join(f"{k} {v}" for k, v in s["prefetch"].items()),
    ]
    if s["first_error"]:
        lines.append(f"  first error: {s['first_error']}")
    if s.get("answers"):
        lines.append("answers (the first client's last pass):")
        for agent, text in s["answers"].items():
            flat = " ".join(text.split())
            lines.append(f"  {agent}: {flat[:ANSWER_CHARS] + ' ...' if len(flat) > ANSWER_CHARS else flat}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvflow_ray.client.loadgen import LoadConfig, application_variants, run_load, summarise
    from kvflow_ray.client.sessions import is_session_spec
    from kvflow_ray.client.workflow import Workflow

    if is_session_spec(args.workflow):
        return run_session_spec(args)

    try:
        workflow = Workflow.from_yaml(args.workflow)
        if min(args.clients, args.iterations, args.max_tokens, args.applications) < 1:
            raise ValueError("--clients, --iterations, --max-tokens and --applications must be at least 1")
        if args.reuse is not None:
            parse_reuse(args.reuse)
        # the embedded server is the caller's own: it sends the route headers the report measures affinity with
        config = app_config(args).model_copy(update={"route_headers": True}) if args.url is None else None
    except (SpecError, ValueError, OSError) as exc:
        print(f"kvflow-ray run: {exc}", file=sys.stderr)
        return 2
    metrics_token = args.metrics_token or (config.metrics_token_value() if config is not None else None)
    load = LoadConfig(clients=args.clients, iterations=args.iterations, max_tokens=args.max_tokens, api_key=args.key,
                      metrics_token=metrics_token, ignore_eos=args.ignore_eos, task=args.task or workflow.spec.task,
                      reads=args.reads, reuse=args.reuse)
    workflows = ([workflow] if args.applications == 1
                 else application_variants(workflow, args.applications, args.preamble_chars))
    result = _against_server(args, config, lambda url: run_load(workflows, url, load))
    if result is None:
        return 2
    summary = summarise(result, workflow, load)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 1 if summary["errors"] else 0


def run_session_spec(args: argparse.Namespace) -> int:
    """`kvflow-ray run SESSION.yaml`: --clients concurrent sessions of the spec."""
    from kvflow_ray.client.sessions import format_sessions, load_session_spec, run_sessions, summarise_sessions

    try:
        spec = load_session_spec(args.workflow)
        if args.clients < 1:
            raise ValueError("--clients must be at least 1")
        config = app_config(args).model_copy(update={"route_headers": True}) if args.url is None else None
    except (ValueError, OSError) as exc:
        print(f"kvflow-ray run: {exc}", file=sys.stderr)
        return 2
    metrics_token = args.metrics_token or (config.metrics_token_value() if config is not None else None)
    result = _against_server(args, config, lambda url: run_sessions(spec, url, args.clients, api_key=args.key,
                                                                    metrics_token=metrics_token))
    if result is None:
        return 2
    summary = summarise_sessions(result, spec, args.clients)
    print(json.dumps(summary, indent=2) if args.json else format_sessions(summary))
    return 1 if summary["errors"] else 0


def _against_server(args: argparse.Namespace, config: Any, drive: Callable[[str], T]) -> T | None:
    """`drive(server root)` against `--url` (checked first), or against the embedded server started with
    `config` for the run and stopped after it; stdout carries the report only. None (said on stderr):
    no server there, a bad key, a missing metrics token."""
    from kvflow_ray.client.loadgen import check_server
    from kvflow_ray.serve.app import LocalServer, say_on_stderr, stdout_to_stderr

    with stdout_to_stderr():
        server = None
        if args.url is None:
            print(f"starting the embedded server ({config.replicas} {config.engine} replicas) ...", file=sys.stderr)
            server = LocalServer(config, port=args.port).start(say=say_on_stderr)
        try:
            if args.url is not None:
                check_server(args.url, args.key)
            return drive(args.url or server.url)  # type: ignore[union-attr]
        except (ConnectionError, PermissionError) as exc:
            print(f"kvflow-ray run: {exc}", file=sys.stderr)
            return None
        finally:
            if server is not None:
                server.stop()
