"""Real `kvkeep server` processes for fault tests: started, killed, stopped and resumed by PID.

Every fixture leaves nothing behind: a stopped process is resumed before it is killed, and the
arena of a killed server is removed from /dev/shm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from serverproc import Server, stop_all

MakeServer = Callable[..., Server]


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[MakeServer]:
    """``make_server(*args, name=..., directory=...)``: a Server, not started yet."""
    servers: list[Server] = []

    def make(*args: str, name: str = "srv", directory: Path | None = None) -> Server:
        directory = directory or tmp_path / name
        directory.mkdir(parents=True, exist_ok=True)
        server = Server(directory, list(args))
        servers.append(server)
        return server

    yield make
    stop_all(servers)  # checks each running server's arena accounting first


SMALL = ("--ram", "8MiB", "--disk", "32MiB", "--extent", "1MiB")


@pytest.fixture
def server(make_server: MakeServer) -> Server:
    """A started server with a small RAM tier (8 MiB) and disk tier (32 MiB)."""
    srv = make_server(*SMALL)
    srv.start()
    return srv
