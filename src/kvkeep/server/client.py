"""The synchronous client the connector uses inside vLLM processes.

Contract: every call either returns within ``timeout_s`` or raises ``CacheUnavailable``;
nothing here hangs or raises anything else for a server that is down, slow, stopped,
restarted or answering with an error (or garbage). ``timeout_s`` is one deadline for the
whole call: waiting for another thread's call on this client, connecting, AUTH, HELLO and the
request itself all come out of it. Construction never touches the network: the connection is made on
first use and re-made after a failure, no sooner than an exponential backoff allows (calls
during the backoff fail at once, so a hot path falls back to recompute cheaply).

Sessions are local values. The client announces a session's namespace with HELLO on each new
connection before its first use, so a server restart is invisible except that slots handed
out by the old instance become invalid (``slot_view`` refuses them) and the arena is re-mapped.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np

from kvkeep.keys import BlockKey, Namespace
from kvkeep.server import protocol as p
from kvkeep.server.arenamap import ArenaMap, retire, shared_map
from kvkeep.store.base import checksum
from kvkeep.store.slots import Offset


class CacheUnavailable(Exception):
    """The cache could not serve this call: down, timed out, disconnected, or refused it."""


class _StaleConnection(CacheUnavailable):
    """The connection was closed by the other side since it was last used."""


class CacheRefused(CacheUnavailable):
    """The server answered with an error; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Session:
    """A namespace and its block size, as this client will announce them to the server."""

    digest: bytes
    block_bytes: int
    label: str = ""


class SlotRef(NamedTuple):
    """An arena slot handed out by ``instance``: ``length`` bytes at ``offset``."""

    key: BlockKey
    offset: Offset
    length: int
    checksum: int
    instance: str


class LookupResult(NamedTuple):
    """``num_present`` leading keys are cached; ``tiers[i]`` names key i's tier."""

    num_present: int
    tiers: tuple[str, ...]


class _Arena(NamedTuple):
    instance: str
    map: mmap.mmap | None  # None for a client made with map_arena=False
    tiers: tuple[str, ...]
    shared: ArenaMap | None  # keeps the process's mapping alive while this client uses it


class KVKeepClient:
    """Thread-safe (one lock around the connection); one connection per client."""

    def __init__(
        self,
        socket_path: str | None = None,
        address: tuple[str, int] | None = None,
        token: bytes | None = None,
        timeout_s: float = 2.0,
        max_backoff_s: float = 5.0,
        map_arena: bool = True,
    ) -> None:
        """``map_arena`` False: a client that only looks keys up (vLLM's scheduler) and never
        maps the server's arena; each mapping is populated, a page-table entry per 4 KiB page
        of the whole arena, so one more per engine costs memory and CPU for nothing."""
        if (socket_path is None) == (address is None):
            raise ValueError("give exactly one of socket_path and address")
        self.socket_path, self.address, self.token = socket_path, address, token
        self.timeout_s, self.max_backoff_s = timeout_s, max_backoff_s
        self.map_arena = map_arena
        self._lock = threading.RLock()
        self._depth = 0  # nesting of _op() in the thread holding the lock
        self._deadline = 0.0  # of the outermost call in progress
        self._sock: socket.socket | None = None
        self._ns_ids: dict[Session, int] = {}
        self._arena: _Arena | None = None
        self._next_id = 0
        self._unanswered: list[int] = []  # ids of requests sent without waiting, in order
        self._failures = 0
        self._retry_at = 0.0

    def sibling(self) -> KVKeepClient:
        """A new client to the same server with the same settings and its own connection (so
        a background thread's calls never wait for this client's lock). No I/O."""
        return KVKeepClient(
            self.socket_path,
            self.address,
            self.token,
            self.timeout_s,
            self.max_backoff_s,
            self.map_arena,
        )

    # --- sessions ----------------------------------------------------------------------------

    @staticmethod
    def session(namespace: Namespace | bytes, block_bytes: int, label: str = "") -> Session:
        """A session value; no I/O. Use it where the server may be down."""
        digest = namespace.digest() if isinstance(namespace, Namespace) else namespace
        return Session(digest, block_bytes, label)

    def hello(self, namespace: Namespace | bytes, block_bytes: int, label: str = "") -> Session:
        """Announce a namespace now; raises CacheRefused if the server cannot hold its blocks."""
        session = self.session(namespace, block_bytes, label)
        with self._op():
            self._ns_id(session)
        return session

    # --- operations --------------------------------------------------------------------------

    def lookup(self, session: Session, keys: Sequence[BlockKey]) -> LookupResult:
        """How many leading ``keys`` are cached, and where. Refreshes the RAM hits' recency."""
        with self._op():
            reply = self._call_ns(session, lambda ns: p.LookupRequest(tuple(keys), ns))
            names = self._arena.tiers if self._arena else ()
            with self._parsing(p.Op.LOOKUP):
                found = p.LookupReply.decode(reply)
                return LookupResult(found.num_present, tuple(map(names.__getitem__, found.tiers)))

    def touch(self, session: Session, keys: Sequence[BlockKey]) -> None:
        """Refresh the recency of the ``keys`` the server's RAM holds, ``keys[0]`` most (for
        blocks the engine serves from its own pool, so they stay in kvkeep's RAM too)."""
        with self._op():
            self._call_ns(session, lambda ns: p.TouchRequest(tuple(keys), ns))

    def reserve(self, session: Session, keys: Sequence[BlockKey]) -> list[SlotRef]:
        """Slots to write blocks into, for keys not stored yet (others are skipped).

        Fewer slots than keys: some were already stored, or the arena is full of pinned
        blocks. Write each slot's bytes with ``slot_view`` then ``commit`` (or ``release``).
        """
        with self._op():
            reply = self._call_ns(session, lambda ns: p.ReserveRequest(tuple(keys), ns))
            with self._parsing(p.Op.RESERVE):
                slots = p.ReserveReply.decode(reply).slots
                return [self._slot(keys[s.key_index], s.offset, session, 0) for s in slots]

    def commit(self, session: Session, slots: Sequence[SlotRef], checksums: Sequence[int]) -> int:
        """Publish written slots, each with the checksum of the bytes its writer meant to put
        there, taken from the writer's source, never read back from the slot: another writer
        can reach a slot whose reservation was lost, and a checksum of the slot would cover
        its bytes. Returns how many were published (a slot no longer reserved by this
        connection is not)."""
        rows = tuple(p.ChecksummedSlot(s.offset, c) for s, c in zip(slots, checksums, strict=True))
        with self._op():
            reply = self._call_ns(session, lambda ns: p.CommitRequest(rows, ns))
            with self._parsing(p.Op.COMMIT):
                return p.CommitReply.decode(reply).committed

    def acquire(self, session: Session, keys: Sequence[BlockKey]) -> list[SlotRef]:
        """Pin the leading cached blocks for reading (promoted from disk if needed).

        Fewer slots than keys means the rest missed. Release every slot returned.
        """
        with self._op():
            reply = self._call_ns(session, lambda ns: p.AcquireRequest(tuple(keys), ns))
            with self._parsing(p.Op.ACQUIRE):
                rows = p.uint_pairs(reply["slots"])  # checked [offset, checksum] rows
                assert self._arena is not None
                length, instance = session.block_bytes, self._arena.instance
                # one tuple a slot and no call: a 7,200-block load's reply is read on the step
                return [
                    SlotRef(k, o, length, c, instance)
                    for k, (o, c) in zip(keys, rows, strict=False)
                ]

    def release(
        self, slots: Sequence[SlotRef], corrupt: Sequence[SlotRef] = (), wait: bool = True
    ) -> None:
        """Unpin acquired slots or abandon reserved ones. Slots of a dead instance are ignored.

        ``corrupt``: acquired slots among ``slots`` that failed ``verify``; the server checks
        them again and drops those whose bytes are bad, so a later save can replace them.

        ``wait`` False sends the request and returns without waiting for the reply: a load on
        the engine's step does not wait a round trip to let go of its pins. The server acts on
        it at once, in order with this connection's other requests; the reply is read before
        the next call on this client. Nothing depends on it: a connection that closes drops
        its pins anyway.
        """
        with self._op():
            live = [s.offset for s in slots if self._arena and s.instance == self._arena.instance]
            if live and self._sock is not None:
                bad = tuple(s.offset for s in corrupt if s.offset in live)
                request = p.ReleaseRequest(tuple(live), bad)
                if wait:
                    self._call(request)
                else:
                    self._send(request)

    def stats(self, integrity: bool = False) -> dict[str, Any]:
        """The server's stats map; with ``integrity``, also ``integrity``: the problems the
        server's arena accounting check finds ([] when sound; O(slots), for tests)."""
        reply = self._retrying(lambda: self._call(p.StatsRequest(integrity)))
        return p.StatsReply.decode(reply).stats

    def slot_view(self, slot: SlotRef) -> np.ndarray:
        """A writable uint8 view of the slot's bytes in the shared arena (no copy)."""
        arena = self._arena
        if not self.map_arena:
            raise RuntimeError("this client was made with map_arena=False: it has no slot views")
        if arena is None or arena.map is None or arena.instance != slot.instance:
            raise CacheUnavailable("slot belongs to a server instance that is gone")
        return np.frombuffer(arena.map, dtype=np.uint8, count=slot.length, offset=slot.offset)

    def arena_mapping(self) -> tuple[str, mmap.mmap] | None:
        """The server instance whose arena is mapped now, and the map (None before the first
        call that reached a server). A restarted server brings a new instance and map."""
        arena = self._arena
        return (arena.instance, arena.map) if arena is not None and arena.map is not None else None

    def arena(self) -> ArenaMap | None:
        """The arena mapping of the server instance seen last (None before the first call
        that reached a server, or without ``map_arena``)."""
        arena = self._arena
        return arena.shared if arena is not None else None

    def wait_populated(self, timeout_s: float) -> bool:
        """Whether the arena's background populate (``kvkeep.server.arenamap``) ended within
        ``timeout_s``; False with no arena mapped."""
        arena = self._arena
        return (
            arena is not None
            and arena.shared is not None
            and arena.shared.populated.wait(timeout_s)
        )

    def _buffer(self, slot: SlotRef) -> memoryview:
        view = self.slot_view(slot)
        return view.data  # the ndarray's own buffer: no copy

    def verify(self, slot: SlotRef) -> bool:
        """Whether the slot's bytes still match the checksum the server gave with it."""
        return checksum(self._buffer(slot)) == slot.checksum

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    # --- plumbing ----------------------------------------------------------------------------

    def _slot(
        self, key: BlockKey, offset: Offset, session: Session, block_checksum: int
    ) -> SlotRef:
        assert self._arena is not None
        return SlotRef(key, offset, session.block_bytes, block_checksum, self._arena.instance)

    def _call_ns(
        self, session: Session, request: Callable[[int], p.RequestMessage]
    ) -> dict[str, Any]:
        """``request(ns)``'s reply, ``ns`` being the session's id on the connection used."""
        return self._retrying(lambda: self._call(request(self._ns_id(session))))

    def _ns_id(self, session: Session) -> int:
        self._ensure_connected()
        if session not in self._ns_ids:
            request = p.HelloRequest(session.digest, session.block_bytes, session.label)
            result = self._call(request)
            with self._parsing(p.Op.HELLO):
                reply = p.HelloReply.decode(result)
                self._map_arena(reply)
                self._ns_ids[session] = reply.ns
        return self._ns_ids[session]

    def _map_arena(self, reply: p.HelloReply) -> None:
        if self._arena is not None and self._arena.instance == reply.instance:
            return
        if not self.map_arena:
            self._arena = _Arena(reply.instance, None, reply.tiers, None)
            return
        try:
            shared = shared_map(reply.arena_path, reply.instance, reply.arena_bytes)
        except OSError as exc:
            raise CacheUnavailable(f"cannot map the arena: {exc}") from exc
        # The old mapping is dropped in the background (unmapping a populated arena takes a
        # tenth of a second per GiB); views of it may still be alive, and keep it until then.
        if self._arena is not None and self._arena.shared is not None:
            retire(self._arena.shared, self._arena)
        self._arena = _Arena(reply.instance, shared.map, reply.tiers, shared)

    @contextlib.contextmanager
    def _parsing(self, op: p.Op) -> Iterator[None]:
        """Turn a reply of the wrong shape into CacheUnavailable (and a fresh connection)."""
        try:
            yield
        except (p.ProtocolError, KeyError, IndexError, TypeError, ValueError, OSError) as exc:
            self._fail()
            raise CacheUnavailable(f"{op.value}: malformed reply: {exc!r}") from exc

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        """Hold the connection for one call; the outermost call sets the deadline for all."""
        deadline = time.monotonic() + self.timeout_s
        if not self._lock.acquire(timeout=self.timeout_s):
            raise CacheUnavailable("timed out waiting for another call on this client")
        try:
            if self._depth == 0:
                self._deadline = deadline
            self._depth += 1
            yield
        finally:
            self._depth -= 1
            self._lock.release()

    def _remaining(self) -> float:
        """Seconds left of the current call; raises TimeoutError when none are."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    def _send(self, request: p.RequestMessage) -> None:
        """Send ``request`` on the open connection and leave its reply for the next call. For
        requests whose purpose a closed connection fulfils (RELEASE: the server drops a
        connection's pins): a connection found closed is dropped, nothing raised, and the
        next call connects again at once (a restarted server is no reason to back off)."""
        op = request.OP
        with self._op():
            sock = self._sock
            if sock is None:
                return
            self._next_id += 1
            try:
                sock.settimeout(self._remaining())
                sock.sendall(p.frame(p.request_body(self._next_id, op, request.encode())))
            except ConnectionError:
                self._disconnect()
                return
            except (OSError, ValueError) as exc:
                self._fail()
                raise CacheUnavailable(f"{op.value} failed: {exc}") from exc
            self._unanswered.append(self._next_id)

    def _read_unanswered(self, sock: socket.socket) -> None:
        """Read the replies of requests sent without waiting (``_send``). A refusal there
        is no caller's business; one that ends the connection does end it."""
        while self._unanswered:
            expected = self._unanswered[0]
            reply = self._read_reply(sock)
            del self._unanswered[0]
            if reply.get("id") != expected or reply.get("v") != p.PROTOCOL_VERSION:
                raise ValueError("reply out of step with the request")
            error = reply.get("error")
            fatal = {c.value for c in p.FATAL_CODES}
            if not reply.get("ok") and isinstance(error, dict) and error.get("code") in fatal:
                raise ConnectionError(f"the server ended the connection: {error}")

    def _call(self, request: p.RequestMessage) -> dict[str, Any]:
        """The result map of ``request``'s reply (decode it with its reply type)."""
        op = request.OP
        with self._op():
            reused = self._sock is not None
            sock = self._ensure_connected()
            try:
                self._read_unanswered(sock)
                self._next_id += 1
                sock.settimeout(self._remaining())
                sock.sendall(p.frame(p.request_body(self._next_id, op, request.encode())))
                reply = self._read_reply(sock)
                return self._result(reply, op)
            except ConnectionError as exc:
                if reused:  # the server went away since the last call: it may be back already
                    self._disconnect()
                    raise _StaleConnection(f"{op.value}: connection was closed: {exc}") from exc
                self._fail()
                raise CacheUnavailable(f"{op.value} failed: {exc}") from exc
            except (OSError, ValueError, msgpack.UnpackException, p.ProtocolError) as exc:
                self._fail()
                raise CacheUnavailable(f"{op.value} failed: {exc}") from exc

    def _retrying(self, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``call``; if it found its connection closed, once more on a fresh one.

        A restarted server closes every old connection. Without this, the first call after
        any server restart would fail and back off, costing a miss per restart.
        """
        with self._op():
            try:
                return call()
            except _StaleConnection:
                return call()

    def _result(self, reply: dict[str, Any], op: p.Op) -> dict[str, Any]:
        if reply.get("id") != self._next_id or reply.get("v") != p.PROTOCOL_VERSION:
            raise ValueError("reply out of step with the request")
        if not reply.get("ok"):
            error = reply.get("error")
            error = error if isinstance(error, dict) else {}
            if error.get("code") in {c.value for c in p.FATAL_CODES}:
                self._disconnect()
            raise CacheRefused(str(error.get("code")), str(error.get("message")))
        result = reply.get("result")
        if not isinstance(result, dict):
            raise ValueError("a reply without a result map")
        return result

    def _read_reply(self, sock: socket.socket) -> dict[str, Any]:
        header = _recv_exactly(sock, p.FRAME_HEADER.size, self._remaining)
        (length,) = p.FRAME_HEADER.unpack(header)
        if length > p.MAX_FRAME_BYTES:
            raise ValueError(f"reply frame of {length} bytes")
        return p.unpack(_recv_exactly(sock, length, self._remaining))

    def _ensure_connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if time.monotonic() < self._retry_at:
            raise CacheUnavailable("server unreachable (backing off)")
        try:
            self._sock = self._connect()
        except OSError as exc:
            self._fail()
            raise CacheUnavailable(f"cannot connect: {exc}") from exc
        self._failures = 0
        if self.token is not None:
            self._call(p.AuthRequest(self.token))
        return self._sock

    def _connect(self) -> socket.socket:
        if self.socket_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = self.socket_path
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            target = self.address
        try:
            sock.settimeout(self._remaining())
            sock.connect(target)
        except OSError:
            sock.close()
            raise
        return sock

    def _fail(self) -> None:
        self._disconnect()
        self._failures += 1
        self._retry_at = time.monotonic() + min(0.05 * 2**self._failures, self.max_backoff_s)

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._ns_ids.clear()
        self._unanswered.clear()


def _recv_exactly(sock: socket.socket, count: int, remaining: Callable[[], float]) -> bytes:
    """``count`` bytes, each wait bounded by what is left of the call's deadline."""
    buf = bytearray(count)
    view, got = memoryview(buf), 0
    while got < count:
        sock.settimeout(remaining())
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("server closed the connection")
        got += n
    return bytes(buf)
