"""An OpenAI-compatible endpoint, seen from the client: one streamed request, timed.

`complete_ids` sends token ids to /v1/completions (exact prompt sizes, no tokenizer in the
way) and `chat_turn` one agent turn to /v1/chat/completions. Both stream, and return what the
server reported (prompt, cached and output tokens from ``usage``) and what the client saw:
time to first token (the first chunk carrying a choice) and end-to-end latency. Every call
either returns or raises `EndpointError` / an ``httpx.HTTPError``, within REQUEST_TIMEOUT_S.

Shared by `kvkeep bench` and `kvkeep plan --calibrate`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvkeep.traffic.workload import Turn

REQUEST_TIMEOUT_S = 1800.0


class EndpointError(RuntimeError):
    """The endpoint answered with an error or broke the stream; the message says which."""


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
