"""Drive coding-agent sessions against any OpenAI-compatible endpoint, and measure each turn.

Per turn the runner records what the server reported (prompt tokens, cached tokens from
`usage.prompt_tokens_details.cached_tokens`, output tokens) and what the client saw (time to
first token from the stream, end-to-end latency). Computed tokens are prompt minus cached.

Agents run closed-loop: an agent sends its next turn when the previous answer is complete and
its tool call has "run" (`tool_delay_s`). Many agents run concurrently on one event loop.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvkeep.endpoint import REQUEST_TIMEOUT_S, chat_turn, discover_model
from kvkeep.workload import Turn

LATE_TURNS = 5

# vLLM metrics the instrument reads (counters, in tokens), summed over their labels.
VLLM_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
)


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Progress = Callable[[TurnResult], None]


async def run_agents(
    url: str,
    sessions: Sequence[Sequence[Turn]],
    tool_delay_s: float = 0.0,
    progress: Progress | None = None,
    model: str | None = None,
) -> list[TurnResult]:
    """Run every session closed-loop and concurrently; results in completion order."""
    results: list[TurnResult] = []
    limits = httpx.Limits(max_connections=max(8, len(sessions) * 2))
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        model = model or await discover_model(client, url)
        t_run = time.perf_counter()

        async def agent(a: int, turns: Sequence[Turn]) -> None:
            for turn in turns:
                start = time.perf_counter() - t_run
                s = await chat_turn(client, url, model, turn)
                res = TurnResult(
                    agent=a,
                    turn=turn.index,
                    prompt_tokens=s.prompt_tokens,
                    cached_tokens=s.cached_tokens,
                    computed_tokens=s.prompt_tokens - s.cached_tokens,
                    output_tokens=s.output_tokens,
                    ttft_s=s.ttft_s,
                    latency_s=s.latency_s,
                    start_s=start,
                )
                results.append(res)
                if progress:
                    progress(res)
                if tool_delay_s > 0:
                    await asyncio.sleep(tool_delay_s)

        await asyncio.gather(*(agent(a, t) for a, t in enumerate(sessions)))
    return results


def summarize_agents(results: list[TurnResult], wall_s: float, agents: int) -> dict[str, Any]:
    """Turns/min overall and per agent, the wait per turn, and the late-turn wait."""
    by_agent: dict[int, list[TurnResult]] = {}
    for r in sorted(results, key=lambda r: (r.agent, r.turn)):
        by_agent.setdefault(r.agent, []).append(r)
    late = [r.latency_s for rows in by_agent.values() for r in rows[-LATE_TURNS:]]
    return {
        "agents": agents,
        "turns": len(results),
        "wall_s": wall_s,
        "turns_per_min": len(results) / (wall_s / 60),
        "turns_per_min_per_agent": {
            str(a): len(rows) / (max(r.start_s + r.latency_s for r in rows) / 60)
            for a, rows in by_agent.items()
        },
        "wait_per_turn_s": {str(a): [r.latency_s for r in rows] for a, rows in by_agent.items()},
        "mean_wait_s": statistics.fmean(r.latency_s for r in results),
        "late_turn_wait_s": statistics.fmean(late),
        "mean_ttft_s": statistics.fmean(r.ttft_s for r in results),
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of each metric name over its labels (`# ...` lines ignored)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals


def scrape_metrics(url: str, names: Sequence[str] = VLLM_COUNTERS) -> dict[str, float]:
    """The chosen counters from `{url}/metrics` (missing ones read as 0)."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    totals = parse_prometheus(r.text)
    return {name: totals.get(name, 0.0) for name in names}


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter increase between two scrapes."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
