"""A private redis-server on 127.0.0.1 for tests, benchmarks and demos; stopped by PID.

It runs with the settings kvkeep's remote tier expects of any shared store: a memory bound
(``maxmemory``) with ``allkeys-lru`` eviction, and no persistence (a cache needs none).
"""

from __future__ import annotations

import os
import random
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


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too and below 65536."""
    for _ in range(200):
        port = free_port()
        if port > 55535:
            port = random.randrange(20000, 55535)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a redis cluster node")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class RedisProcess:
    """One redis-server in ``directory``. ``start`` blocks until it answers PING."""

    directory: Path
    maxmemory: str = "256mb"
    port: int = field(default_factory=free_port)
    cluster: bool = False  # a cluster node (join it with ``create_cluster``)
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
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            "allkeys-lru",
            "--daemonize",
            "no",
            *(
                ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
                if self.cluster
                else []
            ),
        ]

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


def create_cluster(nodes: list[RedisProcess], timeout_s: float = 20.0) -> str:
    """Join started cluster nodes (masters, no replicas) into one cluster and wait until it
    serves every slot. Returns the seed-list URL kvkeep takes (``redis://H1:P1,H2:P2,...``)."""
    addresses = [f"127.0.0.1:{n.port}" for n in nodes]
    cli = redis_server_binary().replace("-server", "-cli")
    command = [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"]
    subprocess.run(command, check=True, capture_output=True, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    # Every node must see the cluster as up: each answers CLUSTERDOWN until it does, and the
    # nodes converge one by one (the first being ok said nothing of the others).
    for node in nodes:
        info = [cli, "-p", str(node.port), "cluster", "info"]
        while b"cluster_state:ok" not in subprocess.run(info, capture_output=True).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster node {node.port} did not reach cluster_state:ok")
            time.sleep(0.1)
    return "redis://" + ",".join(addresses)
