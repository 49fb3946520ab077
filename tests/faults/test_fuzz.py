"""Fault 6: protocol fuzzing, over the codec and against a live server. Random, truncated and
oversized frames, wrong types, huge counts, negative and overflowing ints: the server never
crashes or grows, every bad request gets an error reply or a closed connection, and a
well-behaved client on another connection is unaffected throughout."""

from __future__ import annotations

import contextlib
import signal
import socket
import struct
import time
import tracemalloc
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkeep.server import protocol as p
from kvkeep.server.client import KVKeepClient

from .conftest import Server
from .helpers import BLOCK, NS, fetch, keys, payload, store

INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**32 - 1, 2**63, 2**64 - 1, p.MAX_FRAME_BYTES]),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, st.floats(), st.binary(max_size=40), st.text(max_size=8)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
KEYS = st.lists(st.binary(min_size=31, max_size=33), max_size=6) | VALUES
ARGS = st.fixed_dictionaries(
    {},
    optional={
        "ns": INTS | VALUES,
        "keys": KEYS,
        "slots": st.lists(st.lists(INTS, max_size=3) | INTS, max_size=6) | VALUES,
        "namespace": st.binary(min_size=31, max_size=33) | VALUES,
        "block_bytes": INTS,
        "label": VALUES,
        "token": VALUES,
    },
)
BODIES = (
    st.fixed_dictionaries(
        {
            "v": st.just(p.PROTOCOL_VERSION) | VALUES,
            "id": INTS | VALUES,
            "op": st.sampled_from([op.value for op in p.Op]) | VALUES,
            "args": ARGS | VALUES,
        }
    )
    | VALUES
)


def encode(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200) | BODIES.map(encode))
def test_codec_raises_only_protocol_errors(data: bytes) -> None:
    try:
        request = p.decode_request(data)
    except p.ProtocolError:
        return
    for check in (
        p.arg_keys,
        lambda a: p.arg_int_list(a, "slots", 2),
        lambda a: p.arg_int(a, "ns"),
        lambda a: p.decode_message(p.Request(request.id, request.op, a), announced=2),
    ):
        with contextlib.suppress(p.ProtocolError):
            check(request.args)


def test_codec_refuses_allocation_bombs_without_allocating() -> None:
    """An 8 MiB frame of nested empty arrays would decode into ~600 MB of Python lists; the
    codec refuses it having allocated at most 16 frames' worth (a memory bound, not a
    time bound, so a loaded machine cannot make it flaky)."""
    n = p.MAX_FRAME_BYTES - 16
    bombs = [
        b"\xdd" + struct.pack(">I", n) + b"\x90" * n,  # one array of 8M empty arrays
        b"\xdc\xff\xff" + (b"\xdc\xff\xff" + b"\x90" * 120) * 60_000,  # nested: 7M arrays
        b"\x81\xa1a" + b"\x91" * 100_000 + b"\x90",  # deep nesting
    ]
    for bomb in bombs:
        tracemalloc.start()
        try:
            p.unpack(bomb)
            raise AssertionError("a bomb was decoded")
        except p.ProtocolError:
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 16 * p.MAX_FRAME_BYTES, f"decoding a refused bomb allocated {peak} bytes"


class Raw:
    """A raw connection to the server: send bytes, then read a reply frame or a close."""

    def __init__(self, server: Server) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(server.socket)

    def reply(self) -> dict[str, Any] | None:
        """The next reply frame, or None if the server closed the connection."""
        head = self._exactly(4)
        if head is None:
            return None
        body = self._exactly(struct.unpack(">I", head)[0])
        assert body is not None, "the server closed in the middle of a reply"
        reply = p.unpack(body)
        assert reply["v"] == p.PROTOCOL_VERSION and isinstance(reply["ok"], bool)
        return reply

    def _exactly(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def hello_frame() -> bytes:
    args = {"namespace": NS.digest(), "block_bytes": BLOCK, "label": "fuzz"}
    return p.frame(p.request_body(0, p.Op.HELLO, args))


CUTS = st.sampled_from(["whole", "truncated", "length lies", "garbage"])


def test_live_server_survives_fuzzed_frames(server: Server) -> None:
    good = KVKeepClient(server.socket, timeout_s=5)
    session = good.hello(NS, BLOCK)
    mine = keys(8)
    store(good, session, mine)
    baseline = server.rss()

    @settings(
        max_examples=250,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(body=BODIES, cut=CUTS, greet=st.booleans(), junk=st.binary(min_size=1, max_size=64))
    def one(body: Any, cut: str, greet: bool, junk: bytes) -> None:
        raw = Raw(server)
        try:
            if greet:  # a namespace exists on this connection, so handlers run deeper
                raw.sock.sendall(hello_frame())
                assert (raw.reply() or {}).get("ok") is True
            data = encode(body)
            if cut == "whole":
                raw.sock.sendall(struct.pack(">I", len(data)) + data)
                reply = raw.reply()
                assert reply is None or isinstance(reply.get("id"), int)
            else:
                if cut == "truncated":
                    raw.sock.sendall(struct.pack(">I", len(data) + 1) + data[: len(data) // 2])
                elif cut == "length lies":
                    raw.sock.sendall(struct.pack(">I", len(data) + 50) + data)
                else:
                    raw.sock.sendall(junk)
                raw.sock.shutdown(socket.SHUT_WR)
                while raw.reply() is not None:  # an error reply at most, then the close
                    pass
        finally:
            raw.close()
        assert server.alive()
        assert fetch(good, session, mine[:2]) == [payload(k).tobytes() for k in mine[:2]]

    one()
    for oversized in (p.MAX_FRAME_BYTES + 1, 2**32 - 1):
        raw = Raw(server)
        raw.sock.sendall(struct.pack(">I", oversized))
        reply = raw.reply()
        assert reply is not None and reply["error"]["code"] == "frame_too_large"
        assert raw.reply() is None
        raw.close()
    assert server.alive()
    assert server.rss() - baseline < 48 << 20, "the server's private memory grew"
    assert fetch(good, session, mine) == [payload(k).tobytes() for k in mine]
    assert good.stats()["connections"] == 1, "every fuzzing connection was cleaned up"
    ks = keys(100, offset=50_000)  # nothing stayed reserved or pinned: the arena is usable
    assert len(store(good, session, ks)) == 100
    assert server.terminate() == 0, "and it still shuts down cleanly (write-behind alive)"


def test_bombs_and_bad_checksums_against_the_live_server(server: Server) -> None:
    good = KVKeepClient(server.socket, timeout_s=5)
    session = good.hello(NS, BLOCK)
    baseline = server.rss()
    n = p.MAX_FRAME_BYTES - 16
    raw = Raw(server)
    raw.sock.sendall(struct.pack(">I", n + 5) + b"\xdd" + struct.pack(">I", n) + b"\x90" * n)
    reply = raw.reply()
    assert reply is not None and reply["error"]["code"] == "malformed"
    raw.close()
    assert server.rss() - baseline < 48 << 20
    # A slot committed with a checksum that is no u64 (negative, not an int) is refused. One
    # past 32 bits used to kill the write-behind thread (struct.error) when checksums were
    # CRC-32s, after which SIGTERM hung on its queue.
    raw = Raw(server)
    raw.sock.sendall(hello_frame())
    assert (raw.reply() or {}).get("ok")
    key = keys(1, offset=7_000)[0]
    raw.sock.sendall(p.frame(p.request_body(1, p.Op.RESERVE, {"ns": 0, "keys": [key]})))
    ((_, offset),) = (raw.reply() or {})["result"]["slots"]
    for block_checksum in (-1, -(2**63), 1.5):  # any u64 is a checksum
        raw.sock.sendall(
            p.frame(p.request_body(2, p.Op.COMMIT, {"ns": 0, "slots": [[offset, block_checksum]]}))
        )
        assert (raw.reply() or {})["error"]["code"] == "bad_request"
    # The widest checksum is accepted; it is wrong for the slot's bytes, so the writer
    # refuses to persist it (counted), and lives on.
    commit = {"ns": 0, "slots": [[offset, 2**64 - 1]]}
    raw.sock.sendall(p.frame(p.request_body(3, p.Op.COMMIT, commit)))
    assert (raw.reply() or {})["result"]["committed"] == 1
    raw.close()
    deadline = time.monotonic() + 5
    while good.stats()["corrupt_writes"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert good.stats()["corrupt_writes"] == 1
    store(good, session, keys(4))
    assert fetch(good, session, keys(4)) == [payload(k).tobytes() for k in keys(4)]
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(10) == 0
    server.proc = None


def test_many_namespaces_on_one_connection_are_capped(server: Server) -> None:
    raw = Raw(server)
    codes = []
    for i in range(80):
        args = {"namespace": bytes([i]) * 32, "block_bytes": BLOCK, "label": "x"}
        raw.sock.sendall(p.frame(p.request_body(i, p.Op.HELLO, args)))
        reply = raw.reply() or {}
        codes.append("ok" if reply.get("ok") else reply["error"]["code"])
    assert codes[:64] == ["ok"] * 64 and set(codes[64:]) == {"bad_request"}
    raw.sock.sendall(hello_frame())
    raw.sock.sendall(hello_frame())
    raw.close()
