"""Two real kvkeep servers sharing one real redis-server through their remote tiers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from kvkeep.server.client import KVKeepClient
from kvkeep.store.redis_process import RedisProcess
from serverproc import Server

from .helpers import BLOCK, NS, keys, payload, read_back, store

RAM = ("--ram", "8MiB", "--extent", "1MiB")


def start_pair(factory: Any, url: str, timeout: str = "1.0") -> tuple[Server, Server]:
    """Two servers on one store. The timeout is generous except where a test measures it: on
    a loaded 2-core machine a 0.2 s round trip happens, and would (correctly) be a miss."""
    servers = []
    for name in ("a", "b"):
        srv = factory(*RAM, "--remote", url, "--remote-timeout", timeout, name=name)
        srv.start()
        servers.append(srv)
    return servers[0], servers[1]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def remote_stats(client: KVKeepClient) -> dict[str, int]:
    stats: dict[str, int] = client.stats()["tiers"]["remote"]
    return stats


def test_block_written_by_server_a_is_a_remote_hit_on_server_b(
    server_factory: Any, redis_server: RedisProcess
) -> None:
    a, b = start_pair(server_factory, redis_server.url)
    ca, cb = KVKeepClient(a.socket), KVKeepClient(b.socket)
    sa, sb = ca.hello(NS, BLOCK), cb.hello(NS, BLOCK)
    block_keys = keys(12)
    store(ca, sa, block_keys)
    db = redis.Redis(port=redis_server.port)
    wait_for(lambda: db.dbsize() == 12)  # write-through is asynchronous
    found = cb.lookup(sb, block_keys + keys(1, offset=9999))
    assert found.num_present == 12 and set(found.tiers) == {"remote"}
    expected = [payload(k).tobytes() for k in block_keys]
    assert read_back(cb, sb, block_keys) == expected, "B serves A's bytes"
    assert cb.lookup(sb, block_keys).tiers == ("ram",) * 12, "loads are promoted into RAM"
    stats = remote_stats(cb)
    assert stats["hits"] == 12 and stats["errors"] == 0
    assert remote_stats(ca)["bytes_in"] == 12 * BLOCK
    ca.close(), cb.close()


def test_store_stopped_mid_run_both_servers_keep_serving(
    server_factory: Any, redis_server: RedisProcess
) -> None:
    a, b = start_pair(server_factory, redis_server.url)
    ca, cb = KVKeepClient(a.socket), KVKeepClient(b.socket)
    sa, sb = ca.hello(NS, BLOCK), cb.hello(NS, BLOCK)
    warm = keys(4)
    store(ca, sa, warm)
    db = redis.Redis(port=redis_server.port)
    wait_for(lambda: db.dbsize() == 4)
    redis_server.stop()
    started = time.monotonic()
    assert cb.lookup(sb, warm).num_present == 0, "B misses: the store is gone"
    assert ca.lookup(sa, warm).tiers == ("ram",) * 4, "A still serves its RAM"
    fresh = keys(4, offset=5000)
    assert len(store(cb, sb, fresh)) == 4, "B still stores (the remote write is dropped)"
    assert read_back(cb, sb, fresh) == [payload(k).tobytes() for k in fresh]
    for _ in range(20):
        assert cb.lookup(sb, warm).num_present == 0
    assert time.monotonic() - started < 3.0, "no call waits on the dead store"
    stats = remote_stats(cb)
    assert stats["errors"] >= 1 and stats["misses"] >= 4
    wait_for(lambda: remote_stats(cb)["dropped_puts"] == 4)
    ca.close(), cb.close()


def test_hung_store_costs_one_timeout(server_factory: Any, redis_server: RedisProcess) -> None:
    a, _ = start_pair(server_factory, redis_server.url, timeout="0.2")
    client = KVKeepClient(a.socket, timeout_s=2.0)
    session = client.hello(NS, BLOCK)
    assert client.lookup(session, keys(2)).num_present == 0
    redis_server.pause()
    started = time.monotonic()
    for _ in range(10):
        assert client.lookup(session, keys(2)).num_present == 0
    assert time.monotonic() - started < 1.0
    stored = store(client, session, keys(2, offset=100))
    assert len(stored) == 2 and client.stats()["connections"] == 1
    redis_server.resume()
    client.close()


def test_write_on_eviction_sends_only_blocks_leaving_ram(
    server_factory: Any, redis_server: RedisProcess
) -> None:
    srv = server_factory(*RAM, "--remote", redis_server.url, "--remote-write", "evict")
    srv.start()
    client = KVKeepClient(srv.socket)
    session = client.hello(NS, BLOCK)
    db = redis.Redis(port=redis_server.port)
    store(client, session, keys(100))  # RAM holds 128 blocks of 64 KiB
    time.sleep(0.3)
    assert db.dbsize() == 0
    store(client, session, keys(40, offset=10_000))  # 12 of the first blocks are evicted
    wait_for(lambda: db.dbsize() == 12)
    assert client.lookup(session, keys(12)).tiers == ("remote",) * 12
    client.close()


def test_bad_remote_url_is_refused_with_what_to_change(tmp_path: Any) -> None:
    cmd = [sys.executable, "-m", "kvkeep.cli", "server", "--dir", str(tmp_path), "--ram", "8MiB"]
    proc = subprocess.run(
        [*cmd, "--remote", "http://127.0.0.1:1"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "valkey://HOST:PORT" in proc.stderr
