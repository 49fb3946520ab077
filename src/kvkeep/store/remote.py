"""The remote tier: blocks in a Valkey/Redis server (or cluster) shared by many kvkeep servers.

A key is ``PREFIX || store key`` (64 bytes, see ``keyformat``), a value ``"KVB2" | length u32 |
checksum u64 (little-endian) || payload``. Every load checks the payload against its stored
checksum (XXH3-64) while copying it out; a mismatch, or a value of another format
(``VALUE_MAGIC``), is a counted miss and the key is deleted. Capacity belongs to the remote
server (``maxmemory`` with ``allkeys-lru``; ``ttl_s`` optionally bounds a block's life):
kvkeep never deletes blocks to make room.

Failure contract: no method raises for anything the remote store does. An error or a timeout
(``timeout_s``) is a miss counted in ``errors`` and opens a circuit breaker: while open, every
call misses at once. Reads run in the caller's thread; ``put`` copies the block into a bounded
queue for one writer thread, at most ``write_rate_bytes`` per second; a put that finds the
queue full, or the store down, is dropped and counted (``dropped_puts``).
Keys, capacity and the writer in detail: docs/notes/remote-tier.md.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import unquote

from kvkeep.host.background import give_way, start_thread
from kvkeep.store.base import Found, StoreKey, TierCounters, TierStats, copy_checked
from kvkeep.store.keyformat import REMOTE_KEY_PREFIX
from kvkeep.store.throttle import Breaker, TokenBucket

log = logging.getLogger("kvkeep.remote")

VALUE_HEADER = struct.Struct("<4sIQ")
VALUE_MAGIC = b"KVB2"  # the value format, checksum included: "KVB1" held CRC-32s
_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}
_BATCH_BYTES = 8 << 20  # one write pipeline carries at most this much


class WritePolicy(enum.Enum):
    """When blocks reach the remote tier: on commit, or when RAM evicts them."""

    THROUGH = "through"
    ON_EVICT = "evict"


class RemoteEndpoint(NamedTuple):
    """Where the store is: one node, or the seed nodes of a cluster."""

    nodes: tuple[tuple[str, int], ...]
    cluster: bool
    tls: bool
    db: int
    username: str | None
    password: str | None


def parse_remote_url(url: str) -> RemoteEndpoint:
    """``valkey://HOST:PORT[/DB]``, ``redis://...``, ``rediss://`` (TLS), a seed list
    ``valkey://H1:P1,H2:P2`` (a cluster), or ``valkey+cluster://HOST:PORT`` (a cluster from
    one seed). ``user:password@`` may precede the hosts. Raises ValueError saying what to fix.
    """
    scheme, sep, rest = url.partition("://")
    base, _, flavour = scheme.lower().partition("+")
    if not sep or base not in _SCHEMES or flavour not in ("", "cluster"):
        raise ValueError(
            f"bad --remote {url!r}: use valkey://HOST:PORT, redis://HOST:PORT, "
            "a seed list valkey://H1:P1,H2:P2, or valkey+cluster://HOST:PORT"
        )
    userinfo, _, hostpart = rest.rpartition("@")
    hosts, _, db_text = hostpart.partition("/")
    nodes = tuple(_host_port(h, url) for h in hosts.split(","))
    if not db_text.isdigit() and db_text:
        raise ValueError(f"bad --remote {url!r}: the database after '/' must be a number")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    cluster = flavour == "cluster" or len(nodes) > 1
    if cluster and db_text not in ("", "0"):
        raise ValueError(f"bad --remote {url!r}: a cluster has only database 0")
    return RemoteEndpoint(
        nodes,
        cluster,
        _SCHEMES[base],
        int(db_text or 0),
        unquote(username) or None,
        unquote(password) or None,
    )


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad --remote {url!r}: {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class RemoteConfig:
    """A remote tier at ``url`` (see ``parse_remote_url``).

    ``timeout_s`` bounds every socket operation (connect, send, receive): keep it small, a
    miss is cheaper than a stall. ``write_rate_bytes`` is bytes per second sent to the store
    (0: no limit); ``queue_bytes`` bounds blocks waiting to be sent. ``ttl_s`` 0 leaves expiry
    to the server's maxmemory policy. ``known_keys`` bounds the local memory of keys seen in
    the store, which answers ``contains`` without a round trip.
    """

    url: str
    write_policy: WritePolicy = WritePolicy.THROUGH
    timeout_s: float = 0.25
    write_rate_bytes: int = 64 << 20
    queue_bytes: int = 64 << 20
    ttl_s: int = 0
    key_prefix: bytes = REMOTE_KEY_PREFIX
    known_keys: int = 1 << 16
    backoff_s: float = 0.5
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        parse_remote_url(self.url)
        if not 0 < self.timeout_s <= 30:
            raise ValueError(f"--remote-timeout must be in (0, 30] seconds, got {self.timeout_s}")
        if self.write_rate_bytes < 0 or self.ttl_s < 0:
            raise ValueError("--remote-rate and --remote-ttl must be >= 0 (0: no limit)")
        if self.queue_bytes <= 0 or self.known_keys <= 0:
            raise ValueError("queue_bytes and known_keys must be positive")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")

    @property
    def endpoint(self) -> RemoteEndpoint:
        return parse_remote_url(self.url)


def connect(config: RemoteConfig) -> Any:
    """A redis-py client (``Redis`` or ``RedisCluster``) for ``config``. Thread-safe; it
    connects lazily for a single node, eagerly (to learn the slot map) for a cluster.

    redis-py's own retries are turned off: the breaker above it decides when to try again.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    ep = config.endpoint
    common: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "ssl": ep.tls,
        "username": ep.username,
        "password": ep.password,
    }
    if ep.cluster:
        seeds = [ClusterNode(host, port) for host, port in ep.nodes]
        return RedisCluster(startup_nodes=seeds, **common)
    host, port = ep.nodes[0]
    return redis.Redis(host=host, port=port, db=ep.db, **common)


class _RemoteDown(Exception):
    """Internal: the call failed or was refused by the open breaker; the caller misses."""


class _Pending(NamedTuple):
    key: StoreKey
    value: bytes


class KnownKeys:
    """A bounded LRU set of keys recently seen in (or written to) the store. Thread-safe.

    It is a hint: the store may have evicted a key since. Misses it causes are counted where
    the load happens.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[StoreKey, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: StoreKey) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def discard(self, key: StoreKey) -> None:
        with self._lock:
            self._keys.pop(key, None)


def pack_value(data: bytes | memoryview, block_checksum: int) -> bytes:
    """The stored value of a block: header || payload (one copy of ``data``)."""
    return VALUE_HEADER.pack(VALUE_MAGIC, len(data), block_checksum) + bytes(data)


class Value(NamedTuple):
    checksum: int
    payload: memoryview


def unpack_value(raw: bytes) -> Value | None:
    """The checksum and payload of a stored value of this format whose length checks out;
    None otherwise. The payload is not checked against the checksum here (see ``get``)."""
    if len(raw) < VALUE_HEADER.size:
        return None
    magic, length, block_checksum = VALUE_HEADER.unpack_from(raw)
    payload = memoryview(raw)[VALUE_HEADER.size :]
    if magic != VALUE_MAGIC or len(payload) != length:
        return None
    return Value(block_checksum, payload)


class RemoteTier:
    """The shared tier. Thread-safe; never raises for remote failures (see the module doc)."""

    name = "remote"
    parallel_reads = True  # a get is a network round trip: the tiered store overlaps several

    def __init__(
        self, config: RemoteConfig, client_factory: Callable[[RemoteConfig], Any] = connect
    ) -> None:
        self.config = config
        self._factory = client_factory
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._breaker = Breaker(config.backoff_s, config.max_backoff_s)
        # A tenth of a second of traffic may go at once, and a pipeline carries no more, so
        # the rate holds over short windows too (a block larger than that still goes alone).
        burst = config.write_rate_bytes / 10 or _BATCH_BYTES
        self._batch_limit = int(min(burst, _BATCH_BYTES))
        self._bucket = TokenBucket(config.write_rate_bytes, burst)
        self._known = KnownKeys(config.known_keys)
        self._counters = TierCounters()
        self._pending: deque[_Pending] = deque()
        self._pending_bytes = 0
        self._in_flight_bytes = 0
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._writer = start_thread(self._write_loop, "kvkeep-remote")

    # --- Tier protocol ---------------------------------------------------------------------

    def contains(self, key: StoreKey) -> bool:
        """From local knowledge only (keys seen or written lately): no I/O, O(1)."""
        return key in self._known

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Which ``keys`` the store holds, asked in one pipeline. All False if it fails."""
        if not keys:
            return []
        try:
            answers = self._call(lambda c: _pipeline(c, "exists", [self._rkey(k) for k in keys]))
        except _RemoteDown:
            self._counters.misses += len(keys)
            return [False] * len(keys)
        for key, present in zip(keys, answers, strict=True):
            (self._known.add if present else self._known.discard)(key)
        return [bool(a) for a in answers]

    def get(self, key: StoreKey, out: memoryview) -> Found | None:
        try:
            raw = self._call(lambda c: c.get(self._rkey(key)))
        except _RemoteDown:
            raw = None
        value = unpack_value(raw) if raw is not None else None
        if value is None or len(value.payload) > len(out):
            if raw is not None and value is None:
                self._corrupt(key)
            self._miss(key)
            return None
        block_checksum, payload = value
        if not copy_checked(out, payload, block_checksum):
            self._corrupt(key)
            self._miss(key)
            return None
        self._known.add(key)
        self._counters.hits += 1
        self._counters.bytes_out += len(payload)
        return Found(len(payload), block_checksum)

    def put(self, key: StoreKey, data: memoryview, checksum: int) -> bool:
        """Queue a copy of the block for the writer; False (counted) if it is dropped.

        Never blocks on the network: safe to call with another tier's lock held.
        """
        if key in self._known:
            return False
        if not self._breaker.allow():  # down: do not queue what cannot be sent
            self._counters.dropped_puts += 1
            return False
        value = pack_value(data, checksum)
        with self._cond:
            if self._pending_bytes + len(value) > self.config.queue_bytes:
                self._counters.dropped_puts += 1
                return False
            self._pending.append(_Pending(key, value))
            self._pending_bytes += len(value)
            self._cond.notify()
        return True

    def evict(self, key: StoreKey) -> bool:
        """Delete the block from the store (for every server sharing it)."""
        self._known.discard(key)
        try:
            deleted = self._call(lambda c: c.delete(self._rkey(key)))
        except _RemoteDown:
            return False
        self._counters.evictions += int(deleted)
        return bool(deleted)

    def stats(self) -> TierStats:
        """Counters of this server's traffic, plus ``queued_bytes`` not yet sent; ``blocks``
        counts keys known to be stored.

        Occupancy of the store itself is the store's to report (INFO memory): asking it here
        would put a round trip into every metrics scrape.
        """
        with self._cond:
            queued = self._pending_bytes + self._in_flight_bytes
        counters = {**self._counters.as_dict(), "queued_bytes": queued}
        return TierStats(self.name, counters, len(self._known), 0, 0)

    # --- lifecycle -------------------------------------------------------------------------

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write was sent (or dropped). False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending and not self._in_flight_bytes, timeout_s
            )

    def close(self, drain_s: float = 2.0) -> None:
        """Send what the rate allows within ``drain_s``, drop (and count) the rest, disconnect."""
        self.flush(drain_s)
        self._closing.set()
        with self._cond:
            self._counters.dropped_puts += len(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        self._writer.join(drain_s + self.config.timeout_s * 2)
        with self._client_lock, contextlib.suppress(Exception):
            if self._client is not None:
                self._client.close()

    # --- plumbing --------------------------------------------------------------------------

    def _rkey(self, key: StoreKey) -> bytes:
        return self.config.key_prefix + key

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``; raises _RemoteDown (counted) on any failure or an open breaker."""
        if not self._breaker.allow():
            raise _RemoteDown
        try:
            result = fn(self._connected())
        except Exception as exc:  # redis errors, OSError, timeouts, cluster errors: all misses
            self._counters.errors += 1
            if self._breaker.failure():
                log.warning("remote store %s failed (%s): serving misses", self.config.url, exc)
            raise _RemoteDown from exc
        if self._breaker.is_open:
            log.info("remote store %s is back", self.config.url)
        self._breaker.success()
        return result

    def _connected(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._factory(self.config)
            return self._client

    def _miss(self, key: StoreKey) -> None:
        self._known.discard(key)
        self._counters.misses += 1

    def _corrupt(self, key: StoreKey) -> None:
        """Count a value that failed its check and delete it, so nobody loads it again."""
        self._counters.checksum_failures += 1
        with contextlib.suppress(_RemoteDown):
            self._call(lambda c: c.delete(self._rkey(key)))

    def _write_loop(self) -> None:
        give_way()  # never on a request's path: run in the engine's idle moments
        while (batch := self._next_batch()) is not None:
            try:
                self._send(batch)
            finally:
                with self._cond:
                    self._in_flight_bytes = 0
                    self._cond.notify_all()

    def _next_batch(self) -> list[_Pending] | None:
        """Take up to ``_BATCH_BYTES`` of queued writes; None once closing."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closing.is_set())
            if self._closing.is_set():
                return None
            batch: list[_Pending] = []
            size, limit = 0, self._batch_limit
            while self._pending and (not batch or size + len(self._pending[0].value) <= limit):
                item = self._pending.popleft()
                batch.append(item)
                size += len(item.value)
            self._pending_bytes -= size
            self._in_flight_bytes = size
            return batch

    def _send(self, batch: list[_Pending]) -> None:
        """Wait for the rate limit, then SET the batch in one pipeline (drops are counted)."""
        wait = self._bucket.charge(sum(len(p.value) for p in batch))
        if self._closing.wait(wait):
            self._counters.dropped_puts += len(batch)
            return
        items = [(self._rkey(p.key), p.value) for p in batch]
        ttl = self.config.ttl_s or None
        try:
            self._call(lambda c: _pipeline_set(c, items, ttl))
        except _RemoteDown:
            self._counters.dropped_puts += len(batch)
            return
        for item in batch:
            self._known.add(item.key)
            self._counters.bytes_in += len(item.value) - VALUE_HEADER.size


def _pipeline(client: Any, command: str, keys: list[bytes]) -> list[Any]:
    """One command per key, sent in one non-transactional pipeline (works on a cluster)."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        getattr(pipe, command)(key)
    result: list[Any] = pipe.execute()
    return result


def _pipeline_set(client: Any, items: list[tuple[bytes, bytes]], ttl_s: int | None) -> None:
    pipe = client.pipeline(transaction=False)
    for key, value in items:
        pipe.set(key, value, ex=ttl_s)
    pipe.execute()
