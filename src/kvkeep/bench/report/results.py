"""The two shapes of a results document, read alike, and the scenario runs that failed."""

from __future__ import annotations

from typing import Any


def _raw_scenarios(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if "scenarios" in doc:
        return dict(doc["scenarios"])
    return {str(doc["scenario"]): doc}


def _failed(result: Any) -> bool:
    return isinstance(result, dict) and "error" in result


def scenarios(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{name: scenario document} for either document shape, without the modes that failed
    (see ``errors``); a scenario that failed in every mode is left out."""
    out = {}
    for name, d in _raw_scenarios(doc).items():
        modes = d.get("modes")
        if not isinstance(modes, dict):
            out[name] = d
            continue
        kept = {m: r for m, r in modes.items() if not _failed(r)}
        if kept or not modes:
            out[name] = {**d, "modes": kept}
    return out


def errors(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(scenario, mode, error) for every scenario that failed in some mode."""
    return [
        (name, mode, str(r["error"]))
        for name, d in _raw_scenarios(doc).items()
        for mode, r in (d.get("modes") or {}).items()
        if _failed(r)
    ]
