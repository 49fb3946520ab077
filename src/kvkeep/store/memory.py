"""The RAM tier: a shared-memory arena cut into fixed-size slots, with LRU eviction and pins.

Arena layout (one file in /dev/shm, mapped by the server and every client)::

    | extent 0                 | extent 1                 | ... | extent E-1          |
    | slot | slot | slot | ... | slot      | slot      |  ...                          |
      <- slot_bytes(class A) ->  <- slot_bytes(class B) ->

The arena is split into equal extents. An extent is free until a size class (the rounded-up
block size of a namespace) needs room; then it is carved into slots of that class. A slot is
named by its byte offset in the arena, which is what clients map. When no free slot or extent
is left, the class evicts its least-recently-used unpinned slot; a class with no extent at all
takes over a whole extent from another class (the one that has most) whose slots are unpinned.

Slot states: free -> reserved (being written, invisible to readers) -> committed (visible,
evictable unless pinned) -> free. Pinned committed slots are never evicted or reused.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kvkeep.store.base import Found, StoreKey, TierCounters, TierStats, checksum
from kvkeep.store.policy import LruPolicy

SLOT_ALIGN = 64
DEFAULT_EXTENT_BYTES = 64 << 20


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


class SharedArena:
    """A file in a tmpfs mapped read-write. Created with mode 0600 by the server."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.buffer = memoryview(self.map)

    def prefault(self) -> None:
        """Allocate every page of the arena now (blocking; run it in a thread).

        Pages of a tmpfs file are otherwise allocated and zeroed on first touch, which halves
        the speed of the first write into each slot. Raises OSError if /dev/shm is too small.
        """
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, self.size)
        finally:
            os.close(fd)

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes at ``offset``; no copy."""
        return self.buffer[offset : offset + length]

    def close(self) -> None:
        """Unmap. Views still held elsewhere keep the mapping alive until they go away."""
        # Views exported from the map may still be alive; then the OS unmaps at process exit.
        with contextlib.suppress(BufferError):
            self.buffer.release()
            self.map.close()

    def unlink(self) -> None:
        Path(self.path).unlink(missing_ok=True)


class Pinned(NamedTuple):
    """A committed slot pinned for reading: unpin it with ``ArenaTier.unpin(offset)``."""

    offset: int
    length: int
    checksum: int


class SlotInfo(NamedTuple):
    key: StoreKey
    length: int
    checksum: int


@dataclass
class _Slot:
    key: StoreKey
    length: int
    checksum: int = 0
    pins: int = 1
    committed: bool = False


@dataclass
class _Extent:
    index: int
    slot_bytes: int = 0  # 0: free extent
    free: list[int] = field(default_factory=list)


@dataclass
class _SizeClass:
    slot_bytes: int
    extents: list[_Extent] = field(default_factory=list)
    lru: LruPolicy = field(default_factory=LruPolicy)


class ArenaTier:
    """The RAM tier. All methods are thread-safe (one lock) and never block on I/O."""

    name = "ram"

    def __init__(self, config: ArenaConfig, path: str) -> None:
        self.config = config
        self.arena = SharedArena(path, config.num_extents * config.extent_bytes, create=True)
        self._lock = threading.Lock()
        self._extents = [_Extent(i) for i in range(config.num_extents)]
        self._classes: dict[int, _SizeClass] = {}
        self._slots: dict[int, _Slot] = {}
        self._index: dict[StoreKey, int] = {}  # committed or reserved key -> offset
        self._counters = TierCounters()
        self._bytes_used = 0
        # Called with (key, bytes, checksum) of every committed block about to leave RAM,
        # with the arena lock held and before the slot is reused: it must copy what it keeps,
        # must not block, and must not call back into the arena.
        self.on_evict: Callable[[StoreKey, memoryview, int], object] | None = None

    # --- slot API (the data plane) -------------------------------------------------------

    def reserve(self, key: StoreKey, length: int) -> int | None:
        """A slot to write ``length`` bytes into for ``key``, invisible until ``commit``.

        Returns None if the key is already stored or being written, the block is larger than
        an extent, or every candidate slot is pinned. May evict unpinned blocks.
        """
        if slot_bytes_for(length) > self.config.extent_bytes:
            return None
        with self._lock:
            if key in self._index:
                return None
            offset = self._allocate(slot_bytes_for(length))
            if offset is not None:
                self._slots[offset] = _Slot(key, length)
                self._index[key] = offset
            return offset

    def commit(self, offset: int, checksum: int, keep_pin: bool = False) -> bool:
        """Make a reserved slot visible with its checksum. False if ``offset`` is not reserved.

        With ``keep_pin`` the caller keeps the writer's pin and must ``unpin`` later.
        """
        with self._lock:
            slot = self._slots.get(offset)
            if slot is None or slot.committed:
                return False
            slot.committed, slot.checksum = True, checksum
            slot.pins -= 0 if keep_pin else 1
            self._class_of(offset).lru.add(offset)
            self._counters.bytes_in += slot.length
            self._bytes_used += slot.length
            return True

    def abort(self, offset: int) -> None:
        """Free a reserved, uncommitted slot. A no-op for any other offset."""
        with self._lock:
            slot = self._slots.get(offset)
            if slot is not None and not slot.committed:
                self._free(offset)

    def pin(self, key: StoreKey) -> Pinned | None:
        """Pin the committed block for reading and mark it most recent; None on a miss."""
        with self._lock:
            offset = self._index.get(key, -1)
            slot = self._slots.get(offset)
            if slot is None or not slot.committed:
                self._counters.misses += 1
                return None
            slot.pins += 1
            self._class_of(offset).lru.touch(offset)
            self._counters.hits += 1
            self._counters.bytes_out += slot.length
            return Pinned(offset, slot.length, slot.checksum)

    def touch(self, key: StoreKey) -> bool:
        """Whether ``key`` is committed here; if so, mark it most recent (no hit counted).
        A LOOKUP touches what it finds, so the blocks it promises are the last to be evicted
        before the worker's ACQUIRE, and prefixes in use stay in RAM."""
        with self._lock:
            offset = self._index.get(key, -1)
            slot = self._slots.get(offset)
            if slot is None or not slot.committed:
                return False
            self._class_of(offset).lru.touch(offset)
            return True

    def add_pin(self, offset: int) -> bool:
        """Pin a committed slot by offset (write-behind). False if it is not committed."""
        with self._lock:
            slot = self._slots.get(offset)
            if slot is None or not slot.committed:
                return False
            slot.pins += 1
            return True

    def unpin(self, offset: int) -> None:
        """Drop one pin. Unpinning an unpinned or unknown slot is a no-op."""
        with self._lock:
            slot = self._slots.get(offset)
            if slot is not None and slot.pins > 0:
                slot.pins -= 1

    def discard_corrupt(self, offset: int) -> bool:
        """Drop the committed, unpinned slot at ``offset`` if its bytes no longer match its
        checksum (counted in ``checksum_failures``); the bytes go to no lower tier. False,
        and nothing changes, for a slot that is intact, pinned, or not committed."""
        with self._lock:
            slot = self._slots.get(offset)
            if slot is None or not slot.committed or slot.pins:
                return False
            if checksum(self.view(offset, slot.length)) == slot.checksum:
                return False
            self._counters.checksum_failures += 1
            self._bytes_used -= slot.length
            self._free(offset)
            return True

    def view(self, offset: int, length: int) -> memoryview:
        return self.arena.view(offset, length)

    def committed(self, offset: int) -> SlotInfo | None:
        """The key, length and checksum of a committed slot; None otherwise."""
        with self._lock:
            slot = self._slots.get(offset)
            if slot is None or not slot.committed:
                return None
            return SlotInfo(slot.key, slot.length, slot.checksum)

    def holds(self, key: StoreKey) -> bool:
        """Whether ``key`` is committed or reserved (being written) here."""
        return key in self._index

    # --- Tier protocol ---------------------------------------------------------------------

    def contains(self, key: StoreKey) -> bool:
        slot = self._slots.get(self._index.get(key, -1))
        return slot is not None and slot.committed

    def get(self, key: StoreKey, out: memoryview) -> Found | None:
        pinned = self.pin(key)
        if pinned is None:
            return None
        try:
            if pinned.length > len(out):
                return None
            out[: pinned.length] = self.view(pinned.offset, pinned.length)
            return Found(pinned.length, pinned.checksum)
        finally:
            self.unpin(pinned.offset)

    def put(self, key: StoreKey, data: memoryview, checksum: int) -> bool:
        offset = self.reserve(key, len(data))
        if offset is None:
            self._counters.rejected_puts += 1
            return False
        self.view(offset, len(data))[:] = data
        return self.commit(offset, checksum)

    def evict(self, key: StoreKey) -> bool:
        with self._lock:
            offset = self._index.get(key, -1)
            slot = self._slots.get(offset)
            if slot is None or not slot.committed or slot.pins:
                return False
            self._evict(offset)
            return True

    def stats(self) -> TierStats:
        with self._lock:
            blocks = sum(1 for s in self._slots.values() if s.committed)
            return TierStats(
                self.name, self._counters.as_dict(), blocks, self._bytes_used, self.arena.size
            )

    def close(self) -> None:
        """Unmap and remove the arena file."""
        self.arena.close()
        self.arena.unlink()

    # --- allocation (call with the lock held) ----------------------------------------------

    def _allocate(self, slot_bytes: int) -> int | None:
        cls = self._classes.setdefault(slot_bytes, _SizeClass(slot_bytes))
        for owned in cls.extents:
            if owned.free:
                return owned.free.pop()
        extent = self._free_extent()
        if extent is None and not cls.extents:
            extent = self._steal_extent()
        if extent is not None:
            self._carve(extent, cls)
            return extent.free.pop()
        return self._evict_lru(cls)

    def _free_extent(self) -> _Extent | None:
        return next((e for e in self._extents if e.slot_bytes == 0), None)

    def _carve(self, extent: _Extent, cls: _SizeClass) -> None:
        base, count = (
            extent.index * self.config.extent_bytes,
            self.config.extent_bytes // cls.slot_bytes,
        )
        extent.slot_bytes = cls.slot_bytes
        extent.free = [base + i * cls.slot_bytes for i in reversed(range(count))]
        cls.extents.append(extent)

    def _evict_lru(self, cls: _SizeClass) -> int | None:
        victim = next((o for o in cls.lru.victims() if self._slots[o].pins == 0), None)
        if victim is None:
            return None
        self._evict(victim)
        return self._extent_of(victim).free.pop()

    def _steal_extent(self) -> _Extent | None:
        """Empty one extent of the class holding most extents, if none of its slots is in use."""
        donors = sorted(self._classes.values(), key=lambda c: len(c.extents), reverse=True)
        for donor in donors:
            for extent in donor.extents:
                if self._extent_idle(extent):
                    self._release_extent(donor, extent)
                    return extent
        return None

    def _extent_idle(self, extent: _Extent) -> bool:
        base, end = (
            extent.index * self.config.extent_bytes,
            (extent.index + 1) * self.config.extent_bytes,
        )
        return all(s.committed and s.pins == 0 for o, s in self._slots.items() if base <= o < end)

    def _release_extent(self, donor: _SizeClass, extent: _Extent) -> None:
        base, end = (
            extent.index * self.config.extent_bytes,
            (extent.index + 1) * self.config.extent_bytes,
        )
        for offset in [o for o in self._slots if base <= o < end]:
            self._evict(offset)
        donor.extents.remove(extent)
        extent.slot_bytes, extent.free = 0, []

    def _evict(self, offset: int) -> None:
        slot = self._slots[offset]
        if self.on_evict is not None:
            self.on_evict(slot.key, self.view(offset, slot.length), slot.checksum)
        self._counters.evictions += 1
        self._bytes_used -= slot.length
        self._free(offset)

    def _free(self, offset: int) -> None:
        slot = self._slots.pop(offset)
        if self._index.get(slot.key) == offset:
            del self._index[slot.key]
        self._class_of(offset).lru.remove(offset)
        self._extent_of(offset).free.append(offset)

    def _extent_of(self, offset: int) -> _Extent:
        return self._extents[offset // self.config.extent_bytes]

    def _class_of(self, offset: int) -> _SizeClass:
        return self._classes[self._extent_of(offset).slot_bytes]
