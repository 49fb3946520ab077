"""A block whose bytes in the RAM arena went bad is reported by the reader that caught it
(RELEASE ``corrupt``), re-checked and dropped by the server, and can then be saved again.
Without this, one scribbled block stays a miss for good: a save skips keys already held."""

from __future__ import annotations

import mmap
import os

from kvkeep.server.client import KVKeepClient

from .conftest import MakeServer, Server
from .helpers import BLOCK, NS, drain, fetch, keys, payload, store


def _scribble(server: Server, offset: int) -> None:
    path = (server.directory / "arena.path").read_text().strip()
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as arena:
            arena[offset + 100] ^= 0xFF
    finally:
        os.close(fd)


def _report_scribbled(server: Server, ks: list) -> KVKeepClient:
    """Store ``ks``, scribble over block 1 in RAM, and report it as a reader would."""
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    slots = store(client, session, ks)
    drain(client)  # the disk tier's copy is written from RAM: let it be the intact bytes
    _scribble(server, slots[1].offset)
    acquired = client.acquire(session, ks)
    bad = [s for s in acquired if not client.verify(s)]
    assert [s.key for s in bad] == [ks[1]]
    client.release(acquired, corrupt=bad)
    assert client.stats()["tiers"]["ram"]["checksum_failures"] == 1
    return client


def test_a_reported_corrupt_block_is_dropped_and_saved_again(make_server: MakeServer) -> None:
    server = make_server("--ram", "8MiB", "--extent", "1MiB")  # RAM only
    server.start()
    ks = keys(4)
    client = _report_scribbled(server, ks)
    session = client.hello(NS, BLOCK)
    assert client.lookup(session, ks).num_present == 1  # the chain now stops at block 1
    again = store(client, session, ks)  # only the dropped block needs writing
    assert [s.key for s in again] == [ks[1]]
    assert fetch(client, session, ks) == [payload(k).tobytes() for k in ks]
    client.close()


def test_a_dropped_block_is_served_again_from_disk(server: Server) -> None:
    ks = keys(4)
    client = _report_scribbled(server, ks)
    session = client.hello(NS, BLOCK)
    assert client.lookup(session, ks).tiers[1] == "disk"  # its intact copy
    assert fetch(client, session, ks) == [payload(k).tobytes() for k in ks]
    client.close()


def test_a_false_report_drops_nothing(server: Server) -> None:
    """The server checks the bytes itself: a client cannot evict intact blocks by lying."""
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    ks = keys(3)
    store(client, session, ks)
    acquired = client.acquire(session, ks)
    client.release(acquired, corrupt=acquired)
    assert client.stats()["tiers"]["ram"]["checksum_failures"] == 0
    assert client.lookup(session, ks).num_present == 3
    client.close()


def test_a_block_another_reader_pins_is_kept(server: Server) -> None:
    """Dropping a slot someone still reads would hand its offset to a writer under them."""
    client, other = KVKeepClient(server.socket), KVKeepClient(server.socket)
    session, other_session = client.hello(NS, BLOCK), other.hello(NS, BLOCK)
    ks = keys(2)
    slots = store(client, session, ks)
    drain(client)  # the disk tier's copy is written from RAM: let it be the intact bytes
    _scribble(server, slots[0].offset)
    held = other.acquire(other_session, ks[:1])
    acquired = client.acquire(session, ks[:1])
    client.release(acquired, corrupt=acquired)
    assert client.lookup(session, ks).num_present == 2
    other.release(held)
    client.close()
    other.close()
