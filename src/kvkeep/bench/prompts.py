"""Token-id prompts: documents unique to their seed (`kvkeep.traffic.workload.random_ids`: no two
documents, and no two runs, share a prefix block), each queried with a short question after it,
so every query of a document shares its full blocks and differs only in its tail."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvkeep.bench.metrics import HitRates, Probe, cacheable_tokens, hit_split
from kvkeep.bench.result import FLAT
from kvkeep.traffic.endpoint import REQUEST_TIMEOUT_S, StreamStats, complete_ids, discover_model
from kvkeep.traffic.workload import QUESTION_TOKENS, random_ids


def documents(count: int, tokens: int, seed: str) -> list[list[int]]:
    """`count` documents of `tokens` token ids, deterministic in `seed`."""
    return [random_ids(tokens, f"docs:{seed}:{i}") for i in range(count)]


@dataclass(frozen=True)
class Queried:
    """Documents queried once each: where the hits came from, the mean TTFT and each one,
    and the tokens a cache could serve."""

    rates: HitRates = field(metadata=FLAT)
    ttft_s: float
    ttfts_s: list[float]
    cacheable: int

    @property
    def hit_rate(self) -> float:
        return self.rates.hit_rate


def query(
    probe: Probe,
    docs: list[list[int]],
    block_size: int,
    salt: int = 0,
    progress: Callable[[], object] | None = None,
) -> Queried:
    """Each document once, with its question (``salt`` varies the question), one at a time."""

    async def send_all() -> list[StreamStats]:
        out = []
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            model = await discover_model(client, url)
            for i, doc in enumerate(docs):
                ask = [10 + (i * 13 + salt * 7 + j) % 90 for j in range(QUESTION_TOKENS)]
                out.append(await complete_ids(client, url, model, doc + ask))
                if progress:
                    progress()
        return out

    before, url = probe.snapshot(), probe.current_url()
    sent = asyncio.run(send_all())
    cacheable = sum(cacheable_tokens(s.prompt_tokens, block_size) for s in sent)
    ttfts = [s.ttft_s for s in sent]
    rates = hit_split(probe.delta(before), cacheable)
    return Queried(rates, statistics.fmean(ttfts), ttfts, cacheable)


def reset_device_cache(url: str) -> None:
    """Empty vLLM's device prefix cache and keep kvkeep's (vLLM's dev endpoints are on).

    vLLM refuses while blocks are in use; it is retried for up to 10 s.
    """
    for _ in range(20):
        r = httpx.post(f"{url}/reset_prefix_cache", params={"reset_external": "false"}, timeout=30)
        if r.status_code == 200 and r.json().get("success", True):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}/reset_prefix_cache did not succeed: HTTP {r.status_code} {r.text}")
