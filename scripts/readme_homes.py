"""Does every part of an old README have a home? The README was cut to a newcomer's page and
the rest moved to docs/; this checks that nothing was lost on the way.

The old README (``git show REV:README.md``, by default the last one before the cut) is split
into its sections by Markdown headings, and each section into units: its heading (found by its
text in a heading of any level), each paragraph, list item, table row and line of code. A unit
has a home where README.md or one of docs/*.md (not docs/notes/) holds its text whole, its
whitespace collapsed and links reduced to their text (moved text's relative links gain a
``../``); blank lines, code fences and table separators are skipped. Prints, per section, the
files that hold its units and the units found nowhere, with those of their lines that no file
holds; exits 1 if any unit has no home.

    python scripts/readme_homes.py [--rev REV] [--root DIR]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

OLD_REV = "c37a634"  # the README before it was cut to a newcomer's page
ROOT = Path(__file__).resolve().parents[1]

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+\.)\s+")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


@dataclass
class Unit:
    """A heading, paragraph, list item, table row or code line: ``kind`` and its lines."""

    kind: str
    lines: list[str]

    @property
    def text(self) -> str:
        return normalise(" ".join(self.lines))


@dataclass
class Section:
    """One heading of the old README and the units under it, up to the next heading."""

    heading: str
    units: list[Unit] = field(default_factory=list)


@dataclass
class Home:
    """Where one old section is now: file -> units found there; the units found nowhere."""

    heading: str
    units: int
    files: dict[str, int]
    missing: list[Unit]


@dataclass(frozen=True)
class Doc:
    """A new file: its whole text normalised, and its headings' texts."""

    body: str
    headings: frozenset[str]


def normalise(text: str) -> str:
    """``text`` with links reduced to their text and whitespace collapsed to single spaces."""
    return " ".join(LINK.sub(r"\1", text.replace("](../", "](")).split())


def sections(markdown: str) -> list[Section]:
    """The sections of ``markdown`` in order (what precedes the first heading under "")."""
    out = [Section("")]
    fenced = False
    current: Unit | None = None  # the paragraph or list item a next line continues
    for raw in markdown.splitlines():
        heading = None if fenced else HEADING.match(raw)
        if FENCE.match(raw):
            fenced, current = not fenced, None
        elif fenced:
            if raw.strip():
                out[-1].units.append(Unit("code", [raw]))
        elif heading:
            out.append(Section(raw.strip(), [Unit("heading", [heading.group(2)])]))
            current = None
        elif not raw.strip():
            current = None
        elif TABLE_SEPARATOR.match(raw):
            continue
        elif raw.lstrip().startswith("|"):
            out[-1].units.append(Unit("row", [raw]))
            current = None
        elif LIST_ITEM.match(raw) or current is None:
            current = Unit("item" if LIST_ITEM.match(raw) else "paragraph", [raw])
            out[-1].units.append(current)
        else:
            current.lines.append(raw)
    return [s for s in out if s.units]


def new_docs(root: Path) -> dict[str, Doc]:
    """README.md and docs/*.md (not docs/notes/), by path relative to ``root``."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    out = {}
    for path in (p for p in paths if p.is_file()):
        text = path.read_text()
        heads = (HEADING.match(line) for line in text.splitlines())
        out[str(path.relative_to(root))] = Doc(
            normalise(text), frozenset(normalise(h.group(2)) for h in heads if h)
        )
    return out


def holds(doc: Doc, unit: Unit) -> bool:
    return unit.text in doc.headings if unit.kind == "heading" else unit.text in doc.body


def homes(old_readme: str, root: Path = ROOT) -> list[Home]:
    """For each section of ``old_readme``: which of README.md and docs/*.md hold its units,
    and which of its units none of them holds."""
    docs = new_docs(root)
    out = []
    for section in sections(old_readme):
        found: dict[str, int] = {}
        missing = []
        for unit in section.units:
            holders = [name for name, doc in docs.items() if holds(doc, unit)]
            for name in holders:
                found[name] = found.get(name, 0) + 1
            if not holders:
                missing.append(unit)
        heading = section.heading or "(before the first heading)"
        out.append(Home(heading, len(section.units), found, missing))
    return out


def old_readme(rev: str = OLD_REV, root: Path = ROOT) -> str:
    """README.md as it was at git revision ``rev``."""
    return subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:README.md"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def nowhere(unit: Unit, root: Path) -> list[str]:
    """The lines of ``unit`` that no new file holds even on their own."""
    bodies = [doc.body for doc in new_docs(root).values()]
    return [line for line in unit.lines if not any(normalise(line) in b for b in bodies)]


def table(found: list[Home], root: Path = ROOT) -> str:
    """A Markdown table, section -> files holding its units (how many each) and units missing,
    then each missing unit under its section, with the lines of it that no file holds."""
    rows = ["| old section | units | now in | missing |", "|---|---|---|---|"]
    for h in found:
        by_count = sorted(h.files.items(), key=lambda kv: (-kv[1], kv[0]))
        where = ", ".join(f"{name} ({n})" for name, n in by_count)
        rows.append(f"| {h.heading} | {h.units} | {where or '-'} | {len(h.missing)} |")
    for h in (h for h in found if h.missing):
        rows.append(f"\nno home, in {h.heading}:")
        for unit in h.missing:
            rows.append(f"  {unit.kind} of {len(unit.lines)} line(s): {unit.lines[0].strip()}")
            rows += [f"    nowhere: {line.strip()}" for line in nowhere(unit, root)]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Does every part of an old README have a home?")
    ap.add_argument("--rev", default=OLD_REV, help=f"git revision of the old README ({OLD_REV})")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository")
    args = ap.parse_args(argv)
    found = homes(old_readme(args.rev, args.root), args.root)
    print(table(found, args.root))
    lost = sum(len(h.missing) for h in found)
    total = sum(h.units for h in found)
    print(f"\n{args.rev}:README.md: {total - lost} of {total} units have a home, {lost} none")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
