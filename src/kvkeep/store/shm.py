"""The shared-memory file the RAM tier's slots live in, mapped by the server and every client."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from pathlib import Path

MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23
CHUNK_BYTES = 2 << 20  # per madvise call: the mapping's lock is held for one chunk at a time


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
        """Allocate every page of the arena and map it into this process now (blocking; run
        it in a thread).

        Pages of a tmpfs file are otherwise allocated and zeroed on first touch, which halves
        the speed of the first write into each slot. Allocated pages still fault on this
        mapping's first touch: a promotion from disk, the kernel copying into a slot, ran at
        2.0 GB/s into an allocated arena and 3.3 GB/s into a populated one (512 MiB of 1 MiB
        records, page cache dropped, 2 cores). Raises OSError if /dev/shm is too small.
        """
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, self.size)
        finally:
            os.close(fd)
        populate(self.map)

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


def populate(arena_map: mmap.mmap) -> bool:
    """Map every page of ``arena_map`` into this process's page tables
    (``MADV_POPULATE_WRITE``, Linux 5.14+); False where the kernel cannot (the pages then
    fault in on first use). Blocks for about 0.2 s per GiB."""
    return _advise(arena_map, MADV_POPULATE_WRITE)


def unpopulate(arena_map: mmap.mmap) -> bool:
    """Drop this process's page-table entries of ``arena_map`` (``MADV_DONTNEED``), a chunk
    at a time, so that unmapping it later is cheap; False where the kernel refuses. The
    bytes stay in the shared file: a later read of the mapping faults them in again."""
    return _advise(arena_map, MADV_DONTNEED)


def _advise(arena_map: mmap.mmap, advice: int) -> bool:
    """``madvise(advice)`` over the whole map, ``CHUNK_BYTES`` at a time (the mapping's lock
    is held for one chunk per call); False at the first call the kernel refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buffer = (ctypes.c_char * len(arena_map)).from_buffer(arena_map)
    except (OSError, TypeError, ValueError):
        return False
    try:
        base = ctypes.addressof(buffer)
        for offset in range(0, len(arena_map), CHUNK_BYTES):
            length = ctypes.c_size_t(min(CHUNK_BYTES, len(arena_map) - offset))
            if libc.madvise(ctypes.c_void_p(base + offset), length, advice) != 0:
                return False
        return True
    finally:
        del buffer
