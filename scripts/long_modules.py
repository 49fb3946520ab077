"""A review flag, not a gate: print the modules of ``src/`` over about 600 lines, to be read
for a second concept that wants a module of its own. It never fails: a module is split by
what it does, not by its length. ``make lint`` runs it."""

from __future__ import annotations

import sys
from pathlib import Path

REVIEW_LINES = 600


def long_modules(root: Path, limit: int = REVIEW_LINES) -> list[tuple[int, Path]]:
    """(lines, path) of every module under ``root`` longer than ``limit``, longest first."""
    sizes = [(len(p.read_text().splitlines()), p) for p in root.rglob("*.py")]
    return sorted(((n, p) for n, p in sizes if n > limit), reverse=True)


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("src")
    for n, path in long_modules(root):
        print(f"review: {path} has {n} lines; does it hold two concepts?")
    return 0


if __name__ == "__main__":
    sys.exit(main())
