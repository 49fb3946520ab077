"""A bench process stopped with SIGTERM stops the servers it started instead of orphaning them
(each runs in its own session, so a signal to the bench's group never reaches them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import time
from kvkeep.bench.deploy.cache import CacheServer, CacheSpec
with CacheServer(CacheSpec(ram="64MiB", disk="0")) as cache:
    print(cache.socket, flush=True)
    time.sleep(120)
"""


def _pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_sigterm_to_a_bench_stops_its_cache_server() -> None:
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout is not None
        directory = str(Path(bench.stdout.readline().strip()).parent)
        servers = [p for p in _pids_mentioning(directory) if p != bench.pid]
        assert servers, "the cache server should be running"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) != 0
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in servers):
            assert time.monotonic() < deadline, f"cache server {servers} outlived the bench"
            time.sleep(0.1)
        assert not Path(directory).exists(), "its state directory is removed"
    finally:
        bench.kill()
        bench.wait()


INNER_TEST = """
import time
from pathlib import Path
from kvkeep.bench.deploy.cache import CacheServer, CacheSpec

def test_holds_a_server():
    with CacheServer(CacheSpec(ram="64MiB", disk="0")) as cache:
        Path({marker!r}).write_text(cache.socket)
        time.sleep(120)

def test_never_reached():
    Path({marker!r} + ".later").write_text("ran")
"""


def test_sigterm_to_pytest_ends_the_session_and_stops_the_server(tmp_path: Path) -> None:
    """A CI job stopped by SIGTERM must end the test session (teardown included), not fail
    one test and carry on."""
    marker = tmp_path / "socket"
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(INNER_TEST.format(marker=str(marker)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    inner = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert inner.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        directory = str(Path(marker.read_text()).parent)
        servers = [p for p in _pids_mentioning(directory) if p != inner.pid]
        assert servers
        inner.send_signal(signal.SIGTERM)
        assert inner.wait(30) != 0
        assert not Path(str(marker) + ".later").exists(), "the session went on after SIGTERM"
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in servers):
            assert time.monotonic() < deadline, f"cache server {servers} outlived pytest"
            time.sleep(0.1)
    finally:
        inner.kill()
        inner.wait()
