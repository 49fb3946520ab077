"""`kvkeep bench restart` (S4): what a cache is worth after a restart.

Per mode: warm up on a set of long documents, restart vLLM, and query them again. vLLM's own
prefix cache lives in the engine and starts cold again; kvkeep's cache server outlives the
engine. For kvkeep the cache server itself is then restarted, once with SIGTERM (it flushes)
and once with SIGKILL (it may lose writes in flight, never integrity), and the documents are
queried again with vLLM's device cache emptied first (`/reset_prefix_cache`), so the hits can
only come from kvkeep's disk tier.

Restart-to-ready time (from stopping vLLM to its API answering again) is measured for every
mode in the same run: the study saw LMCache add 20-30 s to a restart.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvkeep.bench.documents import QUESTION_TOKENS, documents, query, reset_device_cache
from kvkeep.bench.launch import LaunchConfig, VLLMServer, dev_env
from kvkeep.bench.probe import Probe
from kvkeep.serve import CacheServerConfig, CacheServerProcess


@dataclass(frozen=True)
class RestartSpec:
    docs: int = 4  # after a restart the first takes the one-time costs; the rest are timed
    doc_tokens: int = 8192
    block_size: int = 128
    cache_ram: str = "1GiB"
    cache_disk: str = "2GiB"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.docs < 2:
            raise ValueError("--docs must be at least 2: one takes a restart's first-request cost")
        if self.doc_tokens < 2 * self.block_size:
            raise ValueError(f"--doc-tokens must be at least {2 * self.block_size}")

    @property
    def max_model_len(self) -> int:
        return self.doc_tokens + QUESTION_TOKENS + 64


class Cache:
    """The kvkeep cache server of one run, with the restarts the scenario needs."""

    def __init__(self, spec: RestartSpec, directory: Path) -> None:
        self.proc = CacheServerProcess(
            CacheServerConfig(directory, ram=spec.cache_ram, disk=spec.cache_disk)
        )

    @property
    def socket(self) -> str:
        return self.proc.cfg.socket_path

    def restart(self, how: str) -> None:
        """Restart the server: `sigterm` (clean, flushes) or `sigkill` (crash)."""
        if how == "sigkill" and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.stop(timeout_s=5)
        else:
            self.proc.stop()
        self.proc.ensure()

    def stats(self) -> dict[str, Any]:
        from kvkeep.server.client import KVKeepClient

        client = KVKeepClient(socket_path=self.socket, timeout_s=2.0)
        try:
            return client.stats()
        finally:
            client.close()


@contextlib.contextmanager
def cache_server(spec: RestartSpec) -> Iterator[Cache]:
    """A kvkeep cache server with RAM and disk tiers, in a temporary directory."""
    directory = Path(tempfile.mkdtemp(prefix="kvkeep-restart-"))
    cache = Cache(spec, directory)
    try:
        cache.proc.ensure()
        yield cache
    finally:
        cache.proc.stop()
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class RestartScenario:
    spec: RestartSpec = RestartSpec()
    name: str = "restart"

    def tokens_needed(self) -> int:
        return self.spec.max_model_len

    def run_mode(self, base: LaunchConfig, mode: str) -> dict[str, Any]:
        """The whole S4 sequence for one mode (it owns its servers)."""
        cfg = replace(
            dev_env(base),
            mode=mode,
            max_model_len=max(base.max_model_len, self.spec.max_model_len),
        )
        with contextlib.ExitStack() as stack:
            cache = stack.enter_context(cache_server(self.spec)) if mode == "kvkeep" else None
            if cache is not None:
                cfg = replace(cfg, cache_socket=cache.socket)
            return self.run_on(VLLMServer(cfg).start(), cache)

    def run_on(self, server: VLLMServer, cache: Cache | None) -> dict[str, Any]:
        """The sequence on an already running server, which it restarts and finally stops.

        The server must have been launched with VLLM_SERVER_DEV_MODE=1 (see `dev_env`) and,
        in mode kvkeep, on `cache`'s socket.
        """
        stats = cache.stats if cache else None
        docs = self._docs()
        cfg = server.cfg
        out: dict[str, Any] = {}
        try:
            out["first_ready_s"] = server.ready_s
            out["warmup"] = self._query(Probe(server.url, stats), docs)
            out["warm"] = self._query(Probe(server.url, stats), docs)
            t0 = time.monotonic()
            server.stop()
            server = VLLMServer(cfg).start()
            out["restart_ready_s"] = time.monotonic() - t0
            out["after_engine_restart"] = self._after_restart(Probe(server.url, stats), docs)
            if cache is not None:
                for how in ("sigterm", "sigkill"):
                    cache.restart(how)
                    reset_device_cache(server.url)
                    out[f"after_server_{how}"] = self._after_restart(Probe(server.url, stats), docs)
        finally:
            server.stop()
        return _flatten(out)

    def _docs(self) -> list[list[int]]:
        seed = f"restart:{self.spec.seed}:{time.time_ns()}"
        return documents(self.spec.docs, self.spec.doc_tokens, seed)

    def _after_restart(self, probe: Probe, docs: list[list[int]]) -> dict[str, Any]:
        """Query after a restart. The first request after any start is slow in every mode
        (and maps the new arena with kvkeep): the first document takes that cost, unmeasured;
        its hits still count, so a cache that lost it shows."""
        canary = self._query(probe, docs[:1])
        rest = self._query(probe, docs[1:])
        n = len(docs) - 1
        hit = (canary["hit_rate"] + n * rest["hit_rate"]) / (n + 1)
        return {**rest, "hit_rate": hit, "canary_ttft_s": canary["ttft_s"]}

    def _query(self, probe: Probe, docs: list[list[int]]) -> dict[str, Any]:
        return query(probe, docs, self.spec.block_size)


def _flatten(out: dict[str, Any]) -> dict[str, Any]:
    """Top-level figures the report and acceptance read, plus the phases in full."""
    flat: dict[str, Any] = {
        "cold_ttft_s": out["warmup"]["ttft_s"],
        "warm_ttft_s": out["warm"]["ttft_s"],
        "restart_ready_s": out["restart_ready_s"],
        "first_ready_s": out["first_ready_s"],
        "after_engine_restart_hit_rate": out["after_engine_restart"]["hit_rate"],
        "after_engine_restart_ttft_s": out["after_engine_restart"]["ttft_s"],
    }
    for how in ("sigterm", "sigkill"):
        phase = out.get(f"after_server_{how}")
        flat[f"after_server_{how}_hit_rate"] = phase["hit_rate"] if phase else None
        flat[f"after_server_{how}_ttft_s"] = phase["ttft_s"] if phase else None
    hits = [flat[f"after_server_{h}_hit_rate"] for h in ("sigterm", "sigkill")]
    flat["after_server_restart_hit_rate"] = None if None in hits else min(hits)
    flat["phases"] = {k: v for k, v in out.items() if isinstance(v, dict)}
    return flat


def main(argv: list[str]) -> int:
    """`kvkeep bench restart`: S4 for each mode, each with its own servers."""
    import argparse
    import sys

    from kvkeep.bench import scenarios as sc

    p = argparse.ArgumentParser(prog="kvkeep bench restart", description=__doc__.splitlines()[0])
    sc.add_common_args(p)
    p.set_defaults(modes=["none", "vllm", "kvkeep"])
    d = RestartSpec()
    p.add_argument("--docs", type=int, default=d.docs)
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    p.add_argument("--cache-ram", default=d.cache_ram)
    p.add_argument("--cache-disk", default=d.cache_disk)
    p.add_argument("--remote", nargs="?", const="", metavar="URL",
                   help="S4 through a shared Valkey/Redis: host A is lost, host B takes over "
                        "(no URL: a private redis-server)")  # fmt: skip
    args = p.parse_args(argv[1:])
    if args.endpoint:
        print("kvkeep bench restart launches its own servers; --endpoint is not supported",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.remote is not None:
        return _main_remote(args)
    spec = RestartSpec(args.docs, args.doc_tokens, cache_ram=args.cache_ram,
                       cache_disk=args.cache_disk)  # fmt: skip
    scenario = RestartScenario(spec)
    base = sc.launch_config(args)
    assert base is not None
    modes: dict[str, Any] = {}
    try:
        for mode in args.modes:
            print(f"mode {mode}: warm up, restart vLLM, query again", file=sys.stderr)
            modes[mode] = scenario.run_mode(base, mode)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"kvkeep bench restart: {exc}", file=sys.stderr)
        return 1
    sc.write_outputs({"scenario": "restart", "modes": modes}, args)
    return 0


def _main_remote(args: Any) -> int:
    """`kvkeep bench restart --remote`: TTFT cold, from kvkeep RAM, and from the remote tier."""
    import sys

    from kvkeep.bench import scenarios as sc
    from kvkeep.bench.remote_bench import RemoteRestartScenario, RemoteRestartSpec, RemoteSpec

    spec = RemoteRestartSpec(docs=args.docs, doc_tokens=args.doc_tokens)
    scenario = RemoteRestartScenario(spec, RemoteSpec(url=args.remote or None))
    base = sc.launch_config(args)
    assert base is not None
    try:
        result = scenario.run(replace(base, max_model_len=max(base.max_model_len,
                                                              spec.max_model_len)))  # fmt: skip
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"kvkeep bench restart --remote: {exc}", file=sys.stderr)
        return 1
    sc.write_outputs({"scenario": "restart_remote", "modes": {"kvkeep": result}}, args)
    return 0
