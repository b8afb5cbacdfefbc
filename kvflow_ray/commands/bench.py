"""Benchmarks on a real engine.

  bench cpu        run a scenario on the CPU engine (real transformer compute, real KV tensors),
                   policies side by side, same JSON as `kvflow-ray sim`
  bench calibrate  measure the engine on this machine and write a simulator profile (`cpu-reference`
                   by default, used by `kvflow-ray sim --profile cpu-reference`; `--name` for others)
  bench fidelity   run one scenario on the engine and on the simulator with that profile, and
                   print simulated / measured latency per policy

The engine runs SmolLM2-135M-Instruct by default (`--model random`: a 4-layer Llama-style model
with seeded random weights, for fast runs and calibration; `--model random-8b`: random weights shaped
like Llama-3.1-8B, for GPUs; `--model-path DIR` / `--gguf FILE`: others). It runs on a CUDA GPU when
torch sees one (`--device`, docs/gpu.md), else on the CPU. Its device KV pool (12,288 tokens) is
smaller than the fixed prompts of the default 10-agent workflow, so policies matter.

Examples:
  kvflow-ray bench cpu --scenario single --agents 10 --fixed 2048 --dynamic 32 --output 8 \\
      --policies lru,hicache,kvflow --json
  kvflow-ray bench calibrate
  kvflow-ray bench fidelity --scenario single --agents 10 --fixed 2048 --dynamic 32 --output 8
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvflow_ray.commands.sim import add_scenario_arguments, build_scenario, format_table
from kvflow_ray.core.graph import SpecError
from kvflow_ray.core.scheduler import engine_policies
from kvflow_ray.engines.cpu.config import DEFAULT_PROFILE

DEFAULT_POLICIES = "lru,hicache,kvflow"
CPU_ITERATIONS = 3  # measured passes of `single` by default: each pass is real compute


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    cpu = sub.add_parser("cpu", help="a scenario on the CPU engine, policies side by side",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scenario_arguments(cpu, single_iterations=CPU_ITERATIONS)
    cpu.add_argument("--pressure", type=float, default=None, metavar="X",
                     help="agentic: set the device pool so that the live session histories (time-averaged, "
                          f"simulated without capacity limit on the {DEFAULT_PROFILE} profile, calibrated first "
                          "when missing) are X times it; instead of --device-kv-tokens")
    cpu.add_argument("--policies", default=DEFAULT_POLICIES,
                     help=f"comma-separated, of {', '.join(engine_policies())} (default {DEFAULT_POLICIES})")
    _engine_arguments(cpu)
    cpu.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    cpu.set_defaults(_bench=_run_cpu)

    cal = sub.add_parser("calibrate", help="measure the engine and write a simulator profile (cpu-reference)")
    _engine_arguments(cal)
    cal.add_argument("--name", default=DEFAULT_PROFILE,
                     help=f"the profile's name, what `sim --profile` takes (default {DEFAULT_PROFILE})")
    cal.add_argument("--out", default=None, help="profile path (default: NAME.yaml in the user profile directory, "
                                                 "~/.cache/kvflow-ray/profiles or $KVFLOW_RAY_PROFILES)")
    cal.set_defaults(_bench=_run_calibrate)

    fid = sub.add_parser("fidelity", help="simulated / measured latency per policy on one scenario")
    add_scenario_arguments(fid, single_iterations=CPU_ITERATIONS)
    fid.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default {DEFAULT_POLICIES})")
    _engine_arguments(fid)
    fid.add_argument("--profile", default=DEFAULT_PROFILE,
                     help="the measured profile to simulate with, calibrated first when missing "
                          f"(default {DEFAULT_PROFILE})")
    fid.add_argument("--recalibrate", action="store_true", help="calibrate first even if a profile exists")
    fid.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    fid.set_defaults(_bench=_run_fidelity)


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    from kvflow_ray.engines.cpu.config import DEVICES, CpuEngineConfig, ModelConfig
    from kvflow_ray.engines.cpu.weights import DEFAULT_MODEL, MODEL_NAMES, RANDOM

    e, m = CpuEngineConfig(), ModelConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--device", default=m.device,
                   help=f"where the model and device KV pool live: {DEVICES} (default {m.device}: cuda when "
                        "torch sees a GPU)")
    g.add_argument("--device-kv-tokens", type=int, default=None,
                   help=f"device KV pool capacity in tokens (default {e.device_kv_tokens})")
    g.add_argument("--host-kv-tokens", type=int, default=e.host_kv_tokens,
                   help=f"host KV pool capacity in tokens (default {e.host_kv_tokens})")
    g.add_argument("--link-gbps", type=float, default=e.link_gbps,
                   help=f"pace device<->host copies to this many GB/s; 0 = unpaced (default {e.link_gbps}; "
                        "never paced on a GPU)")
    g.add_argument("--chunk-tokens", type=int, default=e.chunk_tokens,
                   help=f"chunked prefill: prompt tokens per step while a request decodes (default {e.chunk_tokens})")
    g.add_argument("--idle-chunk-tokens", type=int, default=e.idle_chunk_tokens,
                   help=f"prompt tokens per step while no request decodes; 0 = --chunk-tokens (default "
                        f"{e.idle_chunk_tokens})")
    g.add_argument("--max-running", type=int, default=e.max_running, help="requests in the running batch")
    g.add_argument("--horizon", type=int, default=e.horizon, help="prefetch agents at most this many steps ahead")
    g.add_argument("--max-inflight", type=int, default=e.max_inflight, help="concurrent prefetch loads")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument("--model", default=DEFAULT_MODEL, choices=MODEL_NAMES,
                   help=f"the model by name (default {DEFAULT_MODEL}; {RANDOM}: a seeded random Llama-style model; "
                        "random-8b: random weights shaped like Llama-3.1-8B, bfloat16)")
    g.add_argument("--model-path", default=None, metavar="DIR", help="a local Hugging Face model directory instead")
    g.add_argument("--gguf", default=None, metavar="FILE", help="a GGUF model file instead (dequantized once)")
    g.add_argument("--model-cache", default=None, metavar="DIR",
                   help="where dequantized models are kept (default $KVFLOW_MODEL_CACHE or ~/.cache/kvflow-ray/models)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help=f"model and KV dtype (default: the model's own; {m.dtype} but for random-8b)")
    g.add_argument("--seed", type=int, default=m.seed, help="seed of the random model weights")


def _engine_config(args: argparse.Namespace) -> Any:
    from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
    from kvflow_ray.engines.cpu.weights import resolve_model

    path = resolve_model(args.model, model_path=args.model_path, gguf=args.gguf, cache=args.model_cache)
    model = ModelConfig.named(args.model, dtype=args.dtype, seed=args.seed, path=path, device=args.device)
    device = CpuEngineConfig.device_kv_tokens if args.device_kv_tokens is None else args.device_kv_tokens
    return CpuEngineConfig(model=model, device_kv_tokens=device, host_kv_tokens=args.host_kv_tokens,
                           link_gbps=args.link_gbps or None, chunk_tokens=args.chunk_tokens,
                           idle_chunk_tokens=args.idle_chunk_tokens or None,
                           max_running=args.max_running, horizon=args.horizon, max_inflight=args.max_inflight,
                           threads=args.threads)


def run(args: argparse.Namespace) -> int:
    try:
        return int(args._bench(args))
    except (ValueError, SpecError) as exc:
        print(f"kvflow-ray bench {args.bench}: error: {exc}", file=sys.stderr)
        return 2


def _policies(text: str) -> list[str]:
    from kvflow_ray.engines.sim.runner import parse_policies

    return parse_policies(text)


def _run_cpu(args: argparse.Namespace) -> int:
    policies = _policies(args.policies)
    scenario = build_scenario(args)
    _check_pressure(args)  # before the engine's imports: a wrong flag is refused at once
    from kvflow_ray.engines.cpu.bench import policy_progress, run_cpu_policies

    config = _engine_config(args)
    if args.pressure is not None:
        config = _pool_for_pressure(args, scenario, config)
    with policy_progress(f"cpu {scenario.name}") as progress:
        out = run_cpu_policies(scenario, config, policies, progress=progress)
    print(json.dumps(out) if args.json else format_table(out))
    return 0


def _check_pressure(args: argparse.Namespace) -> None:
    """`--pressure` (which build_scenario took for the agentic scenario only) sets the device pool."""
    if args.pressure is None:
        return
    if args.device_kv_tokens is not None:
        raise ValueError("--pressure sets the device pool: give it or --device-kv-tokens, not both")
    if args.pressure <= 0:
        raise ValueError(f"--pressure must be positive, got {args.pressure}")


def _pool_for_pressure(args: argparse.Namespace, scenario: Any, config: Any) -> Any:
    """`config` with the device pool at which the agentic sessions' live histories are `--pressure`
    times it, measured as the simulator measures them (`runner.pressure_capacity`) on this machine's
    calibrated profile."""
    from dataclasses import replace

    from kvflow_ray.engines.sim.runner import pressure_capacity

    pool, live = pressure_capacity(scenario, _measured_profile(config, DEFAULT_PROFILE), replicas=1)
    print(f"pressure {args.pressure}: device pool {pool:,} tokens (live histories {live:,.0f} tokens, "
          f"simulated on {DEFAULT_PROFILE})", file=sys.stderr)
    return replace(config, device_kv_tokens=pool)


def _measured_profile(config: Any, name: str, *, recalibrate: bool = False) -> Any:
    """The profile `name` measured on this machine, calibrated first (progress on stderr) when it is
    missing or `recalibrate`."""
    from kvflow_ray.engines.cpu.calibrate import calibrate, profile_path, write_profile
    from kvflow_ray.engines.sim.profile import load_profile

    if recalibrate or not profile_path(name=name).exists():
        write_profile(calibrate(config, log=lambda msg: print(msg, file=sys.stderr), name=name))
    return load_profile(name)


def _run_calibrate(args: argparse.Namespace) -> int:
    from kvflow_ray.engines.cpu.calibrate import calibrate, write_profile

    config = _engine_config(args)
    profile = calibrate(config, log=lambda msg: print(msg, file=sys.stderr), name=args.name)
    path = write_profile(profile, args.out)
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(profile["values"]))
    return 0


def _run_fidelity(args: argparse.Namespace) -> int:
    from kvflow_ray.engines.cpu.bench import policy_progress, run_cpu_policies
    from kvflow_ray.engines.sim.runner import run_policies

    policies = _policies(args.policies)
    scenario = build_scenario(args)
    config = _engine_config(args)
    profile = _measured_profile(config, args.profile, recalibrate=args.recalibrate)
    with policy_progress(f"cpu {scenario.name}") as progress:
        measured = run_cpu_policies(scenario, config, policies, progress=progress)
    simulated = run_policies(scenario, profile, policies, horizon=config.horizon,
                             max_inflight=config.max_inflight, gpu_capacity=config.device_kv_tokens)
    out = fidelity_report(measured, simulated)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"scenario {out['scenario']} {out['params']}: simulated ({args.profile}) vs measured (engine)")
        print(f"{'policy':<18}{'measured s':>12}{'simulated s':>13}{'sim/measured':>14}")
        for name, r in out["results"].items():
            print(f"{name:<18}{r['measured_latency_s']:>12.3f}{r['simulated_latency_s']:>13.3f}{r['ratio']:>14.3f}")
    return 0


def fidelity_report(measured: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    results = {}
    for name, m in measured["results"].items():
        s = simulated["results"][name]
        results[name] = {"measured_latency_s": m["latency_s"], "simulated_latency_s": s["latency_s"],
                         "ratio": s["latency_s"] / m["latency_s"] if m["latency_s"] else float("nan"),
                         "measured_gpu_hit_ratio": m["gpu_hit_ratio"], "simulated_gpu_hit_ratio": s["gpu_hit_ratio"]}
    return {"scenario": measured["scenario"], "params": measured["params"], "config": measured["config"],
            "results": results}
