"""The Scenario contract: every `kvkeep bench` experiment is one of these.

A scenario says what it needs (`Needs`) and measures one mode in ``run(ctx)`` (`RunContext`:
the URL, probes, the engine and cache server to restart, kill or read), returning its own
frozen result dataclass (`result.to_json` gives its JSON). It never starts vLLM or a cache
server itself: the one mode loop (`suite.run_modes`) deploys what ``needs()`` asks for, alone
or in `bench all`. It raises on failure; the mode loop records ``{"error": ...}`` for that mode
and goes on with the others.
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar, Protocol

from kvkeep.bench.context import Needs, RunContext

__all__ = ["Needs", "Result", "RunContext", "Scenario", "parse_sizes"]


class Result(Protocol):
    """Any dataclass instance: what ``Scenario.run`` returns (frozen, by convention)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


class Scenario(Protocol):
    name: str

    def needs(self) -> Needs: ...

    def run(self, ctx: RunContext) -> Result: ...


def parse_sizes(text: str) -> list[int]:
    """`4096,16384` -> [4096, 16384]: token counts of at least 16, for argparse."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want integers like 4096,16384, got {text!r}") from None
    if not sizes or min(sizes) < 16:
        raise argparse.ArgumentTypeError("want token counts of at least 16")
    return sizes
