"""The server as a real process: round trips, restarts, corruption, crashes, concurrency."""

from __future__ import annotations

import socket
import stat
import struct
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvkeep.keys import Namespace
from kvkeep.server import protocol as p
from kvkeep.server.client import CacheRefused, CacheUnavailable, KVKeepClient
from kvkeep.store.base import checksum
from serverproc import Server

from .helpers import BLOCK, NS, keys, payload, read_back, store


def test_round_trip_lookup_acquire(server: Server) -> None:
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    ks = keys(10)
    assert client.lookup(session, ks).num_present == 0
    assert len(store(client, session, ks[:6])) == 6
    assert len(client.reserve(session, ks[:7])) == 1, "stored keys are skipped"
    found = client.lookup(session, ks)
    assert found.num_present == 6 and found.tiers == ("ram",) * 6
    assert read_back(client, session, ks) == [payload(k).tobytes() for k in ks[:6]]
    stats = client.stats()
    assert stats["tiers"]["ram"]["hits"] == 6 and stats["tiers"]["ram"]["blocks"] == 6
    assert stat.S_IMODE(Path(server.socket).stat().st_mode) == 0o600
    client.close()


def test_a_release_sent_without_waiting_lets_go_of_the_pins(server_factory: Any) -> None:
    """The loader's RELEASE does not wait for its reply: the next call on the client reads
    it first and gets its own answer, and the blocks are unpinned (other traffic can evict
    them from RAM; pinned ones it never could).

    RAM only: with a lower tier the write-through also pins each new block until its copy
    is written, and that idle-priority writer may not have run yet on a busy machine."""
    server = server_factory("--ram", "8MiB", "--extent", "1MiB")
    server.start()
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    ours = keys(8)
    store(client, session, ours)
    slots = client.acquire(session, ours)
    assert len(slots) == 8
    client.release(slots, wait=False)
    assert client.lookup(session, ours).tiers == ("ram",) * 8, "its own reply, in step"
    other = KVKeepClient(server.socket)
    other_session = other.hello(NS, BLOCK)
    ram_slots = client.stats()["tiers"]["ram"]["capacity_bytes"] // BLOCK
    for start in range(0, 2 * ram_slots, 32):  # twice what RAM holds, none of them ours
        store(other, other_session, keys(32, offset=(1000 + start) * NS.block_size))
    assert "ram" not in client.lookup(session, ours).tiers, "released blocks can be evicted"
    client.close()
    other.close()


def test_a_release_not_waited_for_on_a_dead_connection_costs_no_backoff(server: Server) -> None:
    """A RELEASE sent without waiting to a server that restarted since the ACQUIRE finds the
    connection gone (the pins went with it); the next call reconnects at once."""
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    ours = keys(4)
    store(client, session, ours)
    slots = client.acquire(session, ours)
    server.kill()
    server.start()
    client.release(slots, wait=False)  # never raises
    assert client.lookup(session, ours).num_present in range(5)


def test_namespaces_never_alias(server: Server) -> None:
    client = KVKeepClient(server.socket)
    other_ns = Namespace("other-model", "float16", "LBNHC", "cuda", block_size=16)
    a, b = client.hello(NS, BLOCK), client.hello(other_ns, 2 * BLOCK)
    same_key = keys(1)[0]
    store(client, a, [same_key])
    assert client.lookup(b, [same_key]).num_present == 0
    slot = client.reserve(b, [same_key])[0]
    assert slot.length == 2 * BLOCK
    client.slot_view(slot)[:] = 7
    client.commit(b, [slot], [checksum(np.full(slot.length, 7, np.uint8).data)])
    assert read_back(client, a, [same_key]) == [payload(same_key).tobytes()]
    assert read_back(client, b, [same_key]) == [bytes([7]) * 2 * BLOCK]


def test_block_too_large_is_refused_at_hello(server: Server) -> None:
    with pytest.raises(CacheRefused, match="block_too_large"):
        KVKeepClient(server.socket).hello(NS, 2 << 20)


def test_restart_serves_blocks_from_disk_verified(server: Server) -> None:
    client = KVKeepClient(server.socket, timeout_s=2)
    session = client.hello(NS, BLOCK)
    ks = keys(20)
    store(client, session, ks)
    assert server.terminate() == 0, "SIGTERM flushes and exits 0"
    with pytest.raises(CacheUnavailable):
        client.lookup(session, ks)
    server.start()
    time.sleep(0.2)  # past the client's reconnect backoff
    found = client.lookup(session, ks)
    assert found.num_present == 20 and set(found.tiers) == {"disk"}
    assert read_back(client, session, ks) == [payload(k).tobytes() for k in ks]
    assert client.lookup(session, ks[:1]).tiers == ("ram",), "loads promote"
    assert client.stats()["tiers"]["disk"]["checksum_failures"] == 0


def test_corrupt_record_is_a_counted_miss(server: Server) -> None:
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    ks = keys(4)
    store(client, session, ks)
    server.terminate()
    segment = sorted((server.directory / "disk").glob("seg-*.log"))[0]
    data = bytearray(segment.read_bytes())
    data[88 + BLOCK + 88 + 1000] ^= 0xFF  # a payload byte of the second record
    segment.write_bytes(bytes(data))
    server.start()
    fresh = KVKeepClient(server.socket)
    session = fresh.hello(NS, BLOCK)
    assert read_back(fresh, session, ks) == [payload(ks[0]).tobytes()], "a miss at block 1"
    stats = fresh.stats()["tiers"]["disk"]
    assert stats["checksum_failures"] == 1
    assert fresh.lookup(session, ks).num_present == 1, "the bad record is removed"


@pytest.mark.slow
def test_sigkill_during_write_burst_never_corrupts(server: Server) -> None:
    stop = threading.Event()
    written: list[bytes] = []

    def burst() -> None:
        client = KVKeepClient(server.socket, timeout_s=1)
        session = client.hello(NS, BLOCK)
        for i in range(10_000):
            if stop.is_set():
                return
            batch = keys(8, offset=i * 8 * 16)
            try:
                store(client, session, batch)
            except CacheUnavailable:
                return
            written.extend(batch)

    thread = threading.Thread(target=burst)
    thread.start()
    time.sleep(1.0)
    # Write-through runs when the host is idle enough (kvkeep.store.idlegate): on a busy
    # machine the first record may reach the disk later than a second into the burst.
    watcher, deadline = KVKeepClient(server.socket, timeout_s=2), time.monotonic() + 20
    while watcher.stats()["tiers"]["disk"]["blocks"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    watcher.close()
    server.kill()
    stop.set()
    thread.join()
    server.start()
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    assert len(written) > 50
    returned = 0
    for k in written:
        got = read_back(client, session, [k])  # verifies the checksum too
        assert got in ([], [payload(k).tobytes()])
        returned += len(got)
    assert returned > 0


def test_concurrent_clients(server: Server) -> None:
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            client = KVKeepClient(server.socket)
            session = client.hello(NS, BLOCK)
            mine = keys(6, offset=n * 10_000)
            for _ in range(5):
                store(client, session, mine)
                assert read_back(client, session, mine) == [payload(k).tobytes() for k in mine]
            shared = keys(3, offset=999_999)
            store(client, session, shared)
            # Another client may still be writing a shared block: that is a miss, not an error.
            got = read_back(client, session, shared)
            assert got == [payload(k).tobytes() for k in shared[: len(got)]]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert KVKeepClient(server.socket).stats()["connections"] <= 1


def _raw(server: Server, data: bytes) -> tuple[dict[str, Any] | None, bool]:
    """Send raw bytes; return the reply (if any) and whether the server closed after it."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(server.socket)
    sock.sendall(data)
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            try:
                sock.settimeout(0.3)
                closed = sock.recv(1) == b""
            except TimeoutError:
                closed = False
            return msgpack.unpackb(buf[4:]), closed
    return None, True


V = p.PROTOCOL_VERSION


def _frame(body: Any) -> bytes:
    data = msgpack.packb(body)
    return struct.pack(">I", len(data)) + data


@pytest.mark.parametrize(
    "data,code,closes",
    [
        (_frame({"v": 99, "id": 1, "op": "STATS", "args": {}}), "version", True),
        # a version-1 client sends CRC-32s: refused, never stored under another checksum
        (_frame({"v": 1, "id": 1, "op": "STATS", "args": {}}), "version", True),
        (struct.pack(">I", p.MAX_FRAME_BYTES + 1), "frame_too_large", True),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "malformed", True),
        (_frame([1, 2, 3]), "malformed", True),
        (_frame({"v": V, "id": 1, "op": "NOPE", "args": {}}), "bad_request", False),
        (
            _frame({"v": V, "id": 1, "op": "LOOKUP", "args": {"ns": 5, "keys": []}}),
            "unknown_namespace",
            False,
        ),
        (
            _frame({"v": V, "id": 1, "op": "LOOKUP", "args": {"ns": 0, "keys": [b"x"]}}),
            "unknown_namespace",
            False,
        ),
    ],
)
def test_bad_requests_get_errors_and_server_stays_up(
    server: Server, data: bytes, code: str, closes: bool
) -> None:
    reply, closed = _raw(server, data)
    assert reply is not None and reply["ok"] is False and reply["error"]["code"] == code
    assert closed == closes
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    store(client, session, keys(1))
    assert client.lookup(session, keys(1)).num_present == 1


def test_client_fails_fast_when_server_is_down(tmp_path: Path) -> None:
    client = KVKeepClient(str(tmp_path / "nobody.sock"), timeout_s=0.5)
    session = client.session(NS, BLOCK)
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(CacheUnavailable):
            client.lookup(session, keys(2))
    assert time.monotonic() - started < 1.0


def test_tcp_requires_token_and_metrics(server_factory: Any, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(b"s3cret\n")
    port, metrics_port = _free_port(), _free_port()
    srv = server_factory(
        "--ram", "8MiB", "--disk", "0", "--extent", "1MiB",
        "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
        "--metrics-port", str(metrics_port),
    )  # fmt: skip
    srv.start()
    with pytest.raises(CacheRefused, match="unauthorized"):
        KVKeepClient(address=("127.0.0.1", port)).hello(NS, BLOCK)
    with pytest.raises(CacheRefused, match="unauthorized"):
        KVKeepClient(address=("127.0.0.1", port), token=b"wrong").hello(NS, BLOCK)
    client = KVKeepClient(address=("127.0.0.1", port), token=b"s3cret")
    session = client.hello(NS, BLOCK)
    store(client, session, keys(2))
    assert read_back(client, session, keys(2)) == [payload(k).tobytes() for k in keys(2)]
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    assert b'kvkeep_tier_hits_total{tier="ram"} 2.0' in text
    assert b"kvkeep_dropped_writes_total" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
