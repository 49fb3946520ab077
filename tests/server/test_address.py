"""A cache server's default socket where its directory is too deep for a unix socket path
(108 bytes on Linux, NUL included): a real server on a deep --dir, and the clear refusal of an
explicit --socket that cannot bind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess
from kvkeep.server.address import MAX_SOCKET_PATH_BYTES, default_socket_path
from kvkeep.server.client import KVKeepClient


def deep(base: Path) -> Path:
    path = base / ("d" * 60) / ("e" * 60)
    assert len(os.fsencode(str(path / "kvkeep.sock"))) > MAX_SOCKET_PATH_BYTES
    return path


def test_a_short_directory_keeps_its_socket_inside_it(tmp_path: Path) -> None:
    assert default_socket_path(Path("/tmp/k")) == "/tmp/k/kvkeep.sock"


def test_a_deep_directory_gets_a_short_socket_that_every_process_derives_alike(
    tmp_path: Path,
) -> None:
    a, b = deep(tmp_path / "a"), deep(tmp_path / "b")
    path = default_socket_path(a)
    assert len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES
    assert path == default_socket_path(str(a)) == CacheServerConfig(a).socket_path
    assert path != default_socket_path(b), "two directories must not share a socket"


def test_a_server_on_a_deep_directory_starts_serves_and_removes_its_socket(
    tmp_path: Path,
) -> None:
    proc = CacheServerProcess(CacheServerConfig(deep(tmp_path), ram="8MiB"))
    proc.ensure(timeout_s=30)
    try:
        assert proc.started
        client = KVKeepClient(socket_path=proc.cfg.socket_path, timeout_s=5.0)
        try:
            assert "ram" in client.stats()["tiers"]
        finally:
            client.close()
    finally:
        proc.stop()
    assert not Path(proc.cfg.socket_path).exists(), "the server left its socket behind"


def test_an_explicit_socket_too_long_to_bind_is_refused_by_name(tmp_path: Path) -> None:
    long_socket = str(deep(tmp_path) / "kvkeep.sock")
    with pytest.raises(ValueError, match=r"--socket .* bytes; a unix socket path holds at most"):
        CacheServerConfig(tmp_path, socket=long_socket)
    cmd = [sys.executable, "-m", "kvkeep.cli", "server", "--dir", str(tmp_path / "s"),
           "--ram", "8MiB", "--socket", long_socket]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--socket" in done.stderr and "give a shorter one" in done.stderr
