"""KVFlow on a real GPU: the paper's single-workflow headline and a concurrent-workflows point on this
project's engine (random weights shaped like Llama-3.1-8B, bfloat16, the device KV pool capped as on an
A10G's 24 GB), lru, hicache and kvflow side by side; the engine calibrated into a simulator profile; the
simulator run on that profile for sim-versus-real fidelity. One JSON (`gpu_bench.json`).

Run it with `deploy/gpu-bench.sh` (docs/gpu.md), which needs only Python with torch and transformers:
this package's pure-Python dependencies travel as wheels. `--quick --device cpu` runs the same steps on
the small random model in CI, so the script cannot rot.

The JSON is rewritten after every section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from typing import Any

import results_file

NAME = "gpu_bench"
POLICIES = ["lru", "hicache", "kvflow"]
PAPER_PROFILE = "a10g-llama3.1-8b"  # whose device KV the pool is capped to: the paper's A10G (24 GB)


def shapes(quick: bool) -> dict[str, Any]:
    """What each section runs. Full: the paper's headline (10 agents x 8,192 fixed + 32 dynamic tokens,
    32 output; one warm-up pass, two measured) and 6 concurrent workflows of 10 agents x 2,048 tokens.
    Quick: the same shapes, small, for the 4-layer random model on a CPU."""
    if quick:
        return dict(model="random", headline=dict(agents=4, fixed=256, dynamic=8, output=4, iterations=1, warmup=1),
                    concurrent=dict(tasks=2, fixed=256, agents=4, dynamic=8, output=4, iterations=1, warmup=1),
                    device_kv_tokens=640, host_kv_tokens=4096, chunk_tokens=256, repeats=1)
    from kvflow_ray.engines.sim.profile import load_profile

    return dict(model="random-8b", headline=dict(agents=10, fixed=8192, dynamic=32, output=32, iterations=2, warmup=1),
                concurrent=dict(tasks=6, fixed=2048, agents=10, dynamic=32, output=32, iterations=1, warmup=1),
                device_kv_tokens=load_profile(PAPER_PROFILE).gpu_kv_tokens, host_kv_tokens=131_072,
                chunk_tokens=4096, repeats=3)


def load_hidden(result: dict[str, Any], kv_bytes_per_token: int, h2d_bytes_per_s: float) -> float | None:
    """The share of the measured passes' load time that no request waited for: 1 - stall / load time,
    the load time being the tokens loaded over the calibrated host->device rate (None: nothing loaded)."""
    load_s = result["loaded_tokens"] * kv_bytes_per_token / h2d_bytes_per_s
    if load_s <= 0:
        return None
    stall_s = result["prefetch_stall_s"] * result["workflows_measured"]
    return max(0.0, min(1.0, 1.0 - stall_s / load_s))


def measured_section(scenario: Any, config: Any, model: Any, profile: dict[str, Any], quiet: bool) -> dict[str, Any]:
    """Every policy on the engine, then the simulator on the calibrated profile, side by side."""
    from kvflow_ray.engines.cpu.bench import policy_progress, run_cpu_policies
    from kvflow_ray.engines.sim.profile import Profile
    from kvflow_ray.engines.sim.runner import run_policies

    with policy_progress(f"{scenario.name}") as progress:
        measured = run_cpu_policies(scenario, config, POLICIES, model=model, progress=None if quiet else progress)
    simulated = run_policies(scenario, Profile(**profile["values"]), POLICIES, horizon=config.horizon,
                             max_inflight=config.max_inflight, gpu_capacity=config.device_kv_tokens)
    h2d = profile["values"]["h2d_bytes_per_s"]
    out: dict[str, Any] = {"params": scenario.params, "results": {}}
    for policy in POLICIES:
        m, s = measured["results"][policy], simulated["results"][policy]
        out["results"][policy] = {
            **{key: m[key] for key in ("latency_s", "p99_latency_s", "recomputed_tokens", "loaded_tokens",
                                       "gpu_hit_ratio", "cpu_hit_ratio", "prefetch_stall_s", "prefetch_issued",
                                       "prefetch_used", "workflows_measured", "compute_s", "copy_busy_s")},
            "load_hidden_fraction": load_hidden(m, model.kv_bytes_per_token, h2d),
            "simulated_latency_s": s["latency_s"],
            "sim_over_real": s["latency_s"] / m["latency_s"] if m["latency_s"] else None,
        }
    kvflow = out["results"]["kvflow"]["latency_s"]
    out["kvflow_speedup"] = {base: out["results"][base]["latency_s"] / kvflow if kvflow else None
                             for base in ("lru", "hicache")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the same steps on the small random model: a CI smoke "
                                                         "run on a CPU")
    results_file.add_out_argument(ap, f"{NAME}.json and the calibrated profile's YAML")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (cuda when torch sees a GPU)")
    ap.add_argument("--profile-name", default=None,
                    help="the calibrated profile's name (default: h200-llama3.1-8b on an H200, else "
                         "<gpu>-<model> from the device)")
    args = ap.parse_args(argv)

    import torch
    import transformers

    from kvflow_ray.engines.cpu.calibrate import calibrate, write_profile
    from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
    from kvflow_ray.engines.cpu.kv_pool import paced_link
    from kvflow_ray.engines.cpu.model import CpuModel
    from kvflow_ray.engines.sim.workload import concurrent, single

    started = time.perf_counter()
    shape = shapes(args.quick)
    model = CpuModel(ModelConfig.named(shape["model"], device=args.device))
    device = model.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    name = args.profile_name or profile_name(gpu, shape["model"])
    config = CpuEngineConfig(model=model.config, device_kv_tokens=shape["device_kv_tokens"],
                             host_kv_tokens=shape["host_kv_tokens"], chunk_tokens=shape["chunk_tokens"])
    report: dict[str, Any] = {
        "generated_by": "python benchmarks/gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {**results_file.machine(), "device": str(device), "gpu": gpu, "torch": torch.__version__,
                    "transformers": transformers.__version__, "node": platform.node()},
        "model": {"name": shape["model"], "layers": model.n_layers, "hidden": model.hidden_size,
                  "kv_heads": model.n_kv_heads, "dtype": model.config.dtype, "params": model.n_params,
                  "kv_bytes_per_token": model.kv_bytes_per_token},
        "engine": {"device_kv_tokens": config.device_kv_tokens, "host_kv_tokens": config.host_kv_tokens,
                   "chunk_tokens": config.chunk_tokens, "device_pool_as": None if args.quick else PAPER_PROFILE,
                   "link_paced_gbps": paced_link(config.link_gbps, device)},  # None: the real link, unpaced
    }

    def section(title: str) -> None:
        report["wall_s"] = time.perf_counter() - started
        results_file.write_json(args.out, NAME, report)
        print(f"gpu_bench: {title} done after {report['wall_s']:.0f} s", file=sys.stderr, flush=True)

    print(f"gpu_bench: {shape['model']} on {gpu or device}, {model.n_params / 1e9:.2f}B parameters",
          file=sys.stderr, flush=True)
    profile = calibrate(config, repeats=shape["repeats"], model=model, name=name,
                        log=lambda msg: print(f"gpu_bench: calibrate: {msg}", file=sys.stderr, flush=True))
    report["profile"] = {"name": name, "path": str(write_profile(profile, str(args.out / f"{name}.yaml"))),
                         "values": profile["values"], "fit_errors": profile["measurements"]["fit_errors"]}
    section("calibration")
    report["headline"] = measured_section(single(**shape["headline"]), config, model, profile, args.no_progress)
    section("headline")
    report["concurrent"] = measured_section(concurrent(**shape["concurrent"]), config, model, profile,
                                            args.no_progress)
    section("concurrent workflows")
    for key in ("headline", "concurrent"):
        r = report[key]
        print(f"{key}: " + ", ".join(f"{p} {r['results'][p]['latency_s']:.2f} s" for p in POLICIES)
              + f"; kvflow {r['kvflow_speedup']['lru']:.2f}x lru, {r['kvflow_speedup']['hicache']:.2f}x hicache")
    return 0


def profile_name(gpu: str | None, model: str) -> str:
    """`h200-llama3.1-8b` for the 8B-shaped model on an H200; otherwise the device's first word."""
    kind = "cpu" if gpu is None else next((w for w in gpu.lower().replace("-", " ").split()
                                           if any(c.isdigit() for c in w)), "gpu")
    return f"{kind}-llama3.1-8b" if model == "random-8b" else f"{kind}-{model}"


if __name__ == "__main__":
    sys.exit(main())
