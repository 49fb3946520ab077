"""The disk tier: round-trip, rebuild, corruption, torn tails, bounded capacity."""

from __future__ import annotations

import os
import struct
import sys
import zlib
from pathlib import Path

import pytest

import kvkeep.store.disk as disk_module
from kvkeep.store.disk import DiskConfig, DiskTier
from kvkeep.store.diskformat import HEADER_BYTES

from .helpers import crc, key, payload

KiB = 1024
SEG = 64 * KiB


def make(tmp_path: Path, capacity: int = 16 * SEG) -> DiskTier:
    return DiskTier(DiskConfig(str(tmp_path), capacity, segment_bytes=SEG, fsync_on_seal=False))


def put(disk: DiskTier, i: int, length: int = 10 * KiB) -> bool:
    return disk.put(key(i), memoryview(payload(i, length)), crc(i, length))


def get(disk: DiskTier, i: int, length: int = 10 * KiB) -> bytes | None:
    out = bytearray(length)
    found = disk.get(key(i), memoryview(out))
    return bytes(out) if found else None


def test_round_trip_and_restart(tmp_path: Path) -> None:
    disk = make(tmp_path)
    for i in range(20):  # spans several sealed segments plus an active one
        assert put(disk, i)
    assert get(disk, 3) == payload(3, 10 * KiB)
    disk.close()
    reopened = make(tmp_path)
    assert all(get(reopened, i) == payload(i, 10 * KiB) for i in range(20))
    assert reopened.stats().counters["checksum_failures"] == 0


def test_rebuild_without_close_scans_active_segment(tmp_path: Path) -> None:
    disk = make(tmp_path)
    for i in range(9):
        put(disk, i)
    disk.evict(key(4))
    # no close(): like SIGKILL, the active segment has no index
    reopened = make(tmp_path)
    assert [reopened.contains(key(i)) for i in range(9)] == [i != 4 for i in range(9)]
    assert get(reopened, 8) == payload(8, 10 * KiB)


def test_corrupt_record_is_a_counted_miss_and_removed(tmp_path: Path) -> None:
    disk = make(tmp_path)
    put(disk, 1)
    put(disk, 2)
    segment = sorted(tmp_path.glob("seg-*.log"))[0]
    with open(segment, "r+b") as f:  # flip one payload byte of record 1
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert get(disk, 1) is None
    assert disk.stats().counters["checksum_failures"] == 1
    assert not disk.contains(key(1)) and get(disk, 2) == payload(2, 10 * KiB)
    assert not make(tmp_path).contains(key(1)), "the removal survives a restart"


def test_truncated_tail_is_cut_and_counted(tmp_path: Path) -> None:
    disk = make(tmp_path)
    for i in range(3):
        put(disk, i)
    segment = sorted(tmp_path.glob("seg-*.log"))[-1]
    os.truncate(segment, segment.stat().st_size - 1000)
    reopened = make(tmp_path)
    assert reopened.stats().counters["checksum_failures"] == 1
    assert not reopened.contains(key(2)) and get(reopened, 1) == payload(1, 10 * KiB)
    assert put(reopened, 5) and get(reopened, 5) == payload(5, 10 * KiB)
    assert get(make(tmp_path), 5) is not None


def test_truncated_sealed_segment_falls_back_to_scan(tmp_path: Path) -> None:
    disk = make(tmp_path)
    for i in range(12):
        put(disk, i)
    disk.close()
    first = sorted(tmp_path.glob("seg-*.log"))[0]
    os.truncate(first, first.stat().st_size - 1)
    reopened = make(tmp_path)
    assert reopened.stats().counters["checksum_failures"] == 1
    returned = [i for i in range(12) if get(reopened, i) is not None]
    assert all(get(reopened, i) == payload(i, 10 * KiB) for i in returned)
    assert len(returned) == 11


def test_capacity_is_bounded_oldest_segment_first(tmp_path: Path) -> None:
    disk = make(tmp_path, capacity=4 * SEG)
    for i in range(40):
        put(disk, i)
    stats = disk.stats()
    assert stats.bytes_used <= 4 * SEG
    assert not disk.contains(key(0)) and disk.contains(key(39))
    present = [i for i in range(40) if disk.contains(key(i))]
    assert present == list(range(present[0], 40)), "eviction is oldest first"
    assert stats.counters["evictions"] == present[0]
    assert sum(p.stat().st_size for p in tmp_path.glob("seg-*.log")) <= 4 * SEG


def test_oversized_record_is_rejected(tmp_path: Path) -> None:
    disk = make(tmp_path)
    assert not put(disk, 1, SEG)
    assert disk.stats().counters["rejected_puts"] == 1


def _crc32_segment(path: Path, records: list[tuple[bytes, bytes]]) -> None:
    """A segment as kvkeep wrote it before XXH3-64 (record format version 1, CRC-32s)."""
    head = struct.Struct("<4sHHQ64sI")
    with open(path, "wb") as f:
        for k, data in records:
            header = head.pack(b"KVKR", 1, 0, len(data), k, zlib.crc32(data))
            f.write(header + struct.pack("<I", zlib.crc32(header)) + data)


def test_segments_of_the_crc32_format_are_deleted_not_read(tmp_path: Path) -> None:
    _crc32_segment(tmp_path / "seg-00000001.log", [(key(i), payload(i, 10 * KiB)) for i in (1, 2)])
    disk = make(tmp_path)
    assert not disk.contains(key(1)) and not disk.contains(key(2))
    assert disk.stats().counters["checksum_failures"] == 0, "an old format is not corruption"
    assert disk.stats().bytes_used == 0
    assert put(disk, 3) and get(disk, 3) == payload(3, 10 * KiB)
    disk.close()
    assert get(make(tmp_path), 3) == payload(3, 10 * KiB)


def test_start_writeback_sends_a_range_to_the_device(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * (1 << 20))
        if sys.platform == "linux":
            assert disk_module.start_writeback(fd, 0, 1 << 20)
    finally:
        os.close(fd)
    assert not disk_module.start_writeback(fd, 0, 1 << 20)  # a closed descriptor: nothing started


def test_each_put_starts_the_writeback_of_its_own_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer thread sends each record to the device as it appends it (the range it
    wrote, header included), so the kernel's flusher never writes it later beside a forward."""
    calls: list[tuple[int, int, bool]] = []
    real = disk_module.start_writeback

    def spy(fd: int, offset: int, length: int) -> bool:
        calls.append((offset, length, real(fd, offset, length)))
        return calls[-1][2]

    monkeypatch.setattr(disk_module, "start_writeback", spy)
    tier = DiskTier(DiskConfig(str(tmp_path), capacity_bytes=8 << 20))
    first, second = payload(1, 3000), payload(2, 5000)
    assert tier.put(key(1), memoryview(first), crc(1, 3000))
    assert tier.put(key(2), memoryview(second), crc(2, 5000))
    assert not tier.put(key(1), memoryview(first), crc(1, 3000))  # held already: nothing written
    linux = sys.platform == "linux"
    assert calls == [(0, HEADER_BYTES + 3000, linux),
                     (HEADER_BYTES + 3000, HEADER_BYTES + 5000, linux)]  # fmt: skip
    tier.close()
