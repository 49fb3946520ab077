"""The RAM arena's allocator: extents carved into slots by size class, and each class's LRU.

Arena layout (one file in /dev/shm, mapped by the server and every client)::

    | extent 0                 | extent 1                 | ... | extent E-1          |
    | slot | slot | slot | ... | slot      | slot      |  ...                          |
      <- slot_bytes(class A) ->  <- slot_bytes(class B) ->

A free extent is carved into a size class's slots when it needs room, the way vLLM's
``BlockPool`` hands out KV blocks; a slot is named by its byte offset. Invariants
(``problems`` checks each): every slot of a carved extent is free (in its extent's free list,
once) or in use; a free extent has neither; the classes own exactly the carved extents; a
class's LRU holds exactly its committed slots. Free lists are LIFO, so nothing may trust a
slot's bytes without a checksum taken from their source. Not thread-safe: the RAM tier calls
it under its lock. Size classes and eviction: docs/notes/ram-allocator.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvkeep.store.policy import LruPolicy
from kvkeep.store.slots import Offset


@dataclass
class Extent:
    index: int
    slot_bytes: int = 0  # 0: free extent
    free: list[Offset] = field(default_factory=list)


@dataclass
class SizeClass:
    slot_bytes: int
    extents: list[Extent] = field(default_factory=list)
    lru: LruPolicy = field(default_factory=LruPolicy)


class SlotAllocator:
    """Slots of ``num_extents`` extents of ``extent_bytes`` each; which are in use."""

    def __init__(self, num_extents: int, extent_bytes: int) -> None:
        self.extent_bytes = extent_bytes
        self.extents = [Extent(i) for i in range(num_extents)]
        self.classes: dict[int, SizeClass] = {}
        self.in_use: set[Offset] = set()

    def allocate(
        self, slot_bytes: int, may_go: Callable[[Offset], bool], evict: Callable[[Offset], None]
    ) -> Offset | None:
        """A slot of ``slot_bytes``, in use from now on; None if none can be had. To make
        room it may ``evict`` slots (committed, in use) for which ``may_go`` holds; ``evict``
        must end by calling ``free`` on the slot."""
        cls = self.classes.setdefault(slot_bytes, SizeClass(slot_bytes))
        offset = next((e.free.pop() for e in cls.extents if e.free), None)
        if offset is None:
            extent = self._free_extent()
            if extent is None and not cls.extents:
                extent = self._steal_extent(may_go, evict)
            if extent is not None:
                self._carve(extent, cls)
                offset = extent.free.pop()
            else:
                offset = self._evict_lru(cls, may_go, evict)
        if offset is not None:
            self.in_use.add(offset)
        return offset

    def free(self, offset: Offset) -> None:
        """The slot goes back to its extent's free list (first out again) and its class's
        LRU."""
        self.in_use.discard(offset)
        self.class_of(offset).lru.remove(offset)
        self.extent_of(offset).free.append(offset)

    def class_of(self, offset: Offset) -> SizeClass:
        return self.classes[self.extent_of(offset).slot_bytes]

    def extent_of(self, offset: Offset) -> Extent:
        return self.extents[offset // self.extent_bytes]

    def base(self, extent: Extent) -> int:
        return extent.index * self.extent_bytes

    def _free_extent(self) -> Extent | None:
        return next((e for e in self.extents if e.slot_bytes == 0), None)

    def _carve(self, extent: Extent, cls: SizeClass) -> None:
        base, count = self.base(extent), self.extent_bytes // cls.slot_bytes
        extent.slot_bytes = cls.slot_bytes
        extent.free = [Offset(base + i * cls.slot_bytes) for i in reversed(range(count))]
        cls.extents.append(extent)

    def _evict_lru(
        self, cls: SizeClass, may_go: Callable[[Offset], bool], evict: Callable[[Offset], None]
    ) -> Offset | None:
        victim = next((Offset(o) for o in cls.lru.victims() if may_go(Offset(o))), None)
        if victim is None:
            return None
        evict(victim)
        return self.extent_of(victim).free.pop()

    def _steal_extent(
        self, may_go: Callable[[Offset], bool], evict: Callable[[Offset], None]
    ) -> Extent | None:
        """Empty one extent of the class holding most extents, if every slot in it may go."""
        donors = sorted(self.classes.values(), key=lambda c: len(c.extents), reverse=True)
        for donor in donors:
            for extent in donor.extents:
                live = self.live(extent)
                if all(may_go(o) for o in live):
                    for offset in live:
                        evict(offset)
                    donor.extents.remove(extent)
                    extent.slot_bytes, extent.free = 0, []
                    return extent
        return None

    def live(self, extent: Extent) -> list[Offset]:
        """The slots of ``extent`` in use."""
        base, end = self.base(extent), self.base(extent) + self.extent_bytes
        return [o for o in self.in_use if base <= o < end]

    # --- integrity -------------------------------------------------------------------------

    def problems(
        self, committed: Callable[[Offset], bool], length_of: Callable[[Offset], int]
    ) -> Iterator[str]:
        """Every way the extents, classes and LRUs disagree, one message each."""
        live: dict[int, list[Offset]] = {}  # extent index -> its slots in use, in one pass
        for offset in self.in_use:
            live.setdefault(offset // self.extent_bytes, []).append(offset)
        for extent in self.extents:
            yield from self._extent_problems(extent, live.get(extent.index, []), length_of)
        carved = {e.index for e in self.extents if e.slot_bytes}
        owned = [e.index for c in self.classes.values() for e in c.extents]
        if sorted(owned) != sorted(carved):
            yield f"classes own extents {sorted(owned)}, carved are {sorted(carved)}"
        for cls in self.classes.values():
            if any(e.slot_bytes != cls.slot_bytes for e in cls.extents):
                yield f"class {cls.slot_bytes}: owns an extent of another size"
            slots = [o for e in cls.extents for o in live.get(e.index, [])]
            lru = list(cls.lru.victims())
            if len(lru) != len(set(lru)) or set(lru) != {o for o in slots if committed(o)}:
                yield f"class {cls.slot_bytes}: LRU != its committed slots"

    def _extent_problems(
        self, extent: Extent, live: list[Offset], length_of: Callable[[Offset], int]
    ) -> Iterator[str]:
        free = extent.free
        if extent.slot_bytes == 0:
            if live or free:
                yield f"extent {extent.index}: free, yet has slots"
            return
        base, size = self.base(extent), extent.slot_bytes
        if len(set(free)) != len(free) or set(free) & set(live):
            yield f"extent {extent.index}: free list repeats or holds a live slot"
        if len(free) + len(live) != self.extent_bytes // size:
            yield f"extent {extent.index}: {len(free)} free + {len(live)} live slots"
        for offset in [*free, *live]:
            if (offset - base) % size or offset // self.extent_bytes != extent.index:
                yield f"extent {extent.index}: offset {offset} is not a slot boundary"
        for offset in live:
            if length_of(offset) > size:
                yield f"slot {offset}: {length_of(offset)} bytes in a {size} slot"
