"""A real `kvkeep server` process on one state directory, for the server and fault tests.

Started, terminated (SIGTERM), killed (SIGKILL, resuming it first if stopped) and measured by
PID; a killed server's arena is removed from /dev/shm. ``stop_all`` is the fixtures' teardown:
it asks every running server for its arena integrity check before killing it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kvkeep.server.client import KVKeepClient


@dataclass
class Server:
    """One state directory and the server processes started on it, one at a time."""

    directory: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def socket(self) -> str:
        return str(self.directory / "kvkeep.sock")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> None:
        log_path = self.directory.parent / f"{self.directory.name}-{len(self.logs)}.log"
        self.logs.append(log_path)
        cmd = [sys.executable, "-m", "kvkeep.cli", "server", "--dir", str(self.directory)]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([*cmd, *self.args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while b"kvkeep server ready" not in log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
            time.sleep(0.01)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM (flushes and seals the disk tier) and wait."""
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL (resuming it first if stopped), wait, and remove the arena it leaves."""
        if self.proc is None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(20)
        self.proc = None
        marker = self.directory / "arena.path"
        if marker.exists():
            Path(marker.read_text().strip()).unlink(missing_ok=True)

    def check_integrity(self) -> list[str]:
        """The problems the running server's arena accounting check finds (``[]``: sound),
        asked over its Unix socket (resuming it first if stopped). ``[]`` if it is not running."""
        if not self.alive():
            return []
        os.kill(self.pid, signal.SIGCONT)
        client = KVKeepClient(self.socket, timeout_s=10)
        try:
            problems: list[str] = client.stats(integrity=True)["integrity"]
            return problems
        finally:
            client.close()

    def rss(self) -> int:
        """Private (non-shared) resident bytes: the arena's shared pages are not counted."""
        info = psutil.Process(self.pid).memory_info()
        return int(info.rss - info.shared)

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())


def stop_all(servers: list[Server]) -> None:
    """Kill every server; fail if a running one's arena accounting was inconsistent."""
    try:
        problems = {str(s.directory): s.check_integrity() for s in servers}
    finally:
        for server in servers:
            server.kill()
    assert not any(problems.values()), f"arena accounting inconsistent: {problems}"
