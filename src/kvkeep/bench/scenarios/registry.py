"""Every `kvkeep bench` scenario command, in the study's order (S1-S7, then the others): the
one list the parser, the report and `bench all` read (`kvkeep.bench.command`).

A new scenario is a module in this package that exports ``COMMAND``, and a line here. The
order is the claims table's; `bench all` runs its parts in the order of their places.
"""

from __future__ import annotations

from kvkeep.bench.command import Claim, Command, Section
from kvkeep.bench.scenarios import (
    agents,
    capacity,
    hol,
    replay,
    restart,
    session,
    soak,
    store,
    ttft,
)

SCENARIOS: tuple[Command, ...] = (
    session.COMMAND,  # S1
    ttft.COMMAND,  # S2
    capacity.COMMAND,  # S3
    restart.COMMAND,  # S4
    agents.COMMAND,  # S5
    hol.COMMAND,  # S6
    replay.COMMAND,  # S7
    soak.COMMAND,
    store.COMMAND,
)


def sections() -> dict[str, Section]:
    """{result name: its part of the report}, over every scenario."""
    return {name: s for c in SCENARIOS for name, s in c.sections.items()}


def claims() -> list[Claim]:
    """The study's claims, in the order of the scenarios."""
    return [claim for c in SCENARIOS for claim in c.claims]
