"""The tiered store: prefix lookup, promotion on load, bounded write-through."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kvkeep.store.base import Found, StoreKey, TierCounters, TierStats
from kvkeep.store.disk import DiskConfig, DiskTier
from kvkeep.store.idlegate import CpuSample, IdleGate
from kvkeep.store.tiered import ReserveStatus, TieredStore, WriteBehindConfig

from .helpers import crc, key, payload

KiB = 1024
EXTENT = 64 * KiB
BLOCK = 16 * KiB


def commit(store: TieredStore, i: int) -> None:
    reservation = store.reserve(key(i), BLOCK)
    assert reservation.status is ReserveStatus.RESERVED
    store.view(reservation.offset, BLOCK)[:] = payload(i, BLOCK)
    assert store.commit(reservation.offset, crc(i, BLOCK))


def make(make_arena: Any, tmp_path: Path, depth: int = 64) -> TieredStore:
    disk = DiskTier(DiskConfig(str(tmp_path), 64 * EXTENT, segment_bytes=4 * EXTENT))
    return TieredStore(make_arena(EXTENT, EXTENT), [disk], WriteBehindConfig(depth))


def test_lookup_prefix_promotion_and_write_through(make_arena: Any, tmp_path: Path) -> None:
    store = make(make_arena, tmp_path)
    for i in range(6):  # RAM holds 4: blocks 0 and 1 live on disk only
        commit(store, i)
        store.flush()
    assert store.lookup([key(i) for i in (0, 1, 2, 3, 4, 5, 99, 0)]) == (6, (1, 1, 0, 0, 0, 0))
    assert store.lookup([key(99), key(0)]).num_present == 0
    assert store.reserve(key(0), BLOCK).status is ReserveStatus.PRESENT
    pinned = store.acquire(key(0), BLOCK)
    assert pinned is not None and pinned.checksum == crc(0, BLOCK)
    assert bytes(store.view(pinned.offset, BLOCK)) == payload(0, BLOCK)
    store.release(pinned.offset)
    assert store.lookup([key(0)]).tiers == (0,), "a load promotes the block to RAM"
    assert store.acquire(key(99), BLOCK) is None
    disk_stats = store.stats()["tiers"]["disk"]  # type: ignore[index]
    assert disk_stats["blocks"] == 6 and disk_stats["hits"] == 1
    store.close()


class SlowTier:
    """A lower tier whose puts wait for a gate, to fill the write-behind queue."""

    name = "slow"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.stored: dict[StoreKey, bytes] = {}

    def contains(self, key: StoreKey) -> bool:
        return key in self.stored

    def get(self, key: StoreKey, out: memoryview) -> Found | None:
        return None

    def put(self, key: StoreKey, data: memoryview, checksum: int) -> bool:
        self.gate.wait()
        self.stored[key] = bytes(data)
        return True

    def evict(self, key: StoreKey) -> bool:
        return False

    def stats(self) -> TierStats:
        return TierStats(self.name, TierCounters().as_dict(), len(self.stored), 0, 0)


def test_full_queue_drops_and_counts_without_blocking(make_arena: Any) -> None:
    slow = SlowTier()
    store = TieredStore(make_arena(4 * EXTENT, EXTENT), [slow], WriteBehindConfig(2))
    commit(store, 0)
    while store.stats()["queue_depth"]:  # wait until the writer holds block 0
        time.sleep(0.001)
    for i in range(1, 8):  # two queued, five dropped
        commit(store, i)
    assert store.dropped_writes == 5
    slow.gate.set()
    store.flush()
    assert len(slow.stored) == 3 and store.stats()["queue_depth"] == 0
    assert all(slow.stored[key(i)] == payload(i, BLOCK) for i in range(3))
    store.close()


def test_bytes_changed_in_ram_after_commit_are_not_written_through(make_arena: Any) -> None:
    """A block scribbled in RAM between its commit and its write-through stays out of the
    lower tiers (counted), and the blocks around it are written as usual."""
    slow = SlowTier()
    store = TieredStore(make_arena(4 * EXTENT, EXTENT), [slow], WriteBehindConfig(8))
    commit(store, 0)
    while store.stats()["queue_depth"]:  # the writer holds block 0 at the gate
        time.sleep(0.001)
    commit(store, 1)
    commit(store, 2)
    assert store.stats()["pending_writes"] == 3
    offset = store.acquire(key(1), BLOCK)
    assert offset is not None
    store.view(offset.offset, BLOCK)[7] ^= 0xFF
    store.release(offset.offset)
    slow.gate.set()
    store.flush()
    assert sorted(slow.stored) == [key(0), key(2)]
    stats = store.stats()
    assert stats["corrupt_writes"] == 1 and stats["pending_writes"] == 0
    store.close()


def test_a_holder_pins_the_leading_prefix_and_drop_frees_it(
    make_arena: Any, tmp_path: Path
) -> None:
    disk = DiskTier(DiskConfig(str(tmp_path), 64 * EXTENT, segment_bytes=4 * EXTENT))
    store = TieredStore(make_arena(2 * EXTENT, EXTENT), [disk], WriteBehindConfig(64))
    for i in range(10):  # RAM holds 8: blocks 0 and 1 live on disk only
        commit(store, i)
        store.flush()
    holder = store.holder()
    resident = store.acquire_resident([key(i) for i in (2, 3, 0)], holder)
    assert [bytes(store.view(p.offset, BLOCK)) for p in resident] == [
        payload(i, BLOCK) for i in (2, 3)
    ], "RAM hits up to the first block RAM lacks"
    below = store.acquire_below([key(i) for i in (0, 1, 99, 5)], BLOCK, holder)
    assert [bytes(store.view(p.offset, BLOCK)) for p in below] == [
        payload(i, BLOCK) for i in (0, 1)
    ], "promoted from disk up to the first miss"
    assert store.check_integrity() == []
    store.drop(holder)  # its connection went away
    writer = store.holder()
    reserved = store.reserve_missing([key(i) for i in range(100, 108)], BLOCK, writer)
    assert len(reserved) == 8, "every slot can be reused: the holder left nothing pinned"
    store.drop(writer)
    store.close()


def test_write_through_waits_for_an_idle_core_unless_a_flush_or_a_full_queue_hurries_it(
    make_arena: Any, tmp_path: Path
) -> None:
    """A machine whose every core stays busy (the writer's own CPU aside) holds the writes
    back; a flush sends them at once, and so does a queue three quarters full."""

    def busy() -> IdleGate:
        t0 = time.monotonic()

        def sample() -> CpuSample:
            dt = time.monotonic() - t0
            return CpuSample(2.0 * dt, 0.0, t0 + dt)

        return IdleGate(window_s=0.01, max_wait_s=60, sample=sample, cores=2)

    disk = DiskTier(DiskConfig(str(tmp_path / "d"), capacity_bytes=4 << 20))
    store = TieredStore(make_arena(EXTENT * 16, EXTENT), [disk], WriteBehindConfig(8), busy)
    commit(store, 1)
    time.sleep(0.3)
    assert disk.stats().counters["bytes_in"] == 0  # still waiting for a spare core
    for i in range(2, 9):  # past three quarters of 8 queued, the writer goes at once
        commit(store, i)
    deadline = time.monotonic() + 5
    while disk.stats().blocks < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert 1 <= disk.stats().blocks < 8  # down to below three quarters, then it waits again
    t0 = time.monotonic()
    store.flush()
    assert time.monotonic() - t0 < 5 and disk.stats().blocks == 8
    store.close()
