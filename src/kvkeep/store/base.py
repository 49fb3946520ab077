"""The Tier protocol every storage tier implements, and the types tiers share."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

import xxhash

from kvkeep.store.keyformat import StoreKey

__all__ = [
    "CHECKSUM_BITS",
    "Found",
    "NullTier",
    "StoreKey",
    "Tier",
    "TierCounters",
    "TierStats",
    "checksum",
    "copy_checked",
]


CHECKSUM_BITS = 64
"""Width of a block checksum: every stored and wire checksum is an unsigned int below 2**64."""

CHECKSUM_NAME = "xxh3_64"

_CHUNK_BYTES = 256 << 10  # copy_checked's step: stays in L2 between its copy and its hash


def checksum(data: bytes | memoryview) -> int:
    """The checksum of a block's bytes: XXH3-64 (``xxhash``), the one function every tier,
    the server, the client and the connector call. Pure; releases the GIL on large inputs.

    It catches torn writes, truncation, bit rot and blocks swapped between slots, which is
    what it is for here (the cache is not defended against an adversary that can write to
    its files). Measured on this machine over 1 MiB blocks: XXH3-64 ~35 GB/s, google-crc32c
    ~17 GB/s, zlib's CRC-32 ~7 GB/s (the old checksum), memcpy ~20 GB/s. Every persisted
    value that holds a checksum names this choice by a format version (disk ``VERSION``,
    remote ``VALUE_MAGIC``, ``KEY_FORMAT_VERSION``) and the wire by ``PROTOCOL_VERSION``.
    """
    return xxhash.xxh3_64_intdigest(data)


def copy_checked(dst: memoryview, src: memoryview, expected: int) -> bool:
    """Copy ``src`` into the front of ``dst``; whether the bytes copied have ``checksum``
    ``expected``. Mutates ``dst`` whatever the answer; ``dst`` must be at least as long.

    One pass over memory instead of two: each 256 KiB chunk is hashed from ``dst`` right
    after it is copied, while it is still in cache, so a verified copy costs about what a
    plain copy does. The result equals ``checksum(dst[:len(src)]) == expected``.
    """
    digest = xxhash.xxh3_64()
    for start in range(0, len(src), _CHUNK_BYTES):
        end = min(start + _CHUNK_BYTES, len(src))
        dst[start:end] = src[start:end]
        digest.update(dst[start:end])
    return digest.intdigest() == expected


class Found(NamedTuple):
    """A tier hit: how many bytes were copied and their checksum."""

    length: int
    checksum: int


@dataclass
class TierCounters:
    """Cumulative counters of one tier. Mutated only by the tier that owns them."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    rejected_puts: int = 0
    write_errors: int = 0  # failed writes to the medium (e.g. a full filesystem)
    errors: int = 0  # calls to another process (the remote store) that failed or timed out
    dropped_puts: int = 0  # writes given up: queue full, rate limit backlog, or store down
    read_ns: int = 0  # reading blocks from the medium, summed over threads (disk)
    verify_ns: int = 0  # checksumming loaded blocks, summed over threads (disk)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TierStats(NamedTuple):
    """A snapshot of one tier: counters plus current occupancy."""

    name: str
    counters: dict[str, int]
    blocks: int
    bytes_used: int
    capacity_bytes: int

    def as_dict(self) -> dict[str, int]:
        occupancy = {
            "blocks": self.blocks,
            "bytes_used": self.bytes_used,
            "capacity_bytes": self.capacity_bytes,
        }
        return {**self.counters, **occupancy}


class Tier(Protocol):
    """One level of storage. Implementations are thread-safe.

    Tiers are kept in an ordered list, fastest first; the tiered store never asks which
    concrete class a tier is, except that the first tier is the shared-memory arena.

    Optional: ``parallel_reads = True`` says a ``get`` is mostly waiting (a network round
    trip): the tiered store then runs several at once. Others are read one after another in
    the order asked, which for the disk is file order (see ``TieredStore.acquire_below``).

    Optional: ``contains_many(keys) -> list[bool]`` answers many ``contains`` at once (one
    round trip). A tier whose ``contains`` can only answer from local hints (the remote tier)
    implements it; the tiered store calls it at most once per lookup, with the keys from the
    first one no faster tier holds to the end. It blocks on I/O and never raises: a failure
    is all False.
    """

    name: str

    def contains(self, key: StoreKey) -> bool:
        """Whether ``get`` would probably hit. No side effects, never raises, O(1)."""
        ...

    def get(self, key: StoreKey, out: memoryview) -> Found | None:
        """Copy the block's bytes into the front of ``out``; ``None`` on a miss.

        A block whose checksum fails is a miss: it is counted, removed, and never returned.
        A block longer than ``out`` is a miss. Counts a hit or a miss.
        """
        ...

    def put(self, key: StoreKey, data: memoryview, checksum: int) -> bool:
        """Store a copy of ``data`` (whose ``checksum()`` is ``checksum``); may evict others.

        Returns False (and stores nothing) when the block can never fit or the key is already
        stored. Idempotent per key.
        """
        ...

    def evict(self, key: StoreKey) -> bool:
        """Remove the block; False if it was absent or is in use. Evicting 0 blocks is safe."""
        ...

    def stats(self) -> TierStats:
        """A consistent snapshot of counters and occupancy."""
        ...


class NullTier:
    """A tier that holds nothing: used where a level is configured off (``--disk 0``)."""

    def __init__(self, name: str = "null") -> None:
        self.name = name

    def contains(self, key: StoreKey) -> bool:
        return False

    def get(self, key: StoreKey, out: memoryview) -> Found | None:
        return None

    def put(self, key: StoreKey, data: memoryview, checksum: int) -> bool:
        return False

    def evict(self, key: StoreKey) -> bool:
        return False

    def stats(self) -> TierStats:
        return TierStats(self.name, TierCounters().as_dict(), 0, 0, 0)
