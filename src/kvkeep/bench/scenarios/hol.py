"""`kvkeep bench hol` (S6): a cached request next to a large uncached prefill.

A short prompt is cached first, then its TTFT is measured alone and again while a large cold
prompt is being prefilled. vLLM batches the two; with chunked prefill the short request waits
at most for one chunk of the large one (`--max-num-batched-tokens`), without it for the whole
prefill. The study notes that a cached request can still wait; this puts a number on it.
With `--budgets`, each budget is its own deployment and its results are under `MODE@BUDGET`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx

from kvkeep.bench.context import RunContext
from kvkeep.bench.scenario import Needs, parse_sizes
from kvkeep.endpoint import complete_ids, discover_model
from kvkeep.workload import random_ids

REPEATS = 3


@dataclass(frozen=True)
class HOLResult:
    ttft_alone_s: float
    ttft_beside_prefill_s: float
    ratio: float | None
    long_prefill_ttft_s: float
    short_tokens: int
    long_tokens: int
    max_num_batched_tokens: int | None


@dataclass
class HOLScenario:
    short_tokens: int = 1024
    long_tokens: int = 16384
    head_start_s: float = 0.3
    seed: int = 0
    budget: int | None = None  # vLLM's --max-num-batched-tokens (None: the run's)
    name: str = "hol"

    def needs(self) -> Needs:
        return Needs(tokens=self.long_tokens + 64, max_num_batched_tokens=self.budget)

    def run(self, ctx: RunContext) -> HOLResult:
        return asyncio.run(self._run(ctx.url))

    def _ids(self, n: int, salt: object) -> list[int]:
        return random_ids(n, f"hol:{self.seed}:{salt}")

    async def _run(self, url: str) -> HOLResult:
        short = self._ids(self.short_tokens, "short")
        async with httpx.AsyncClient() as client:
            model = await discover_model(client, url)
            await complete_ids(client, url, model, short)  # cache it
            alone = [(await complete_ids(client, url, model, short)).ttft_s for _ in range(REPEATS)]
            beside, long_ttft = [], []
            for i in range(REPEATS):
                long_ids = self._ids(self.long_tokens, f"long:{i}:{time.time_ns()}")
                big = asyncio.create_task(complete_ids(client, url, model, long_ids))
                await asyncio.sleep(self.head_start_s)
                beside.append((await complete_ids(client, url, model, short)).ttft_s)
                long_ttft.append((await big).ttft_s)
        a, b = statistics.median(alone), statistics.median(beside)
        return HOLResult(a, b, b / a if a > 0 else None, statistics.median(long_ttft),
                         self.short_tokens, self.long_tokens, self.budget)  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--short-tokens", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--budgets", type=parse_sizes, default=None,
                   help="--max-num-batched-tokens values (default: vLLM's)")  # fmt: skip


def build(args: argparse.Namespace) -> list[HOLScenario]:
    if not args.budgets:
        budget = args.max_num_batched_tokens
        return [HOLScenario(args.short_tokens, args.long_tokens, budget=budget)]
    return [HOLScenario(args.short_tokens, args.long_tokens, budget=b, name=f"hol@{b}")
            for b in args.budgets]  # fmt: skip
