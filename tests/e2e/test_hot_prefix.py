"""End to end: a prefix vLLM keeps serving from its own pool stays in kvkeep's small RAM
while other traffic passes through it, and is the first back once vLLM's device cache is
emptied.

One cache server with RAM for a few dozen blocks and no disk (what RAM evicts is gone); one
hot prompt served again after each of 12 cold ones (about 100 other blocks in all). One vLLM
start (~25 s on 2 cores).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.prompts import reset_device_cache
from kvkeep.launch.cache_server import CacheServerProcess
from kvkeep.server.client import KVKeepClient

from .conftest import CacheServerFactory
from .engine import BLOCK, complete, engine_block_bytes, tokens_at_least, worker_namespace

pytestmark = pytest.mark.e2e


def _ram_held(cache: CacheServerProcess, ids: list[int]) -> tuple[int, int]:
    """(leading blocks of ``ids`` kvkeep's RAM holds, blocks RAM holds in all)."""
    ns = worker_namespace(cache.cfg.directory)
    client = KVKeepClient(socket_path=cache.cfg.socket_path, timeout_s=5.0)
    try:
        found = client.lookup(ns.session(), ns.keys(ids))
        assert set(found.tiers) <= {"ram"}
        return found.num_present, int(client.stats()["tiers"]["ram"]["blocks"])
    finally:
        client.close()


def test_a_prefix_served_from_vllms_pool_stays_and_comes_back_first(
    tiny_model: Path, tmp_path: Path, cache_server: CacheServerFactory
) -> None:
    rng = random.Random(11)
    hot = [rng.randrange(100, 1000) for _ in range(6 * BLOCK + 40)]  # 6 full blocks
    others = [[rng.randrange(100, 1000) for _ in range(8 * BLOCK + 10)] for _ in range(12)]
    ram = 32 * engine_block_bytes(tiny_model)  # 32 blocks: 8 MiB in bf16, 16 MiB in float32
    small_cache = cache_server(str(ram), extra_args=("--extent", "1MiB"))
    cfg = LaunchConfig(
        model=tiny_model,
        mode="kvkeep",
        max_model_len=8192,
        cache_socket=small_cache.cfg.socket_path,
        log_dir=tmp_path / "logs",
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),  # for reset_device_cache
    )
    with VLLMServer(cfg) as server:
        complete(server.url, hot)
        for prompt in others:
            complete(server.url, prompt)
            served = complete(server.url, hot)  # vLLM's own hit: kvkeep is not asked
            assert served.cached_tokens == 6 * BLOCK
        before = tokens_at_least(server.url, "saved", (6 + 12 * 8) * BLOCK)
        held, ram_blocks = _ram_held(small_cache, hot)
        assert before["loaded"] == 0
        assert ram_blocks < 12 * 8, "the RAM tier was meant to be too small for all traffic"
        assert held == 6, f"kvkeep's RAM kept {held} of the hot prompt's 6 blocks"

        reset_device_cache(server.url)  # the hot prefix can only come from kvkeep now
        served = complete(server.url, hot)
        counts = tokens_at_least(server.url, "loaded", 6 * BLOCK)
    assert served.cached_tokens == 6 * BLOCK
    assert counts["loaded"] == 6 * BLOCK and counts["load_failed"] == 0
