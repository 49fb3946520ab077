"""The RAM arena: bytes round-trip, exact LRU order, pins, size classes."""

from __future__ import annotations

from typing import Any

from kvkeep.store.ram import RamTier
from kvkeep.store.slots import INTERNAL, Holder, Offset

from .helpers import crc, key, payload

KiB = 1024
EXTENT = 64 * KiB


def put(arena: RamTier, i: int, length: int = 16 * KiB) -> bool:
    return arena.put(key(i), memoryview(payload(i, length)), crc(i, length))


def get(arena: RamTier, i: int, length: int = 16 * KiB) -> bytes | None:
    out = bytearray(length)
    found = arena.get(key(i), memoryview(out))
    return bytes(out[: found.length]) if found else None


def test_round_trip_and_checksum(make_arena: Any) -> None:
    arena = make_arena(2 * EXTENT, EXTENT)
    assert put(arena, 1)
    assert get(arena, 1) == payload(1, 16 * KiB)
    pinned = arena.pin(key(1))
    assert pinned is not None and pinned.checksum == crc(1, 16 * KiB)
    assert bytes(arena.view(pinned.offset, pinned.length)) == payload(1, 16 * KiB)
    assert get(arena, 2) is None
    assert not put(arena, 1), "a key is stored once"


def test_lru_eviction_order_is_exact(make_arena: Any) -> None:
    arena = make_arena(EXTENT, EXTENT)  # 4 slots of 16 KiB
    for i in range(4):
        assert put(arena, i)
    assert get(arena, 0) is not None  # 0 becomes most recent: order 1, 2, 3, 0
    for new, evicted in [(4, 1), (5, 2), (6, 3), (7, 0)]:
        assert put(arena, new)
        assert not arena.contains(key(evicted)), f"{evicted} should go when {new} comes"
        assert arena.stats().counters["evictions"] == new - 3


def test_touch_refreshes_recency_without_counting_a_hit(make_arena: Any) -> None:
    arena = make_arena(EXTENT, EXTENT)  # 4 slots of 16 KiB
    for i in range(4):
        assert put(arena, i)
    assert arena.touch([key(0)]) == 1 and arena.touch([key(9)]) == 0
    assert arena.stats().counters["hits"] == 0
    assert put(arena, 4)
    assert arena.contains(key(0)) and not arena.contains(key(1)), "a touched block went first"


def test_a_prefix_lookup_and_pin_stop_at_the_first_miss_and_keep_the_head_longest(
    make_arena: Any,
) -> None:
    """The batched calls a LOOKUP and an ACQUIRE run: they stop at the first key RAM lacks,
    and the prefix they saw ages tail first (a chain without its head is useless)."""
    arena = make_arena(EXTENT, EXTENT)  # 4 slots of 16 KiB
    for i in (3, 0, 1, 2):  # 3 oldest, then 0, 1, 2
        assert put(arena, i)
    assert arena.touch_prefix([key(9), key(0)]) == 0
    assert arena.touch_prefix([key(0), key(1), key(2), key(9), key(3)]) == 3
    assert arena.touch_prefix([key(7), key(0), key(1)], start=1) == 2
    pinned = arena.pin_prefix([key(2), key(1), key(8), key(0)])
    assert [arena.committed(p.offset).key for p in pinned] == [key(2), key(1)]  # type: ignore[union-attr]
    counters = arena.stats().counters
    assert (counters["hits"], counters["misses"]) == (2, 1)
    assert not put(arena, 4) or arena.contains(key(2)), "a pinned block was evicted"
    arena.release_many([p.offset for p in pinned], INTERNAL)
    # recency, oldest first: 3 (never seen); 0 (touched by both lookups); then the pinned
    # prefix 2, 1, whose head 2 is most recent of all
    assert not arena.contains(key(3)), "the put of 4 evicted the oldest, 3"
    for new, evicted in [(5, 0), (6, 1), (7, 2)]:
        assert put(arena, new)
        assert not arena.contains(key(evicted)), f"{evicted} should go when {new} comes"


def test_pinned_slots_are_never_evicted(make_arena: Any) -> None:
    arena = make_arena(EXTENT, EXTENT)
    for i in range(4):
        put(arena, i)
    pins = [arena.pin(key(i)) for i in range(4)]
    assert not put(arena, 9), "every slot pinned: the put is refused"
    assert arena.stats().counters["rejected_puts"] == 1
    arena.unpin(pins[2].offset)  # type: ignore[union-attr]
    assert put(arena, 9)
    assert not arena.contains(key(2)) and all(arena.contains(key(i)) for i in (0, 1, 3))


def test_reserved_slot_is_invisible_until_commit(make_arena: Any) -> None:
    arena = make_arena(EXTENT, EXTENT)
    offset = arena.reserve(key(1), 100)
    assert offset is not None and not arena.contains(key(1))
    assert arena.reserve(key(1), 100) is None, "a key being written is not reserved twice"
    arena.view(offset, 100)[:] = payload(1, 100)
    assert arena.commit(offset, crc(1, 100))
    assert get(arena, 1, 100) == payload(1, 100)
    other = arena.reserve(key(2), 100)
    arena.abort(other)
    assert not arena.contains(key(2)) and arena.reserve(key(2), 100) is not None


def test_size_classes_share_the_arena(make_arena: Any) -> None:
    arena = make_arena(2 * EXTENT, EXTENT)
    for i in range(8):  # class A fills both extents
        put(arena, i, 16 * KiB)
    assert put(arena, 100, 32 * KiB), "class B takes over an idle extent"
    assert get(arena, 100, 32 * KiB) == payload(100, 32 * KiB)
    survivors = [i for i in range(8) if arena.contains(key(i))]
    assert len(survivors) == 4
    assert not put(arena, 101, EXTENT + 1), "a block larger than an extent never fits"


def test_pins_and_reservations_belong_to_their_holder(make_arena: Any) -> None:
    arena = make_arena(EXTENT, EXTENT)
    one, two = Holder(1), Holder(2)
    offset = arena.reserve(key(1), 100, one)
    assert offset is not None
    assert not arena.commit(offset, crc(1, 100), two), "another holder cannot commit it"
    assert not arena.abort(offset, two) and arena.holds(key(1))
    assert arena.commit(offset, crc(1, 100), one)
    assert arena.pin(key(1), one) and arena.pin(key(1), one) and arena.pin(key(1), two)
    assert not arena.unpin(offset, Holder(3)), "no pin of its own to drop"
    pending = arena.reserve(key(2), 100, one)
    assert arena.check_integrity() == []
    arena.drop_holder(one)  # its connection went away: two pins and a reservation
    assert not arena.holds(key(2)) and pending is not None
    assert not arena.evict(key(1)), "holder two still reads it"
    assert arena.unpin(offset, two) and arena.evict(key(1))
    assert arena.check_integrity() == []


def test_check_integrity_names_what_disagrees(make_arena: Any) -> None:
    arena = make_arena(EXTENT, EXTENT)
    for i in range(3):
        put(arena, i)
    assert arena.check_integrity() == []
    arena._bytes_used += 1
    assert any("bytes_used" in p for p in arena.check_integrity())
    arena._bytes_used -= 1
    offset = next(iter(arena._slots))
    arena._slots_of.extents[0].free.append(offset)
    assert any("free list" in p for p in arena.check_integrity())
    arena._slots_of.extents[0].free.pop()
    arena._slots[offset].pins[Holder(7)] = 1
    assert any("holders" in p for p in arena.check_integrity())
    del arena._slots[offset].pins[Holder(7)]
    arena._slots_of.classes[16 * KiB].lru.remove(offset)
    assert any("LRU" in p for p in arena.check_integrity())
    arena._slots_of.classes[16 * KiB].lru.add(offset)
    del arena._index[arena._slots[Offset(offset)].key]
    assert any("not indexed" in p for p in arena.check_integrity())
    arena._index[arena._slots[Offset(offset)].key] = offset
    assert arena.check_integrity() == []
