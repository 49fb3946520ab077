"""Fault 3: the disk tier's filesystem fills up (a size-limited tmpfs of the test's own, smaller
than the configured --disk). Writes fail cleanly and are counted, the oldest segments are
evicted to make room, and the server keeps serving RAM hits."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvkeep.server.client import KVKeepClient

from .conftest import MakeServer, Server
from .helpers import BLOCK, NS, disk_stats, drain, fetch, keys, payload, store

FS_BYTES = 4 << 20


@pytest.fixture
def small_fs(make_server: MakeServer, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    """A server whose state directory is on a 4 MiB tmpfs, but which believes it has 64 MiB."""
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mount)], check=True
    )
    try:
        srv = make_server(
            "--ram", "4MiB", "--disk", "64MiB", "--extent", "1MiB", directory=mount / "srv"
        )  # fmt: skip
        srv.start()
        yield srv, mount
        srv.kill()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_filesystem_evicts_oldest_and_keeps_serving(small_fs: tuple[Server, Path]) -> None:
    server, _ = small_fs
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    ks = keys(160)  # 10 MiB into a 4 MiB filesystem
    for start in range(0, len(ks), 8):
        store(client, session, ks[start : start + 8])
        drain(client)
    disk = disk_stats(client)
    assert disk["write_errors"] > 0, "the full filesystem was hit and counted"
    assert disk["evictions"] > 0, "the oldest blocks made room"
    assert disk["bytes_used"] <= FS_BYTES
    assert server.alive()
    newest = ks[-40:]
    assert fetch(client, session, newest) == [payload(k).tobytes() for k in newest], "RAM hits"
    client.close()
    assert server.terminate() == 0, "SIGTERM still flushes and exits cleanly"
    server.start()
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    present = [k for k in ks if client.lookup(session, [k]).num_present]
    assert len(present) >= 16, "recent blocks survived on disk"
    assert present == ks[ks.index(present[0]) :], "what is kept is the newest, oldest went first"
    assert fetch(client, session, present[-8:]) == [payload(k).tobytes() for k in present[-8:]]
    assert disk_stats(client)["checksum_failures"] == 0, "no torn record was left behind"


def test_no_space_at_all_fails_writes_and_recovers(small_fs: tuple[Server, Path]) -> None:
    server, mount = small_fs
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    ballast = mount / "ballast"
    with open(ballast, "wb") as f:  # someone else fills the filesystem to the last byte
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    before = keys(8)
    store(client, session, before)
    drain(client)
    stats = client.stats()
    assert stats["tiers"]["disk"]["write_errors"] >= 8 and stats["tiers"]["disk"]["blocks"] == 0
    assert stats["write_errors"] >= 8
    assert fetch(client, session, before) == [payload(k).tobytes() for k in before], "RAM serves"
    ballast.unlink()
    after = keys(8, offset=10_000)
    store(client, session, after)
    drain(client)
    assert disk_stats(client)["blocks"] == 8, "writes land again once there is room"
    assert server.alive()
