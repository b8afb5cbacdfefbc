"""The README stays a five-minute read, and every page the README and docs/ link to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "k8s" / "README.md"]


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_bytes()) < 15_000


def test_every_relative_link_resolves() -> None:
    missing = [(str(page.relative_to(ROOT)), target) for page in _pages()
               for target in LINK.findall(page.read_text())
               if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists()]
    assert missing == []


def test_contracts_are_cited_inside_the_repository() -> None:
    """Code and docs cite docs/design.md, not a design document outside the checkout."""
    outside = [str(path.relative_to(ROOT)) for path in [*ROOT.glob("kvflow_ray/**/*.py"), *_pages()]
               if "shared/DESIGN.md" in path.read_text()]
    assert outside == []
