"""The arena as clients map it: one mapping per server instance and process, shared by every
client, populated ahead, and gone when no client uses it."""

from __future__ import annotations

import gc
import mmap
import os
import time
import weakref

from kvkeep.server import arenamap
from kvkeep.server.client import KVKeepClient

from .helpers import BLOCK, NS, keys, read_back, store


def test_clients_of_one_process_share_one_mapping(server_factory: object) -> None:
    server = server_factory("--ram", "16MiB")  # type: ignore[operator]
    server.start()
    first, second = KVKeepClient(server.socket), KVKeepClient(server.socket)
    session = first.hello(NS, BLOCK)
    assert not second.wait_populated(0)  # nothing mapped yet
    second.hello(NS, BLOCK)
    assert first.wait_populated(10) and second.wait_populated(0), "populate never ended"
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


def test_a_restarted_server_s_old_mapping_is_unmapped_off_the_call(server_factory: object) -> None:
    """The first call after a server restart maps the new arena and hands the old mapping to
    the background: unmapping a populated arena took 145 ms per 768 MiB on that call. The old
    mapping is still there when the call returns, gone soon after, and the call answers."""
    server = server_factory("--ram", "16MiB")  # type: ignore[operator]
    server.start()
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    old = client.arena_mapping()
    assert old is not None
    old_map = weakref.ref(old[1])
    del old
    server.terminate()
    server.start()
    assert client.lookup(session, keys(2)).num_present == 0  # reconnected, on the new arena
    new = client.arena_mapping()
    assert new is not None and new[1] is not old_map()
    assert old_map() is not None, "the old mapping was dropped on the caller's thread"
    deadline = time.monotonic() + arenamap.RETIRE_DELAY_S + 10
    while old_map() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert old_map() is None, "the retired mapping was never dropped"
    client.close()


def _mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split()) == 6}


def test_a_lookup_only_client_never_maps_the_arena(server_factory: object) -> None:
    """vLLM's scheduler only looks keys up: its client (and its sibling, the touches) must
    not map, and so populate, the whole arena, not even after a server restart."""
    server = server_factory("--ram", "16MiB")  # type: ignore[operator]
    server.start()
    writer = KVKeepClient(server.socket)
    ws = writer.hello(NS, BLOCK)
    ks = keys(3)
    assert len(store(writer, ws, ks)) == 3
    ((arena_path, _),) = arenamap._MAPS.keys()
    assert arena_path in _mapped_paths()
    writer.close()
    del writer, ws
    deadline = time.monotonic() + 10  # its background populate may still hold it a moment
    while arena_path in _mapped_paths() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert arena_path not in _mapped_paths(), "a closed client's mapping outlived it"
    lookups = KVKeepClient(server.socket, map_arena=False)
    for client in (lookups, lookups.sibling()):
        session = client.hello(NS, BLOCK)
        assert client.lookup(session, ks).num_present == 3
        client.touch(session, ks)
        assert client.arena_mapping() is None
        assert not arenamap._MAPS and arena_path not in _mapped_paths()
    slot = KVKeepClient(server.socket)  # a slot this client could be handed by mistake
    held = slot.acquire(slot.hello(NS, BLOCK), ks)
    try:
        lookups.slot_view(held[0])
        raise AssertionError("slot_view worked without a mapping")
    except RuntimeError as exc:
        assert "map_arena=False" in str(exc)
    slot.release(held)
    slot.close()
    server.terminate()
    server.start()
    session = lookups.hello(NS, BLOCK)
    assert lookups.lookup(session, ks).num_present == 0  # a new instance; RAM only
    assert lookups.arena_mapping() is None
    lookups.close()
