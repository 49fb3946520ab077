"""`kvkeep bench hol` (S6): a cached request next to a large uncached prefill.

A short prompt is cached first, then its TTFT is measured alone and again while a large cold
prompt is being prefilled. vLLM batches the two; with chunked prefill the short request waits
at most for one chunk of the large one (`--max-num-batched-tokens`), without it for the whole
prefill. The study notes that a cached request can still wait; this puts a number on it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvkeep.endpoint import complete_ids, discover_model

REPEATS = 3


@dataclass
class HOLScenario:
    short_tokens: int = 1024
    long_tokens: int = 16384
    head_start_s: float = 0.3
    seed: int = 0
    budget: int | None = None  # the server's --max-num-batched-tokens, for the record
    name: str = "hol"

    def tokens_needed(self) -> int:
        return self.long_tokens + 64

    def run(self, url: str) -> dict[str, Any]:
        return asyncio.run(self._run(url))

    def _ids(self, n: int, salt: object) -> list[int]:
        rng = random.Random(f"kvkeep-hol:{self.seed}:{salt}")
        return [rng.randrange(100, 1000) for _ in range(n)]

    async def _run(self, url: str) -> dict[str, Any]:
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
        return {
            "ttft_alone_s": a,
            "ttft_beside_prefill_s": b,
            "ratio": b / a if a > 0 else None,
            "long_prefill_ttft_s": statistics.median(long_ttft),
            "short_tokens": self.short_tokens,
            "long_tokens": self.long_tokens,
            "max_num_batched_tokens": self.budget,
        }


def main(argv: list[str]) -> int:
    """`kvkeep bench hol`: S6 per cache mode and chunked-prefill budget."""
    import argparse
    import sys
    from dataclasses import replace

    from kvkeep.bench import scenarios as sc

    p = argparse.ArgumentParser(prog="kvkeep bench hol", description=__doc__.splitlines()[0])
    sc.add_common_args(p)
    p.add_argument("--short-tokens", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--budgets", type=sc.parse_sizes, default=None,
                   help="--max-num-batched-tokens values (default: vLLM's)")  # fmt: skip
    args = p.parse_args(argv[1:])
    modes: dict[str, Any] = {}
    try:
        for budget in args.budgets or [args.max_num_batched_tokens]:
            scenario = HOLScenario(args.short_tokens, args.long_tokens, budget=budget)
            base = sc.launch_config(args)
            if base is not None:
                base = replace(base, max_num_batched_tokens=budget)
            by = sc.run_modes([scenario], args.modes, base, args.endpoint)
            for mode, res in by["hol"].items():
                modes[mode if budget is None else f"{mode}@{budget}"] = res
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"kvkeep bench hol: {exc}", file=sys.stderr)
        return 1
    sc.write_outputs({"scenario": "hol", "modes": modes}, args)
    return 0
