"""Behaviour pinned: `kvflow-ray sim --json` for three small fixed-seed runs (the README's acceptance
scenario, the concurrent scenario and PEER, each under memory pressure so eviction, the host tier,
prefetch and admission all act) must print exactly what `tests/golden/` holds. A refactor of the
policies, the scheduler or the engines that changes any decision changes a byte here.

To accept a deliberate behaviour change, regenerate with `python tests/test_golden.py --update`
and say why in the commit."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

from kvflow_ray.cli import main

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).parent.parent
RUNS: dict[str, list[str]] = {
    "sim_single": ["--scenario", "single", "--agents", "6", "--fixed", "2048", "--dynamic", "32", "--output", "16",
                   "--iterations", "3", "--profile", "a10g-llama3.1-8b", "--gpu-kv-tokens", "12000",
                   "--policies", "lru,hicache,kvflow,kvflow-noprefetch,belady,infinite"],
    "sim_concurrent": ["--scenario", "concurrent", "--fixed", "1024", "--tasks", "8", "--profile",
                       "h100-qwen2.5-32b", "--policies", "lru,hicache,kvflow"],
    "sim_peer": ["--workflow", str(ROOT / "workflows" / "peer.yaml"), "--clients", "64", "--profile",
                 "a10g-llama3.1-8b", "--gpu-kv-tokens", "3000", "--policies", "lru,hicache,kvflow,kvflow-noprefetch"],
}


def run_sim(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["sim", *args, "--json"]) == 0
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_simulator_output_is_byte_identical_to_the_golden_run(name: str) -> None:
    assert run_sim(RUNS[name]) == (GOLDEN / f"{name}.json").read_text()


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    for name, args in RUNS.items():
        (GOLDEN / f"{name}.json").write_text(run_sim(args))


# ------------------------------------------------------------------------------------------- the CPU engine
def cpu_outputs() -> str:
    """Greedy outputs and cache outcomes of a 3-agent workflow on the CPU engine (a tiny seeded model,
    a device pool smaller than the prompts, hints before each call), per engine policy."""
    import json

    import torch

    from kvflow_ray.engines.base import GenerateRequest, Hints
    from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
    from kvflow_ray.engines.cpu.engine import CpuEngine

    def tokens(n: int, seed: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    model = ModelConfig(n_layers=2, hidden_size=64, n_heads=2, n_kv_heads=1, intermediate_size=128)
    fixed = {f"a{i}": tokens(120 + 40 * i, i) for i in range(3)}
    out: dict[str, list[dict[str, object]]] = {}
    for policy in ("lru", "hicache", "kvflow", "kvflow-noprefetch"):
        config = CpuEngineConfig(model=model, policy=policy, device_kv_tokens=400, host_kv_tokens=4000, link_gbps=None)
        runs: list[dict[str, object]] = []
        with CpuEngine(config) as engine:
            agents = list(fixed)
            for step in range(2 * len(agents)):
                agent = agents[step % len(agents)]
                steps = {a: float((i - step) % len(agents)) for i, a in enumerate(agents)}
                engine.apply_hints(Hints(steps={"wf": steps}, prompts={("wf", a): p for a, p in fixed.items()}))
                while engine.busy:  # the prefetches the hints start land before the call (no timing in the result)
                    engine.step(timeout=0.01)
                result = engine.generate(GenerateRequest(tokens=fixed[agent] + tokens(8, 100 + step), max_tokens=5,
                                                         workflow="wf", agent=agent))
                runs.append({"tokens": result.tokens, "gpu": result.gpu_hit_tokens, "cpu": result.cpu_hit_tokens,
                             "miss": result.miss_tokens})
        out[policy] = runs
    return json.dumps(out, sort_keys=True) + "\n"


def test_cpu_engine_greedy_outputs_are_unchanged() -> None:
    assert cpu_outputs() == (GOLDEN / "cpu_engine.json").read_text()


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    (GOLDEN / "cpu_engine.json").write_text(cpu_outputs())
