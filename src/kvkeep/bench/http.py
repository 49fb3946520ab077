"""Closed-loop coding agents against one or several OpenAI-compatible endpoints: the one agent
loop (`agent_loop`; `run_agents`, the replay and `bench soak` each run their step in it)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TypeVar

import httpx

from kvkeep.traffic.endpoint import REQUEST_TIMEOUT_S, chat_turn, discover_model
from kvkeep.traffic.workload import Turn

LATE_TURNS = 5


@dataclass(frozen=True)
class TurnResult:
    """What one request measured. Times are seconds; `start_s` is relative to the run start."""

    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    start_s: float


T = TypeVar("T")  # what a session is a sequence of: a Turn, or a replayed request


async def agent_loop(
    sessions: Sequence[Sequence[T]],
    step: Callable[[httpx.AsyncClient, int, T], Awaitable[None]],
    tool_delay_s: float = 0.0,
    until: float | None = None,
) -> None:
    """Every agent ``a`` awaits ``step(client, a, turn)`` for its turns in order; with
    ``until`` (a monotonic time) it replays them again and again until then."""
    limits = httpx.Limits(max_connections=max(8, len(sessions) * 2))
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:

        async def agent(a: int, turns: Sequence[T]) -> None:
            i = 0
            while i < len(turns) if until is None else time.monotonic() < until:
                await step(client, a, turns[i % len(turns)])
                i += 1
                if tool_delay_s > 0:
                    await asyncio.sleep(tool_delay_s)

        await asyncio.gather(*(agent(a, t) for a, t in enumerate(sessions)))


async def run_agents(
    urls: Sequence[str],
    sessions: Sequence[Sequence[Turn]],
    tool_delay_s: float = 0.0,
    progress: Callable[[TurnResult], None] | None = None,
    unit: Callable[[], AbstractAsyncContextManager[None]] | None = None,
) -> list[TurnResult]:
    """Run every session closed-loop and concurrently, measuring each turn (computed tokens
    are prompt minus cached); results in completion order. With several URLs, turn ``t`` of
    agent ``a`` goes to replica ``(a + t) % N``: an agent's consecutive turns never share a
    replica, the worst case for locality. With ``unit`` (`RunContext.aturn`) each request is
    one unit of a scenario whose modes take turns."""
    results: list[TurnResult] = []
    async with httpx.AsyncClient() as client:
        model = await discover_model(client, urls[0])
    t_run = time.perf_counter()

    async def step(client: httpx.AsyncClient, a: int, turn: Turn) -> None:
        async with unit() if unit else contextlib.nullcontext():
            start = time.perf_counter() - t_run
            s = await chat_turn(client, urls[(a + turn.index) % len(urls)], model, turn)
        computed = s.prompt_tokens - s.cached_tokens
        row = TurnResult(
            a,
            turn.index,
            s.prompt_tokens,
            s.cached_tokens,
            computed,
            s.output_tokens,
            s.ttft_s,
            s.latency_s,
            start,
        )
        results.append(row)
        if progress:
            progress(row)

    await agent_loop(sessions, step, tool_delay_s)
    return results


@dataclass(frozen=True)
class AgentsSummary:
    """Turns/min overall and per agent, the wait per turn, and the late-turn wait."""

    agents: int
    turns: int
    wall_s: float
    turns_per_min: float
    turns_per_min_per_agent: dict[str, float]
    wait_per_turn_s: dict[str, list[float]]
    mean_wait_s: float
    late_turn_wait_s: float
    mean_ttft_s: float


def summarize_agents(
    results: list[TurnResult], wall_s: float, agents: int, late: int = LATE_TURNS
) -> AgentsSummary:
    """Turns/min over ``wall_s``; ``late``: how many of each agent's last turns the late-turn
    wait averages."""
    by_agent: dict[int, list[TurnResult]] = {}
    for r in sorted(results, key=lambda r: (r.agent, r.turn)):
        by_agent.setdefault(r.agent, []).append(r)
    late_rows = [r.latency_s for rows in by_agent.values() for r in rows[-late:]]
    return AgentsSummary(
        agents,
        len(results),
        wall_s,
        len(results) / (wall_s / 60),
        {
            str(a): len(rows) / (max(r.start_s + r.latency_s for r in rows) / 60)
            for a, rows in by_agent.items()
        },
        {str(a): [r.latency_s for r in rows] for a, rows in by_agent.items()},
        statistics.fmean(r.latency_s for r in results),
        statistics.fmean(late_rows),
        statistics.fmean(r.ttft_s for r in results),
    )


def summarize_sample(
    results: list[TurnResult], sample: Sequence[int], tool_delay_s: float, agents: int, stride: int
) -> AgentsSummary:
    """The agents' figures over the turns in ``sample`` alone, the same way in every mode
    whether it ran only those or every turn: each agent's time is its sampled turns'
    latencies and tool delays (a closed loop spends nothing else), the run's the slowest
    agent's, and the late-turn wait covers as many sampled turns as ``LATE_TURNS`` turns
    span (at stride 3, the last 2)."""
    keep = set(sample)
    rows = [r for r in results if r.turn in keep]
    per_agent: dict[int, float] = {}
    for r in rows:
        per_agent[r.agent] = per_agent.get(r.agent, 0.0) + r.latency_s + tool_delay_s
    late = max(1, -(-LATE_TURNS // stride))
    return summarize_agents(rows, max(per_agent.values()), agents, late)
