"""The core `TieredCache` against SGLang 0.5.23's own `RadixCache`, side by side on one token stream.

SGLang's radix-cache trace shape: 10 agents, each a 2,048-token fixed prompt plus a 32-token dynamic
suffix, called in a cycle (the agent that ran longest ago runs next: LRU's worst case), 1,000
requests per run, at two device capacities; the runs are interleaved (SGLang lru, core lru, core
kvflow, repeated `--repeats` times) so machine noise hits all three alike. Each request does what
a scheduler does with its cache, with no model: look up the prompt, lock the prefix, evict for the
rest, allocate it, insert the whole prompt, unlock. SGLang's side uses its real classes and calls
(`match_prefix`, `inc_lock_ref`, `evict_from_tree_cache`, the real KV pool allocator, `insert`,
`dec_lock_ref`); the core's side gets the workflow's steps-to-execution before each call, as the
router would send them.

Needs SGLang (scripts/install-sglang-cpu.sh) and the test extra: it borrows the SGLang test rig
(tests/sglang: real pools on CPU, the torchvision stand-in).

Run: python benchmarks/cache_vs_sglang.py [--requests N] [--repeats N] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import results_file  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parents[1]
AGENTS = 10
FIXED = 2048
DYNAMIC = 32
CAPACITIES = (8192, 32768)


def prompts(requests: int) -> list[tuple[int, tuple[int, ...]]]:
    """(agent, prompt) in call order: the agents cycle; each call has a fresh dynamic suffix."""
    fixed = [tuple(range(a * 100_000, a * 100_000 + FIXED)) for a in range(AGENTS)]
    return [(i % AGENTS, fixed[i % AGENTS] + tuple(range(10_000_000 + i * DYNAMIC, 10_000_000 + (i + 1) * DYNAMIC)))
            for i in range(requests)]


def run_sglang(stream: list[tuple[int, tuple[int, ...]]], capacity: int) -> dict[str, float]:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_caches import build

    rig = build("legacy", "lru", kv_tokens=capacity)
    cache, allocator = rig.cache, rig.allocator
    hit = total = 0
    started = time.perf_counter()
    for _agent, tokens in stream:
        key = RadixKey(array("q", tokens))
        match = cache.match_prefix(MatchPrefixParams(key=key))
        node = match.last_device_node
        cache.inc_lock_ref(node)
        prefix = cache.path_device_indices(node)[:match.device_prefix_len]
        need = len(tokens) - len(prefix)
        if allocator.available_size() < need:
            evict_from_tree_cache(cache, need)
        new = allocator.alloc(need)
        assert new is not None, "SGLang could not make room"
        result = cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=torch.cat([prefix, new])))
        already = int(getattr(result, "prefix_len", len(prefix)))
        if already > len(prefix):  # KV someone inserted meanwhile: ours is a duplicate
            allocator.free(new[:already - len(prefix)])
        cache.dec_lock_ref(node)
        hit += len(prefix)
        total += len(tokens)
    elapsed = time.perf_counter() - started
    return {"req_per_s": len(stream) / elapsed, "hit_ratio": hit / total}


def run_core(stream: list[tuple[int, tuple[int, ...]]], capacity: int, policy: str) -> dict[str, float]:
    from kvflow_ray.core.cache import TieredCache
    from kvflow_ray.core.policies import StepBook, make_eviction_policy

    book = StepBook()
    cache = TieredCache(capacity, make_eviction_policy(policy, book))
    hit = total = 0
    started = time.perf_counter()
    for i, (agent, tokens) in enumerate(stream):
        book.set_steps("wf", {f"a{a}": float((a - agent) % AGENTS) for a in range(AGENTS)})
        match = cache.match(tokens)
        cache.tree.lock(match.last)
        need = len(tokens) - match.length
        ok, _writebacks = cache.make_room(need)
        assert ok, f"request {i}: the core could not make room"
        cache.alloc(need)
        cache.commit(tokens, need)
        cache.tree.tag_prefix(tokens[:FIXED], ("wf", f"a{agent}"))
        cache.tree.unlock(match.last)
        hit += match.length
        total += len(tokens)
    elapsed = time.perf_counter() - started
    return {"req_per_s": len(stream) / elapsed, "hit_ratio": hit / total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per run")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per capacity")
    results_file.add_out_argument(ap, "cache_vs_sglang.json")
    args = ap.parse_args(argv)
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    sys.path[:0] = [str(ROOT / "tests" / "sglang")]
    import conftest  # noqa: F401  (installs the torchvision stand-in SGLang's imports need on CPU)

    stream = prompts(args.requests)
    report: dict[str, Any] = {"generated_by": "python benchmarks/cache_vs_sglang.py", "requests": args.requests,
                              "trace": f"{AGENTS} agents x ({FIXED} fixed + {DYNAMIC} dynamic), cycling",
                              "capacities": {}}
    for capacity in CAPACITIES:
        runs: dict[str, list[dict[str, float]]] = {"sglang-lru": [], "core-lru": [], "core-kvflow": []}
        for _ in range(args.repeats):
            runs["sglang-lru"].append(run_sglang(stream, capacity))
            runs["core-lru"].append(run_core(stream, capacity, "lru"))
            runs["core-kvflow"].append(run_core(stream, capacity, "kvflow"))
        summary = {name: {"req_per_s_min": min(r["req_per_s"] for r in rs),
                          "req_per_s_median": statistics.median(r["req_per_s"] for r in rs),
                          "req_per_s_max": max(r["req_per_s"] for r in rs), "hit_ratio": rs[0]["hit_ratio"]}
                   for name, rs in runs.items()}
        base = summary["sglang-lru"]["req_per_s_median"]
        for entry in summary.values():
            entry["vs_sglang"] = entry["req_per_s_median"] / base
        report["capacities"][str(capacity)] = summary
        for name, entry in summary.items():
            print(f"capacity {capacity:>6}  {name:<12} {entry['req_per_s_median']:>8.0f} req/s "
                  f"({entry['req_per_s_min']:.0f}-{entry['req_per_s_max']:.0f})  hit {entry['hit_ratio']:.3f}  "
                  f"{entry['vs_sglang']:.2f}x SGLang")
    results_file.write_json(args.out, "cache_vs_sglang", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
