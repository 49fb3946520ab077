"""Reports from a results document (its shapes: `results.py`): `report.md`, `report.html`,
`results.json` and PNG files, the same from a saved results.json. Every number in a table is
measured in the run that produced the document, except the column headed "study", which quotes
the published study the benchmark reproduces. Which table and plots a result gets, and the
claims' rows, each scenario's `Command` says (`scenarios.registry`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from kvkeep.bench.report import tables
from kvkeep.bench.report.environment import markdown as env_markdown
from kvkeep.bench.report.html import html
from kvkeep.bench.report.results import errors, scenarios, typed

__all__ = ["errors", "markdown", "scenarios", "write_report"]


def markdown(doc: dict[str, Any]) -> str:
    """The report's tables, one section per scenario, as Markdown."""
    registry = _registry()
    sections = registry.sections()
    parts = [
        s.table(typed(d, s.result))
        for name, d in scenarios(doc).items()
        if (s := sections.get(name)) and s.table
    ]
    if "scenarios" in doc and len(parts) > 2:
        parts.insert(0, tables.claims_table(doc, registry.claims(), sections))
    if isinstance(doc.get("pace"), dict):
        parts.append(pace_markdown(doc))
    if isinstance(doc.get("wall_s"), int | float):
        parts.append(f"This run took {_duration(doc['wall_s'])} (set-up excluded).")
    if isinstance(doc.get("timings"), dict) and doc["timings"]:
        parts.append(tables.timings_table(doc["timings"]))
    if isinstance(doc.get("environment"), dict):
        parts.append(env_markdown(doc["environment"]))
    failed = errors(doc)
    if failed:
        lines = [f"- {name}, mode {mode}: {error}" for name, mode, error in failed]
        parts.insert(0, "## Failed: these results are missing\n\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _duration(seconds: float) -> str:
    """``1557`` -> "25 min 57 s"; under a minute, seconds alone."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def write_report(doc: dict[str, Any], out: Path) -> list[Path]:
    """Write report.md, results.json and the plots into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    paths: list[Path] = []
    sections = _registry().sections()
    runs = {n: typed(d, sections[n].result) for n, d in scenarios(doc).items() if n in sections}
    for name, run in runs.items():
        s = sections[name]
        if s.plot is not None:
            paths += s.plot(run, out, *((runs.get(s.beside),) if s.beside else ()))
    body = "# kvkeep bench report\n\n" + markdown(doc)
    body += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in paths) + "\n"
    (out / "report.md").write_text(body)
    (out / "report.html").write_text(html(body, paths))
    return [out / "report.md", out / "results.json", out / "report.html", *paths]


def _registry() -> ModuleType:
    """The scenarios' registry, imported at call time: the scenario modules import the
    report's tables and plots, so this package must not import them while it loads."""
    from kvkeep.bench.scenarios import registry

    return registry


def pace_markdown(doc: dict[str, Any]) -> str:
    """What the time boxes made of this machine (`kvkeep.bench.pace`): its measured pace and
    each time-boxed scenario's units, against the reference machine's."""
    pace = doc["pace"]
    measured, factor = pace.get("cold_ttft_s"), pace.get("factor") or 1.0
    if measured is None:
        return "Time boxes: S2 measured no cold prefill, so every baseline ran at its size."
    from kvkeep.bench.scenarios import agents, hol, restart

    units = []
    for name, key, label, full in (
        ("hol", "tries", "S6 {} tries in every mode", hol.REPEATS),
        ("agents", "stride", "S5's baselines one turn in {}", agents.QUICK_STRIDE),
        (
            "restart",
            "restart_ready_samples_s",
            "S4 {} vLLM restart(s) per mode",
            restart.RestartSpec().restarts,
        ),
    ):
        for r in (doc.get("scenarios", {}).get(name, {}).get("modes") or {}).values():
            value = r.get(key) if isinstance(r, dict) else None
            if value:
                n = len(value) if isinstance(value, list) else value
                units.append(label.format(n) + f" ({full} at the reference)")
                break
    head = (
        f"Time boxes: a cold {pace['reference_tokens']:,}-token prefill took {measured:.2f} s "
        f"here (S2's median), {factor:.1f}x the {pace['reference_s']:.2f} s of the machine "
        "the demo's sizes were set on (2 cores with AMX)"
    )
    if factor <= 1.0 or not units:
        return head + ", so every baseline ran at its size."
    return (
        head
        + ", so the baselines ran fewer units, the same in every mode: "
        + "; ".join(units)
        + "."
    )
