"""Benchmarks of the remote tier: replicas that share one Valkey/Redis.

- ``RemoteRestartScenario`` (``kvkeep bench restart --remote``): host A serves a set of long
  documents (cold prefill), then again from its own kvkeep RAM (device cache emptied), and is
  then lost: its vLLM and cache server stop and its state is deleted. A replacement host B,
  with an empty cache server on the same store, serves the documents again: every hit it gets
  comes from the remote tier. One table: TTFT cold, from kvkeep RAM, from the remote tier.
- ``ReplicatedAgentsScenario`` (``kvkeep bench agents --replicas N``): closed-loop agents
  behind a router that sends each turn to the next replica (round robin per turn, the worst
  case for locality), so a turn's prefix was computed on another replica: with a shared
  store it is a remote hit, without one a recompute.

Each replica is a vLLM with its own kvkeep cache server (``--remote URL``), as on separate
hosts. The store is the one given (``RemoteSpec.url``) or a private redis-server started here
with maxmemory + allkeys-lru. Nothing here imports vllm.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvkeep.bench.documents import QUESTION_TOKENS, documents, query, reset_device_cache
from kvkeep.bench.launch import LaunchConfig, VLLMServer, dev_env
from kvkeep.bench.probe import Counters, Probe, hit_split
from kvkeep.bench.runner import TurnResult, summarize_agents
from kvkeep.endpoint import REQUEST_TIMEOUT_S, chat_turn, complete_ids, discover_model
from kvkeep.plan.footprint import footprint_from_file
from kvkeep.serve import CacheServerConfig, CacheServerProcess
from kvkeep.server.client import KVKeepClient
from kvkeep.store.redis_process import RedisProcess
from kvkeep.workload import SessionSpec, TokenCounter, Turn, generate_sessions


@dataclass(frozen=True)
class RemoteSpec:
    """The shared store and the replicas' cache servers.

    ``url`` None starts a private redis-server (``maxmemory``, allkeys-lru) for the run.
    ``rate`` is each cache server's ``--remote-rate``.
    """

    url: str | None = None
    maxmemory: str = "2gb"
    cache_ram: str = "1GiB"
    cache_disk: str = "0"
    write: str = "through"
    rate: str = "256MiB"
    timeout_s: float = 0.25

    def server_args(self, url: str) -> tuple[str, ...]:
        return (
            "--remote", url,
            "--remote-write", self.write,
            "--remote-rate", self.rate,
            "--remote-timeout", str(self.timeout_s),
        )  # fmt: skip


class ReplicaCache:
    """One replica's kvkeep cache server, in a temporary directory removed by ``close``."""

    def __init__(self, spec: RemoteSpec, url: str | None, name: str) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix=f"kvkeep-{name}-"))
        extra = spec.server_args(url) if url else ()
        cfg = CacheServerConfig(self.directory, spec.cache_ram, spec.cache_disk, None, extra)
        self.proc = CacheServerProcess(cfg)

    @property
    def socket(self) -> str:
        return self.proc.cfg.socket_path

    def start(self) -> ReplicaCache:
        self.proc.ensure()
        return self

    def stats(self) -> dict[str, Any]:
        client = KVKeepClient(socket_path=self.socket, timeout_s=5.0)
        try:
            return client.stats()
        finally:
            client.close()

    def wait_sent(self, timeout_s: float = 120.0) -> bool:
        """Block until the remote tier's write queue is empty. False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            remote = self.stats()["tiers"].get("remote")
            if remote is None or remote.get("queued_bytes", 0) == 0:
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        """Stop the server and delete its state: the host is gone."""
        self.proc.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def shared_store(spec: RemoteSpec) -> Iterator[str]:
    """The store's URL: ``spec.url``, or a private redis-server stopped afterwards."""
    if spec.url is not None:
        yield spec.url
        return
    directory = Path(tempfile.mkdtemp(prefix="kvkeep-redis-"))
    server = RedisProcess(directory, maxmemory=spec.maxmemory)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def replica_caches(spec: RemoteSpec, url: str | None, count: int) -> Iterator[list[ReplicaCache]]:
    """``count`` cache servers on the store ``url`` (None: no remote tier), closed after."""
    with contextlib.ExitStack() as stack:
        caches = []
        for i in range(count):
            cache = ReplicaCache(spec, url, f"replica{i}")
            stack.callback(cache.close)
            caches.append(cache.start())
        yield caches


@contextlib.contextmanager
def replicas(cfgs: Sequence[LaunchConfig]) -> Iterator[list[VLLMServer]]:
    """vLLM servers started in parallel (each start is ~25 s of mostly waiting); all are
    stopped afterwards, or at once if any fails to start."""
    servers = [VLLMServer(cfg) for cfg in cfgs]
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(s.start) for s in servers]:
                future.result()
        yield servers
    finally:
        for server in servers:
            server.stop()


def kv_bytes_per_token(model: Path) -> int:
    """KV bytes per token of the model (from its config.json), for the closing figures."""
    return int(footprint_from_file(model / "config.json").bytes_per_token())


# --- restart --remote -----------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteRestartSpec:
    docs: int = 2
    doc_tokens: int = 16384
    block_size: int = 128
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.doc_tokens + QUESTION_TOKENS + 64


@dataclass
class RemoteRestartScenario:
    """A host lost and replaced; see the module doc. ``run`` owns every process it needs."""

    spec: RemoteRestartSpec = RemoteRestartSpec()
    remote: RemoteSpec = RemoteSpec()
    name: str = "restart_remote"

    def run(self, base: LaunchConfig) -> dict[str, Any]:
        cfg = replace(
            dev_env(base),
            mode="kvkeep",
            max_model_len=max(base.max_model_len, self.spec.max_model_len),
        )
        docs = self._docs()
        out: dict[str, Any] = {"kv_bytes_per_token": kv_bytes_per_token(cfg.model)}
        with shared_store(self.remote) as url:
            out.update(self._host_a(cfg, url, docs))
            out.update(self._host_b(cfg, url, docs))
        return summarize_restart(out, self.spec.doc_tokens)

    def _host_a(self, cfg: LaunchConfig, url: str, docs: list[list[int]]) -> dict[str, Any]:
        """Cold, then kvkeep-RAM hits; waits until every block reached the store."""
        cold, ram, stats = self._host(cfg, url, docs, wait_sent=True)
        return {"cold": cold, "ram": ram, "a_remote": stats}

    def _host_b(self, cfg: LaunchConfig, url: str, docs: list[list[int]]) -> dict[str, Any]:
        """A fresh host on the same store: remote hits, then its own RAM hits."""
        remote, ram_b, stats = self._host(cfg, url, docs, wait_sent=False)
        return {"remote": remote, "ram_after_remote": ram_b, "b_remote": stats}

    def _host(
        self, cfg: LaunchConfig, url: str, docs: list[list[int]], wait_sent: bool
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """One host (vLLM + its cache server) on the store: the documents once, then again
        with vLLM's device cache emptied; then the remote tier's counters."""
        with (
            replica_caches(self.remote, url, 1) as (cache,),
            replicas([replace(cfg, cache_socket=cache.socket)]) as (server,),
        ):
            warm_up(server.url)
            probe = Probe(server.url, cache.stats)
            first = query(probe, docs, self.spec.block_size)
            reset_device_cache(server.url)
            second = query(probe, docs, self.spec.block_size)
            sent = {"all_sent": cache.wait_sent()} if wait_sent else {}
            stats = {**cache.stats()["tiers"]["remote"], **sent}
        return first, second, stats

    def _docs(self) -> list[list[int]]:
        seed = f"remote:{self.spec.seed}:{time.time_ns()}"
        return documents(self.spec.docs, self.spec.doc_tokens, seed)


def warm_up(url: str) -> None:
    """One short unrelated request: a fresh vLLM's first request pays one-off start-up costs
    (measured here: 8.2 s for a 16k remote hit that took 0.2-0.5 s once warm)."""
    rng = random.Random(f"kvkeep-warm-up:{url}")
    asyncio.run(_warm_up(url, [rng.randrange(100, 1000) for _ in range(300)]))


async def _warm_up(url: str, prompt: list[int]) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        await complete_ids(client, url, await discover_model(client, url), prompt)


def summarize_restart(out: dict[str, Any], doc_tokens: int) -> dict[str, Any]:
    """The figures the report needs on top, the phases in full below."""
    phases = ("cold", "ram", "remote", "ram_after_remote")
    flat: dict[str, Any] = {f"{p}_ttft_s": out[p]["ttft_s"] for p in phases}
    flat.update(
        doc_tokens=doc_tokens,
        kv_bytes_per_token=out["kv_bytes_per_token"],
        remote_hit_rate=out["remote"].get("remote_hit_rate", 0.0),
        ram_hit_rate=out["ram"].get("ram_hit_rate", 0.0),
        remote_errors=out["b_remote"]["errors"],
        remote_checksum_failures=out["b_remote"]["checksum_failures"],
        remote_bytes_sent=out["a_remote"]["bytes_in"],
        remote_dropped_puts=out["a_remote"]["dropped_puts"],
    )
    flat["phases"] = {p: out[p] for p in phases}
    return flat


# --- agents --replicas ------------------------------------------------------------------------


@dataclass
class ReplicatedAgentsScenario:
    """Agents routed turn by turn over ``replicas`` vLLMs; ``remote`` None: no shared store
    (each replica keeps only its own kvkeep cache), for the comparison."""

    spec: SessionSpec
    counter: TokenCounter
    agents: int = 4
    replicas: int = 2
    tool_delay_s: float = 0.5
    remote: RemoteSpec | None = field(default_factory=RemoteSpec)
    block_size: int = 128
    name: str = "agents_replicas"

    def run(self, base: LaunchConfig) -> dict[str, Any]:
        if self.agents < 1 or self.replicas < 1:
            raise ValueError("--agents and --replicas must be at least 1")
        cfg = replace(base, mode="kvkeep")
        sessions = generate_sessions(self.spec, self.counter, self.agents)
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(shared_store(self.remote)) if self.remote else None
            caches = stack.enter_context(
                replica_caches(self.remote or RemoteSpec(), url, self.replicas)
            )
            servers = stack.enter_context(
                replicas([replace(cfg, cache_socket=c.socket) for c in caches])
            )
            probes = [Probe(s.url, c.stats) for s, c in zip(servers, caches, strict=True)]
            return self._measure(probes, sessions)

    def _measure(self, probes: list[Probe], sessions: list[list[Turn]]) -> dict[str, Any]:
        before = [p.snapshot() for p in probes]
        t0 = time.perf_counter()
        urls = [p.url for p in probes]
        results = asyncio.run(run_routed_agents(urls, sessions, self.tool_delay_s))
        wall = time.perf_counter() - t0
        delta = merge_counters([p.delta(b) for p, b in zip(probes, before, strict=True)])
        out = summarize_agents(results, wall, self.agents)
        prompt = sum(r.prompt_tokens for r in results)
        out.update(hit_split(delta, prompt, self.block_size))
        out.update(replicas=self.replicas, shared_store=self.remote is not None)
        out["routing"] = "round robin per turn"
        return out


def merge_counters(deltas: Sequence[Counters]) -> Counters:
    """The sum of several replicas' counter deltas."""
    vllm: dict[str, float] = {}
    tiers: dict[str, float] = {}
    for d in deltas:
        for k, v in d.vllm.items():
            vllm[k] = vllm.get(k, 0.0) + v
        for k, v in d.tier_hits.items():
            tiers[k] = tiers.get(k, 0.0) + v
    return Counters(vllm, tiers)


async def run_routed_agents(
    urls: Sequence[str], sessions: Sequence[Sequence[Turn]], tool_delay_s: float
) -> list[TurnResult]:
    """Like ``runner.run_agents``, but turn ``t`` of agent ``a`` goes to replica
    ``(a + t) % len(urls)``: consecutive turns of an agent never share a replica (N > 1)."""
    results: list[TurnResult] = []
    limits = httpx.Limits(max_connections=max(8, len(sessions) * 2))
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        model = await discover_model(client, urls[0])
        t_run = time.perf_counter()

        async def agent(a: int, turns: Sequence[Turn]) -> None:
            for turn in turns:
                start = time.perf_counter() - t_run
                url = urls[(a + turn.index) % len(urls)]
                s = await chat_turn(client, url, model, turn)
                computed = s.prompt_tokens - s.cached_tokens
                row = (s.prompt_tokens, s.cached_tokens, computed, s.output_tokens)
                results.append(TurnResult(a, turn.index, *row, s.ttft_s, s.latency_s, start))
                if tool_delay_s > 0:
                    await asyncio.sleep(tool_delay_s)

        await asyncio.gather(*(agent(a, t) for a, t in enumerate(sessions)))
    return results
