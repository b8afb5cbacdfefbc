"""What the benchmarks share about their output: the `--out` folder (default `benchmarks/out`, which git
ignores; the committed `benchmarks/results` changes only with `--out benchmarks/results`), the machine a
report names, the JSON and plot write, and the check for the `[bench]` extra before any work starts."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
OUT = BENCHMARKS / "out"  # git-ignored: where a run writes unless told otherwise
RESULTS = BENCHMARKS / "results"  # committed: what docs/results/ and the README quote


def add_out_argument(ap: argparse.ArgumentParser, files: str) -> None:
    """--out DIR: where `files` (e.g. "scale.json and scale.png") are written."""
    ap.add_argument("--out", type=Path, default=OUT,
                    help=f"write {files} in this folder (default {OUT.relative_to(BENCHMARKS.parent)}, which git "
                         f"ignores; --out {RESULTS.relative_to(BENCHMARKS.parent)} replaces the committed results)")


def add_output_arguments(ap: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """--quick (a smoke run), --out, --no-progress."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    add_out_argument(ap, f"{name}.json and {name}.png")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def parser(doc: str | None, name: str, quick_help: str) -> argparse.ArgumentParser:
    """A benchmark's command line: described by its docstring's first paragraph, with the output flags."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_output_arguments(ap, name, quick_help)
    return ap


def require(*modules: str, extra: str = "bench") -> None:
    """Exit with one line, before any work, when a module the benchmark needs is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"{Path(sys.argv[0]).name}: needs {', '.join(missing)}: pip install -e '.[{extra}]'")


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "processor": platform.processor() or platform.machine()}


def save(fig: Any, path: Path) -> None:
    """A finished matplotlib figure, laid out, as `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(out: Path, name: str, report: Any) -> Path:
    """`out/<name>.json`, said on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


def write(out: Path, name: str, report: dict[str, Any], plot: Callable[[Path], None]) -> None:
    """`out/<name>.json` (the report) and `out/<name>.png` (drawn by `plot`), said on stderr."""
    write_json(out, name, report)
    plot(out / f"{name}.png")
    print(f"wrote {out / f'{name}.png'}", file=sys.stderr)
