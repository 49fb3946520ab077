"""Fault 1: the server dies (SIGKILL) again and again under a write burst from several client
processes, each with two threads sharing one client."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvkeep.server.client import KVKeepClient

from .conftest import Server
from .helpers import BLOCK, NS, disk_stats, fetch, keys, payload, store

CYCLES = 20
WORKERS = 3
WORKER = Path(__file__).with_name("burst_worker.py")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_cycles_under_write_burst(server: Server, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    outs = [tmp_path / f"worker-{w}.json" for w in range(WORKERS)]
    workers = [
        subprocess.Popen([sys.executable, str(WORKER), server.socket, str(w), str(stop), str(out)])
        for w, out in enumerate(outs)
    ]
    restarts: list[float] = []
    try:
        time.sleep(1.0)
        for cycle in range(CYCLES):
            server.kill()
            if cycle % 4 == 3:
                time.sleep(0.3)  # down for a while: clients back off and must come back
            server.start()
            restarts.append(time.time())
            time.sleep(0.6)
        time.sleep(1.5)  # a tail with the server up: everyone must have reconnected
    finally:
        stop.touch()
        for proc in workers:
            proc.wait(30)
    reports = [json.loads(out.read_text()) for out in outs]
    for report in reports:
        assert report["other"] == [], "clients may only ever see CacheUnavailable"
        assert report["bad_blocks"] == 0
        assert report["slowest"] < 1.0 + 0.5, "a call outlived the client's timeout"
        assert any(t > restarts[-1] for t in report["ok"]), "did not reconnect after a restart"
    assert sum(r["unavailable"] for r in reports) > 0, "the kills were felt"
    assert sum(r["served"] for r in reports) > 100
    # Reconnection is not a fluke of the last cycle: calls succeeded after most restarts.
    ok_times = sorted(t for r in reports for t in r["ok"])
    windows = zip(restarts, [*restarts[1:], float("inf")], strict=True)
    recovered = sum(any(a < t < b for t in ok_times) for a, b in windows)
    assert recovered >= CYCLES - 2
    # Torn tails were cut at start-up and the disk still serves what it kept, verified.
    stats = disk_stats(KVKeepClient(server.socket))
    assert stats["blocks"] > 0 and stats["hits"] + stats["misses"] >= 0
    assert server.alive()


def test_reconnects_to_a_restarted_server(server: Server) -> None:
    client = KVKeepClient(server.socket, timeout_s=1.0, max_backoff_s=0.1)
    session = client.hello(NS, BLOCK)
    first = client.stats()["instance"]
    server.kill()
    server.start()
    deadline = time.monotonic() + 5
    while True:
        try:
            client.lookup(session, [])
            break
        except Exception as exc:
            assert type(exc).__name__ == "CacheUnavailable"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert client.stats()["instance"] != first


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_first_call_after_a_restart_succeeds(server: Server, how: str) -> None:
    """A connection closed by a restart is retried once at once, not counted as a miss."""
    client = KVKeepClient(server.socket, timeout_s=1.0)
    session = client.hello(NS, BLOCK)
    block_keys = keys(3)
    store(client, session, block_keys)
    client.lookup(session, block_keys)  # the connection is in use and open
    if how == "kill":
        time.sleep(1.0)  # let write-behind reach the disk before the crash
        server.kill()
    else:
        server.terminate()
    server.start()
    assert client.lookup(session, block_keys).num_present == 3  # no CacheUnavailable first
    assert fetch(client, session, block_keys) == [payload(k).tobytes() for k in block_keys]
