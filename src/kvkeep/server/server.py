"""The cache server: one asyncio loop serving the protocol over a TieredStore.

A protocol adapter: it decodes typed requests (``protocol``), turns a connection's namespace
ids and block keys into store keys (``kvkeep.store.keyformat``), calls the store, and encodes
typed replies. Every storage decision and all pin and reservation bookkeeping live behind
``TieredStore``; this module never reaches into a tier.

Every request is handled on the loop thread except ACQUIREs that must read from a lower tier,
and LOOKUPs that may ask the network, which run in a thread pool so a slow disk or remote
store never stalls other requests. A connection owns its namespaces (HELLO) and a store
``Holder`` for its reservations and pins; when it goes away the store drops that holder, so a
crashed engine leaves nothing pinned behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import logging
import os
import secrets
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvkeep.host.background import give_way, start_thread
from kvkeep.server import protocol as p
from kvkeep.server.address import check_socket_path, default_socket_path
from kvkeep.server.namespaces import NamespaceRegistry
from kvkeep.store.base import NullTier, StoreKey, Tier
from kvkeep.store.disk import DiskConfig, DiskTier
from kvkeep.store.keyformat import NamespaceDigest, namespace_digest, store_keys
from kvkeep.store.ram import RamTier
from kvkeep.store.remote import RemoteConfig, RemoteTier, WritePolicy
from kvkeep.store.slots import ArenaConfig, Holder, slot_bytes_for
from kvkeep.store.tiered import TieredStore, WriteBehindConfig

log = logging.getLogger("kvkeep.server")

MAX_NAMESPACES_PER_CONNECTION = 64


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``kvkeep server`` is started with. ``disk_bytes`` 0 turns the disk off."""

    directory: str
    ram_bytes: int
    disk_bytes: int
    socket_path: str | None = None  # default: DIRECTORY/kvkeep.sock (`default_socket_path`)
    listen: tuple[str, int] | None = None
    token: bytes | None = None
    extent_bytes: int = 64 << 20
    queue_depth: int = 256
    shm_dir: str = "/dev/shm"
    remote: RemoteConfig | None = None  # a shared Valkey/Redis tier below RAM and disk

    def __post_init__(self) -> None:
        if self.listen is not None and not self.token:
            raise ValueError("--listen needs --token-file: TCP connections must authenticate")
        if self.socket_path is not None:
            check_socket_path(self.socket_path)

    @property
    def effective_socket_path(self) -> str:
        return self.socket_path or default_socket_path(self.directory)


@dataclass(frozen=True)
class _Namespace:
    digest: NamespaceDigest  # the client's digest and block_bytes together
    block_bytes: int
    label: str


@dataclass
class _Connection:
    """What one client connection owns: its namespaces, and (through ``holder``) its
    reservations and pins in the store."""

    authenticated: bool
    holder: Holder
    namespaces: list[_Namespace] = field(default_factory=list)


class CacheServer:
    """Owns the store and the listeners. ``run()`` returns after SIGTERM has flushed."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.instance = secrets.token_hex(8)
        Path(config.directory).mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(Path(config.directory))
        self.store = TieredStore(self._make_ram(), self._make_lower(), self._write_config())
        self.connections = 0
        self._io_pool = ThreadPoolExecutor(4, thread_name_prefix="kvkeep-io")
        self.namespaces = NamespaceRegistry(
            Path(config.directory) / "namespaces.json",
            self.store.namespace_blocks,
        )
        self._stop = asyncio.Event()
        self._arena_ready = False  # the prefault thread has allocated and mapped the arena

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then flush pending writes and clean up."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        start_thread(self._prefault, "kvkeep-prefault")
        servers = [await self._start_unix()]
        if self.config.listen is not None:
            host, port = self.config.listen
            servers.append(await asyncio.start_server(self._tcp_client, host, port))
        log.info(
            "kvkeep server ready: instance %s socket %s",
            self.instance,
            self.config.effective_socket_path,
        )
        print(f"kvkeep server ready socket={self.config.effective_socket_path}", flush=True)
        await self._stop.wait()
        for server in servers:
            server.close()
        self.shutdown()

    def _prefault(self) -> None:
        # At idle priority, as write-through: on a CPU engine's cores, allocating and mapping
        # a GiB takes a few tenths of a second the forward would lose. Until it is done, a
        # promotion into a page not yet mapped faults it in (slower, never wrong).
        give_way()
        try:
            self.store.prefault()
            self._arena_ready = True
        except OSError as exc:
            log.warning("could not allocate the arena up front (%s): is /dev/shm big enough?", exc)

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Flush write-behind, seal the disk tier, remove the arena and the socket."""
        self.store.close()
        Path(self.config.effective_socket_path).unlink(missing_ok=True)
        os.close(self._lock_fd)

    async def _start_unix(self) -> asyncio.AbstractServer:
        path = self.config.effective_socket_path
        Path(path).unlink(missing_ok=True)  # the directory lock proves no server owns it
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others connect
        try:
            return await asyncio.start_unix_server(self._unix_client, path)
        finally:
            os.umask(old_umask)

    def _make_ram(self) -> RamTier:
        extent = min(self.config.extent_bytes, self.config.ram_bytes // 4096 * 4096)
        arena_config = ArenaConfig(self.config.ram_bytes, extent, self.config.shm_dir)
        marker = Path(self.config.directory) / "arena.path"
        if marker.exists():  # the arena of a server that was killed: nobody else owns it
            Path(marker.read_text().strip()).unlink(missing_ok=True)
        path = str(Path(self.config.shm_dir) / f"kvkeep-{self.instance}")
        marker.write_text(path)
        return RamTier(arena_config, path)

    def _make_lower(self) -> list[Tier]:
        """Disk (or its null stand-in) first, then the remote tier when one is configured."""
        remote = self.config.remote
        return [self._make_disk(), *([RemoteTier(remote)] if remote else [])]

    def _make_disk(self) -> Tier:
        if self.config.disk_bytes == 0:
            return NullTier("disk")
        disk_dir = str(Path(self.config.directory) / "disk")
        disk = DiskTier(DiskConfig(disk_dir, self.config.disk_bytes))
        log.info(
            "disk index rebuilt: %d blocks in %.3f s", disk.stats().blocks, disk.rebuild_seconds
        )
        return disk

    def _write_config(self) -> WriteBehindConfig:
        remote = self.config.remote
        spill = remote is not None and remote.write_policy is WritePolicy.ON_EVICT
        on_evict = frozenset({RemoteTier.name}) if spill else frozenset()
        return WriteBehindConfig(self.config.queue_depth, on_evict)

    # --- connections -----------------------------------------------------------------------

    async def _unix_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await self._serve(reader, writer, _Connection(True, self.store.holder()))

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await self._serve(reader, writer, _Connection(False, self.store.holder()))

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Connection
    ) -> None:
        self.connections += 1
        try:
            while await self._serve_one(reader, writer, conn):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except Exception:  # a bug must cost this connection, never the server
            log.exception("closing a connection after an unexpected error")
        finally:
            self.connections -= 1
            self.store.drop(conn.holder)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_one(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Connection
    ) -> bool:
        """Read, handle and answer one request. False: the connection must close."""
        request_id = 0
        try:
            (length,) = p.FRAME_HEADER.unpack(await reader.readexactly(p.FRAME_HEADER.size))
            p.check_frame_length(length)
            request = p.decode_request(await reader.readexactly(length))
            request_id = request.id
            reply = p.ok_reply(request.id, (await self._dispatch(conn, request)).encode())
        except p.ProtocolError as exc:
            reply = p.error_reply(request_id, exc)
            writer.write(p.frame(reply))
            await writer.drain()
            return exc.code not in p.FATAL_CODES
        writer.write(p.frame(reply))
        await writer.drain()
        return True

    # --- operations ------------------------------------------------------------------------

    async def _dispatch(self, conn: _Connection, request: p.Request) -> p.ReplyMessage:
        if request.op is not p.Op.AUTH and not conn.authenticated:
            raise p.ProtocolError(p.ErrorCode.UNAUTHORIZED, "send AUTH with the server token first")
        message = p.decode_message(request, len(conn.namespaces))
        match message:
            case p.AcquireRequest():
                return await self._acquire(conn, message)
            case p.LookupRequest():
                return await self._lookup(conn, message)
            case p.AuthRequest():
                return self._auth(conn, message)
            case p.HelloRequest():
                return self._hello(conn, message)
            case p.ReserveRequest():
                return self._reserve(conn, message)
            case p.CommitRequest():
                return self._commit(conn, message)
            case p.ReleaseRequest():
                return self._release(conn, message)
            case p.StatsRequest():
                return p.StatsReply(self.stats(integrity=message.integrity))
            case p.TouchRequest():
                self.store.touch(self._keys(conn, message)[1])
                return p.EmptyReply()
        raise AssertionError(f"no handler for {request.op}")  # decode_message covers every op

    def _auth(self, conn: _Connection, request: p.AuthRequest) -> p.EmptyReply:
        token = request.token
        if self.config.token is not None and not hmac.compare_digest(token, self.config.token):
            raise p.ProtocolError(p.ErrorCode.UNAUTHORIZED, "wrong token")
        conn.authenticated = True
        return p.EmptyReply()

    def _hello(self, conn: _Connection, request: p.HelloRequest) -> p.HelloReply:
        arena = self.store.arena
        max_block = arena.max_block_bytes
        if not 0 < slot_bytes_for(request.block_bytes) <= max_block:
            raise p.ProtocolError(
                p.ErrorCode.BLOCK_TOO_LARGE,
                f"blocks of {request.block_bytes} bytes do not fit this server (max "
                f"{max_block}); restart it with more --ram",
            )
        digest = namespace_digest(request.namespace, request.block_bytes)
        ns = _Namespace(digest, request.block_bytes, request.label)
        if ns not in conn.namespaces:
            if len(conn.namespaces) >= MAX_NAMESPACES_PER_CONNECTION:
                raise p.ProtocolError(
                    p.ErrorCode.BAD_REQUEST,
                    f"more than {MAX_NAMESPACES_PER_CONNECTION} namespaces on one connection",
                )
            conn.namespaces.append(ns)
            self._io_pool.submit(
                self.namespaces.announce, digest, request.namespace, ns.label, ns.block_bytes
            )
        tiers = tuple(t.name for t in self.store.tiers)
        index = conn.namespaces.index(ns)
        return p.HelloReply(index, self.instance, arena.path, arena.size, tiers, max_block)

    def _keys(self, conn: _Connection, request: p.KeysRequest) -> tuple[_Namespace, list[StoreKey]]:
        ns = conn.namespaces[request.ns]  # decode_message checked it was announced
        return ns, store_keys(ns.digest, request.keys)

    async def _lookup(self, conn: _Connection, request: p.LookupRequest) -> p.LookupReply:
        """On the loop thread, unless a tier may ask the network (then in the I/O pool, so a
        slow remote store delays only this lookup)."""
        _, keys = self._keys(conn, request)
        if self.store.may_block:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(self._io_pool, self.store.lookup, keys)
        else:
            found = self.store.lookup(keys)
        return p.LookupReply(found.num_present, found.tiers)

    def _reserve(self, conn: _Connection, request: p.ReserveRequest) -> p.ReserveReply:
        ns, keys = self._keys(conn, request)
        reserved = self.store.reserve_missing(keys, ns.block_bytes, conn.holder)
        return p.ReserveReply(tuple(p.ReservedSlot(r.key_index, r.offset) for r in reserved))

    def _commit(self, conn: _Connection, request: p.CommitRequest) -> p.CommitReply:
        store, holder = self.store, conn.holder
        return p.CommitReply(sum(store.commit(s.offset, s.checksum, holder) for s in request.slots))

    async def _acquire(self, conn: _Connection, request: p.AcquireRequest) -> p.AcquireReply:
        """RAM hits are pinned on the loop thread; the rest, if a lower tier holds the next
        key, in the I/O pool (so a slow disk delays only this request)."""
        ns, keys = self._keys(conn, request)
        pinned = self.store.acquire_resident(keys, conn.holder)
        rest = keys[len(pinned) :]
        if rest and self.store.held_below(rest[0]):
            loop = asyncio.get_running_loop()
            pinned += await loop.run_in_executor(
                self._io_pool, self.store.acquire_below, rest, ns.block_bytes, conn.holder
            )
        return p.AcquireReply(tuple(p.ChecksummedSlot(o, c) for o, _, c in pinned))

    def _release(self, conn: _Connection, request: p.ReleaseRequest) -> p.EmptyReply:
        """Unpin or abandon ``slots``. ``corrupt`` names pinned slots whose bytes failed the
        client's checksum: each is re-checked here and, if its bytes really are bad and no
        one else reads it, dropped, so the engine's next save replaces it (otherwise it
        would stay a miss for good: a save skips keys already held)."""
        self.store.release_many(request.slots, conn.holder)
        for offset in request.corrupt:
            if self.store.discard_corrupt(offset):
                log.warning("dropped a block whose bytes in RAM failed a client's checksum")
        return p.EmptyReply()

    def stats(self, integrity: bool = False) -> dict[str, Any]:
        """The store's stats, this process's instance, open connections and ``arena_ready``
        (the arena is allocated and mapped: promotions run at full speed), and the CPU
        seconds this process has used (``cpu_s``), of which the thread that answers requests
        (``rpc_cpu_s``; the rest is write-through and start-up); with ``integrity``, also
        every problem ``check_integrity`` finds (O(slots)). Called on the event loop."""
        times = os.times()
        stats = {
            **self.store.stats(),
            "instance": self.instance,
            "connections": self.connections,
            "arena_ready": self._arena_ready,
            "cpu_s": times.user + times.system,
            "rpc_cpu_s": time.thread_time(),
        }
        if integrity:
            stats["integrity"] = self.store.check_integrity()
        return stats


def _lock_directory(directory: Path) -> int:
    """Hold an exclusive lock on DIRECTORY/server.lock for the process lifetime."""
    fd = os.open(directory / "server.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"another kvkeep server is using {directory}") from None
    return fd
