"""The two shapes of a results document, read alike; the scenario runs that failed; and a
scenario's document rebuilt as typed results (`Run`), which every table and plot reads.

A results document is the JSON of the scenarios' result dataclasses (`result.to_json`): one
scenario (`{"scenario": NAME, "modes": {...}}`) or several (`{"scenarios": {NAME: {...}}}`).
A scenario's ``modes`` holds a JSON object per mode: its result, ``{}`` for a mode it does not
run in, or ``{"error": ...}`` for a run that failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvkeep.bench.result import from_json

R = TypeVar("R")


@dataclass(frozen=True)
class Run(Generic[R]):
    """One scenario's results, typed: each mode's result rebuilt by its class (`from_json`),
    in the document's mode order; ``skipped``: the modes it does not run in (an empty
    result); ``record``: the rest of its document (`bench all`'s size, `InSuite.record`).
    A mode's connector profile (`--profile`) is not part of its result: `tables.profile_table`
    reads it from the document."""

    modes: dict[str, R]
    skipped: tuple[str, ...] = ()
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def first(self) -> R | None:
        """The first mode's result (what every mode shares: the sizes it ran at)."""
        return next(iter(self.modes.values()), None)


def typed(d: dict[str, Any], cls: type[R]) -> Run[R]:
    """Scenario document ``d`` (failed modes left out: `scenarios`) with each mode's result
    as a ``cls``. Raises ValueError naming a key the results lack."""
    modes = {m: from_json(cls, r) for m, r in d["modes"].items() if r}
    return Run(
        modes,
        tuple(m for m, r in d["modes"].items() if not r),
        {k: v for k, v in d.items() if k not in ("modes", "scenario")},
    )


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
