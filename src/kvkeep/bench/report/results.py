"""The two shapes of a results document, read alike, and the scenario runs that failed.

A results document is the JSON of the scenarios' result dataclasses (`result.to_json`): one
scenario (`{"scenario": NAME, "modes": {...}}`) or several (`{"scenarios": {NAME: {...}}}`).
A scenario's ``modes`` holds a JSON object per mode: its result, ``{}`` for a mode it does not
run in, or ``{"error": ...}`` for a run that failed.
"""

from __future__ import annotations

from typing import Any


def _raw_scenarios(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(doc["scenarios"]) if "scenarios" in doc else {str(doc["scenario"]): doc}


def scenarios(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{name: scenario document} for either document shape, without the modes that failed
    (see ``errors``); a scenario that failed in every mode is left out."""
    out = {}
    for name, d in _raw_scenarios(doc).items():
        kept = {m: r for m, r in d["modes"].items() if "error" not in r}
        if kept or not d["modes"]:
            out[name] = {**d, "modes": kept}
    return out


def errors(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(scenario, mode, error) for every scenario that failed in some mode."""
    return [
        (name, mode, str(r["error"]))
        for name, d in _raw_scenarios(doc).items()
        for mode, r in d["modes"].items()
        if "error" in r
    ]
