"""The package layout is the architecture (docs/architecture.md): lower layers never import upper
ones. Checked on the source, so a violation fails here rather than in a fresh install."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvflow_ray"

# layer -> the kvflow_ray subpackages and third-party modules it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": ("kvflow_ray.engines", "kvflow_ray.router", "kvflow_ray.serve", "kvflow_ray.client", "torch", "ray"),
    "engines": ("kvflow_ray.serve", "kvflow_ray.client"),
    "router": ("kvflow_ray.engines.cpu", "kvflow_ray.engines.sglang", "kvflow_ray.engines.sim", "kvflow_ray.serve",
               "kvflow_ray.client", "torch", "ray"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, at any depth (a lazy import counts too)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def violations(layer: str) -> list[str]:
    banned = FORBIDDEN[layer]
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
            for path in sorted((PACKAGE / layer).rglob("*.py"))
            for line, module in imported_modules(path)
            if any(module == b or module.startswith(b + ".") for b in banned)]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_never_import_upper_ones(layer: str) -> None:
    assert violations(layer) == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvflow_ray.serve.config import AppConfig\n    import ray.serve\n")
    assert imported_modules(bad) == [(2, "kvflow_ray.serve.config"), (3, "ray.serve")]
