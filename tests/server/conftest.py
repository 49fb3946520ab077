"""Real `kvkeep server` processes in temporary directories, stopped by PID."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from serverproc import Server, stop_all


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[object]:
    servers: list[Server] = []

    def make(*args: str, name: str = "srv") -> Server:
        directory = tmp_path / name
        directory.mkdir()
        server = Server(directory, list(args))
        servers.append(server)
        return server

    yield make
    stop_all(servers)  # checks each running server's arena accounting first


@pytest.fixture
def server(server_factory: object) -> Server:
    srv = server_factory("--ram", "8MiB", "--disk", "32MiB", "--extent", "1MiB")  # type: ignore[operator]
    srv.start()
    return srv
