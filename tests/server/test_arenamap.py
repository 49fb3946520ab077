"""The arena as clients map it: one mapping per server instance and process, shared by every
client, populated ahead, and gone when no client uses it."""

from __future__ import annotations

import gc
import mmap
import os

from kvkeep.server import arenamap
from kvkeep.server.client import KVKeepClient

from .helpers import BLOCK, NS, keys, read_back, store


def test_clients_of_one_process_share_one_mapping(server_factory: object) -> None:
    server = server_factory("--ram", "16MiB")  # type: ignore[operator]
    server.start()
    first, second = KVKeepClient(server.socket), KVKeepClient(server.socket)
    session = first.hello(NS, BLOCK)
    second.hello(NS, BLOCK)
    one, two = first.arena_mapping(), second.arena_mapping()
    assert one is not None and two is not None and one[1] is two[1]
    instance = one[0]
    assert instance in [a.instance for a in arenamap._MAPS.values()]
    ks = keys(3)
    assert len(store(first, session, ks)) == 3
    assert read_back(second, session, ks) == read_back(first, session, ks)
    first.close()
    second.close()
    del one, two, first, second
    gc.collect()
    assert instance not in [a.instance for a in arenamap._MAPS.values()]


def test_a_mapping_is_populated_ahead() -> None:
    """On Linux 5.14+ the whole mapping is populated (the pages then need no fault on first
    use); elsewhere populate says it could not, and nothing else changes."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    anonymous = mmap.mmap(-1, 8 << 20)
    assert arenamap.populate(anonymous) == ((major, minor) >= (5, 14))
    anonymous[:4] = b"abcd"  # still an ordinary, writable mapping
    assert anonymous[:4] == b"abcd"
    anonymous.close()  # the export taken to populate it is gone
