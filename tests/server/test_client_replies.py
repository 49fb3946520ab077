"""The client's contract against a server that answers garbage: a malformed reply to any
operation is a CacheUnavailable, never another exception and never a slot to map."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvkeep.server import protocol as p
from kvkeep.server.client import CacheUnavailable, KVKeepClient

from .helpers import BLOCK, NS, keys


class FakeServer:
    """Answers HELLO properly and every other request with ``result``."""

    def __init__(self, directory: Path) -> None:
        self.arena = directory / "arena"
        self.arena.write_bytes(bytes(1 << 20))
        self.path = str(directory / "fake.sock")
        self.result: dict[str, Any] = {}
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while header := conn.recv(p.FRAME_HEADER.size, socket.MSG_WAITALL):
                (length,) = p.FRAME_HEADER.unpack(header)
                request = p.decode_request(conn.recv(length, socket.MSG_WAITALL))
                conn.sendall(p.frame(p.ok_reply(request.id, self._result(request.op))))

    def _result(self, op: p.Op) -> dict[str, Any]:
        if op is p.Op.HELLO:
            hello = p.HelloReply(0, "fake", str(self.arena), 1 << 20, ("ram",), 1 << 20)
            return hello.encode()
        return self.result


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeServer]:
    server = FakeServer(tmp_path)
    yield server
    server.sock.close()


CALLS = {
    "lookup": lambda c, s: c.lookup(s, keys(2)),
    "reserve": lambda c, s: c.reserve(s, keys(2)),
    "acquire": lambda c, s: c.acquire(s, keys(2)),
    "commit": lambda c, s: c.commit(s, [], []),
}
MALFORMED = [
    ("lookup", {}),
    ("lookup", {"num_present": "two", "tiers": [0, 0]}),
    ("lookup", {"num_present": 1, "tiers": ["ram"]}),
    ("lookup", {"num_present": 1, "tiers": [7]}),
    ("reserve", {"slots": 3}),
    ("reserve", {"slots": [[0]]}),
    ("reserve", {"slots": [[0, "at 64"]]}),
    ("reserve", {"slots": [[5, 64]]}),
    ("acquire", {"slots": [[-64, 1]]}),
    ("acquire", {"slots": [["x", 1]]}),
    ("acquire", {"slots": None}),
    ("commit", {"committed": "all"}),
    ("commit", {}),
]


@pytest.mark.parametrize("op,result", MALFORMED)
def test_a_malformed_reply_is_cache_unavailable(
    fake: FakeServer, op: str, result: dict[str, Any]
) -> None:
    client = KVKeepClient(fake.path, timeout_s=2)
    session = client.hello(NS, BLOCK)
    fake.result = result
    with pytest.raises(CacheUnavailable):
        CALLS[op](client, session)
    client.close()


def test_a_well_formed_reply_is_served(fake: FakeServer) -> None:
    client = KVKeepClient(fake.path, timeout_s=2)
    session = client.hello(NS, BLOCK)
    fake.result = {"slots": [[64, 7]]}
    (slot,) = client.acquire(session, keys(2))
    assert (slot.offset, slot.checksum, slot.length) == (64, 7, BLOCK)
    client.close()
