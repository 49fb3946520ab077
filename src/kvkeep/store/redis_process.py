"""A private redis-server on 127.0.0.1 for tests, benchmarks and demos; stopped by PID.

It runs with the settings kvkeep's remote tier expects of any shared store: a memory bound
(``maxmemory``) with ``allkeys-lru`` eviction, and no persistence (a cache needs none).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

INSTALL_HINT = "run scripts/redis-test-server.sh install (apt-get install redis-server)"


def redis_server_binary() -> str:
    """The redis-server (or valkey-server) on PATH; raises RuntimeError saying how to get one."""
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
        if found:
            return found
    raise RuntimeError(f"redis-server is not installed: {INSTALL_HINT}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class RedisProcess:
    """One redis-server in ``directory``. ``start`` blocks until it answers PING."""

    directory: Path
    maxmemory: str = "256mb"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.directory / "redis.log").read_text()[-2000:]
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.02)

    def _command(self) -> list[str]:
        return [
            redis_server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--daemonize", "no",
        ]  # fmt: skip

    def ping(self) -> bool:
        """Whether the server answers PING now (0.2 s timeout)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Stop the server by PID (SIGKILL if it ignores ``sig``). Idempotent."""
        if self.proc is None:
            return
        self.resume_if_paused()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing (a hung store)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def resume_if_paused(self) -> None:
        """SIGCONT if paused, so that ``stop`` can end the process."""
        if self.paused and self.proc is not None:
            self.resume()
