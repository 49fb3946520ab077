"""Waiting for a quiet machine before a measurement starts.

When several engines are up at once (`kvkeep.bench.suite`, modes side by side), the one not
measured must not take the cores of the one that is: each keeps working a little after its
last request (vLLM polls its queues for 1 s after its last step; mode kvkeep stores a
prefill's blocks and writes them through to disk). What that cost: docs/notes/bench-quiet.md.

``wait_for_quiet`` reads the machine's CPU time (/proc/stat) and returns once a whole window
was nearly idle, or after a timeout. It looks at the machine, not at the processes, so it
also waits for whatever else was running.
"""

from __future__ import annotations

import time
from pathlib import Path

STAT = Path("/proc/stat")
BUSY_BELOW = 0.15  # of all cores: one core of 2 polling reads 0.5
WINDOW_S = 0.3
TIMEOUT_S = 20.0


def cpu_times(stat: Path = STAT) -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot; None where there is no /proc/stat.
    Idle and I/O wait count as not busy."""
    try:
        line = stat.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = [int(x) for x in line.split()[1:9]]  # user nice system idle iowait irq softirq steal
    if len(fields) < 5:
        return None
    total = sum(fields)
    return total - fields[3] - fields[4], total


def wait_for_quiet(
    busy_below: float = BUSY_BELOW,
    window_s: float = WINDOW_S,
    timeout_s: float = TIMEOUT_S,
    stat: Path = STAT,
) -> tuple[float, bool]:
    """Wait until the machine's cores were busy less than ``busy_below`` of one ``window_s``;
    (seconds waited, whether it got quiet). Without /proc/stat: one window's sleep, (that,
    False)."""
    start = time.monotonic()
    before = cpu_times(stat)
    while True:
        time.sleep(window_s)
        after = cpu_times(stat)
        waited = time.monotonic() - start
        if before is None or after is None:
            return waited, False
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total < busy_below:
            return waited, True
        if waited >= timeout_s:
            return waited, False
        before = after
