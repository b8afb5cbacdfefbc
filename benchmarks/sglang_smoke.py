"""GPU smoke benchmark: the KVFlow microbenchmark on real SGLang (with the kvflow plugin), policy by policy.

For each policy (lru, hicache, kvflow) it starts an in-process SGLang engine (`SglangEngine`) on a
Llama-3.1-8B-shaped model with random weights (`--load-format dummy`: only a config.json, written here,
so no download and no internet), runs the ten-agent sequential workflow (workflows/microbench10.yaml,
looping back to its first agent) and shuts the engine down again. The device KV pool is capped so the
agents' fixed prompts do NOT all fit on the GPU, while the host tier (HiCache, for hicache and kvflow)
holds them all: LRU then evicts exactly the agent that runs next, and KVFlow's steps-to-execution
eviction and prefetch should keep it.

The driver plays the workflow router's part, as `kvflow-ray sim` does: before each agent it sends the
agents' steps-to-execution (kvflow_ray.core.graph) to the engine with `apply_hints` (kvflow only: lru
and hicache are SGLang's stock behaviour), and times every pass of the loop on the wall clock.
Prompts are random token ids (fixed: one per agent, reused every pass; dynamic: fresh per call), the
scenario of docs/design.md §8 `single` (`--agents 10 --fixed 8192 --dynamic 32 --output 32 --iterations 10`).

Prints ONE JSON object on stdout (docs/design.md §8: {"scenario": "single", "profile": "<gpu>-llama3.1-8b-dummy",
"results": {policy: {latency_s, p99_latency_s, gpu_hit_ratio, cpu_hit_ratio, recomputed_tokens,
loaded_tokens, prefetch_stall_s, ...}}}), writes it to --out too, and the speedups of kvflow over lru
and hicache on stderr with the progress. Hit ratios and recomputed tokens come from SGLang's per-request
`cached_tokens_details`; loaded tokens, prefetch counts and stall from the plugin's status when it
reports them (else loaded = host hits of the measured requests, stall = 0).

Needs a CUDA GPU with room for 16 GB of weights plus the KV pool, and `pip install -e '.[sglang]'`
(done beforehand on offline hosts). deploy/gpu-smoke.sh runs it with the defaults:
    python benchmarks/sglang_smoke.py --out benchmarks/results/sglang_smoke.json
    python benchmarks/sglang_smoke.py --policies kvflow --iterations 2 --fixed 2048   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is this checkout
    sys.path.insert(0, str(ROOT))

from kvflow_ray.core.graph import WorkflowSpec, load_spec  # noqa: E402
from kvflow_ray.core.predict import Forecaster  # noqa: E402
from kvflow_ray.core.scheduler import ReplicaStats  # noqa: E402
from kvflow_ray.engines.base import GenerateRequest, Hints  # noqa: E402
from kvflow_ray.engines.sim.runner import summarise_run  # noqa: E402
from kvflow_ray.engines.sim.simulator import ClientPlan, IterationRecord, WorkflowClient  # noqa: E402
from kvflow_ray.engines.sim.workload import sequential_loop  # noqa: E402

POLICIES = ("lru", "hicache", "kvflow")
DEFAULT_WORKFLOW = ROOT / "workflows" / "microbench10.yaml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "sglang_smoke.json"
MODEL_TAG = "llama3.1-8b-dummy"
# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json). SGLang's dummy loader needs only this:
# the architecture picks the model class, the sizes shape the random weights and the KV pool
# (32 layers x 8 KV heads x 128 x 2 x bf16 = 128 KiB per token).
LLAMA31_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
# Random prompt ids stay clear of Llama 3's special tokens (128000..128255) and of the lowest ids.
TOKEN_LOW, TOKEN_HIGH = 100, 128_000


def log(message: str) -> None:
    print(f"[sglang-smoke] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the model
def write_model_config(model_dir: Path) -> Path:
    """A local Llama-3.1-8B-shaped model for `--load-format dummy`: config.json, plus a generation_config.json
    with only the special ids (SGLang looks for one and, without it, asks the hub; sampling defaults
    stay SGLang's, since every request sets its own)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(LLAMA31_8B_CONFIG, indent=2) + "\n")
    generation = {"bos_token_id": LLAMA31_8B_CONFIG["bos_token_id"], "eos_token_id": LLAMA31_8B_CONFIG["eos_token_id"]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return model_dir


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi (not torch: initialising CUDA here would hold GPU memory in
    this process next to SGLang's); "gpu" when there is none to ask."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "gpu"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else "gpu"


def profile_name(gpu: str) -> str:
    """"NVIDIA H200" -> "h200-llama3.1-8b-dummy" (the `profile` of the result JSON)."""
    words = [w for w in gpu.lower().replace("_", " ").split() if w not in ("nvidia", "geforce", "tesla")]
    slug = "-".join("".join(c for c in w if c.isalnum() or c == ".") for w in words).strip("-") or "gpu"
    return f"{slug}-{MODEL_TAG}"


# ---------------------------------------------------------------------------------------------- sizing
def request_tokens(fixed: int, dynamic: int, output: int) -> int:
    return fixed + dynamic + output


def default_device_tokens(agents: int, fixed: int, dynamic: int, output: int) -> int:
    """A device KV pool holding about 40% of the agents' requests: a sequential loop of N agents then
    makes LRU evict exactly the agent that runs next (the paper's microbenchmark pressure), while two
    requests always fit (one running, one being prefetched)."""
    per_request = request_tokens(fixed, dynamic, output)
    tokens = max(int(agents * per_request * 0.4), 2 * per_request)
    return -(-tokens // 64) * 64


def default_hicache_ratio(agents: int, fixed: int, dynamic: int, output: int, device_tokens: int) -> float:
    """Host pool = ratio x device pool: every agent's request with 50% to spare (the dynamic suffixes
    and outputs are cached too), at least SGLang's default of 2."""
    need = 1.5 * agents * request_tokens(fixed, dynamic, output)
    return max(2.0, math.ceil(2 * need / device_tokens) / 2)


def make_prompts(agents: Sequence[str], fixed: int, seed: int, low: int = TOKEN_LOW,
                 high: int = TOKEN_HIGH) -> dict[str, tuple[int, ...]]:
    """A random fixed prompt per agent (seeded: every policy sees the same tokens)."""
    rng = random.Random(seed)
    return {agent: tuple(rng.randrange(low, high) for _ in range(fixed)) for agent in agents}


def build_plan(spec: WorkflowSpec, *, fixed: int, dynamic: int, output: int, iterations: int, warmup: int,
               seed: int, low: int = TOKEN_LOW, high: int = TOKEN_HIGH) -> ClientPlan:
    return ClientPlan(key="smoke/0", spec=spec, prompts=make_prompts(list(spec.agents), fixed, seed, low, high),
                      dynamic=dynamic, output=output, iterations=warmup + iterations, warmup=warmup)


def workflow_spec(path: Path, agents: int | None) -> WorkflowSpec:
    """The workflow's graph; with `agents` different from its size, the same shape (a sequential loop)
    with that many agents, as `kvflow-ray sim --scenario single` builds it."""
    spec = load_spec(path)
    if agents is None or agents == len(spec.agents):
        return spec
    if agents < 2:
        raise ValueError(f"--agents must be at least 2, got {agents}")
    return sequential_loop("single", [f"agent{i}" for i in range(agents)])


# ---------------------------------------------------------------------------------------------- the driver
@dataclass(frozen=True)
class RequestRecord:
    """One finished agent call."""

    agent: str
    iteration: int
    measured: bool
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    miss_tokens: int
    stall_s: float
    ttft_s: float
    latency_s: float


class SmokeDriver:
    """A `ClientHost` (engines/sim/simulator.py) over any engine with the `submit` interface (SglangEngine,
    or the simulator's SimEngine in tests): runs one workflow instance on the wall clock and records
    every call. Completions come back on the engine's thread and are handled on the caller's."""

    def __init__(self, engine: Any, plan: ClientPlan, *, seed: int = 0, low: int = TOKEN_LOW,
                 high: int = TOKEN_HIGH, progress: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.plan = plan
        self.measuring = False
        self.iterations: list[IterationRecord] = []
        self.records: list[RequestRecord] = []
        self.stats_at_measure: dict[str, Any] | None = None  # engine stats when the first measured call went out
        self._rng = random.Random(seed + 1)
        self._low, self._high = low, high
        self._progress = progress
        self._done: queue.Queue[tuple[WorkflowClient, str, int, bool, Any]] = queue.Queue()
        self._outstanding = 0
        self._t0 = time.perf_counter()
        self.forecast = Forecaster()  # the step graph's steps (the plugin runs kvflow)

    @property
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def register_prompts(self, workflow: str, prompts: dict[str, tuple[int, ...]], salt: str = "") -> None:
        self.engine.apply_hints(Hints(prompts={(workflow, agent): tokens for agent, tokens in prompts.items()}))

    def publish(self, workflow: str, steps: Mapping[str, float]) -> None:
        self.engine.apply_hints(Hints(steps={workflow: dict(steps)}))

    def retire(self, workflow: str) -> None:
        self.engine.apply_hints(Hints(retire=[workflow]))

    def call(self, client: WorkflowClient, agent: str) -> None:
        plan = client.plan
        prompt = plan.prompts[agent]
        dynamic = tuple(self._rng.randrange(self._low, self._high) for _ in range(plan.dynamic))
        measured = client.iteration >= plan.warmup
        if measured and self.stats_at_measure is None:
            self.stats_at_measure = self.engine.stats()
        request = GenerateRequest(tokens=prompt + dynamic, max_tokens=max(plan.output, 1), ignore_eos=True,
                                  workflow=plan.key, agent=agent, fixed_prefix_tokens=len(prompt))
        iteration = client.iteration
        self._outstanding += 1
        self.engine.submit(request, on_done=lambda req: self._done.put((client, agent, iteration, measured, req)))

    def run(self, request_timeout_s: float = 900.0) -> float:
        """Run the workflow to the end; returns the makespan in seconds."""
        self._t0 = time.perf_counter()
        WorkflowClient(self, self.plan).begin()  # type: ignore[arg-type]
        while self._outstanding:
            try:
                client, agent, iteration, measured, req = self._done.get(timeout=request_timeout_s)
            except queue.Empty:
                raise RuntimeError(f"no request finished within {request_timeout_s:.0f} s") from None
            self._outstanding -= 1
            if req.error is not None:
                raise RuntimeError(f"agent {agent!r} failed: {req.error}") from req.error
            r = req.result
            self.records.append(RequestRecord(agent, iteration, measured, r.prompt_tokens, r.gpu_hit_tokens,
                                              r.cpu_hit_tokens, r.miss_tokens, r.stall_s, r.ttft_s, r.latency_s))
            passes = len(self.iterations)
            client.on_done(agent)
            if self._progress is not None and len(self.iterations) > passes:
                it = self.iterations[-1]
                self._progress(f"pass {it.index + 1}/{self.plan.iterations}{'' if it.measured else ' (warm-up)'}: "
                               f"{it.latency:.3f} s")
        return self.now


# ---------------------------------------------------------------------------------------------- results
def _delta(before: Mapping[str, Any] | None, after: Mapping[str, Any], *path: str) -> float:
    def get(stats: Mapping[str, Any] | None) -> float:
        value: Any = stats or {}
        for key in path:
            value = value.get(key, 0) if isinstance(value, Mapping) else 0
        return float(value or 0)

    return get(after) - get(before)


def summarise_policy(records: Sequence[RequestRecord], iterations: Sequence[IterationRecord], makespan: float,
                     device_kv_tokens: int | None, stats_before: Mapping[str, Any] | None,
                     stats_after: Mapping[str, Any]) -> dict[str, Any]:
    """One policy's docs/design.md §8 result. Token counts are the measured requests' own (`cached_tokens_details`);
    loaded tokens, prefetch and stall come from the engine's stats over the measured window when the
    engine reports them (for SGLang: keys the plugin wrote, `status_keys`), else from the requests."""
    measured = [r for r in records if r.measured]
    passes = [it for it in iterations if it.measured]
    totals = ReplicaStats(gpu_tokens=sum(r.gpu_hit_tokens for r in measured),
                          cpu_tokens=sum(r.cpu_hit_tokens for r in measured),
                          miss_tokens=sum(r.miss_tokens for r in measured),
                          loaded_tokens=sum(r.cpu_hit_tokens for r in measured),
                          stall_s=sum(r.stall_s for r in measured), requests=len(measured))
    result = summarise_run(iterations, [totals], makespan, device_kv_tokens)
    reported = stats_after.get("status_keys")
    has = (lambda key: key in reported) if reported is not None else (lambda key: key in stats_after)
    sources = {}
    if has("loaded_tokens"):
        result["loaded_tokens"] = int(_delta(stats_before, stats_after, "loaded_tokens"))
    sources["loaded_tokens"] = "engine" if has("loaded_tokens") else "requests"
    if has("prefetch_stall_s"):
        stall = _delta(stats_before, stats_after, "prefetch_stall_s")
        result["prefetch_stall_s"] = stall / len(passes) if passes else 0.0
    sources["prefetch_stall_s"] = "engine" if has("prefetch_stall_s") else "requests"
    if has("prefetch"):
        result["prefetch_issued"] = int(_delta(stats_before, stats_after, "prefetch", "issued"))
        result["prefetch_used"] = int(_delta(stats_before, stats_after, "prefetch", "used"))
    result["sources"] = sources
    result["pass_latencies_s"] = [it.latency for it in passes]
    result["ttft_s"] = statistics.fmean(r.ttft_s for r in measured) if measured else 0.0
    result["requests_measured"] = len(measured)
    result["prompt_tokens_measured"] = sum(r.prompt_tokens for r in measured)
    return result


def speedups(results: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean-latency speedup of every policy over each baseline present (lru, hicache): baseline / policy."""
    out: dict[str, dict[str, float]] = {}
    for base in ("lru", "hicache"):
        if base not in results or not results[base].get("latency_s"):
            continue
        out[f"vs_{base}"] = {policy: results[base]["latency_s"] / r["latency_s"]
                             for policy, r in results.items() if r.get("latency_s")}
    return out


def report(profile: str, params: Mapping[str, Any], config: Mapping[str, Any],
           results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {"scenario": "single", "profile": profile, "engine": "sglang", "workflow": params.get("workflow"),
            "params": dict(params), "config": dict(config), "results": dict(results),
            "speedup": speedups(results)}


# ---------------------------------------------------------------------------------------------- running
def run_policy(policy: str, args: argparse.Namespace, model_dir: Path, plan: ClientPlan, device_tokens: int,
               hicache_ratio: float) -> dict[str, Any]:
    from kvflow_ray.core.scheduler import resolve_policy
    from kvflow_ray.engines.sglang.engine import SglangEngine
    from kvflow_ray.engines.sglang.protocol import STATUS_INTERVAL_S

    host_tier = resolve_policy(policy, serving_on="SGLang").host_tier
    extra = dict(args.server_arg or {})
    log(f"{policy}: starting SGLang (device pool {device_tokens} tokens"
        f"{f', host pool {hicache_ratio:g}x' if host_tier else ', no host tier'})")
    started = time.perf_counter()
    engine = SglangEngine(str(model_dir), policy=policy, load_format="dummy", skip_tokenizer_init=True,
                          max_total_tokens=device_tokens, hicache_ratio=hicache_ratio if host_tier else None,
                          mem_fraction_static=args.mem_fraction_static, random_seed=args.seed, server_args=extra)
    startup_s = time.perf_counter() - started
    try:
        log(f"{policy}: engine up in {startup_s:.0f} s "
            f"(device pool {engine.device_tokens} tokens); running {plan.iterations} passes")
        driver = SmokeDriver(engine, plan, seed=args.seed, progress=lambda m: log(f"{policy}: {m}"))
        makespan = driver.run(args.request_timeout)
        time.sleep(STATUS_INTERVAL_S + 0.5)  # the plugin's last status write covers the whole run
        after = engine.stats()
        result = summarise_policy(driver.records, driver.iterations, makespan, engine.device_tokens,
                                  driver.stats_at_measure, after)
        result["engine_stats"] = after
        result["startup_s"] = startup_s
        return result
    finally:
        engine.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="KVFlow microbenchmark on real SGLang (GPU): lru vs hicache vs kvflow on a dummy-weights "
                    "Llama-3.1-8B, the device KV pool capped below the agents' prompts. Prints one JSON "
                    "object (docs/design.md §8) on stdout; progress and speedups on stderr.",
        epilog="Needs a CUDA GPU and `pip install -e '.[sglang]'` (the kvflow SGLang plugin). "
               "deploy/gpu-smoke.sh runs it with these defaults.")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma list of lru, hicache, kvflow (default: all three)")
    parser.add_argument("--workflow", type=Path, default=DEFAULT_WORKFLOW, help="workflow spec: its graph "
                        "(prompts are random token ids; default workflows/microbench10.yaml)")
    parser.add_argument("--agents", type=int, default=None, help="agents; when different from the workflow's, "
                        "a sequential loop of this many agents (default: the workflow's)")
    parser.add_argument("--fixed", type=int, default=8192, help="fixed prompt tokens per agent (default 8192)")
    parser.add_argument("--dynamic", type=int, default=32, help="fresh prompt tokens per call (default 32)")
    parser.add_argument("--output", type=int, default=32, help="output tokens per call (default 32)")
    parser.add_argument("--iterations", type=int, default=10, help="measured passes of the loop (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="passes before measuring (default 1)")
    parser.add_argument("--device-kv-tokens", type=int, default=None,
                        help="device KV pool (SGLang max_total_tokens); default: about 40%% of all agents' requests")
    parser.add_argument("--hicache-ratio", type=float, default=None,
                        help="host pool / device pool for hicache and kvflow; default: every agent's request "
                             "with 50%% to spare, at least 2")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="SGLang's GPU memory fraction for weights + KV pool (default: SGLang's)")
    parser.add_argument("--server-arg", action="append", default=None, type=_server_arg, metavar="KEY=JSON",
                        help="another SGLang server arg, e.g. --server-arg page_size=16 --server-arg "
                             "disable_cuda_graph=true (repeatable; the value is JSON, else a string)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where to write the dummy model's config.json (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompt tokens and SGLang's random_seed (default 0)")
    parser.add_argument("--request-timeout", type=float, default=900.0,
                        help="seconds to wait for the next request to finish (default 900)")
    parser.add_argument("--profile", default=None, help="the result's profile name (default: <gpu>-llama3.1-8b-dummy "
                        "from nvidia-smi)")
    parser.add_argument("--out", type=Path, default=None, help=f"also write the JSON here (e.g. {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    args.server_arg = dict(args.server_arg or [])
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        parser.error(f"--policies: choose from {', '.join(POLICIES)} (got {args.policies!r})")
    args.policies = list(dict.fromkeys(policies))
    for name in ("fixed", "iterations", "output"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.dynamic < 0 or args.warmup < 0:
        parser.error("--dynamic and --warmup must be >= 0")
    return args


def _server_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = workflow_spec(args.workflow, args.agents)
    n = len(spec.agents)
    device_tokens = args.device_kv_tokens or default_device_tokens(n, args.fixed, args.dynamic, args.output)
    ratio = args.hicache_ratio or default_hicache_ratio(n, args.fixed, args.dynamic, args.output, device_tokens)
    per_request = request_tokens(args.fixed, args.dynamic, args.output)
    if device_tokens >= n * per_request:
        log(f"warning: the device pool ({device_tokens} tokens) holds every agent's request "
            f"({n} x {per_request}): no cache pressure, the policies will look alike")
    plan = build_plan(spec, fixed=args.fixed, dynamic=args.dynamic, output=args.output, iterations=args.iterations,
                      warmup=args.warmup, seed=args.seed)
    profile = args.profile or profile_name(gpu_name())
    params = {"workflow": spec.name, "agents": n, "fixed": args.fixed, "dynamic": args.dynamic,
              "output": args.output, "iterations": args.iterations, "warmup": args.warmup,
              "device_kv_tokens": device_tokens, "hicache_ratio": ratio, "seed": args.seed,
              "kv_bytes_per_token": KV_BYTES_PER_TOKEN}
    config = {"model": "Llama-3.1-8B shape, dummy weights (bf16)", "server_args": args.server_arg,
              "mem_fraction_static": args.mem_fraction_static}
    log(f"{profile}: {n} agents x ({args.fixed} fixed + {args.dynamic} dynamic + {args.output} out), "
        f"{args.warmup}+{args.iterations} passes; device pool {device_tokens} tokens "
        f"({device_tokens * KV_BYTES_PER_TOKEN / 2**30:.1f} GiB), all prompts {n * per_request} tokens")

    from kvflow_ray.serve.app import stdout_to_stderr

    tmp = None if args.model_dir else Path(tempfile.mkdtemp(prefix="kvflow-llama-dummy-"))
    model_dir = write_model_config(args.model_dir or tmp)  # type: ignore[arg-type]
    results: dict[str, Any] = {}
    try:
        with stdout_to_stderr():  # SGLang and its children print; stdout carries only the JSON
            for policy in args.policies:
                results[policy] = run_policy(policy, args, model_dir, plan, device_tokens, ratio)
                r = results[policy]
                log(f"{policy}: latency {r['latency_s']:.3f} s (p99 {r['p99_latency_s']:.3f}), gpu hit "
                    f"{r['gpu_hit_ratio']:.3f}, cpu hit {r['cpu_hit_ratio']:.3f}, recomputed {r['recomputed_tokens']}, "
                    f"loaded {r['loaded_tokens']}, stall {r['prefetch_stall_s']:.3f} s/pass")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = report(profile, params, config, results)
    for base, table in out["speedup"].items():
        log(f"speedup {base}: " + ", ".join(f"{p} {s:.2f}x" for p, s in table.items()))
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

