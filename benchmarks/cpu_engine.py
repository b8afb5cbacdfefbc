"""CPU engine benchmarks: policies side by side, simulator fidelity, and memory after 1,000 requests.

1. `single` (10 agents, 2,048-token fixed prompts, 32 dynamic, 8 output) on the CPU engine under
   lru, hicache and kvflow, reporting speedups over lru (the issue-3 acceptance run);
2. fidelity: calibrates the `cpu-reference` profile on this machine, simulates the same scenario with
   it, and prints simulated / measured latency per policy;
3. memory: 1,000 requests (several workflows' agents, retired as they finish) through one kvflow
   engine; prints RSS growth beyond the KV pools.

Writes cpu_engine.json into --out (default benchmarks/out). Run: python benchmarks/cpu_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_file
from tqdm import tqdm

from kvflow_ray.commands.bench import fidelity_report
from kvflow_ray.engines.base import GenerateRequest, Hints
from kvflow_ray.engines.cpu.bench import policy_progress, run_cpu_policies
from kvflow_ray.engines.cpu.calibrate import calibrate, write_profile
from kvflow_ray.engines.cpu.config import CpuEngineConfig
from kvflow_ray.engines.cpu.engine import CpuEngine
from kvflow_ray.engines.cpu.model import CpuModel
from kvflow_ray.engines.sim import workload
from kvflow_ray.engines.sim.profile import load_profile
from kvflow_ray.engines.sim.runner import run_policies

POLICIES = ["lru", "hicache", "kvflow"]


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; the peak, ru_maxrss, would hide a return to baseline)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def policies_and_fidelity(model: CpuModel, config: CpuEngineConfig, iterations: int) -> dict[str, Any]:
    scenario = workload.single(agents=10, fixed=2048, dynamic=32, output=8, iterations=iterations)
    with policy_progress("cpu single") as progress:
        measured = run_cpu_policies(scenario, config, POLICIES, model=model, progress=progress)
    with tempfile.TemporaryDirectory() as tmp:
        profile_file = write_profile(calibrate(config, model=model), str(Path(tmp) / "cpu-reference.yaml"))
        profile = load_profile(str(profile_file))
        calibration = profile_file.read_text()
    simulated = run_policies(scenario, profile, POLICIES, horizon=config.horizon, max_inflight=config.max_inflight,
                             gpu_capacity=config.device_kv_tokens)
    return {"measured": measured, "simulated": simulated, "fidelity": fidelity_report(measured, simulated),
            "calibration": calibration}


def memory_run(model: CpuModel, requests: int) -> dict[str, Any]:
    """Workflows of 4 agents (shared preamble + role prompt) with fresh dynamic suffixes; each
    workflow instance is retired after its pass, as the router does."""
    config = CpuEngineConfig(device_kv_tokens=4096, host_kv_tokens=16384, link_gbps=None)
    agents = ["planner", "executor", "expresser", "reviewer"]
    preamble = [(7 * i) % 256 for i in range(96)]
    roles = {a: preamble + [(31 * i + 17 * k) % 256 for i in range(160)] for k, a in enumerate(agents)}
    samples: list[tuple[int, int]] = []
    gc.collect()
    before = rss_bytes()
    with CpuEngine(config, model=model) as engine:
        pool_bytes = engine.device.nbytes + (engine.host.nbytes if engine.host else 0)
        bar = tqdm(total=requests, desc="memory", unit="req", file=sys.stderr, disable=None)
        for i in range(requests):
            wf = f"mem/{i // len(agents)}"
            agent = agents[i % len(agents)]
            if i % len(agents) == 0:
                engine.apply_hints(Hints(prompts={(wf, a): tuple(roles[a]) for a in agents}))
            engine.apply_hints(Hints(steps={wf: {a: float((k - i) % len(agents)) for k, a in enumerate(agents)}}))
            dynamic = [(i * 13 + j * 7) % 256 for j in range(24)]
            engine.generate(GenerateRequest(tokens=roles[agent] + dynamic, max_tokens=8, ignore_eos=True,
                                            workflow=wf, agent=agent))
            if i % len(agents) == len(agents) - 1:
                engine.apply_hints(Hints(retire=[wf]))
            if (i + 1) % 100 == 0:
                samples.append((i + 1, rss_bytes()))
            bar.update(1)
        bar.close()
        engine.cache_events()
    baseline = samples[0][1]  # after 100 requests: model, pools and allocator caches are warm
    growth = samples[-1][1] - baseline
    return {"requests": requests, "pool_bytes": pool_bytes, "rss_before_engine": before, "rss_after_100": baseline,
            "engine_rss_bytes": samples[-1][1] - before,
            "rss_after_all": samples[-1][1], "rss_growth_bytes": growth, "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 measured pass and 300 requests (about 2 minutes)")
    results_file.add_out_argument(parser, "cpu_engine.json")
    args = parser.parse_args()
    started = time.perf_counter()
    config = CpuEngineConfig()
    model = CpuModel(config.model, threads=config.threads)
    memory = memory_run(model, requests=300 if args.quick else 1000)  # first: nothing else has run yet
    out = policies_and_fidelity(model, config, iterations=1 if args.quick else 3)
    out["memory"] = memory
    out["wall_s"] = time.perf_counter() - started
    results_file.write_json(args.out, "cpu_engine", out)

    r = out["measured"]["results"]
    print(f"CPU engine, single 10x2048/32/8, {out['measured']['params']['iterations']} measured passes "
          f"(device pool {config.device_kv_tokens} tokens, link {config.link_gbps} GB/s)")
    print(f"{'policy':<10}{'latency s':>11}{'vs lru':>8}{'gpu hit':>9}{'cpu hit':>9}{'stall s':>9}"
          f"{'simulated s':>13}{'sim/meas':>10}")
    for name in POLICIES:
        f = out["fidelity"]["results"][name]
        print(f"{name:<10}{r[name]['latency_s']:>11.3f}{r['lru']['latency_s'] / r[name]['latency_s']:>7.2f}x"
              f"{r[name]['gpu_hit_ratio']:>9.3f}{r[name]['cpu_hit_ratio']:>9.3f}{r[name]['prefetch_stall_s']:>9.3f}"
              f"{f['simulated_latency_s']:>13.3f}{f['ratio']:>10.3f}")
    m = out["memory"]
    print(f"memory: {m['requests']} requests; the engine added {m['engine_rss_bytes'] / 2**20:.1f} MiB of RSS "
          f"(KV pools {m['pool_bytes'] / 2**20:.1f} MiB); RSS {m['rss_after_100'] / 2**20:.0f} MiB after 100 requests, "
          f"{m['rss_after_all'] / 2**20:.0f} MiB after {m['requests']} ({m['rss_growth_bytes'] / 2**20:+.1f} MiB)")
    print(f"wrote {args.out} in {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
