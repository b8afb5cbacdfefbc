"""CPU engine benchmarks: policies side by side, simulator fidelity, and memory after 1,000 requests.

1. `single` (10 agents, 2,048-token fixed prompts, 32 dynamic, 8 output) on the CPU engine under
   lru, hicache and kvflow, reporting speedups over lru (the issue-3 acceptance run);
2. fidelity: calibrates the `cpu-reference` profile on this machine, simulates the same scenario with
   it, and prints simulated / measured latency per policy;
3. memory: 1,000 requests (several workflows' agents, retired as they finish) through one kvflow
   engine; prints RSS growth beyond the KV pools.
   (1-3 run the seeded random model: its compute and KV are real, its weights do not matter here.)
4. real model (SmolLM2-135M-Instruct, `--sections real`): `single` as in 1 under lru, hicache and
   kvflow (what `kvflow-ray bench cpu` runs by default), twice: with the default host tier, which holds
   every prompt (both host-tier policies then recompute only the dynamic suffixes, which no cache can
   save), and with a host tier the size of the device pool, where the two tiers together cannot hold
   every prompt and the policies' choices decide what is recomputed; then the engine side by side with Hugging Face
   `generate` on the same model in the same process, same prompts, greedy: single-stream decode
   tokens/s, 8 concurrent streams' aggregate decode tokens/s (against `generate` on the 8 prompts as
   one left-padded batch), the same for 8 streams that start with one cached 2,048-token agent prompt
   (64 tokens of their own each; `generate` holds the prompt once per stream), and prefill tokens/s
   of a 2,048-token prompt; and one pass over the model's linear layers at 1, 8 and 2,048 rows, as
   `generate` runs them (`F.linear`) and as the engine does (weights packed for oneDNN). Decode rates leave the
   prefill out: the engine's from the streams' first tokens to their end (it prefills waiting
   prompts before it decodes), generate's as the time for n tokens less the time for 1.

Writes cpu_engine.json into --out (default benchmarks/out).
Run: python benchmarks/cpu_engine.py [--quick] [--sections random,real]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import results_file
from tqdm import tqdm

from kvflow_ray.commands.bench import fidelity_report
from kvflow_ray.engines.base import GenerateRequest, Hints
from kvflow_ray.engines.cpu.bench import policy_progress, run_cpu_policies
from kvflow_ray.engines.cpu.calibrate import calibrate, write_profile
from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
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


SPEED_PROMPT = 512  # tokens of each decode benchmark prompt (an agent prompt's order of size)
SPEED_NEW = 64  # tokens generated per stream
STREAMS = 8
PREFILL_CONTEXT = 2048
SHARED_PROMPT, SHARED_OWN = 2048, 64  # 8 streams sharing an agent's cached prompt, each with its own input
PREFILL_PAIRS = 3  # prefill samples per side and round


def _prompt(tokenizer: Any, n: int, seed: int) -> list[int]:
    """`n` tokens of English text (a report of numbered lines), different for each seed."""
    text = " ".join(f"Item {seed}.{i}: the quarterly revenue of segment {i % 7} rose by {(i * seed) % 13} percent."
                    for i in range(n))
    return tokenizer.encode(text)[:n]


def _hf_seconds(hf: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Wall seconds of `generate` on the prompts as one left-padded batch, greedy, exactly new_tokens each."""
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - started


def _decode_rate(results: list[Any]) -> float:
    """The engine's aggregate decode tokens/s over a run of `SPEED_NEW` tokens per stream: from the moment
    every stream has its first token (it prefills waiting prompts before it decodes) until the last ends."""
    window = max(r.latency_s for r in results) - max(r.ttft_s for r in results)
    return len(results) * (SPEED_NEW - 1) / window


def _hf_decode_rate(hf: Any, prompts: list[list[int]], pad_id: int) -> float:
    """`generate`'s aggregate decode tokens/s on the prompts as one batch: `SPEED_NEW` tokens less 1 token
    (the prefill and the first token)."""
    seconds = _hf_seconds(hf, prompts, SPEED_NEW, pad_id) - _hf_seconds(hf, prompts, 1, pad_id)
    return len(prompts) * (SPEED_NEW - 1) / seconds


def _engine_results(engine: CpuEngine, prompts: list[list[int]], new_tokens: int) -> list[Any]:
    requests = [engine.submit(GenerateRequest(tokens=p, max_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    while engine.busy:
        engine.step()
    return [r.result for r in requests]


def real_model_speed(path: str, repeats: int) -> dict[str, Any]:
    """The engine and `generate`, alternately, `repeats` rounds (prefill: `PREFILL_PAIRS` samples each
    per round); medians. Each engine run is on a fresh engine: both sides compute every prompt token,
    except the agent prompt the sharing streams start with, which the engine caches first."""
    import statistics

    from kvflow_ray.engines.tokenizer import load_tokenizer

    model = CpuModel(ModelConfig(path=path))
    tokenizer = load_tokenizer(path)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    config = CpuEngineConfig(model=ModelConfig(path=path), policy="lru", device_kv_tokens=16_384)
    rows: dict[str, list[float]] = {k: [] for k in ("engine_decode", "hf_decode", "engine_batch", "hf_batch",
                                                    "engine_shared", "hf_shared", "engine_prefill", "hf_prefill")}
    single = _prompt(tokenizer, SPEED_PROMPT, 1)
    batch = [_prompt(tokenizer, SPEED_PROMPT - 8 * i, 10 + i) for i in range(STREAMS)]  # unequal: padding is real
    long = _prompt(tokenizer, PREFILL_CONTEXT, 99)
    # an agent's prompt that every stream starts with (cached before they arrive), then each stream's own input
    agent_prompt = _prompt(tokenizer, SHARED_PROMPT, 7)
    sharing = [agent_prompt + _prompt(tokenizer, SHARED_OWN, 30 + i) for i in range(STREAMS)]
    linear = linear_kernels(model) if model.packed is not None else None
    bar = tqdm(total=repeats, desc="real model", unit="round", file=sys.stderr, disable=None)
    for _ in range(repeats):
        with CpuEngine(config, model=model) as engine:
            rows["engine_decode"].append(_decode_rate(_engine_results(engine, [single], SPEED_NEW)))
        rows["hf_decode"].append(_hf_decode_rate(model.hf, [single], pad))
        with CpuEngine(config, model=model) as engine:
            rows["engine_batch"].append(_decode_rate(_engine_results(engine, batch, SPEED_NEW)))
        rows["hf_batch"].append(_hf_decode_rate(model.hf, batch, pad))
        with CpuEngine(config, model=model) as engine:
            _engine_results(engine, [agent_prompt], 1)
            rows["engine_shared"].append(_decode_rate(_engine_results(engine, sharing, SPEED_NEW)))
        rows["hf_shared"].append(_hf_decode_rate(model.hf, sharing, pad))
        for _ in range(PREFILL_PAIRS):  # a few seconds each: more samples, alternating, steady the median
            with CpuEngine(config, model=model) as engine:
                (first,) = _engine_results(engine, [long], 1)
            rows["engine_prefill"].append(PREFILL_CONTEXT / first.ttft_s)
            rows["hf_prefill"].append(PREFILL_CONTEXT / _hf_seconds(model.hf, [long], 1, pad))
        bar.update(1)
    bar.close()
    median = {k: statistics.median(v) for k, v in rows.items()}
    return {"model": path, "params": model.n_params, "prompt_tokens": SPEED_PROMPT, "new_tokens": SPEED_NEW,
            "streams": STREAMS, "prefill_context": PREFILL_CONTEXT, "shared_prompt": SHARED_PROMPT,
            "shared_own": SHARED_OWN, "repeats": repeats, "runs": rows, "linear_kernels": linear,
            "tokens_per_s": median,
            "ratios": {"decode_vs_hf": median["engine_decode"] / median["hf_decode"],
                       "batch_vs_hf": median["engine_batch"] / median["hf_batch"],
                       "batch_vs_own_single_decode": median["engine_batch"] / median["engine_decode"],
                       "shared_vs_hf": median["engine_shared"] / median["hf_shared"],
                       "prefill_vs_hf": median["engine_prefill"] / median["hf_prefill"]}}


LINEAR_ROWS = (1, 8, 2048)  # one stream decoding, 8 streams decoding, a 2,048-token prefill
LINEAR_SAMPLES = 9


def linear_kernels(model: CpuModel) -> dict[str, Any]:
    """One pass over every linear layer of the model (lm_head included) at each of `LINEAR_ROWS` rows, run
    as `generate` runs it (`F.linear`) and as the engine does (`PackedLinears`), alternately; medians of
    `LINEAR_SAMPLES` passes each, in ms."""
    import statistics

    import torch

    linears = [m for m in model.hf.modules() if type(m) is torch.nn.Linear]
    out: dict[str, Any] = {"layers": len(linears), "rows": {}}
    for rows in LINEAR_ROWS:
        inputs = {n: torch.randn(rows, n, dtype=model.torch_dtype) for n in {m.in_features for m in linears}}
        times: dict[str, list[float]] = {"stock": [], "packed": []}
        with torch.inference_mode():
            for _ in range(LINEAR_SAMPLES + 1):  # the first of each is a warm-up
                for kind in times:
                    with model.linears() if kind == "packed" else contextlib.nullcontext():
                        started = time.perf_counter()
                        for m in linears:
                            m(inputs[m.in_features])
                        times[kind].append((time.perf_counter() - started) * 1e3)
        stock, packed = (statistics.median(times[k][1:]) for k in ("stock", "packed"))
        out["rows"][str(rows)] = {"stock_ms": stock, "packed_ms": packed, "packed_vs_stock": packed / stock}
    return out


def print_linear_kernels(r: dict[str, Any]) -> None:
    print(f"  the {r['layers']} linear layers, one pass, F.linear vs the engine's packed oneDNN weights "
          f"(median of {LINEAR_SAMPLES}):")
    for rows, q in r["rows"].items():
        print(f"    {rows:>5} rows: {q['stock_ms']:.1f} vs {q['packed_ms']:.1f} ms "
              f"({q['packed_vs_stock']:.2f}x the time)")


def print_policies(p: dict[str, Any]) -> None:
    print(f"real model, single 10x2048/32/8, {p['params']['iterations']} measured passes (device pool "
          f"{p['config']['device_kv_tokens']} tokens, host pool {p['config']['host_kv_tokens']}):")
    print(f"{'policy':<10}{'latency s':>11}{'vs lru':>8}{'recomputed':>12}{'vs lru':>8}{'loaded':>9}"
          f"{'gpu hit':>9}{'cpu hit':>9}")
    lru = p["results"]["lru"]
    for name in POLICIES:
        q = p["results"][name]
        print(f"{name:<10}{q['latency_s']:>11.2f}{lru['latency_s'] / q['latency_s']:>7.2f}x"
              f"{q['recomputed_tokens']:>12}{q['recomputed_tokens'] / lru['recomputed_tokens']:>7.2f}x"
              f"{q['loaded_tokens']:>9}{q['gpu_hit_ratio']:>9.3f}{q['cpu_hit_ratio']:>9.3f}")


def print_real_model(r: dict[str, Any]) -> None:
    print_policies(r["policies"])
    if "policies_small_host" in r:
        print_policies(r["policies_small_host"])
    t, x = r["tokens_per_s"], r["ratios"]
    print(f"real model ({r['params'] / 1e6:.1f}M params), engine vs Hugging Face generate, same process, greedy, "
          f"median of {r['repeats']} (pairs: each engine sample over the generate sample taken beside it):")
    print(f"  single-stream decode ({r['prompt_tokens']}-token prompt): {t['engine_decode']:.1f} vs "
          f"{t['hf_decode']:.1f} tokens/s ({x['decode_vs_hf']:.2f}x; pairs {_pairs(r, 'decode')})")
    print(f"  {r['streams']} streams, aggregate decode: {t['engine_batch']:.1f} vs {t['hf_batch']:.1f} tokens/s "
          f"({x['batch_vs_hf']:.2f}x, pairs {_pairs(r, 'batch')}; {x['batch_vs_own_single_decode']:.2f}x the "
          "engine's single-stream decode)")
    if "shared_vs_hf" in x:
        print(f"  {r['streams']} streams sharing a cached {r['shared_prompt']}-token prompt (+{r['shared_own']} own "
              f"tokens each), aggregate decode: {t['engine_shared']:.1f} vs {t['hf_shared']:.1f} tokens/s "
              f"({x['shared_vs_hf']:.2f}x; pairs {_pairs(r, 'shared')})")
    print(f"  prefill at {r['prefill_context']} tokens: {t['engine_prefill']:.0f} vs {t['hf_prefill']:.0f} tokens/s "
          f"({x['prefill_vs_hf']:.2f}x; pairs {_pairs(r, 'prefill')})")
    if "linear_kernels" in r:
        print_linear_kernels(r["linear_kernels"])


def _pairs(r: dict[str, Any], kind: str) -> str:
    """The range of the engine's samples over `generate`'s taken beside them (`runs`), e.g. 0.93-1.00x."""
    ratios = [mine / theirs for mine, theirs in zip(r["runs"][f"engine_{kind}"], r["runs"][f"hf_{kind}"], strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 measured pass and 300 requests (about 2 minutes)")
    parser.add_argument("--sections", default="random,real",
                        help="random: policies, fidelity and memory on the random model; real: SmolLM2 vs generate")
    results_file.add_out_argument(parser, "cpu_engine.json")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    started = time.perf_counter()
    out: dict[str, Any] = {}
    if "random" in sections:
        config = CpuEngineConfig()
        model = CpuModel(config.model, threads=config.threads)
        out["memory"] = memory_run(model, requests=300 if args.quick else 1000)  # first: nothing else ran yet
        out.update(policies_and_fidelity(model, config, iterations=1 if args.quick else 3))
        print_random_model(out, config)
    if "real" in sections:
        from kvflow_ray.engines.cpu.weights import resolve_model

        path = resolve_model()
        assert path is not None
        config = CpuEngineConfig(model=ModelConfig(path=path))
        scenario = workload.single(agents=10, fixed=2048, dynamic=32, output=8, iterations=1 if args.quick else 2)
        model = CpuModel(config.model, threads=config.threads)
        with policy_progress("real model single") as progress:
            policies = run_cpu_policies(scenario, config, POLICIES, model=model, progress=progress)
        small_host = replace(config, host_kv_tokens=config.device_kv_tokens)
        with policy_progress("real model single, small host tier") as progress:
            host_bound = run_cpu_policies(scenario, small_host, POLICIES, model=model, progress=progress)
        del model
        out["real_model"] = real_model_speed(path, repeats=1 if args.quick else 3)
        out["real_model"]["policies"] = policies
        out["real_model"]["policies_small_host"] = host_bound
        print_real_model(out["real_model"])
    out["wall_s"] = time.perf_counter() - started
    results_file.write_json(args.out, "cpu_engine", out)
    print(f"wrote {args.out} in {out['wall_s']:.0f} s")
    return 0


def print_random_model(out: dict[str, Any], config: CpuEngineConfig) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
