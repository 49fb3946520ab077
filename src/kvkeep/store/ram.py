"""The RAM tier: blocks in slots of a shared-memory arena, with pins and LRU eviction.

Where a block's slot is and which slot goes when room is needed is the allocator's
(:mod:`kvkeep.store.allocator`); this module keeps what the slots hold and who holds them.

Slot states: free -> reserved (being written, invisible to readers) -> committed (visible,
evictable unless pinned) -> free. Pinned committed slots are never evicted or reused.

Pins and reservations belong to a ``Holder``: one per server connection, and ``INTERNAL`` for
the store's own short pins (write-behind, promotion, ``get``/``put``). They are counted once,
here, per holder and slot; ``drop_holder`` aborts a holder's reservations and drops its pins,
so a connection that goes away leaves nothing behind. TOUCH (``touch``, one key or a whole
prefix) makes committed blocks most recent without counting a hit. ``check_integrity``
re-derives every count from the slots and names what disagrees.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvkeep.store.allocator import SlotAllocator
from kvkeep.store.base import Found, StoreKey, TierCounters, TierStats, checksum
from kvkeep.store.shm import SharedArena
from kvkeep.store.slots import (
    INTERNAL,
    ArenaConfig,
    Holder,
    Offset,
    Pinned,
    SlotInfo,
    slot_bytes_for,
)


@dataclass
class _Slot:
    key: StoreKey
    length: int
    owner: Holder  # who reserved it; its reservation ends at commit
    checksum: int = 0
    committed: bool = False
    pins: dict[Holder, int] = field(default_factory=dict)  # no zero entries


class RamTier:
    """The RAM tier. All methods are thread-safe (one lock) and never block on I/O."""

    name = "ram"

    def __init__(self, config: ArenaConfig, path: str) -> None:
        self.config = config
        self.arena = SharedArena(path, config.num_extents * config.extent_bytes, create=True)
        self._lock = threading.Lock()
        self._slots_of = SlotAllocator(config.num_extents, config.extent_bytes)
        self._slots: dict[Offset, _Slot] = {}
        self._index: dict[StoreKey, Offset] = {}  # committed or reserved key -> offset
        self._held: dict[Holder, set[Offset]] = {}  # slots a holder pins or has reserved
        self._counters = TierCounters()
        self._bytes_used = 0
        # Called with (key, bytes, checksum) of every committed block about to leave RAM,
        # with the arena lock held and before the slot is reused: it must copy what it keeps,
        # must not block, and must not call back into the arena.
        self.on_evict: Callable[[StoreKey, memoryview, int], object] | None = None

    # --- slot API (the data plane) -------------------------------------------------------

    def reserve(self, key: StoreKey, length: int, holder: Holder = INTERNAL) -> Offset | None:
        """A slot for ``holder`` to write ``length`` bytes of ``key`` into, invisible until
        ``commit``.

        Returns None if the key is already stored or being written, the block is larger than
        an extent, or every candidate slot is pinned. May evict unpinned blocks.
        """
        if slot_bytes_for(length) > self.config.extent_bytes:
            return None
        with self._lock:
            if key in self._index:
                return None
            offset = self._slots_of.allocate(slot_bytes_for(length), self._may_go, self._evict)
            if offset is not None:
                self._slots[offset] = _Slot(key, length, holder)
                self._index[key] = offset
                self._held.setdefault(holder, set()).add(offset)
            return offset

    def commit(
        self,
        offset: Offset,
        checksum: int,
        holder: Holder = INTERNAL,
        pin_for: Holder | None = None,
    ) -> bool:
        """Make a slot ``holder`` reserved visible with its checksum; with ``pin_for``, pinned
        for that holder at once (nothing can evict it in between). False, and nothing changes,
        if ``offset`` is not a slot ``holder`` reserved."""
        with self._lock:
            slot = self._slots.get(offset)
            if slot is None or slot.committed or slot.owner != holder:
                return False
            slot.committed, slot.checksum = True, checksum
            self._unhold(holder, offset)
            if pin_for is not None:
                self._pin(slot, offset, pin_for)
            self._slots_of.class_of(offset).lru.add(offset)
            self._counters.bytes_in += slot.length
            self._bytes_used += slot.length
            return True

    def abort(self, offset: Offset, holder: Holder = INTERNAL) -> bool:
        """Free a slot ``holder`` reserved and has not committed. False (a no-op) otherwise."""
        with self._lock:
            return self._abort(offset, holder)

    def pin(self, key: StoreKey, holder: Holder = INTERNAL) -> Pinned | None:
        """Pin the committed block for ``holder`` and mark it most recent; None on a miss."""
        found = self.pin_prefix((key,), holder)
        return found[0] if found else None

    def pin_prefix(self, keys: Sequence[StoreKey], holder: Holder = INTERNAL) -> list[Pinned]:
        """``pin`` the leading committed ``keys`` for ``holder``, stopping at the first miss
        (counted, as ``pin`` counts it), under one lock; the first key ends most recent."""
        index, slots, pinned = self._index, self._slots, []
        with self._lock:
            for key in keys:
                offset = index.get(key)
                slot = slots[offset] if offset is not None else None
                if offset is None or slot is None or not slot.committed:
                    self._counters.misses += 1
                    break
                self._pin(slot, offset, holder)
                pinned.append(Pinned(offset, slot.length, slot.checksum))
            self._touch_offsets([p.offset for p in pinned])
            self._counters.hits += len(pinned)
            self._counters.bytes_out += sum(p.length for p in pinned)
        return pinned

    def touch(self, keys: Sequence[StoreKey]) -> int:
        """Mark the committed ``keys`` most recent, ``keys[0]`` most of all (no hit counted);
        how many were here. Last key first, so that when a chain ages its tail goes before
        its head: a chain without its head is useless, one without its tail is a shorter hit.
        One lock for all: a whole prompt's prefix costs one call."""
        with self._lock:
            found = [o for o in map(self._index.get, keys) if o is not None]
            return self._touch_offsets([o for o in found if self._slots[o].committed])

    def touch_prefix(self, keys: Sequence[StoreKey], start: int = 0) -> int:
        """How many of ``keys[start:]`` in a row are committed here; those are marked most
        recent, ``keys[start]`` most of all (as ``touch``; no hit counted). A LOOKUP
        touches what it finds, so the blocks it promises are the last to be evicted before
        the worker's ACQUIRE, and prefixes in use stay in RAM. One lock, no per-key calls."""
        slots, found = self._slots, []
        with self._lock:
            for offset in map(self._index.get, itertools.islice(keys, start, None)):
                if offset is None or not slots[offset].committed:
                    break
                found.append(offset)
            return self._touch_offsets(found)

    def _touch_offsets(self, offsets: list[Offset]) -> int:
        """Make ``offsets`` (committed) most recent, the first most of all; how many. Locked."""
        classes = self._slots_of.classes
        if len(classes) == 1:  # one block size: one LRU
            next(iter(classes.values())).lru.touch_many(reversed(offsets))
            return len(offsets)
        for offset in reversed(offsets):
            self._slots_of.class_of(offset).lru.touch(offset)
        return len(offsets)

    def unpin(self, offset: Offset, holder: Holder = INTERNAL) -> bool:
        """Drop one of ``holder``'s pins on ``offset``. False (a no-op) if it holds none."""
        with self._lock:
            slot = self._slots.get(offset)
            return slot is not None and self._unpin(slot, offset, holder)

    def release(self, offset: Offset, holder: Holder) -> None:
        """Abort ``holder``'s reservation of ``offset``, or else drop one of its pins there.
        A no-op for a slot ``holder`` neither reserved nor pinned."""
        self.release_many((offset,), holder)

    def release_many(self, offsets: Iterable[Offset], holder: Holder) -> None:
        """``release`` each of ``offsets`` in turn, under one lock."""
        slots = self._slots
        with self._lock:
            for offset in offsets:
                slot = slots.get(offset)
                if slot is None:
                    continue
                if slot.committed:
                    self._unpin(slot, offset, holder)
                elif slot.owner == holder:
                    self._free(offset)

    def drop_holder(self, holder: Holder) -> None:
        """Abort every reservation and drop every pin of ``holder`` (its connection is gone)."""
        with self._lock:
            for offset in sorted(self._held.get(holder, ())):
                slot = self._slots[offset]
                if not self._abort(offset, holder):
                    while self._unpin(slot, offset, holder):
                        pass

    def discard_corrupt(self, offset: Offset) -> bool:
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

    def view(self, offset: Offset, length: int) -> memoryview:
        return self.arena.view(offset, length)

    def committed(self, offset: Offset) -> SlotInfo | None:
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
        offset = self._index.get(key)
        slot = self._slots.get(offset) if offset is not None else None
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
            offset = self._index.get(key)
            if offset is None:
                return False
            slot = self._slots[offset]
            if not slot.committed or slot.pins:
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

    def check_integrity(self) -> list[str]:
        """Every way the slot accounting disagrees with itself, one message each; [] when
        it is consistent. Takes the lock for O(slots + extents): for tests and diagnostics,
        not for a hot path. Mutates nothing."""
        with self._lock:
            return list(self._problems())

    # --- pins and reservations (lock held) -------------------------------------------------

    def _pin(self, slot: _Slot, offset: Offset, holder: Holder) -> None:
        # Hot path (ACQUIRE of 1,000-block prompts): no set built unless the holder is new.
        slot.pins[holder] = slot.pins.get(holder, 0) + 1
        held = self._held.get(holder)
        if held is None:
            held = self._held[holder] = set()
        held.add(offset)

    def _unpin(self, slot: _Slot, offset: Offset, holder: Holder) -> bool:
        count = slot.pins.get(holder, 0)
        if count == 0:
            return False
        if count == 1:
            del slot.pins[holder]
            self._unhold(holder, offset)
        else:
            slot.pins[holder] = count - 1
        return True

    def _abort(self, offset: Offset, holder: Holder) -> bool:
        slot = self._slots.get(offset)
        if slot is None or slot.committed or slot.owner != holder:
            return False
        self._free(offset)
        return True

    def _unhold(self, holder: Holder, offset: Offset) -> None:
        held = self._held.get(holder)
        if held is not None:
            held.discard(offset)
            if not held:
                del self._held[holder]

    # --- what the allocator asks (lock held) ---------------------------------------------

    def _may_go(self, offset: Offset) -> bool:
        slot = self._slots[offset]
        return slot.committed and not slot.pins

    def _evict(self, offset: Offset) -> None:
        slot = self._slots[offset]
        if self.on_evict is not None:
            self.on_evict(slot.key, self.view(offset, slot.length), slot.checksum)
        self._counters.evictions += 1
        self._bytes_used -= slot.length
        self._free(offset)

    def _free(self, offset: Offset) -> None:
        slot = self._slots.pop(offset)
        if self._index.get(slot.key) == offset:
            del self._index[slot.key]
        if not slot.committed:
            self._unhold(slot.owner, offset)
        self._slots_of.free(offset)

    # --- integrity (lock held) -------------------------------------------------------------

    def _problems(self) -> Iterator[str]:
        yield from self._index_problems()
        yield from self._pin_problems()
        if set(self._slots) != self._slots_of.in_use:
            yield "the slots held and those the allocator has in use differ"
        yield from self._slots_of.problems(
            lambda o: o in self._slots and self._slots[o].committed,
            lambda o: self._slots[o].length if o in self._slots else 0,
        )
        committed = sum(s.length for s in self._slots.values() if s.committed)
        if committed != self._bytes_used:
            yield f"bytes_used {self._bytes_used} != {committed} committed bytes"

    def _index_problems(self) -> Iterator[str]:
        for key, offset in self._index.items():
            slot = self._slots.get(offset)
            if slot is None or slot.key != key:
                yield f"index: key {key.hex()[:16]} -> {offset}, a slot of another key or none"
        for offset, slot in self._slots.items():
            if self._index.get(slot.key) != offset:
                yield f"slot {offset}: its key is not indexed to it"

    def _pin_problems(self) -> Iterator[str]:
        expected: dict[Holder, set[Offset]] = {}
        for offset, slot in self._slots.items():
            if any(count <= 0 for count in slot.pins.values()):
                yield f"slot {offset}: a pin count <= 0: {slot.pins}"
            if slot.pins and not slot.committed:
                yield f"slot {offset}: pinned but not committed"
            holders = [*slot.pins, *([] if slot.committed else [slot.owner])]
            for holder in holders:
                expected.setdefault(holder, set()).add(offset)
        if expected != self._held:
            yield f"holders' slots {self._held} != those the slots name {expected}"
