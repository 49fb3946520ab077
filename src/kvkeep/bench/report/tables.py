"""The pieces of the report's Markdown tables, and the tables that span scenarios: the
study's claims side by side, and the connector's profile.

Each scenario module declares its own table (most are a `Table` of `Column`s: a row per mode,
a column per figure read off the mode's typed result) and its claims' rows; its `Command`
names them (``sections``, ``claims``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvkeep.bench.command import Claim, Format, Section
from kvkeep.bench.report.results import Run, _raw_scenarios, scenarios, typed
from kvkeep.vllm.counters import PROFILE_NAMES


def _fmt(pattern: str, value: Callable[[Any], Any] = float) -> Format:
    """A cell's text: ``pattern`` of ``value(v)``, or "-" where nothing was measured (None)."""
    return lambda v: "-" if v is None else pattern.format(value(v))


count, secs, times, one_place = _fmt("{:,}", int), _fmt("{:.3f} s"), _fmt("{:.1f}x"), _fmt("{:.1f}")
pct = _fmt("{:.1f}%", lambda v: 100 * float(v))


R = TypeVar("R")


def markdown_table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Column(Generic[R]):
    """A table's column: its label, ``get``: its figure from a mode's result (None: not
    measured, shown as "-"), and how to write it."""

    label: str
    get: Callable[[R], Any]
    fmt: Format = secs


@dataclass(frozen=True)
class Table(Generic[R]):
    """A row per mode that ran (a mode with an empty result is "not run" and left out)."""

    head: str | Callable[[Run[R]], str]
    columns: tuple[Column[R], ...]
    first: str = "mode"
    not_run: str = ""  # why a mode's result is empty, said above the table

    def __call__(self, run: Run[R]) -> str:
        head = self.head if isinstance(self.head, str) else self.head(run)
        if run.skipped and self.not_run:
            head += f"Not run for {', '.join(run.skipped)}: {self.not_run}.\n\n"
        rows = [[m, *(c.fmt(c.get(r)) for c in self.columns)] for m, r in run.modes.items()]
        return head + markdown_table([self.first, *(c.label for c in self.columns)], rows)


def claims_table(
    doc: dict[str, Any], claims: Iterable[Claim[Any]], sections: Mapping[str, Section[Any]]
) -> str:
    """One row per claim of the study (in the order given): its figure, then each mode
    measured in this run ("-" where that mode did not measure it). ``sections``: each
    result name's class, by which its modes' results are read."""
    runs = {n: typed(d, sections[n].result) for n, d in scenarios(doc).items() if n in sections}
    raw = _raw_scenarios(doc).values()
    modes = list(dict.fromkeys(m for d in raw for m in d["modes"]))
    rows = []
    for c in claims:
        run = runs.get(c.scenario, Run({}))
        figures = [None if (r := run.modes.get(m)) is None else c.get(r) for m in modes]
        rows.append([c.title(run), c.study, *map(c.fmt, figures)])
    head = "## The study's claims, measured side by side\n\n"
    return head + markdown_table(["claim", "study", *modes], rows)


# The connector's phases (`vllm:kvkeep_seconds_total{op=...}`), then its whole load and save.
PROFILE_OPS = (
    *(name.removesuffix("_s") for name in PROFILE_NAMES),
    "load",
    "save",
    "server_cpu",
    "server_rpc_cpu",
)


def profile_table(doc: dict[str, Any]) -> str:
    """`--profile`: the connector's milliseconds per phase, in total and per finished request,
    one row per scenario and mode that recorded a profile (mode kvkeep; the others are 0)."""
    rows = []
    for name, d in scenarios(doc).items():
        for mode, result in d["modes"].items():
            prof = result.get("profile")
            if not prof or not any(prof.get(op) for op in PROFILE_OPS):
                continue
            n = max(prof.get("requests", 0.0), 1.0)
            cells = [
                f"{1e3 * prof.get(op, 0.0):.0f} / {1e3 * prof.get(op, 0.0) / n:.1f}"
                for op in PROFILE_OPS
            ]
            rows.append([name, mode, count(prof.get("requests")), *cells])
    head = (
        "### Connector profile (ms in total / ms per request; `load` and `save` are the "
        "worker's whole step phases, the others their parts; `saver_cpu` is the saver "
        "thread's CPU time, `server_cpu` the cache server's, `server_rpc_cpu` the part "
        "of it that answered requests)\n\n"
    )
    return head + markdown_table(["scenario", "mode", "requests", *PROFILE_OPS], rows)


def timings_table(timings: Mapping[str, Mapping[str, Any]]) -> str:
    """Where the run's time went: per scenario (``NAME@TAG`` variants on rows of their own),
    its group's engine starts, each mode's seconds holding the machine and the scenario's
    wall time (`suite.Timings`), then the totals."""
    modes: list[str] = []
    for t in timings.values():
        modes += [m for m in t.get("modes", {}) if m not in modes]
    rows, total = [], {"starts": 0.0, "wall": 0.0, **dict.fromkeys(modes, 0.0)}
    for name, t in timings.items():
        by_mode = t.get("modes", {})
        rows.append(
            [
                name,
                f"{t.get('starts_s', 0.0):.0f}",
                *(f"{by_mode[m]:.0f}" if m in by_mode else "-" for m in modes),
                f"{t.get('wall_s', 0.0):.0f}",
            ]
        )
        total["starts"] += t.get("starts_s", 0.0)
        total["wall"] += t.get("wall_s", 0.0)
        for m in modes:
            total[m] += by_mode.get(m, 0.0)
    rows.append(
        [
            "all",
            f"{total['starts']:.0f}",
            *(f"{total[m]:.0f}" for m in modes),
            f"{total['wall']:.0f}",
        ]
    )
    head = (
        "### Where the time went (seconds)\n\n"
        "Engine starts are a group's (its modes' engines start at once), counted with its first "
        "scenario. A mode's seconds are those it held the machine while the modes took turns; "
        "a scenario's wall time also holds the waits for a quiet machine between turns.\n\n"
    )
    header = ["scenario", "engine starts", *(f"{m}" for m in modes), "scenario wall"]
    return head + markdown_table(header, rows)
