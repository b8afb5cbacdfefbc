"""Print the benchmark tables of docs/results/simulator.md from a `paper_figures.py` result, so that
page quotes exactly what the last run measured.

    python benchmarks/report.py [benchmarks/results/paper_figures.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FIG5_PROFILES = ("a10g-llama3.1-8b", "h100-qwen2.5-32b")
TABLES = (
    ("fig6", "Figure 6, concurrent independent workflows (fixed tokens / workflows), speedup vs lru"),
    ("fig8", "Figure 8, PEER loop (clients), speedup vs lru"),
)


def fig5_table(entries: list[dict[str, Any]]) -> list[str]:
    by_label: dict[str, dict[str, dict[str, Any]]] = {}
    for entry in entries:
        by_label.setdefault(entry["label"], {})[entry["profile"]] = entry
    lines = ["Figure 5, single workflow (Fixed/Dynamic/Output), `kvflow` vs lru / vs hicache:", "",
             "| config | A10G + Llama-3.1-8B | H100 + Qwen2.5-32B |", "| --- | ---: | ---: |"]
    for label, per_profile in by_label.items():
        cells = []
        for profile in FIG5_PROFILES:
            entry = per_profile.get(profile)
            cells.append("-" if entry is None else
                         f"{entry['speedup_vs_lru']['kvflow']:.2f}× / {entry['speedup_vs_hicache']['kvflow']:.2f}×")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


def policy_table(title: str, entries: list[dict[str, Any]]) -> list[str]:
    policies = [p for p in entries[0]["speedup_vs_lru"] if p != "lru"]
    lines = [title + ":", "", f"| profile | config | {' | '.join(policies)} | kvflow vs hicache |",
             "| --- | --- | " + " | ".join("---:" for _ in policies) + " | ---: |"]
    for entry in entries:
        cells = " | ".join(f"{entry['speedup_vs_lru'][p]:.2f}×" for p in policies)
        lines.append(f"| {entry['profile']} | {entry['label']} | {cells} | "
                     f"{entry['speedup_vs_hicache']['kvflow']:.2f}× |")
    return lines


def main(path: str = "benchmarks/results/paper_figures.json") -> None:
    data = json.loads(Path(path).read_text())
    figures = data["figures"]
    lines = [f"**Paper grids** (`{data['generated_by']}`, {data['total_wall_s']:.0f} s on this machine; JSON and "
             "plots in `benchmarks/results/`). Speedup of mean workflow latency over `lru`.", ""]
    if "fig5" in figures:
        lines += fig5_table(figures["fig5"])
    for name, title in TABLES:
        if name in figures:
            lines += ["", *policy_table(title, figures[name])]
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:2])
