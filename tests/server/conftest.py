"""Real `kvkeep server` processes in temporary directories, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class ServerProcess:
    directory: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    log: list[Path] = field(default_factory=list)

    @property
    def socket(self) -> str:
        return str(self.directory / "kvkeep.sock")

    def start(self, timeout: float = 20.0) -> None:
        log_path = self.directory.parent / f"server-{len(self.log)}.log"
        self.log.append(log_path)
        cmd = [
            sys.executable,
            "-m",
            "kvkeep.cli",
            "server",
            "--dir",
            str(self.directory),
            *self.args,
        ]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while b"kvkeep server ready" not in log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
        marker = self.directory / "arena.path"
        if marker.exists():  # a killed server leaves its arena; the next start removes it too
            Path(marker.read_text()).unlink(missing_ok=True)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[object]:
    servers: list[ServerProcess] = []

    def make(*args: str, name: str = "srv") -> ServerProcess:
        directory = tmp_path / name
        directory.mkdir()
        server = ServerProcess(directory, list(args))
        servers.append(server)
        return server

    yield make
    for server in servers:
        if server.proc is not None:
            server.kill()


@pytest.fixture
def server(server_factory: object) -> ServerProcess:
    srv = server_factory("--ram", "8MiB", "--disk", "32MiB", "--extent", "1MiB")  # type: ignore[operator]
    srv.start()
    return srv
