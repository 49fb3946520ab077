"""Checking a load's arena slots against their checksums, beside the load's copy.

``SlotVerifier.start`` returns a ``Check`` at once, its slots cut into parts of about
``PART_BYTES``. On a big load of big slots, helper threads check parts while the loader's
thread copies; the loader's thread checks, after each run it copied, the parts no helper has
taken (``Check.help``), then takes what is left and waits (``Check.result``). Small loads, and
loads of small slots, get no helper. The answer is the first bad slot, exactly as a single
thread would have found it. The mover decides what the copy does before that answer
(``Mover.scatter_checked``): the host copies straight into the engine's blocks and reports
those from the first bad slot on as failed; CUDA scatters only the good slots into the KV
cache. Why helpers, and when not: docs/notes/loads.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvkeep.host.background import unbind
from kvkeep.store.base import checksum

# Waking a helper costs tens of microseconds; with small slots both threads fight over the GIL.
MIN_PARALLEL_BYTES = 4 << 20  # below this a load is checked on the caller's thread
# ... and so is one of smaller slots than this: with a helper, a host load of 128 KiB slots
# ran at 3.9 GB/s against 4.3 alone, of 256 KiB slots at 5.6 against 4.8 (2 cores)
MIN_PARALLEL_SLOT_BYTES = 256 << 10
PART_BYTES = 1 << 20  # the share of slots a thread takes at a time (fits a core's L2)
MAX_THREADS = 8


def default_threads() -> int:
    """Threads for a device load's checksums: half the cores this process was started with
    (its parent's set, as ``unbind`` takes), within [1, MAX_THREADS]; the other half is left
    to vLLM's own threads."""
    return max(1, min(MAX_THREADS, _cores() // 2))


def host_threads(copy_threads: int) -> int:
    """Threads for a host load's checksums, the caller's included: two where the copy, on
    ``copy_threads`` threads, leaves a core free (a helper hashes while the caller copies);
    else one. On a CPU engine the copy runs on the engine's thread team, which holds every
    core it was given, and a helper beside it stalls the team: measured on 2 cores with
    2 MiB blocks, a load ran at 4.9 GB/s with a helper against 5.6 without."""
    return 2 if _cores() > copy_threads else 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(os.getppid()) | os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Check:
    """The checksums of one load, running (``SlotVerifier.start``). Slots are checked in
    parts, taken in order by whichever thread comes first: the helpers from the start, the
    loader's thread in ``help`` (right after it copied those slots, while they are in its
    cache) and in ``result``. ``result`` is the index of the first slot whose bytes miss
    their checksum (``len(views)`` when none does); once it has returned no thread reads a
    slot any more, so their pins may go."""

    def __init__(
        self,
        views: Sequence[memoryview],
        expected: Sequence[int],
        parts: list[tuple[int, int]],
        pool: ThreadPoolExecutor | None,
        helpers: int,
        first_bad: int | None = None,
    ) -> None:
        self._views, self._expected, self._parts = views, expected, parts
        self._taken = 0  # parts handed out so far
        self._first_bad = len(views) if first_bad is None else first_bad
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = (
            [pool.submit(self._work) for _ in range(helpers)] if pool is not None else []
        )
        self._result: int | None = None
        self.caller_s = 0.0  # the loader's thread's time in ``help`` and ``result``

    @classmethod
    def passed(cls, n: int) -> Check:
        """A check of ``n`` slots that every one passed (a copy without checksums)."""
        return cls([], [], [], None, 0, first_bad=n)

    def failed_before(self, index: int) -> bool:
        """Whether a slot before ``index`` is known to have failed already."""
        return self._first_bad < index

    def help(self, upto: int) -> None:
        """Check the parts that start before slot ``upto`` and that no helper has taken."""
        t0 = time.perf_counter()
        self._work(upto)
        self.caller_s += time.perf_counter() - t0

    def result(self) -> int:
        if self._result is None:
            t0 = time.perf_counter()
            self._work()
            for future in self._futures:
                future.result()
            self._result = self._first_bad
            self.caller_s += time.perf_counter() - t0
        return self._result

    def _take(self, upto: int | None) -> tuple[int, int] | None:
        with self._lock:
            if self._taken == len(self._parts):
                return None
            part = self._parts[self._taken]
            if upto is not None and part[0] >= upto:
                return None
            self._taken += 1
            return part

    def _work(self, upto: int | None = None) -> None:
        views, expected = self._views, self._expected
        while (part := self._take(upto)) is not None:
            lo, hi = part
            if lo >= self._first_bad:  # a slot before this part failed already
                continue
            for j in range(lo, hi):
                if checksum(views[j]) != expected[j]:
                    with self._lock:
                        self._first_bad = min(self._first_bad, j)
                    break


class SlotVerifier:
    """Starts a load's checksums on up to ``threads`` threads, the caller's included. One
    caller at a time per instance (each loader has its own)."""

    def __init__(
        self,
        threads: int = 1,
        min_parallel_bytes: int = MIN_PARALLEL_BYTES,
        min_parallel_slot_bytes: int = MIN_PARALLEL_SLOT_BYTES,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self.threads = max(1, threads)
        self.part_bytes = part_bytes
        self.min_parallel_bytes = min_parallel_bytes
        self.min_parallel_slot_bytes = min_parallel_slot_bytes
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, "kvkeep-verify", initializer=unbind)
            if self.threads > 1
            else None
        )

    def start(self, views: Sequence[memoryview], expected: Sequence[int]) -> Check:
        """Begin checking ``views`` against ``expected`` (same length): on the helper threads
        now when the load is big enough, else only as the caller ``help``s or asks."""
        n, total = len(views), sum(map(len, views))
        per_part = max(1, self.part_bytes * n // max(total, 1))
        parts = [(lo, min(n, lo + per_part)) for lo in range(0, n, per_part)] or [(0, 0)]
        shared = (
            self._pool is not None
            and total >= max(self.min_parallel_bytes, 1)
            and total >= n * self.min_parallel_slot_bytes
        )
        if not shared:
            return Check(views, expected, parts, None, 0)
        return Check(views, expected, parts, self._pool, min(self.threads - 1, len(parts)))

    def first_bad(self, views: Sequence[memoryview], expected: Sequence[int]) -> int:
        """The index of the first of ``views`` whose checksum is not ``expected``'s at the same
        index; ``len(views)`` when every one matches."""
        return self.start(views, expected).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
