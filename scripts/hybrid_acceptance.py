"""Measure issue 14's acceptance on the tiny Gemma-3-style hybrid (sliding-window) model.

Prints one JSON line per measurement:

- ``pool``: vLLM's KV pool in tokens ("CPU KV cache size: N tokens"), for vLLM alone and
  under kvkeep, with the same ``VLLM_CPU_KVCACHE_SPACE`` and token budget, and whether
  either log says HMA was turned off;
- per prompt size (4k and 16k tokens by default): the prompt is sent once (computed, saved),
  vLLM restarts, and it is sent again: ``loaded_fraction`` of the claimable full-attention
  blocks loaded from kvkeep, the sliding groups' ``window_loaded`` tokens, whether the reply
  equals vLLM's own prefix-cache hit (``same_as_hit``), and the bytes kvkeep stored for it
  per prompt token against every layer's KV per token.

Run (it starts vLLM three times; take the vLLM lock on a shared machine)::

    KVKEEP_TINY_GEMMA3=.cache/tiny-gemma3 flock /tmp/kvkeep-vllm.lock \\
        python scripts/hybrid_acceptance.py [4096 16384]
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.engine import BLOCK, complete, reference

from kvkeep.bench.criterion import same_as_hit
from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.metrics import kvkeep_tokens
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess
from kvkeep.launch.serve import CPU_SCHEDULING
from kvkeep.server.client import KVKeepClient

MODEL = Path(os.environ.get("KVKEEP_TINY_GEMMA3", ".cache/tiny-gemma3"))
POOL = re.compile(r"KV cache size: ([\d,]+) tokens")


def pool_tokens(log: Path) -> dict[str, object]:
    text = log.read_text(errors="replace")
    found = POOL.search(text)
    return {
        "pool_tokens": int(found.group(1).replace(",", "")) if found else None,
        "hma_turned_off": "Turning off hybrid kv cache manager" in text,
    }


def ram_bytes(socket: str) -> int:
    client = KVKeepClient(socket_path=socket, timeout_s=5.0)
    try:
        return int(client.stats()["tiers"]["ram"]["bytes_used"])
    finally:
        client.close()


def settled(url: str) -> dict[str, float]:
    last = kvkeep_tokens(url)
    for _ in range(20):
        time.sleep(1.0)
        now = kvkeep_tokens(url)
        if now == last:
            return now
        last = now
    return last


def one_size(server: VLLMServer, socket: str, tokens: int, rng: random.Random) -> dict:
    ids = [rng.randrange(100, 8192) for _ in range(tokens)]
    before_bytes = ram_bytes(socket)
    complete(server.url, ids)
    time.sleep(3.0)  # saves are stored in the background
    stored = ram_bytes(socket) - before_bytes
    server.restart()
    before = settled(server.url)
    served = complete(server.url, ids)
    after = settled(server.url)
    ref = reference(server.url, ids)
    claimable = (len(ids) - 1) // BLOCK * BLOCK
    verdict = same_as_hit(served.reply, ref.hit)
    return {
        "tokens": tokens,
        "claimable_tokens": claimable,
        "loaded_fraction": (after["loaded"] - before["loaded"]) / claimable,
        "window_loaded": after.get("window_loaded", 0) - before.get("window_loaded", 0),
        "cached_tokens": served.cached_tokens,
        "same_as_hit": bool(verdict),
        "why": verdict.why,
        "stored_bytes_per_token": stored / tokens,
    }


def main(sizes: list[int]) -> None:
    base = Path(tempfile.mkdtemp(prefix="kvkeep-hybrid-"))
    rng = random.Random(14)
    max_len = max(sizes) + 1024
    # vLLM sizes a sliding-window request by its window plus a step's tokens, so its pool in
    # tokens depends on the token budget: vLLM alone gets the budget kvkeep serve sets.
    budget = dict(CPU_SCHEDULING)
    cfg = LaunchConfig(
        model=MODEL,
        mode="vllm",
        max_model_len=max_len,
        log_dir=base / "logs",
        max_num_batched_tokens=int(budget["--max-num-batched-tokens"] or 0),
        long_prefill_token_threshold=int(budget["--long-prefill-token-threshold"] or 0),
    )
    with VLLMServer(cfg) as alone:
        print(json.dumps({"pool": "vllm", **pool_tokens(alone.log_path)}), flush=True)
    cache = CacheServerProcess(CacheServerConfig(base / "cache", ram="1GiB", disk="0"))
    cache.ensure()
    try:
        cfg = LaunchConfig(
            model=MODEL,
            mode="kvkeep",
            max_model_len=max_len,
            cache_socket=cache.cfg.socket_path,
            log_dir=base / "logs",
        )
        with VLLMServer(cfg) as server:
            print(json.dumps({"pool": "kvkeep", **pool_tokens(server.log_path)}), flush=True)
            for tokens in sizes:
                row = one_size(server, cache.cfg.socket_path, tokens, rng)
                print(json.dumps(row), flush=True)
    finally:
        cache.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4096, 16384])
