"""The Tier protocol every storage tier implements, and the types tiers share."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

from kvkeep.store.keyformat import StoreKey

__all__ = ["Found", "NullTier", "StoreKey", "Tier", "TierCounters", "TierStats", "checksum"]


def checksum(data: bytes | memoryview) -> int:
    """CRC-32 (zlib) of a block's bytes.

    CRC-32 catches torn writes, truncation and bit rot, which is what it is for here (the
    cache is not defended against an adversary that can write to its files). zlib's runs at
    ~3.5 GiB/s on this machine, fast enough to check every block loaded from disk.
    """
    return zlib.crc32(data)


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
        """Store a copy of ``data`` (whose CRC-32 is ``checksum``); may evict other blocks.

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
