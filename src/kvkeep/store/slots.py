"""The RAM arena's vocabulary: slot offsets, pin holders, the arena's size and slot classes.

A light module (no locks, no mapping): the protocol and the client name slots with ``Offset``
without importing the tier itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, NewType

from kvkeep.store.keyformat import StoreKey

SLOT_ALIGN = 64
DEFAULT_EXTENT_BYTES = 64 << 20

Offset = NewType("Offset", int)
"""A slot's byte offset in the arena: what clients map, and what names a slot everywhere."""

Holder = NewType("Holder", int)
"""Who holds a pin or a reservation: a server connection, or ``INTERNAL``."""

INTERNAL = Holder(0)
"""The store's own pins and reservations (write-behind, promotion, ``get``/``put``)."""


@dataclass(frozen=True)
class ArenaConfig:
    """Where and how big the arena is. ``extent_bytes`` bounds the largest block it holds."""

    size_bytes: int
    extent_bytes: int = DEFAULT_EXTENT_BYTES
    shm_dir: str = "/dev/shm"

    def __post_init__(self) -> None:
        if self.extent_bytes <= 0 or self.extent_bytes % 4096:
            raise ValueError(
                f"extent_bytes must be a positive multiple of 4096: {self.extent_bytes}"
            )
        if self.size_bytes < self.extent_bytes:
            raise ValueError(
                f"RAM size {self.size_bytes} is below one extent ({self.extent_bytes} bytes); "
                "give more RAM or a smaller extent"
            )

    @property
    def num_extents(self) -> int:
        return self.size_bytes // self.extent_bytes


def slot_bytes_for(block_bytes: int) -> int:
    """The slot size class of a block: its length rounded up to 64 bytes."""
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


class Pinned(NamedTuple):
    """A committed slot pinned for reading: unpin it with ``RamTier.unpin(offset, holder)``."""

    offset: Offset
    length: int
    checksum: int


class SlotInfo(NamedTuple):
    key: StoreKey
    length: int
    checksum: int
