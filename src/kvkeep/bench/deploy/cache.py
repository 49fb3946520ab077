"""The kvkeep cache server of a bench run, and the shared store replicas use.

Every scenario in mode kvkeep gets the same cache server, alone or in `bench all`: `CacheSpec()`
(`--cache-ram` / `--cache-disk` change it for a run; `bench soak` has its own defaults). With a
shared store, each replica's server adds the remote tier (`--remote URL`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvkeep.bench.deploy import exit_on_sigterm
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess
from kvkeep.server.client import CacheUnavailable, KVKeepClient
from kvkeep.store.redis_process import RedisProcess
from kvkeep.traffic.workload import BENCH_CACHE_DISK, BENCH_CACHE_RAM
from kvkeep.units import parse_size


@dataclass(frozen=True)
class CacheSpec:
    """One cache server's tiers; the remote tier's settings apply only with a store URL."""

    ram: str = BENCH_CACHE_RAM
    disk: str = BENCH_CACHE_DISK
    remote_write: str = "through"
    remote_rate: str = "256MiB"
    remote_timeout_s: float = 0.25
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_size(self.ram)  # raises ValueError naming the bad size, before anything starts
        parse_size(self.disk)

    def args(self, store: str | None) -> tuple[str, ...]:
        """`kvkeep server` flags beyond the tier sizes. Pure."""
        if store is None:
            return self.extra_args
        return (
            "--remote",
            store,
            "--remote-write",
            self.remote_write,
            "--remote-rate",
            self.remote_rate,
            "--remote-timeout",
            str(self.remote_timeout_s),
            *self.extra_args,
        )


class CacheServer(CacheServerProcess):
    """A kvkeep cache server process in its own state directory (a fresh temporary one unless
    ``directory`` is given). ``close()`` (or leaving the ``with`` block) stops it and deletes
    the directory; every other method leaves the directory alone. ``stop(timeout_s)``: SIGTERM
    (it flushes), SIGKILL after ``timeout_s``; idempotent."""

    def __init__(
        self,
        spec: CacheSpec = CacheSpec(),
        store: str | None = None,
        name: str = "cache",
        directory: Path | None = None,
    ) -> None:
        self.directory = directory or Path(tempfile.mkdtemp(prefix=f"kvkeep-{name}-"))
        cfg = CacheServerConfig(self.directory, spec.ram, spec.disk, None, spec.args(store))
        super().__init__(cfg)

    @property
    def socket(self) -> str:
        return self.cfg.socket_path

    def start(self) -> CacheServer:
        """Start it and wait until it listens; raises RuntimeError with its log's tail."""
        exit_on_sigterm()
        self.ensure()
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: writes in flight may be lost, never integrity."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.stop(timeout_s=5)

    def restart(self, how: str = "sigterm") -> None:
        """Stop it (``sigterm``: cleanly; ``sigkill``: a crash) and start it on the same
        directory: RAM is lost, the disk tier is rebuilt."""
        if how == "sigkill":
            self.kill()
        else:
            self.stop()
        self.start()

    def replace_host(self) -> None:
        """Stop it, delete its state and start an empty one: the host was lost and a new
        one took its place (on the same shared store, if any)."""
        self.close()
        self.start()

    def stats(self) -> dict[str, Any] | None:
        """The server's STATS reply, or None while it is down."""
        client = KVKeepClient(socket_path=self.socket, timeout_s=5.0)
        try:
            return client.stats()
        except CacheUnavailable:
            return None
        finally:
            client.close()

    def wait_sent(self, timeout_s: float = 120.0) -> bool:
        """Block until every committed block has been handed on: the write-through queue
        (which holds blocks back while the engine computes) and the remote tier's send queue
        are both empty. False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.stats() or {}
            remote = stats.get("tiers", {}).get("remote")
            behind = stats.get("pending_writes", 0)
            if behind == 0 and (remote is None or remote.get("queued_bytes", 0) == 0):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        """Stop it and delete its state directory. Idempotent."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> CacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def shared_store(url: str | None = None, maxmemory: str = "2gb") -> Iterator[str]:
    """The store's URL: ``url``, or a private redis-server (``maxmemory``, allkeys-lru)
    stopped and deleted afterwards."""
    if url:
        yield url
        return
    directory = Path(tempfile.mkdtemp(prefix="kvkeep-redis-"))
    server = RedisProcess(directory, maxmemory=maxmemory)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)
