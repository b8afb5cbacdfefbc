"""Run a workflow scenario on the discrete-event simulator, comparing KV cache policies side by side.

Policies: lru (device only, a miss recomputes), hicache (LRU + host tier, load on demand),
kvflow (workflow-aware eviction + prefetch + status-aware admission in longest-prefix order),
kvflow-noprefetch and kvflow-fcfs (ablations: no prefetch; the queue in arrival order),
belady (offline optimum eviction over the known access order), infinite (no capacity limit),
predictive and oracle (dynamic workflows); for agent sessions in tool pauses (--scenario agentic)
tlru (SGLang's T-LRU), retention (SGLang's retention_seconds), continuum (Continuum's TTL pinning and
job-level FCFS) and pause-oracle (kvflow knowing each pause's length); lpm (SGLang's
longest-prefix-match order), queue-aware (PEEK's order over the waiting queue: pioneers first,
clusters together, an oldest-first lane; eviction protects what queued requests need), kvflow-qa
(kvflow with queue-aware admission).

Examples:
  kvflow-ray sim --scenario single --agents 10 --fixed 8192 --dynamic 32 --output 32 \\
      --profile a10g-llama3.1-8b --policies lru,hicache,kvflow,belady,infinite --json
  kvflow-ray sim --scenario concurrent --fixed 1024 --tasks 64 --profile h100-qwen2.5-32b \\
      --policies lru,hicache,kvflow --json
  kvflow-ray sim --workflow workflows/peer.yaml --clients 32 --profile a10g-llama3.1-8b
  kvflow-ray sim --scenario burst --prompts 16 --policies hicache,lpm,queue-aware --seed 1
  kvflow-ray sim --scenario fanout --workers 16 --policies kvflow,kvflow-qa
  kvflow-ray sim --scenario agentic --sessions 64 --pressure 2 --profile h100-llama3.1-8b \
      --policies lru,hicache,tlru,retention,continuum,kvflow,pause-oracle
  kvflow-ray sim --scenario concurrent --tasks 128 --replicas 8 --policies lru,kvflow \
      --routing workflow,ray-prefix,sglang-cache-aware,dynamo-kv,llmd-precise,pow2,round-robin

Routing (--routing, several compared in one run; results keyed "<policy>@<routing>"): every call
goes through the serving router with that policy. workflow: the workflow router (prefix affinity,
priced); ray-prefix: Ray Serve LLM's PrefixCacheAffinityRouter; sglang-cache-aware: the SGLang
gateway's cache_aware; dynamo-kv: NVIDIA Dynamo's KV router; llmd-precise: llm-d's precise prefix
scorer + load scorers; pow2; round-robin. Without --routing each workflow stays on one replica,
assigned in turn.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvflow_ray.core.graph import SpecError, load_spec
from kvflow_ray.core.kv_budget import DEFAULT_SCORER, KV_SCORERS, KvBudget, parse_scorer
from kvflow_ray.core.reuse import parse_reuse
from kvflow_ray.core.scheduler import POLICIES
from kvflow_ray.engines.sim import agentic, workload
from kvflow_ray.engines.sim.profile import available_profiles, load_profile
from kvflow_ray.engines.sim.runner import parse_policies, parse_routings, run_policies

DEFAULT_POLICIES = "lru,hicache,kvflow,belady,infinite"


def add_scenario_arguments(parser: argparse.ArgumentParser, single_iterations: int = 10, fleet: bool = False) -> None:
    """The scenario flags, shared by `sim` and `bench cpu` (docs/design.md §8); `fleet`: the fleet scenario's
    too (the simulator's alone: its arrivals follow the simulated clock)."""
    which = parser.add_mutually_exclusive_group(required=True)
    scenarios = ["single", "concurrent", "peer", "dynamic", "burst", "fanout", "agentic", *(["fleet"] if fleet else [])]
    which.add_argument("--scenario", choices=scenarios, help="a built-in scenario")
    which.add_argument("--workflow", metavar="FILE", help="run any workflow spec (YAML/JSON)")
    parser.add_argument("--agents", type=int, default=10, help="agents per workflow (single, concurrent)")
    parser.add_argument("--fixed", type=int, default=None,
                        help="fixed prompt tokens per agent (default: 8192 single, 1024 concurrent/workflow)")
    parser.add_argument("--dynamic", type=int, default=None,
                        help="dynamic suffix tokens per call (default: 32 single, 256 concurrent, 128 peer)")
    parser.add_argument("--output", type=int, default=None,
                        help="output tokens per call (default: 32 single, 256 concurrent, 64 peer)")
    parser.add_argument("--iterations", type=int, default=None,
                        help=f"measured passes per workflow after one warm-up pass (default {single_iterations} "
                             "single, 3 otherwise)")
    parser.add_argument("--tasks", type=int, default=64, help="concurrent workflow instances (concurrent)")
    parser.add_argument("--clients", type=int, default=None,
                        help="concurrent clients (peer: 64, workflow: 1); workflow instances (fleet: 256, llmd: 1024)")
    parser.add_argument("--branches", type=int, default=4, help="dynamic: specialists that triage chooses one of")
    parser.add_argument("--skew", type=float, default=None,
                        help="Zipf exponent of the odds, 0: uniform (dynamic: of the specialists, default 1.5; "
                             "burst: of the system prompts, default 0)")
    parser.add_argument("--loop-p", type=float, default=0.3,
                        help="dynamic: probability that the reviewer sends the ticket back to triage")
    parser.add_argument("--mix", choices=workload.DYNAMIC_MIXES, default="steady",
                        help="dynamic: steady odds; drift (they reverse halfway); adversarial (they reverse "
                             "after the warm-up)")
    parser.add_argument("--apps", type=int, default=None,
                        help="applications, each with its own prompts (fleet: per tenant, default 2; dynamic: 4; "
                             "fanout: one per instance)")
    parser.add_argument("--requests", type=int, default=256, help="burst: calls arriving together")
    parser.add_argument("--prompts", type=int, default=16,
                        help="burst: system prompts the calls share (>= --requests: none shared, the control)")
    parser.add_argument("--system", type=int, default=4096, help="burst: tokens per system prompt")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds within which the calls (burst, default 1) or instances (fanout, default 2) "
                             "arrive")
    parser.add_argument("--workers", type=int, default=16, help="fanout: workers the planner starts at once")
    if fleet:
        parser.add_argument("--seed", type=int, default=0,
                            help="seed of the fleet, dynamic, burst and fanout scenarios' random draws and of "
                                 "routing policies that draw at random")
        parser.add_argument("--rate", type=float, default=None,
                            help="fleet: workflow instances arriving per second, Poisson (default 2; llmd 10)")
        parser.add_argument("--tenants", type=int, default=None,
                            help="fleet: tenants, each its own cache namespace (default 8; with --pressure, as many "
                                 "as the pressure takes)")
        parser.add_argument("--pressure", type=float, default=None, metavar="X",
                            help="fleet: the applications' prompts over the fleet's device KV (working set / "
                                 "replicas x device pool; 0.5, 1, 2, 4, 8): sets the tenants, or with --tenants "
                                 "the prompt sizes; the report prints the ratio either way. agentic: the live "
                                 "session histories (time-averaged, measured without capacity limit) over the "
                                 "fleet's device KV: sets the device pool (default 2)")
        parser.add_argument("--preset", choices=["llmd", "tools"], default=None,
                            help="fleet: llmd = llm-d's benchmark shape (150 system prompts of 6,000 tokens, "
                                 "1,200-token questions, 1,000 tokens out); tools = agents' system prompts of "
                                 "4-16k tokens (tool schemas), as agent frameworks send")
    parser.add_argument("--sessions", type=int, default=64,
                        help="agentic: agent sessions (5-30 turns each, tool pauses between them)")
    parser.add_argument("--variant", choices=["single", "planner"], default="single",
                        help="agentic: single agents, or planners whose spawn tool starts 2-4 sub-agent sessions")
    parser.add_argument("--shape", choices=list(agentic.SHAPES), default="standard" if fleet else "small",
                        help="agentic: standard (4-8k-token system prompts, 200-4,000-token tool results, "
                             "100-500 output tokens, 5-30 turns), small (the same at CPU size, pauses / 20) or "
                             "tiny (small with pauses / 200: smoke runs)")
    parser.add_argument("--pause-hint", type=float, default=None, metavar="S",
                        help="agentic: clients send kvflow.expected_pause_s = S with every turn (default none)")
    parser.set_defaults(_single_iterations=single_iterations, _scenario_seeded=fleet)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser, fleet=True)
    parser.add_argument("--profile", default="a10g-llama3.1-8b",
                        help=f"GPU cost profile name or YAML path (built in: {', '.join(available_profiles())}; "
                             "cpu-reference after `kvflow-ray bench calibrate`)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help=f"comma-separated, of: {', '.join(POLICIES)} (default {DEFAULT_POLICIES}); a combination "
                             "of registered policies is added with core.scheduler.register_policy")
    parser.add_argument("--replicas", type=int, default=1, help="simulated GPU replicas")
    parser.add_argument("--routing", default=None, metavar="NAMES",
                        help="comma-separated routing policies to compare (see above); default: none, each "
                             "workflow pinned to one replica")
    parser.add_argument("--horizon", type=int, default=1, help="prefetch agents at most this many steps ahead")
    parser.add_argument("--max-inflight", type=int, default=4, help="concurrent prefetch loads per replica")
    parser.add_argument("--gpu-kv-tokens", type=int, default=None,
                        help="override the device KV pool size (default: derived from the profile)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                        help="override a profile field, e.g. --set peak_flops=125e12 (repeatable)")
    parser.add_argument("--reuse", default=None, metavar="METHOD",
                        help="--workflow: each call carries its predecessors' outputs, reused beyond the prefix by "
                             "METHOD (exact, position, epic:k=16, blend:r=0.15; default: the spec's `reuse`, else "
                             "no outputs carried); docs/design.md §12")
    parser.add_argument("--kv-budgets", default=None, metavar="LIST",
                        help="compare per-request KV budgets side by side, e.g. off,1024: each call's private KV "
                             "capped at B tokens, compacted every 128 (docs/design.md §13)")
    parser.add_argument("--kv-scorer", default=DEFAULT_SCORER, metavar="NAME",
                        help=f"with --kv-budgets: how keys are scored, of {', '.join(KV_SCORERS.names())} "
                             "(its buffered queries set the re-score cost)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_scenario(args: argparse.Namespace, fleet_kv_tokens: int | None = None) -> workload.Scenario:
    """The scenario the flags name; `fleet_kv_tokens` (replicas x device pool) for the fleet's pressure."""
    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    if getattr(args, "preset", None) is not None and args.scenario != "fleet":
        raise ValueError("--preset goes with --scenario fleet")
    if getattr(args, "pressure", None) is not None and args.scenario not in ("fleet", "agentic"):
        raise ValueError("--pressure goes with --scenario fleet or agentic")
    if args.scenario == "agentic":
        pressure = getattr(args, "pressure", None)
        if pressure is None and args._scenario_seeded:  # the simulator sets its pool by the pressure (default 2)
            pressure = 2.0
        return agentic.agentic(sessions=args.sessions, pressure=pressure,
                               apps=pick(args.apps, 4), tenants=pick(getattr(args, "tenants", None), 2),
                               rate=getattr(args, "rate", None), variant=args.variant, shape=args.shape,
                               hint_s=args.pause_hint, seed=args.seed if args._scenario_seeded else 0)
    if args.scenario == "fleet":
        rate = args.rate
        if args.preset == "llmd":
            if args.pressure is not None:
                raise ValueError("--pressure does not go with --preset llmd (its prompts are llm-d's)")
            return workload.llmd(clients=pick(args.clients, 1024), rate=10.0 if rate is None else rate,
                                 output=pick(args.output, 1000), seed=args.seed)
        tenants = args.tenants if args.tenants is not None or args.pressure is not None else 8
        return workload.fleet(tenants=tenants, apps=pick(args.apps, 2), clients=pick(args.clients, 256),
                              rate=2.0 if rate is None else rate, dynamic=pick(args.dynamic, 256),
                              output=pick(args.output, 128), seed=args.seed, preset=args.preset or "default",
                              pressure=args.pressure, fleet_kv_tokens=fleet_kv_tokens)
    seed = args.seed if args._scenario_seeded else 0
    if args.scenario == "burst":
        return workload.burst(requests=args.requests, prompts=args.prompts, system=args.system,
                              question=pick(args.dynamic, 128), output=pick(args.output, 64),
                              window=1.0 if args.window is None else args.window,
                              skew=0.0 if args.skew is None else args.skew, seed=seed)
    if args.scenario == "fanout":
        return workload.fanout(workers=args.workers, clients=pick(args.clients, 8), apps=args.apps,
                               fixed=pick(args.fixed, 2048), dynamic=pick(args.dynamic, 128),
                               output=pick(args.output, 64), iterations=pick(args.iterations, 2),
                               window=2.0 if args.window is None else args.window, seed=seed)
    if args.scenario == "dynamic":
        return workload.dynamic(branches=args.branches, skew=1.5 if args.skew is None else args.skew,
                                loop_p=args.loop_p,
                                clients=pick(args.clients, 8), apps=pick(args.apps, 4), fixed=pick(args.fixed, 2048),
                                dynamic=pick(args.dynamic, 64), output=pick(args.output, 64),
                                iterations=pick(args.iterations, 12), mix=args.mix, seed=seed)
    if getattr(args, "reuse", None) is not None:
        if not args.workflow:
            raise ValueError("--reuse goes with --workflow")
        parse_reuse(args.reuse)
    if args.workflow:
        spec = load_spec(args.workflow)
        return workload.from_spec(spec, clients=pick(args.clients, 1), fixed=pick(args.fixed, 1024),
                                  dynamic=pick(args.dynamic, 32), output=pick(args.output, 32),
                                  iterations=pick(args.iterations, 3), reuse=args.reuse)
    if args.scenario == "single":
        return workload.single(agents=args.agents, fixed=pick(args.fixed, 8192), dynamic=pick(args.dynamic, 32),
                               output=pick(args.output, 32),
                               iterations=pick(args.iterations, args._single_iterations))
    if args.scenario == "concurrent":
        return workload.concurrent(tasks=args.tasks, fixed=pick(args.fixed, 1024), agents=args.agents,
                                   dynamic=pick(args.dynamic, 256), output=pick(args.output, 256),
                                   iterations=pick(args.iterations, 3))
    return workload.peer(clients=pick(args.clients, 64), dynamic=pick(args.dynamic, 128),
                         output=pick(args.output, 64), iterations=pick(args.iterations, 3))


def run(args: argparse.Namespace) -> int:
    try:
        policies = parse_policies(args.policies)
        routings = parse_routings(args.routing) if args.routing is not None else None
        overrides = {}
        for item in args.overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item}: expected FIELD=VALUE")
            overrides[key.strip()] = value.strip()
        profile = load_profile(args.profile, overrides)
        scenario = build_scenario(args, args.replicas * (args.gpu_kv_tokens or profile.gpu_kv_tokens))
        kv_budgets = parse_kv_budgets(getattr(args, "kv_budgets", None))
        parse_scorer(args.kv_scorer)
    except (ValueError, SpecError) as exc:
        print(f"kvflow-ray sim: error: {exc}", file=sys.stderr)
        return 2
    from kvflow_ray.progress import progress as progress_bar

    bar = progress_bar(len(policies) * len(routings or [None]) * len(kv_budgets), f"sim {scenario.name}", "run")

    started = False

    def progress(name: str) -> None:
        nonlocal started
        if started:
            bar.update(1)
        started = True
        bar.set_postfix_str(name)

    try:
        out = run_policies(scenario, profile, policies, replicas=args.replicas, horizon=args.horizon,
                           max_inflight=args.max_inflight, gpu_capacity=args.gpu_kv_tokens, progress=progress,
                           routings=routings, seed=args.seed, kv_budgets=kv_budgets, kv_scorer=args.kv_scorer)
    except ValueError as exc:
        bar.close()
        print(f"kvflow-ray sim: error: {exc}", file=sys.stderr)
        return 2
    bar.update(1)
    bar.close()
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out))
    return 0


def parse_kv_budgets(text: str | None) -> list[KvBudget | None]:
    """`off,1024,2048` -> [None, KvBudget(1024), KvBudget(2048)]; None -> [None] (no budget)."""
    if text is None:
        return [None]
    budgets: list[KvBudget | None] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item == "off":
            budgets.append(None)
            continue
        try:
            budgets.append(KvBudget(int(item)))
        except ValueError:
            raise ValueError(f"--kv-budgets: {item!r} is neither 'off' nor a budget of at least 64 tokens") from None
    if not budgets:
        raise ValueError("--kv-budgets: give at least one of off or a token count")
    return budgets


def format_table(out: dict) -> str:
    results = out["results"]
    base = results.get("lru") or next(iter(results.values()))
    width = max(18, *(len(name) + 2 for name in results))
    params = out["params"]
    lines = [f"scenario {out['scenario']} on {out['profile']} {params}"]
    if params.get("live_history_tokens") is not None:
        lines.append(f"live session histories {params['live_history_tokens']:,} tokens = "
                     f"{params['measured_pressure']:.2f} x the fleet's device KV "
                     f"({params['device_kv_tokens']:,} tokens per replica); latency = job completion time")
    elif params.get("working_set_tokens") is not None:
        lines.append(f"working set {params['working_set_tokens']:,} tokens = {params['pressure']:.2f} x the fleet's "
                     "device KV")
    lines.append(f"{'policy':<{width}}{'latency s':>11}{'p99 s':>9}{'vs lru':>8}{'gpu hit':>9}{'cpu hit':>9}"
                 f"{'recomputed':>12}{'loaded':>10}{'stall s':>9}{'ttft p50':>10}{'ttft p99':>10}{'max wait':>10}")
    for name, r in results.items():
        _policy, at, routing = name.partition("@")
        base = results.get(f"lru@{routing}" if at else "lru") or base  # lru under the same routing
        speedup = base["latency_s"] / r["latency_s"] if r["latency_s"] else float("nan")
        lines.append(f"{name:<{width}}{r['latency_s']:>11.3f}{r['p99_latency_s']:>9.3f}{speedup:>7.2f}x"
                     f"{r['gpu_hit_ratio']:>9.3f}{r['cpu_hit_ratio']:>9.3f}{r['recomputed_tokens']:>12}"
                     f"{r['loaded_tokens']:>10}{r['prefetch_stall_s']:>9.3f}{r['ttft_p50_s']:>10.3f}"
                     f"{r['ttft_p99_s']:>10.3f}{r['max_wait_s']:>10.3f}")
    return "\n".join(lines)
