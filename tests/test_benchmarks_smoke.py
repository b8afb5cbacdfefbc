"""Smoke test: benchmarks/paper_figures.py runs end to end (fig8, --quick) and writes its JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "paper_figures.py"
POLICIES = {"lru", "hicache", "kvflow", "kvflow-noprefetch", "infinite"}
RESULT_KEYS = {"latency_s", "p99_latency_s", "gpu_hit_ratio", "cpu_hit_ratio", "recomputed_tokens",
               "loaded_tokens", "prefetch_stall_s"}


def test_paper_figures_quick_fig8(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--only", "fig8", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fig8" in proc.stdout and "kvflow" in proc.stdout  # the speedup table

    report = json.loads((tmp_path / "paper_figures.json").read_text())
    assert "paper_figures.py" in report["generated_by"]
    assert set(report["figures"]) == {"fig8"}
    assert {"fig5", "fig6", "fig8"} <= set(report["paper"])
    entries = report["figures"]["fig8"]
    assert {e["profile"] for e in entries} == {"a10g-llama3.1-8b", "h100-qwen2.5-32b"}
    assert len(entries) == 4  # two client counts per profile
    for entry in entries:
        assert {"profile", "params", "results", "speedup_vs_lru", "speedup_vs_hicache"} <= set(entry)
        assert entry["params"]["clients"] in (16, 64)
        assert set(entry["results"]) == POLICIES
        for result in entry["results"].values():
            assert set(result) >= RESULT_KEYS
            assert result["latency_s"] > 0
        assert entry["speedup_vs_lru"]["lru"] == pytest.approx(1.0)
        assert entry["speedup_vs_hicache"]["hicache"] == pytest.approx(1.0)
        assert all(v is not None and v > 0 for v in entry["speedup_vs_lru"].values())

    plot = tmp_path / "fig8.png"
    assert plot.exists() and plot.stat().st_size > 1000
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
