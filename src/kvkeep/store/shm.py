"""The shared-memory file the RAM tier's slots live in, mapped by the server and every client."""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path


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
