"""Checking a load's arena slots against their checksums, on one thread or several.

A load's checksums run on the host before its copy: on a GPU host one thread hashes at about
the rate of one core's memory bandwidth (~10 GB/s), below PCIe's 25-50 GB/s, so a big load
waits mostly for its checksums. ``SlotVerifier`` splits a big run of slots into contiguous
parts, one per thread (``checksum`` releases the GIL), and reports the first bad slot as a
single thread would. Small runs stay on the caller's thread: handing work to a thread costs
tens of microseconds, and on a 2-core machine whose cores run the forward it buys nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvkeep.background import unbind
from kvkeep.store.base import checksum

MIN_PARALLEL_BYTES = 8 << 20  # below this a run is checked on the caller's thread
MAX_THREADS = 8


def default_threads() -> int:
    """Threads for a device load's checksums: half the cores this process was started with
    (its parent's set, as ``unbind`` takes), within [1, MAX_THREADS]; the other half is left
    to vLLM's own threads."""
    try:
        cores = len(os.sched_getaffinity(os.getppid()) | os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores // 2))


class SlotVerifier:
    """``first_bad``: the index of the first slot whose bytes miss their checksum. Thread-safe
    for one caller at a time per instance (each loader has its own)."""

    def __init__(self, threads: int = 1, min_parallel_bytes: int = MIN_PARALLEL_BYTES) -> None:
        self.threads = max(1, threads)
        self.min_parallel_bytes = min_parallel_bytes
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, "kvkeep-verify", initializer=unbind)
            if self.threads > 1
            else None
        )

    def first_bad(self, views: Sequence[memoryview], expected: Sequence[int]) -> int:
        """The index of the first of ``views`` whose checksum is not ``expected``'s at the same
        index; ``len(views)`` when every one matches."""
        n = len(views)
        parts = min(self.threads, n)
        if self._pool is None or parts < 2 or sum(map(len, views)) < self.min_parallel_bytes:
            return _first_bad(views, expected, 0, n)
        bounds = [n * i // parts for i in range(parts + 1)]
        futures = [
            self._pool.submit(_first_bad, views, expected, bounds[i], bounds[i + 1])
            for i in range(1, parts)
        ]
        found = [_first_bad(views, expected, bounds[0], bounds[1])]
        found += [f.result() for f in futures]
        return min(found)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _first_bad(views: Sequence[memoryview], expected: Sequence[int], lo: int, hi: int) -> int:
    """The first index in [lo, hi) whose view misses its checksum; ``len(views)`` if none."""
    for i in range(lo, hi):
        if checksum(views[i]) != expected[i]:
            return i
    return len(views)
