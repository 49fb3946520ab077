"""The writer's idle gate: holds the cache server's write-through back while the engine computes.

The writer asks ``IdleGate.busy`` before each block: how many cores the rest of the machine
(everything but the writer's own thread) kept busy since the last answer, from /proc/stat.
While the others leave less than ``spare_cores`` idle it waits, ``window_s`` at a time; once
they leave a core, it writes. Writes that wait too long still go (the caller decides: a queue
that fills, a flush, ``max_wait_s``). Where /proc/stat cannot be read, the machine never counts
as busy. Why SCHED_IDLE alone is not enough: docs/notes/background-work.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple


class CpuSample(NamedTuple):
    """Seconds every CPU of the machine spent busy, and this thread's own CPU seconds."""

    busy_s: float
    own_s: float
    at: float  # time.monotonic()


def read_cpu(path: str = "/proc/stat") -> CpuSample | None:
    """A sample now; None where ``path`` cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            fields = f.readline().split()
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(ticks) < 8 or fields[0] != b"cpu":
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return CpuSample(busy / os.sysconf("SC_CLK_TCK"), time.thread_time(), time.monotonic())


class IdleGate:
    """``busy()``: whether the rest of the machine left less than ``spare_cores`` cores idle
    over the last ``window_s`` or more. Call it from one thread (its own CPU is subtracted)."""

    def __init__(
        self,
        spare_cores: float = 0.75,
        window_s: float = 0.05,
        max_wait_s: float = 5.0,
        sample: Callable[[], CpuSample | None] = read_cpu,
        cores: int | None = None,
    ) -> None:
        self.spare_cores, self.window_s, self.max_wait_s = spare_cores, window_s, max_wait_s
        self._sample = sample
        self.cores = cores or os.cpu_count() or 1
        self._last = sample()
        self._busy = True  # until a whole window has been seen
        self.waited_s = 0.0  # in ``wait``, in all

    def busy(self) -> bool:
        now = self._sample()
        if now is None or self._last is None:
            self._last = now
            return False
        span = now.at - self._last.at
        if span < self.window_s:
            return self._busy  # too short for /proc/stat's ticks (10 ms): the last verdict
        others = (now.busy_s - self._last.busy_s) - (now.own_s - self._last.own_s)
        self._busy = self.cores - max(0.0, others) / span < self.spare_cores
        self._last = now
        return self._busy

    def wait(self, hurry: Callable[[], bool]) -> None:
        """Return once ``busy()`` is False, ``hurry()`` is True, or after ``max_wait_s``
        (the caller's ``hurry`` may bound a write's wait from its enqueueing)."""
        t0 = time.monotonic()
        while self.busy() and not hurry() and time.monotonic() - t0 < self.max_wait_s:
            time.sleep(self.window_s)
        self.waited_s += time.monotonic() - t0
