"""Measure where asynchronous loads pay off on this machine (issue 13, item 4).

An asynchronous load costs its own request at least one extra engine step (vLLM parks it in
WAITING_FOR_REMOTE_KVS and schedules it after the load is reported); a synchronous one makes
every other running request wait for the copy. So a load should go to the background when
the synchronous copy of its N blocks takes longer than one engine step of the others.

For N blocks (128 tokens each) this prints, as one JSON line per row:
- ``sync_load_ms``: the connector's own load time (``vllm:kvkeep_seconds_total{op="load"}``)
  for a hit of N blocks loaded synchronously, after vLLM's device cache was emptied;
- ``ttft_sync_ms`` / ``ttft_async_ms``: the request's time to its first token on an idle
  engine, every load synchronous / every load asynchronous (the idle cost of going async);
and the engine step to compare with: ``decode_step_ms`` for 1 and 4 running requests (the
mean gap between streamed tokens).

Run (it starts vLLM twice; take the vLLM lock on a shared machine)::

    KVKEEP_TINY_MODEL=.cache/tiny-model flock /tmp/kvkeep-vllm.lock \\
        python scripts/async_threshold.py
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.metrics import kvkeep_profile
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess

BLOCK = 128
SIZES = tuple(int(n) for n in os.environ.get("KVKEEP_SIZES", "1,2,4,8,16,32,64,96,128").split(","))
REPEATS = 3
MODEL_NAME = "kvkeep-tiny"


def complete(url: str, ids: list[int], max_tokens: int = 1) -> float:
    """Seconds to a greedy completion of ``max_tokens`` tokens."""
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - t0


def reset_device_cache(url: str) -> None:
    r = httpx.post(f"{url}/reset_prefix_cache", params={"reset_external": "false"}, timeout=30)
    r.raise_for_status()


def load_seconds(url: str) -> float:
    return kvkeep_profile([url]).get("load", 0.0)


def hit_times(url: str, ids: list[int]) -> tuple[float, float]:
    """(seconds to the first token, connector load seconds) of ``ids`` served from kvkeep."""
    complete(url, ids)
    time.sleep(1.0)  # the saver stores in the background
    reset_device_cache(url)
    before = load_seconds(url)
    ttft = complete(url, ids)
    time.sleep(0.5)  # stats reach the API server a step late
    return ttft, load_seconds(url) - before


def decode_step_ms(url: str, rng: random.Random, streams: int) -> float:
    """Mean gap between streamed tokens with ``streams`` requests decoding together."""
    gaps: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        prompt = [rng.randrange(100, 8000) for _ in range(200)]
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 64, "temperature": 0.0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        stamps = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        with lock:
            gaps.extend(b - a for a, b in itertools.pairwise(stamps[8:]))

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1e3 * statistics.median(gaps)


def run(model: Path, threshold: int | None, base: Path) -> dict[str, object]:
    cache = CacheServerProcess(CacheServerConfig(base / f"cache-{threshold}", ram="2GiB"))
    cache.ensure()
    model_len = max(8192, (max(SIZES) + 1) * BLOCK)
    cfg = LaunchConfig(model=model, mode="kvkeep", max_model_len=model_len,
                       cache_socket=cache.cfg.socket_path, log_dir=base / "logs",
                       connector_settings=(("load_async_min_blocks", threshold),))  # fmt: skip
    rng = random.Random(13)
    out: dict[str, object] = {}
    try:
        with VLLMServer(cfg) as server:
            hit_times(server.url, [rng.randrange(100, 8000) for _ in range(4 * BLOCK + 1)])
            for n in SIZES:
                runs = [hit_times(server.url, [rng.randrange(100, 8000)
                                               for _ in range(n * BLOCK + 1)])
                        for _ in range(REPEATS)]  # fmt: skip
                out[f"ttft_{n}"] = 1e3 * statistics.median(r[0] for r in runs)
                out[f"load_{n}"] = 1e3 * statistics.median(r[1] for r in runs)
            if threshold is None:
                out["decode_1"] = decode_step_ms(server.url, rng, 1)
                out["decode_4"] = decode_step_ms(server.url, rng, 4)
    finally:
        cache.stop()
    return out


def main() -> None:
    model = Path(os.environ.get("KVKEEP_TINY_MODEL", ".cache/tiny-model"))
    base = Path(tempfile.mkdtemp(prefix="kvkeep-async-"))
    try:
        sync, background = run(model, None, base), run(model, 1, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    step = {"decode_step_ms_1": sync["decode_1"], "decode_step_ms_4": sync["decode_4"]}
    print(json.dumps({k: round(float(v), 2) for k, v in step.items()}))  # type: ignore[arg-type]
    for n in SIZES:
        row = {"blocks": n, "sync_load_ms": sync[f"load_{n}"], "ttft_sync_ms": sync[f"ttft_{n}"],
               "ttft_async_ms": background[f"ttft_{n}"]}  # fmt: skip
        print(json.dumps({k: round(float(v), 2) for k, v in row.items()}))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
