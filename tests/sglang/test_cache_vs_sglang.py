"""benchmarks/cache_vs_sglang.py runs end to end against SGLang 0.5.23's real RadixCache, and the core's
lru finds exactly the prefix hits SGLang's LRU finds on the same token stream (a differential check of
the baseline; kvflow keeps the agent about to run where LRU keeps none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cache_vs_sglang_quick(tmp_path: Path) -> None:
    out = tmp_path / "cache_vs_sglang.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cache_vs_sglang.py"), "--requests", "120",
                           "--repeats", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for capacity, runs in report["capacities"].items():
        assert runs["core-lru"]["hit_ratio"] == runs["sglang-lru"]["hit_ratio"], capacity
        assert all(run["req_per_s_median"] > 0 for run in runs.values())
    tight = report["capacities"]["8192"]
    assert tight["sglang-lru"]["hit_ratio"] == 0.0 < tight["core-kvflow"]["hit_ratio"]
