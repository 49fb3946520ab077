"""Reports from a results document (its shapes: `results.py`): `report.md`, `report.html`,
`results.json` and PNG files, the same from a saved results.json. Every number in a table is
measured in the run that produced the document, except the column headed "study", which quotes
the published study the benchmark reproduces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvkeep.bench.report import plots, tables
from kvkeep.bench.report.environment import markdown as env_markdown
from kvkeep.bench.report.html import html
from kvkeep.bench.report.results import errors, scenarios

__all__ = ["errors", "markdown", "scenarios", "write_report"]


def markdown(doc: dict[str, Any]) -> str:
    """The report's tables, one section per scenario, as Markdown."""
    parts = [tables.TABLES[name](d) for name, d in scenarios(doc).items() if name in tables.TABLES]
    if "scenarios" in doc and len(parts) > 2:
        parts.insert(0, tables.claims_table(doc))
    if isinstance(doc.get("environment"), dict):
        parts.append(env_markdown(doc["environment"]))
    failed = errors(doc)
    if failed:
        lines = [f"- {name}, mode {mode}: {error}" for name, mode, error in failed]
        parts.insert(0, "## Failed: these results are missing\n\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


def write_report(doc: dict[str, Any], out: Path) -> list[Path]:
    """Write report.md, results.json and the plots into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    paths: list[Path] = []
    docs = scenarios(doc)
    for name, d in docs.items():
        if name == "agents":
            paths += plots.plot_agents(d, out, docs.get("agents_fit"))
        elif name in plots.PLOTS:
            paths += plots.PLOTS[name](d, out)
    body = "# kvkeep bench report\n\n" + markdown(doc)
    body += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in paths) + "\n"
    (out / "report.md").write_text(body)
    (out / "report.html").write_text(html(body, paths))
    return [out / "report.md", out / "results.json", out / "report.html", *paths]
