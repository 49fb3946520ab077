"""The README is a newcomer's page: short, and every page it sends the reader to exists.

That nothing of the README before the cut was lost is `scripts/readme_homes.py`'s to show
(it compares against that revision, so it is a one-off check, not a test that later edits of
docs/ should have to keep passing)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_CHARS = 8500
GENERATED = ("kvkeep-report/",)  # written by `make demo`, not committed


def test_the_readme_is_a_newcomers_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) <= README_MAX_CHARS, f"README.md has {len(text)} characters"
    for heading in ("## Two commands", "## `kvkeep serve`", "## Models", "## What the demo"):
        assert heading in text, f"the README lost its section {heading!r}"


def test_every_local_link_of_the_readme_and_docs_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith(GENERATED):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
