"""The remote tier against a real redis-server: round trip, checksums, failures, rate, sharing."""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis

from kvkeep.store.keyformat import REMOTE_KEY_PREFIX
from kvkeep.store.redis_process import RedisProcess, create_cluster, free_cluster_port
from kvkeep.store.remote import (
    VALUE_HEADER,
    RemoteConfig,
    RemoteTier,
    WritePolicy,
    parse_remote_url,
)
from kvkeep.store.throttle import Breaker, TokenBucket
from kvkeep.store.tiered import ReserveStatus, TieredStore, WriteBehindConfig

from .helpers import crc, key, payload

KiB = 1024
BLOCK = 16 * KiB
EXTENT = 64 * KiB


def remote(server: RedisProcess, **overrides: Any) -> RemoteTier:
    return RemoteTier(RemoteConfig(server.url, **{"timeout_s": 0.2, **overrides}))


def put(tier: RemoteTier, i: int, length: int = BLOCK) -> bool:
    return tier.put(key(i), memoryview(payload(i, length)), crc(i, length))


def raw(server: RedisProcess) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


# --- configuration ----------------------------------------------------------------------------


def test_urls_name_one_node_or_a_cluster() -> None:
    one = parse_remote_url("valkey://10.0.0.5:6380/2")
    assert one.nodes == (("10.0.0.5", 6380),) and one.db == 2 and not one.cluster
    seeds = parse_remote_url("redis://a:7000,b:7001")
    assert seeds.cluster and seeds.nodes == (("a", 7000), ("b", 7001))
    assert parse_remote_url("valkey+cluster://a:7000").cluster
    auth = parse_remote_url("rediss://user:p%40ss@h:1")
    assert auth.tls and auth.username == "user" and auth.password == "p@ss"
    for bad in ("h:1", "http://h:1", "redis://h", "redis://h:1/x", "redis://a:1,b:2/3"):
        with pytest.raises(ValueError, match="--remote"):
            parse_remote_url(bad)


def test_config_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="--remote-timeout"):
        RemoteConfig("redis://h:1", timeout_s=0)
    with pytest.raises(ValueError, match="--remote-rate"):
        RemoteConfig("redis://h:1", write_rate_bytes=-1)


def test_token_bucket_bounds_bytes_over_any_window() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=1000, burst=100, clock=lambda: now[0])
    assert bucket.charge(100) == 0.0  # the burst goes at once
    assert bucket.charge(500) == pytest.approx(0.5)  # then the debt is paid at the rate
    now[0] = 0.5
    assert bucket.charge(1000) == pytest.approx(1.0)
    assert TokenBucket(rate=0, burst=0).charge(1 << 30) == 0.0  # 0: no limit


def test_breaker_backs_off_doubling_and_closes_on_success() -> None:
    now = [0.0]
    breaker = Breaker(0.5, 2.0, clock=lambda: now[0])
    assert breaker.allow() and breaker.failure()
    assert not breaker.allow() and not breaker.failure()  # second failure: 1.0 s
    now[0] = 0.99
    assert not breaker.allow()
    now[0] = 1.0
    assert breaker.allow()
    breaker.success()
    assert breaker.allow() and not breaker.is_open


# --- against redis-server -----------------------------------------------------------------------


def test_round_trip_through_a_fresh_tier(redis_server: RedisProcess) -> None:
    writer = remote(redis_server)
    assert all(put(writer, i) for i in range(4))
    assert writer.flush()
    reader = remote(redis_server)  # knows nothing locally: must ask the store
    assert not reader.contains(key(0))
    assert reader.contains_many([key(i) for i in (0, 1, 9, 3)]) == [True, True, False, True]
    assert reader.contains(key(0)), "a batch answer is remembered for contains()"
    out = bytearray(BLOCK + 100)
    found = reader.get(key(2), memoryview(out))
    assert found is not None and found.length == BLOCK and found.checksum == crc(2, BLOCK)
    assert bytes(out[:BLOCK]) == payload(2, BLOCK)
    assert reader.get(key(9), memoryview(out)) is None
    assert reader.get(key(2), memoryview(bytearray(BLOCK - 1))) is None, "too long for out"
    counters = reader.stats().counters
    assert (counters["hits"], counters["misses"], counters["errors"]) == (1, 2, 0)
    assert writer.stats().counters["bytes_in"] == 4 * BLOCK
    stored = raw(redis_server).get(REMOTE_KEY_PREFIX + key(2))
    assert stored is not None and len(stored) == VALUE_HEADER.size + BLOCK
    writer.close(), reader.close()


def test_checksum_mismatch_is_a_counted_miss_and_deletes_the_value(
    redis_server: RedisProcess,
) -> None:
    tier = remote(redis_server)
    put(tier, 1)
    tier.flush()
    rkey = REMOTE_KEY_PREFIX + key(1)
    value = bytearray(raw(redis_server).get(rkey) or b"")
    value[-1] ^= 0xFF  # bit rot in the payload
    raw(redis_server).set(rkey, bytes(value))
    assert tier.get(key(1), memoryview(bytearray(BLOCK))) is None
    assert tier.stats().counters["checksum_failures"] == 1
    assert tier.stats().counters["misses"] == 1
    assert raw(redis_server).exists(rkey) == 0, "a corrupt value is deleted for everyone"
    assert not tier.contains(key(1))
    raw(redis_server).set(REMOTE_KEY_PREFIX + key(2), b"short")  # not even a header
    assert tier.get(key(2), memoryview(bytearray(BLOCK))) is None
    assert tier.stats().counters["checksum_failures"] == 2


def test_a_value_of_the_crc32_format_is_refused_not_misread(redis_server: RedisProcess) -> None:
    """A value written by kvkeep before XXH3-64 ("KVB1": length u32, CRC-32 u32), even one
    found under the current prefix, is a counted miss and deleted; its bytes are never
    served. (Under its own prefix, ``kvkeep:1:``, it is never even asked for.)"""
    tier = remote(redis_server)
    data = payload(3, BLOCK)
    old = struct.pack("<4sII", b"KVB1", BLOCK, zlib.crc32(data)) + data
    raw(redis_server).set(REMOTE_KEY_PREFIX + key(3), old)
    out = bytearray(BLOCK)
    assert tier.get(key(3), memoryview(out)) is None
    assert tier.stats().counters["checksum_failures"] == 1
    assert raw(redis_server).exists(REMOTE_KEY_PREFIX + key(3)) == 0
    assert REMOTE_KEY_PREFIX != b"kvkeep:1:", "the CRC-32 format's keys are not this format's"
    tier.close()


def test_stopped_store_means_fast_counted_misses_then_recovery(
    redis_server: RedisProcess,
) -> None:
    tier = remote(redis_server, backoff_s=0.3, max_backoff_s=0.3)
    put(tier, 0)
    tier.flush()
    redis_server.stop()
    started = time.monotonic()
    for _ in range(50):  # the breaker answers these without the network
        assert tier.contains_many([key(0), key(1)]) == [False, False]
        assert tier.get(key(0), memoryview(bytearray(BLOCK))) is None
        put(tier, 5)
    assert time.monotonic() - started < 1.0
    counters = tier.stats().counters
    assert counters["errors"] >= 1 and counters["misses"] >= 150
    redis_server.start()  # same port, empty store (no persistence)
    time.sleep(0.35)  # let the breaker's backoff pass
    assert tier.contains_many([key(0)]) == [False], "the store came back empty"
    assert put(tier, 0) and tier.flush()
    assert tier.contains_many([key(0)]) == [True]
    tier.close()


def test_hung_store_costs_one_timeout_not_a_hang(redis_server: RedisProcess) -> None:
    tier = remote(redis_server, timeout_s=0.1, backoff_s=5.0, max_backoff_s=5.0)
    assert tier.contains_many([key(0)]) == [False]  # connected
    redis_server.pause()
    started = time.monotonic()
    assert tier.contains_many([key(0)]) == [False]
    assert tier.get(key(0), memoryview(bytearray(BLOCK))) is None
    assert not put(tier, 0), "puts are dropped while the store is down"
    assert time.monotonic() - started < 1.0, "one timeout (0.1 s), not the 5 s backoff"
    assert tier.stats().counters["errors"] == 1
    assert tier.stats().counters["dropped_puts"] == 1
    redis_server.resume()
    tier.close(drain_s=0.5)


def test_write_rate_is_bounded_and_put_never_waits(redis_server: RedisProcess) -> None:
    rate = 1 << 20  # 1 MiB/s; burst a tenth of that
    tier = remote(redis_server, write_rate_bytes=rate, queue_bytes=8 << 20)
    started = time.monotonic()
    assert all(put(tier, i, 64 * KiB) for i in range(24))  # 1.5 MiB
    assert time.monotonic() - started < 0.5, "put only queues (sending takes 1.5 s)"
    assert tier.flush(10)
    elapsed = time.monotonic() - started
    sent = 24 * (64 * KiB + VALUE_HEADER.size)
    assert elapsed >= (sent - rate / 10) / rate * 0.95
    assert elapsed < sent / rate + 1.0
    assert raw(redis_server).dbsize() == 24
    tier.close()


def test_full_queue_drops_and_counts(redis_server: RedisProcess) -> None:
    tier = remote(redis_server, write_rate_bytes=64 * KiB, queue_bytes=4 * BLOCK)
    results = [put(tier, i) for i in range(20)]
    assert results.count(False) >= 10
    assert tier.stats().counters["dropped_puts"] == results.count(False)
    tier.close(drain_s=0.1)
    assert tier.stats().counters["dropped_puts"] + raw(redis_server).dbsize() == 20


def test_a_cluster_from_a_seed_list(tmp_path: Path) -> None:
    nodes = [
        RedisProcess(tmp_path / f"n{i}", "32mb", port=free_cluster_port(), cluster=True)
        for i in range(3)
    ]
    try:
        for node in nodes:
            node.start()
        url = create_cluster(nodes)
        writer = RemoteTier(RemoteConfig(url, timeout_s=0.5))
        assert all(put(writer, i) for i in range(40)) and writer.flush()
        assert writer.stats().counters["errors"] == 0
        one_seed = f"valkey+cluster://127.0.0.1:{nodes[2].port}"
        reader = RemoteTier(RemoteConfig(one_seed, timeout_s=0.5))
        assert reader.contains_many([key(i) for i in range(41)]) == [True] * 40 + [False]
        out = memoryview(bytearray(BLOCK))
        assert reader.get(key(33), out) is not None and bytes(out) == payload(33, BLOCK)
        writer.close(), reader.close()
    finally:
        for node in nodes:
            node.stop()


def test_server_side_lru_evicts_under_maxmemory(tmp_path: Path) -> None:
    small = RedisProcess(tmp_path / "small", maxmemory="2mb")
    small.start()
    try:
        tier = remote(small, write_rate_bytes=0)
        for i in range(64):  # 4 MiB into a 2 MiB store: the oldest go
            put(tier, i, 64 * KiB)
            tier.flush()
        present = tier.contains_many([key(i) for i in range(64)])
        assert not present[0] and present[-1] and 0 < sum(present) < 64
        tier.close()
    finally:
        small.stop()


# --- inside the tiered store --------------------------------------------------------------------


def tiered(
    make_arena: Any, server: RedisProcess, policy: WritePolicy
) -> tuple[TieredStore, RemoteTier]:
    tier = remote(server, write_policy=policy, write_rate_bytes=0)
    on_evict = frozenset({"remote"}) if policy is WritePolicy.ON_EVICT else frozenset()
    store = TieredStore(make_arena(EXTENT, EXTENT), [tier], WriteBehindConfig(64, on_evict))
    return store, tier


def commit(store: TieredStore, i: int) -> None:
    reservation = store.reserve(key(i), BLOCK)
    assert reservation.status is ReserveStatus.RESERVED
    store.view(reservation.offset, BLOCK)[:] = payload(i, BLOCK)
    assert store.commit(reservation.offset, crc(i, BLOCK))


def flush(store: TieredStore, tier: RemoteTier) -> None:
    store.flush()
    assert tier.flush()


def test_block_written_by_one_store_is_a_remote_hit_for_another(
    make_arena: Any, redis_server: RedisProcess
) -> None:
    a, a_remote = tiered(make_arena, redis_server, WritePolicy.THROUGH)
    b, _ = tiered(make_arena, redis_server, WritePolicy.THROUGH)
    for i in range(3):
        commit(a, i)
    flush(a, a_remote)
    commit(b, 0)  # B has block 0 in RAM itself
    assert b.lookup([key(0), key(1), key(2), key(7)]) == (3, (0, 1, 1))
    pinned = b.acquire(key(1), BLOCK)
    assert pinned is not None and bytes(b.view(pinned.offset, BLOCK)) == payload(1, BLOCK)
    b.release(pinned.offset)
    assert b.lookup([key(1)]).tiers == (0,), "a remote load is promoted into RAM"
    assert b.stats()["tiers"]["remote"]["hits"] == 1  # type: ignore[index]
    a.close(), b.close()


def test_lookup_asks_the_store_once_per_prompt(make_arena: Any, redis_server: RedisProcess) -> None:
    store, tier = tiered(make_arena, redis_server, WritePolicy.THROUGH)
    calls: list[int] = []
    batch = tier.contains_many
    tier.contains_many = lambda keys: calls.append(len(keys)) or batch(keys)  # type: ignore[method-assign]
    for i in range(2):
        commit(store, i)
    flush(store, tier)
    keys = [key(i) for i in range(100)]
    assert store.lookup(keys[:2]).num_present == 2 and calls == [], "RAM hits stay local"
    assert store.lookup(keys).num_present == 2
    assert calls == [98], "one pipeline for every key past the last RAM hit"
    store.close()


def test_on_evict_policy_writes_only_blocks_leaving_ram(
    make_arena: Any, redis_server: RedisProcess
) -> None:
    store, tier = tiered(make_arena, redis_server, WritePolicy.ON_EVICT)
    for i in range(4):  # RAM holds exactly 4 blocks: nothing leaves yet
        commit(store, i)
    flush(store, tier)
    assert raw(redis_server).dbsize() == 0
    for i in range(4, 6):  # 0 and 1 are evicted (LRU) and go to the store
        commit(store, i)
    flush(store, tier)
    assert store.lookup([key(i) for i in range(6)]) == (6, (1, 1, 0, 0, 0, 0))
    assert raw(redis_server).dbsize() == 2
    store.close()


def test_unknown_on_evict_tier_is_refused(make_arena: Any) -> None:
    with pytest.raises(ValueError, match="not configured"):
        TieredStore(make_arena(EXTENT, EXTENT), [], WriteBehindConfig(8, frozenset({"remote"})))
