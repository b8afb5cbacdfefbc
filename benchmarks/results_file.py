"""What the benchmarks that write `benchmarks/results/<name>.json` and `<name>.png` share (scale.py,
fleet.py, dynamic.py): their output flags, where results go, the machine a report names, the write."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def parser(doc: str | None, name: str, quick_help: str) -> argparse.ArgumentParser:
    """A benchmark's command line: described by its docstring's first paragraph, with the output flags."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_output_arguments(ap, name, quick_help)
    return ap


def save(fig: Any, path: Path) -> None:
    """A finished matplotlib figure, laid out, as `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_output_arguments(ap: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """--quick (a smoke run that writes nowhere unless --out is given), --out, --no-progress."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", type=Path, default=None,
                    help=f"write {name}.json and {name}.png here (default: benchmarks/results, not with --quick)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def output_dir(args: argparse.Namespace) -> Path | None:
    """Where the results go: --out, else benchmarks/results, except for a --quick run."""
    return args.out if args.out is not None else (None if args.quick else RESULTS)


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "processor": platform.processor() or platform.machine()}


def write(out: Path, name: str, report: dict[str, Any], plot: Callable[[Path], None]) -> None:
    """`out/<name>.json` (the report) and `out/<name>.png` (drawn by `plot`), said on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(out / f"{name}.png")
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}", file=sys.stderr)
