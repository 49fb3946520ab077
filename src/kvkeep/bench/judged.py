"""The judged-reply client: greedy requests whose replies ``kvkeep.bench.criterion`` compares.

Every request asks for its output as token ids (``return_tokens_as_token_ids``) with each
position's logprob and its ``TOP_ALTERNATIVES`` best alternatives, so that the criterion can
tell a near tie from a wrong token. The soak and the end-to-end tests both use it, on
completions (token ids in) and chat (messages in) alike; the served model's name is the
caller's, never assumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import httpx

from kvkeep.bench.criterion import TOP_ALTERNATIVES, Reply, token_id


class Judged(NamedTuple):
    """A reply the criterion can judge, and the usage that says where its prompt came from."""

    reply: Reply
    prompt_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (0 when vLLM omits it)


_GREEDY: dict[str, Any] = {
    "temperature": 0.0,
    "ignore_eos": True,  # every reply has max_tokens tokens: replies compare position by position
    "return_tokens_as_token_ids": True,
}


def completion_body(
    model: str, ids: Sequence[int], max_tokens: int, salt: str | None = None
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request on token ids (``salt``: vLLM's ``cache_salt``)."""
    body = {"model": model, "prompt": list(ids), "max_tokens": max_tokens, **_GREEDY}
    body["logprobs"] = TOP_ALTERNATIVES
    if salt is not None:
        body["cache_salt"] = salt
    return body


def chat_body(
    model: str,
    messages: Sequence[dict[str, Any]],
    max_tokens: int,
    tools: Sequence[dict[str, Any]] | None = None,
    salt: str | None = None,
) -> dict[str, Any]:
    """A greedy ``/v1/chat/completions`` request."""
    body = {"model": model, "messages": list(messages), "max_tokens": max_tokens, **_GREEDY}
    body.update(logprobs=True, top_logprobs=TOP_ALTERNATIVES)
    if tools:
        body["tools"] = list(tools)
    if salt is not None:
        body["cache_salt"] = salt
    return body


def path_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def parse(doc: dict[str, Any]) -> Judged:
    """The judged reply of a completions or chat response (raises KeyError/ValueError on a
    response without the logprobs the request asked for)."""
    choice = doc["choices"][0]
    lp = choice["logprobs"]
    if "content" in lp:  # chat: one entry per position
        content = lp["content"]
        reply = Reply(
            [token_id(c["token"]) for c in content],
            [float(c["logprob"]) for c in content],
            [
                {token_id(t["token"]): float(t["logprob"]) for t in c.get("top_logprobs") or ()}
                for c in content
            ],
        )
    else:  # completions: parallel lists
        reply = Reply(
            [token_id(t) for t in lp["tokens"]],
            [float(x) for x in lp["token_logprobs"]],
            [{token_id(t): float(v) for t, v in alt.items()} for alt in lp["top_logprobs"]],
        )
    usage = doc["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Judged(reply, int(usage["prompt_tokens"]), int(cached))


def ask(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> Judged:
    """POST one judged request; raises httpx.HTTPStatusError naming vLLM's answer on an error."""
    r = httpx.post(f"{url}{path_of(body)}", json=body, timeout=timeout_s)
    _raise_for_status(r)
    return parse(r.json())


async def ask_async(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float
) -> Judged:
    """`ask` on a shared async client; raises httpx.HTTPError on any transport or HTTP error."""
    r = await client.post(f"{url}{path_of(body)}", json=body, timeout=timeout_s)
    _raise_for_status(r)
    return parse(r.json())


def _raise_for_status(r: httpx.Response) -> None:
    if r.is_error:
        raise httpx.HTTPStatusError(
            f"HTTP {r.status_code} from {r.request.url}: {r.text[:300]}",
            request=r.request,
            response=r,
        )
