"""`Command`: all that `kvkeep bench NAME` is, declared once, in its scenario module.

Each scenario module exports one ``COMMAND``; `scenarios.registry` lists them, and the
parser (`cli.COMMANDS`), the report's tables, plots and claims (`registry.sections`,
`registry.claims`) and `bench all`'s sizes (`suite.QUICK`, `suite.FULL`) are read off that
list. A command's ``sections`` are its results as the report shows them, by the name the
results file them under (a variant ``NAME@TAG`` under NAME); ``in_suite`` its part of
`bench all`. Pure declarations: nothing here runs a scenario or draws a table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvkeep.bench.pace import Pace
from kvkeep.bench.scenario import Scenario
from kvkeep.plan.replay import ENGINE_BLOCK_TOKENS
from kvkeep.traffic.workload import TokenCounter

if TYPE_CHECKING:  # the report's package imports this module's Claim and Format
    from kvkeep.bench.report.results import Run

Output = Callable[[dict[str, Any], argparse.Namespace], int]
Format = Callable[[Any], str]
K = TypeVar("K")  # a scenario's knobs at one size of `bench all`
R = TypeVar("R")  # a scenario's result dataclass


@dataclass(frozen=True)
class Section(Generic[R]):
    """One result name's part of the report: its result dataclass (each mode's JSON is
    rebuilt as one, `report.results.typed`), its Markdown table, and its plots (``out``, then
    the run); ``beside``: another result name whose run the plot draws beside this one (S5's
    run whose working set fits)."""

    result: type[R]
    table: Callable[[Run[R]], str] | None = None
    plot: Callable[..., list[Path]] | None = None
    beside: str | None = None


@dataclass(frozen=True)
class Claim(Generic[R]):
    """A row of the study's claims: its label, the study's figure, and ``get``: each mode's
    figure from its result (None: not measured). ``fill``: names the label's ``{fields}``
    from the scenario's run (S2's names its largest prompt)."""

    label: str
    study: str
    scenario: str
    get: Callable[[R], Any]
    fmt: Format
    fill: Callable[[Run[R]], dict[str, Any]] | None = None

    def title(self, run: Run[R]) -> str:
        return self.label.format(**self.fill(run)) if self.fill else self.label


@dataclass(frozen=True)
class SuiteRun:
    """What every part of one `bench all` shares: the device pool (blocks), the tokenizer
    that sizes the sessions, whether vLLM's own scheduling is measured beside
    `kvkeep serve`'s (mode vllm runs, not against an endpoint), and the machine's pace, which
    S2 measures and the time-boxed baselines after it read (`kvkeep.bench.pace`; None: every
    knob at its size's value)."""

    pool_blocks: int
    counter: TokenCounter
    reference: bool = True
    pace: Pace | None = None

    @property
    def pool_tokens(self) -> int:
        return self.pool_blocks * ENGINE_BLOCK_TOKENS


@dataclass(frozen=True)
class InSuite(Generic[K]):
    """A scenario's part of `bench all`: its knobs at each size, and ``runs``: {place in the
    suite's run order (lower first): the scenarios the knobs make}; ``record``: more for its
    document in the results; ``quick_s``, ``full_s``: how long its scenarios took."""

    quick: K
    full: K
    runs: Mapping[int, Callable[[K, SuiteRun], Sequence[Scenario]]]
    record: Callable[[K], dict[str, Any]] | None = None
    # {scenario: seconds it took in every mode, engine starts included, in a measured run of
    # `bench all` at each size}: what the progress bar counts down from (no entry: unmeasured)
    quick_s: Mapping[str, float] = field(default_factory=dict)
    full_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Command:
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    build: Callable[[argparse.Namespace], Sequence[Scenario]]  # raises ValueError
    modes: str = "none,vllm"  # the default --modes (narrowed to the modes the scenarios need)
    compare: bool = True  # the mode-comparing arguments (--endpoint, pool, --out)
    launch: bool = True  # the vLLM and cache-server arguments
    output: Output | None = None  # its own output, instead of the report of modes
    document: Callable[[argparse.Namespace], dict[str, Any]] | None = None  # more to record
    suite: bool = False  # `bench all`: scenarios at a size (`suite.size`), one document
    sections: Mapping[str, Section[Any]] = field(default_factory=dict)
    claims: tuple[Claim[Any], ...] = ()
    in_suite: InSuite[Any] | None = None
