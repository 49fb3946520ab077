"""Drive coding-agent sessions against any OpenAI-compatible endpoint, and measure each turn.

Per turn the runner records what the server reported (prompt tokens, cached tokens from
`usage.prompt_tokens_details.cached_tokens`, output tokens) and what the client saw (time to
first token from the stream, end-to-end latency). Computed tokens are prompt minus cached.

Agents run closed-loop: an agent sends its next turn when the previous answer is complete and
its tool call has "run" (`tool_delay_s`). Many agents run concurrently on one event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvkeep.bench.workload import Turn

REQUEST_TIMEOUT_S = 1800.0

# vLLM metrics the instrument reads (counters, in tokens), summed over their labels.
VLLM_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
)


class EndpointError(RuntimeError):
    """The endpoint answered with an error or broke the stream; the message says which."""


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


@dataclass(frozen=True)
class StreamStats:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float


async def discover_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model id the endpoint serves."""
    r = await client.get(f"{url}/v1/models", timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise EndpointError(f"{url}/v1/models lists no model")
    return str(data[0]["id"])


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a server-sent-event stream, split only where SSE splits them.

    httpx's ``aiter_lines`` splits like ``str.splitlines``: also at U+0085, U+2028 and U+2029,
    which JSON leaves unescaped inside strings. A completion that generated one of them (a
    model with random weights does, sooner or later) arrived as two halves of a JSON object.
    """
    pending = b""
    async for data in chunks:
        # CRLF, LF and CR end a line; a CRLF cut between two chunks yields one extra empty
        # line, which SSE readers skip anyway.
        pending += data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamStats:
    """POST a streaming request; TTFT is the arrival of the first chunk carrying a choice."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:500]
            raise EndpointError(f"{url} answered HTTP {r.status_code}: {text}")
        async for line in sse_lines(r.aiter_bytes()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    latency = time.perf_counter() - t0
    if not usage:
        raise EndpointError(f"{url} sent no usage; does it support stream_options.include_usage?")
    details = usage.get("prompt_tokens_details") or {}
    return StreamStats(
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int(details.get("cached_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        ttft_s=latency if ttft is None else ttft,
        latency_s=latency,
    )


async def chat_turn(
    client: httpx.AsyncClient, url: str, model: str, turn: Turn, extra: dict[str, Any] | None = None
) -> StreamStats:
    """Send one agent turn to /v1/chat/completions (greedy, exactly `max_tokens` outputs)."""
    body = {
        "model": model,
        "messages": turn.messages,
        "tools": turn.tools,
        "max_tokens": turn.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **(extra or {}),
    }
    return await _stream(client, f"{url}/v1/chat/completions", body)


async def complete_ids(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt_ids: Sequence[int],
    max_tokens: int = 1,
    extra: dict[str, Any] | None = None,
) -> StreamStats:
    """Send a token-id prompt to /v1/completions (no tokenizer in the way of exact sizes)."""
    body = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **(extra or {}),
    }
    return await _stream(client, f"{url}/v1/completions", body)


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
