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
from kvkeep.bench.launch import cache_server
with cache_server("64MiB") as socket_path:
    print(socket_path, flush=True)
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
        assert bench.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in servers):
            assert time.monotonic() < deadline, f"cache server {servers} outlived the bench"
            time.sleep(0.1)
        assert not Path(directory).exists(), "its state directory is removed"
    finally:
        bench.kill()
        bench.wait()
