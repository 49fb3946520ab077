"""The disk tier: append-only, checksummed segment files with a sealed index per segment.

``DIR/seg-NNNNNNNN.log`` holds records (``header || payload``; ``diskformat.py`` gives the
header and index layouts), appended to the newest, active segment; its ``.idx`` is written
(tmp + rename) when a segment is sealed, so start-up never reads a sealed ``.log``. Contract:
a block is served only if its header names the key asked for with the length and checksum
(XXH3-64) the index holds, and its payload passes the checksum on every load; a mismatch is a
counted miss and the key is dropped and tombstoned. A torn record after SIGKILL is cut off at
start-up; a segment of another ``VERSION`` is deleted, never read (its blocks are recomputed).
Capacity is FIFO by whole segments, oldest first (RAM above serves recency); on ENOSPC the
append is cut off, the oldest segment deleted and the append tried once more, else ``put``
raises OSError. Each record's pages go to the device right after its append.
Crash safety, writeback and ENOSPC in detail: docs/notes/disk-tier.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvkeep.store.base import Found, StoreKey, TierCounters, TierStats, checksum
from kvkeep.store.diskformat import (
    HEADER_BYTES,
    KIND_DATA,
    KIND_TOMBSTONE,
    VERSION,
    Record,
    format_version,
    pack_header,
    read_index,
    unpack_header,
    write_index,
)
from kvkeep.store.keyformat import namespace_of

_MiB = 1 << 20

log = logging.getLogger("kvkeep.store.disk")

# Left to the kernel, dirty pages are flushed 30 s later by its own threads at normal
# priority, in the middle of whatever the engine computes then.
SYNC_FILE_RANGE_WRITE = 2  # Linux: start writeback of the range's dirty pages, do not wait


def _find_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _find_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Start writing ``[offset, offset + length)`` of ``fd`` to its device now, on this thread,
    without waiting for it to land (no durability: that is ``fsync``'s). False where the
    platform has no ``sync_file_range`` or the call failed; the kernel then flushes later."""
    if _SYNC_FILE_RANGE is None:
        return False
    return _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0  # GIL released


@dataclass(frozen=True)
class DiskConfig:
    """A disk tier in ``directory`` holding at most ``capacity_bytes`` of segment files.

    ``segment_bytes`` 0 means capacity / 64, clamped to [1 MiB, 1 GiB]: small enough that FIFO
    eviction frees little at a time, large enough to keep the open file count low.
    """

    directory: str
    capacity_bytes: int
    segment_bytes: int = 0
    fsync_on_seal: bool = True

    @property
    def effective_segment_bytes(self) -> int:
        if self.segment_bytes:
            return self.segment_bytes
        return min(max(self.capacity_bytes // 64, _MiB), 1024 * _MiB)

    def __post_init__(self) -> None:
        if self.capacity_bytes < 2 * self.effective_segment_bytes:
            raise ValueError(
                f"disk capacity {self.capacity_bytes} must hold two segments of "
                f"{self.effective_segment_bytes} bytes; raise --disk"
            )


class _Loc(NamedTuple):
    segment: int
    offset: int
    length: int
    checksum: int


@dataclass
class _Segment:
    id: int
    fd: int
    size: int = 0
    records: list[Record] = field(default_factory=list)
    sealed: bool = False


class DiskTier:
    """The persistent tier. Thread-safe; reads run outside the lock."""

    name = "disk"

    def __init__(self, config: DiskConfig) -> None:
        self.config = config
        self.dir = Path(config.directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: dict[StoreKey, _Loc] = {}
        self._segments: dict[int, _Segment] = {}
        self._counters = TierCounters()
        self._used = 0
        self._full_logged = False
        started = time.perf_counter()
        self._rebuild()
        self.rebuild_seconds = time.perf_counter() - started

    # --- Tier protocol ---------------------------------------------------------------------

    def contains(self, key: StoreKey) -> bool:
        return key in self._index

    def get(self, key: StoreKey, out: memoryview) -> Found | None:
        with self._lock:
            loc = self._index.get(key)
            if loc is not None:
                fd = self._segments[loc.segment].fd
        if loc is None or loc.length > len(out):
            self._counters.misses += 1
            return None
        target, header = out[: loc.length], bytearray(HEADER_BYTES)
        started = time.perf_counter_ns()
        try:
            wanted = HEADER_BYTES + loc.length
            complete = os.preadv(fd, [header, target], loc.offset - HEADER_BYTES) == wanted
        except OSError:  # the segment was evicted (its fd closed) while we read it
            complete = False
        read = time.perf_counter_ns()
        record = unpack_header(bytes(header), loc.offset) if complete else None
        expected = Record(key, loc.offset, loc.length, loc.checksum, KIND_DATA)
        intact = record == expected and checksum(target) == loc.checksum
        self._counters.read_ns += read - started
        self._counters.verify_ns += time.perf_counter_ns() - read
        if not intact:
            self._drop_corrupt(key, loc)
            return None
        self._counters.hits += 1
        self._counters.bytes_out += loc.length
        return Found(loc.length, loc.checksum)

    def put(self, key: StoreKey, data: memoryview, checksum: int) -> bool:
        record_bytes = HEADER_BYTES + len(data)
        with self._lock:
            if key in self._index:
                return False
            if record_bytes > self.config.effective_segment_bytes:
                self._counters.rejected_puts += 1
                return False
            self._make_room(record_bytes)
            try:
                fd, end = self._append(KIND_DATA, key, data, checksum)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or not self._free_space_after(exc):
                    raise
                fd, end = self._append(KIND_DATA, key, data, checksum)  # may raise (counted)
            self._counters.bytes_in += len(data)
        # Outside the lock: submitting the I/O may wait for the device's queue, reads may not.
        # Were the segment deleted meanwhile by another put, a stale ``fd`` costs nothing:
        # the call fails, or starts the writeback of whichever file now holds the number.
        start_writeback(fd, end - record_bytes, record_bytes)
        return True

    def evict(self, key: StoreKey) -> bool:
        with self._lock:
            if self._index.pop(key, None) is None:
                return False
            self._tombstone(key)
            self._counters.evictions += 1
            return True

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                self.name,
                self._counters.as_dict(),
                len(self._index),
                self._used,
                self.config.capacity_bytes,
            )

    def namespace_blocks(self) -> Counter[bytes]:
        """Blocks held per namespace digest. O(blocks): call it off the event loop."""
        with self._lock:
            keys = list(self._index)
        return Counter(namespace_of(key) for key in keys)

    # --- lifecycle -------------------------------------------------------------------------

    def flush(self) -> None:
        """Make every record written so far durable (fsync the active segment)."""
        with self._lock:
            os.fsync(self._active.fd)

    def close(self) -> None:
        """Seal the active segment (so the next start reads only indexes) and close files."""
        with self._lock:
            if self._active.size:
                self._seal(self._active)
            for segment in self._segments.values():
                os.close(segment.fd)
            self._segments.clear()

    # --- writing (lock held) ---------------------------------------------------------------

    @property
    def _active(self) -> _Segment:
        return self._segments[max(self._segments)]

    def _append(
        self, kind: int, key: StoreKey, data: bytes | memoryview, block_checksum: int
    ) -> tuple[int, int]:
        """Write one record at the end of the active segment, or nothing at all; the file
        descriptor and the offset the record ends at.

        A failed or short write (a full filesystem) is cut off the file again, counted in
        ``write_errors`` and raised as OSError, so the segment never holds a torn record.
        """
        segment = self._active
        header = pack_header(kind, key, len(data), block_checksum)
        try:
            written = os.pwritev(segment.fd, [header, data], segment.size)
            if written != HEADER_BYTES + len(data):
                raise OSError(errno.ENOSPC, f"short write: {written} bytes")
        except OSError:
            self._counters.write_errors += 1
            with contextlib.suppress(OSError):
                os.ftruncate(segment.fd, segment.size)
            raise
        record = Record(key, segment.size + HEADER_BYTES, len(data), block_checksum, kind)
        segment.records.append(record)
        segment.size += HEADER_BYTES + len(data)
        self._used += HEADER_BYTES + len(data)
        if kind == KIND_DATA:
            self._index[key] = _Loc(segment.id, record.offset, record.length, block_checksum)
        written_at = (segment.fd, segment.size)
        if segment.size >= self.config.effective_segment_bytes:
            self._seal(segment)
            self._open_segment(segment.id + 1)
        return written_at

    def _make_room(self, record_bytes: int) -> None:
        while self._used + record_bytes > self.config.capacity_bytes:
            if not self._delete_oldest_segment():
                return

    def _delete_oldest_segment(self) -> bool:
        """Delete the oldest segment (rotating first if it is the active one); False if the
        tier holds nothing to delete."""
        oldest = self._segments[min(self._segments)]
        if not oldest.sealed:
            if not oldest.size:
                return False
            self._seal(oldest)
            self._open_segment(oldest.id + 1)
        self._delete_segment(oldest)
        return True

    def _free_space_after(self, exc: OSError) -> bool:
        """The filesystem is full below our capacity: evict the oldest segment, per policy."""
        if not self._full_logged:
            self._full_logged = True
            log.warning(
                "disk tier %s: filesystem full (%s) at %d bytes used of %d configured; "
                "evicting the oldest segments to make room (logged once)",
                self.dir,
                exc.strerror,
                self._used,
                self.config.capacity_bytes,
            )
        return self._delete_oldest_segment()

    def _tombstone(self, key: StoreKey) -> None:
        """Best effort: a tombstone that cannot be written only lets a dropped record come
        back after a restart, where it is checked (and dropped) again when read."""
        with contextlib.suppress(OSError):
            self._append(KIND_TOMBSTONE, key, b"", 0)

    def _seal(self, segment: _Segment) -> None:
        """No more appends to ``segment``. An index that cannot be written (disk full) only
        makes the next start-up scan the segment instead of reading its index."""
        segment.sealed = True
        try:
            if self.config.fsync_on_seal:
                os.fsync(segment.fd)
            write_index(self._path(segment.id, "idx"), segment.records, segment.size)
        except OSError as exc:
            self._counters.write_errors += 1
            log.warning("disk tier: could not write the index of segment %d: %s", segment.id, exc)

    def _open_segment(self, segment_id: int) -> _Segment:
        fd = os.open(self._path(segment_id, "log"), os.O_RDWR | os.O_CREAT, 0o600)
        segment = _Segment(segment_id, fd, os.fstat(fd).st_size)
        self._segments[segment_id] = segment
        return segment

    def _delete_segment(self, segment: _Segment) -> None:
        for record in segment.records:
            loc = self._index.get(record.key)
            if loc is not None and loc.segment == segment.id:
                del self._index[record.key]
                self._counters.evictions += 1
        del self._segments[segment.id]
        self._used -= segment.size
        self._path(segment.id, "idx").unlink(missing_ok=True)
        self._path(segment.id, "log").unlink(missing_ok=True)
        os.close(segment.fd)

    def _drop_corrupt(self, key: StoreKey, loc: _Loc) -> None:
        with self._lock:
            self._counters.misses += 1
            if self._index.get(key) != loc:
                return  # evicted while we read it (its fd may even have been reused): a miss
            self._counters.checksum_failures += 1
            log.warning("disk tier: dropped a corrupt record in segment %d", loc.segment)
            del self._index[key]
            if self._segments:
                self._tombstone(key)

    def _path(self, segment_id: int, suffix: str) -> Path:
        return self.dir / f"seg-{segment_id:08d}.{suffix}"

    # --- start-up --------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Replay every segment, oldest first; later records and tombstones win."""
        self._remove_strays()
        ids = sorted(int(p.stem.split("-")[1]) for p in self.dir.glob("seg-*.log"))
        ids = self._drop_other_versions(ids)
        for segment_id in ids:
            segment = self._open_segment(segment_id)
            self._load_segment(segment, is_last=segment_id == ids[-1])
        if not ids or self._segments[ids[-1]].sealed:
            self._open_segment(ids[-1] + 1 if ids else 1)

    def _remove_strays(self) -> None:
        """Index files a crash left behind: half-written ones, and those of deleted segments."""
        for path in self.dir.glob("seg-*.idx.tmp"):
            path.unlink(missing_ok=True)
        for path in self.dir.glob("seg-*.idx"):
            if not path.with_suffix(".log").exists():
                path.unlink(missing_ok=True)

    def _drop_other_versions(self, ids: list[int]) -> list[int]:
        """Delete the segments (and their indexes) written in another record format; the ids
        of the others. Their checksums mean something else, so they are never read."""
        others = [i for i in ids if format_version(self._path(i, "log")) not in (None, VERSION)]
        for segment_id in others:
            self._path(segment_id, "idx").unlink(missing_ok=True)
            self._path(segment_id, "log").unlink(missing_ok=True)
        if others:
            log.warning(
                "disk tier %s: deleted %d segments of another record format (this kvkeep "
                "writes version %d); their blocks will be recomputed",
                self.dir,
                len(others),
                VERSION,
            )
        return [i for i in ids if i not in others]

    def _load_segment(self, segment: _Segment, is_last: bool) -> None:
        records = read_index(self._path(segment.id, "idx"), segment.size)
        if records is None:
            records = self._scan(segment)
            if not is_last:
                with contextlib.suppress(OSError):  # disk full: scan it again next time
                    write_index(self._path(segment.id, "idx"), records, segment.size)
        segment.records = records
        # Only the newest segment without an index takes appends; all others are sealed.
        segment.sealed = not is_last or self._path(segment.id, "idx").exists()
        self._used += segment.size
        for record in records:
            self._replay(segment.id, record)

    def _replay(self, segment_id: int, record: Record) -> None:
        if record.kind == KIND_TOMBSTONE:
            self._index.pop(record.key, None)
        else:
            self._index[record.key] = _Loc(
                segment_id, record.offset, record.length, record.checksum
            )

    def _scan(self, segment: _Segment) -> list[Record]:
        """Read headers front to back; truncate the file at the first torn or bad record."""
        records: list[Record] = []
        pos = 0
        while pos + HEADER_BYTES <= segment.size:
            record = unpack_header(os.pread(segment.fd, HEADER_BYTES, pos), pos + HEADER_BYTES)
            if record is None or record.offset + record.length > segment.size:
                break
            records.append(record)
            pos = record.offset + record.length
        if pos != segment.size:
            self._counters.checksum_failures += 1
            os.ftruncate(segment.fd, pos)
            segment.size = pos
        return records


def drop_page_cache(directory: str) -> None:
    """Ask the kernel to forget cached pages of every segment (for cold-read benchmarks)."""
    for path in Path(directory).glob("seg-*.log"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
