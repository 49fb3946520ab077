"""wait_for_quiet against the machine's real CPU time: processes that spin on every core."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvkeep.bench.quiet import cpu_times, wait_for_quiet

SPIN = (
    "import sys, time\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "while time.monotonic() < end: pass"
)


@contextmanager
def spinning(seconds: float) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One busy process per core for ``seconds``, stopped on exit in any case."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)])
             for _ in range(os.cpu_count() or 1)]  # fmt: skip
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


# The machine must be quiet once the spinners end: not beside another pytest-xdist worker.
@pytest.mark.whole_machine
def test_it_waits_for_busy_cores_to_go_idle() -> None:
    with spinning(1.5):
        time.sleep(0.2)  # they are running
        start = time.monotonic()
        waited, quiet = wait_for_quiet(timeout_s=20.0)
        assert time.monotonic() - start >= 1.0  # not before the spinners ended
    assert quiet and waited < 20.0


@pytest.mark.whole_machine
def test_it_gives_up_after_the_timeout_and_says_so() -> None:
    with spinning(60.0):
        time.sleep(0.2)
        waited, quiet = wait_for_quiet(timeout_s=1.0)
    assert not quiet and 1.0 <= waited < 5.0


def test_without_proc_stat_it_waits_one_window_and_says_it_could_not_tell(tmp_path: Path) -> None:
    missing = tmp_path / "stat"
    assert cpu_times(missing) is None
    waited, quiet = wait_for_quiet(window_s=0.1, stat=missing)
    assert not quiet and 0.1 <= waited < 1.0
