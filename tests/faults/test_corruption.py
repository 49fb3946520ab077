"""Fault 2: corruption of the disk tier's files (server stopped, and server running) and of the
shared-memory arena. Every case must be detected before bytes reach a client, counted, and
become a miss; blocks that were not touched must still be served, verified."""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from kvkeep.keys import BlockKey
from kvkeep.server.client import KVKeepClient, Session
from kvkeep.store.diskformat import HEADER_BYTES, read_index, write_index

from .conftest import Server
from .helpers import BLOCK, NS, disk_stats, fetch, keys, payload, store

RECORD = HEADER_BYTES + BLOCK
N = 20  # 16 records seal the first 1 MiB segment; 4 more go to the second


class Where(NamedTuple):
    log: Path
    offset: int  # of the record's header


def locate(server: Server) -> dict[bytes, Where]:
    """Each stored block key -> its record, read from the sealed segment indexes."""
    found: dict[bytes, Where] = {}
    for idx in sorted((server.directory / "disk").glob("seg-*.idx")):
        log = idx.with_suffix(".log")
        for record in read_index(idx, log.stat().st_size) or []:
            if record.kind == 0:
                found[record.key[32:]] = Where(log, record.offset - HEADER_BYTES)
    return found


def patch(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes in place (same inode: a running server sees it through its fd)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def flip(path: Path, offset: int) -> None:
    patch(path, offset, bytes([read(path, offset, 1)[0] ^ 0x5A]))


def swap_records(a: Where, b: Where) -> None:
    ra, rb = read(a.log, a.offset, RECORD), read(b.log, b.offset, RECORD)
    patch(a.log, a.offset, rb)
    patch(b.log, b.offset, ra)


def swap_index_entries(a: Where, b: Where, ks: tuple[bytes, bytes]) -> None:
    """Swap whole records *and* rewrite the index so each key's entry carries the checksum of
    the record now at its offset: every payload checks out, but under the other key."""
    swap_records(a, b)
    assert a.log == b.log
    idx = a.log.with_suffix(".idx")
    records = read_index(idx, a.log.stat().st_size)
    assert records is not None
    block_checksum = {r.key[32:]: r.checksum for r in records}
    fixed = [
        r._replace(checksum=block_checksum[ks[1]] if r.key[32:] == ks[0] else block_checksum[ks[0]])
        if r.key[32:] in ks
        else r
        for r in records
    ]
    write_index(idx, fixed, a.log.stat().st_size)


def fresh(server: Server) -> tuple[KVKeepClient, Session]:
    client = KVKeepClient(server.socket)
    return client, client.hello(NS, BLOCK)


@pytest.fixture
def filled(server: Server) -> tuple[Server, list[BlockKey], dict[bytes, Where]]:
    """A server whose disk holds N blocks in two sealed segments; the server is stopped."""
    client, session = fresh(server)
    ks = keys(N)
    assert len(store(client, session, ks)) == N
    client.close()
    assert server.terminate() == 0
    where = locate(server)
    assert set(where) == set(ks)
    return server, ks, where


def expect_served(server: Server, ks: list[BlockKey], bad: set[int], failures: int) -> None:
    """Each key alone: the ``bad`` ones miss, all others are served with their own bytes."""
    client, session = fresh(server)
    for i, k in enumerate(ks):
        got = fetch(client, session, [k])
        assert got == ([] if i in bad else [payload(k).tobytes()]), f"block {i}"
    stats = disk_stats(client)
    assert stats["checksum_failures"] == failures
    assert client.lookup(session, [ks[i] for i in bad]).num_present == 0, "dropped for good"


Corrupt = Callable[[list[BlockKey], dict[bytes, Where]], None]

STOPPED_CASES: dict[str, tuple[Corrupt, set[int], int]] = {
    "payload byte": (lambda ks, w: flip(w[ks[3]].log, w[ks[3]].offset + HEADER_BYTES + 5), {3}, 1),
    "last payload byte": (
        lambda ks, w: flip(w[ks[17]].log, w[ks[17]].offset + RECORD - 1),
        {17},
        1,
    ),
    "header key byte": (lambda ks, w: flip(w[ks[5]].log, w[ks[5]].offset + 40), {5}, 1),
    "swap records": (lambda ks, w: swap_records(w[ks[2]], w[ks[9]]), {2, 9}, 2),
    "swap records and index checksums": (
        lambda ks, w: swap_index_entries(w[ks[2]], w[ks[9]], (ks[2], ks[9])),
        {2, 9},
        2,
    ),
    "zeroed record": (lambda ks, w: patch(w[ks[7]].log, w[ks[7]].offset, bytes(RECORD)), {7}, 1),
}


@pytest.mark.parametrize("case", STOPPED_CASES)
def test_corruption_while_stopped(
    filled: tuple[Server, list[BlockKey], dict[bytes, Where]], case: str
) -> None:
    server, ks, where = filled
    corrupt, bad, failures = STOPPED_CASES[case]
    corrupt(ks, where)
    server.start()
    expect_served(server, ks, bad, failures)


def test_truncated_segment_keeps_its_intact_prefix(
    filled: tuple[Server, list[BlockKey], dict[bytes, Where]],
) -> None:
    server, ks, where = filled
    log = where[ks[0]].log
    os.truncate(log, 10 * RECORD + 1000)  # inside record 10 of 16
    server.start()
    client, session = fresh(server)
    assert fetch(client, session, ks[:10]) == [payload(k).tobytes() for k in ks[:10]]
    assert client.lookup(session, ks[10:16]).num_present == 0
    assert fetch(client, session, ks[16:]) == [payload(k).tobytes() for k in ks[16:]]
    assert disk_stats(client)["checksum_failures"] == 1, "the torn tail is counted"


def test_deleted_or_damaged_index_is_rebuilt_from_the_log(
    filled: tuple[Server, list[BlockKey], dict[bytes, Where]],
) -> None:
    server, ks, where = filled
    first, second = where[ks[0]].log, where[ks[-1]].log
    first.with_suffix(".idx").unlink()
    flip(second.with_suffix(".idx"), 40)
    server.start()
    expect_served(server, ks, set(), 0)


def test_deleted_segment_and_stray_files(
    filled: tuple[Server, list[BlockKey], dict[bytes, Where]],
) -> None:
    server, ks, where = filled
    log = where[ks[0]].log
    log.unlink()  # its index stays behind, an orphan
    (log.parent / "seg-00000099.idx.tmp").write_bytes(b"half an index")
    server.start()
    client, session = fresh(server)
    assert client.lookup(session, ks).num_present == 0
    assert fetch(client, session, ks[16:]) == [payload(k).tobytes() for k in ks[16:]]
    assert sorted(p.name for p in log.parent.iterdir() if "idx" in p.name) == [
        "seg-00000002.idx"
    ], "orphan and half-written indexes are removed"


def test_swapped_segments_with_their_indexes_still_serve_right_bytes(
    filled: tuple[Server, list[BlockKey], dict[bytes, Where]],
) -> None:
    server, ks, where = filled
    one, two = where[ks[0]].log, where[ks[-1]].log
    tmp = one.with_name("tmp")
    for suffix in (".log", ".idx"):
        shutil.move(one.with_suffix(suffix), tmp)
        shutil.move(two.with_suffix(suffix), one.with_suffix(suffix))
        shutil.move(tmp, two.with_suffix(suffix))
    server.start()
    expect_served(server, ks, set(), 0)


RUNNING_CASES: dict[str, tuple[Corrupt, set[int], int]] = {
    "payload byte": STOPPED_CASES["payload byte"],
    "header key byte": STOPPED_CASES["header key byte"],
    "swap records": STOPPED_CASES["swap records"],
    "truncate": (lambda ks, w: os.truncate(w[ks[0]].log, 12 * RECORD + 7), {12, 13, 14, 15}, 4),
}


@pytest.mark.parametrize("case", RUNNING_CASES)
def test_corruption_while_running(
    filled: tuple[Server, list[BlockKey], dict[bytes, Where]], case: str
) -> None:
    server, ks, where = filled
    server.start()  # RAM is empty: every block comes from disk
    corrupt, bad, failures = RUNNING_CASES[case]
    corrupt(ks, where)  # in place, through the same inodes the server has open
    expect_served(server, ks, bad, failures)
    assert server.alive()


def test_deleted_segment_while_running_serves_verified_bytes(
    filled: tuple[Server, list[BlockKey], dict[bytes, Where]],
) -> None:
    """Unlinking a segment the server has open does not change its bytes: they are still
    correct and served (checked); the blocks are gone after the next restart."""
    server, ks, where = filled
    server.start()
    where[ks[0]].log.unlink()
    expect_served(server, ks, set(), 0)


def test_arena_corruption_is_caught_by_verify(server: Server) -> None:
    client, session = fresh(server)
    ks = keys(4)
    slots = store(client, session, ks)
    arena_path = (server.directory / "arena.path").read_text().strip()
    fd = os.open(arena_path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as arena:  # a stray writer scribbles over block 1
            arena[slots[1].offset + 100] ^= 0xFF
    finally:
        os.close(fd)
    acquired = client.acquire(session, ks)
    try:
        assert [client.verify(s) for s in acquired] == [True, False, True, True]
    finally:
        client.release(acquired)
