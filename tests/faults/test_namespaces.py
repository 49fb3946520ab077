"""Faults 4 and 5: a directory reused by a changed model (config, dtype, block size, format
version), and tenants with different cache_salt values, never share a byte; a namespace that
finds only others' blocks is logged once; TCP needs the token; the socket and arena are 0600."""

from __future__ import annotations

import dataclasses
import socket
import stat
from pathlib import Path

import numpy as np
import pytest

from kvkeep.server import protocol as p
from kvkeep.server.client import CacheRefused, KVKeepClient
from kvkeep.store.base import checksum

from .conftest import MakeServer, Server
from .helpers import BLOCK, NS, disk_stats, fetch, keys, payload, store

WARNING = "has no cached blocks here"

CHANGED = {
    "model config": (dataclasses.replace(NS, model_digest="tiny-model-v2"), BLOCK),
    "kv dtype": (dataclasses.replace(NS, kv_dtype="float16"), BLOCK),
    "block size": (dataclasses.replace(NS, block_size=32), 2 * BLOCK),
    "format version": (dataclasses.replace(NS, format_version=NS.format_version + 1), BLOCK),
    "same digest, other block bytes": (NS, BLOCK // 2),
}


@pytest.mark.parametrize("change", CHANGED)
def test_changed_model_gets_zero_hits_and_one_clear_warning(server: Server, change: str) -> None:
    old = KVKeepClient(server.socket)
    old_session = old.hello(NS, BLOCK, label="tiny-model bf16 bs16")
    tokens = list(range(8 * 32))  # the same prompt under both namespaces
    old_keys = keys(8, NS)
    store(old, old_session, old_keys)
    old.close()
    assert server.terminate() == 0
    server.start()  # RAM is empty; the disk holds only the old namespace
    ns, block_bytes = CHANGED[change]
    new_keys = [k for k in keys(len(tokens) // ns.block_size, ns)]
    for _ in range(3):  # several clients and HELLOs: still one warning
        client = KVKeepClient(server.socket)
        session = client.hello(ns, block_bytes, label="tiny-model changed")
        assert client.lookup(session, new_keys).num_present == 0
        assert client.acquire(session, new_keys) == []
        assert client.lookup(session, old_keys).num_present == 0, "not even the old keys"
        assert client.acquire(session, old_keys) == []
        client.close()
    writer = KVKeepClient(server.socket)
    session = writer.hello(ns, block_bytes)
    slot = writer.reserve(session, old_keys[:1])[0]  # the same key, its own namespace
    writer.slot_view(slot)[:] = 7
    writer.commit(session, [slot], [checksum(np.full(slot.length, 7, np.uint8).data)])
    old = KVKeepClient(server.socket)
    old_session = old.hello(NS, BLOCK)
    assert fetch(old, old_session, old_keys) == [payload(k).tobytes() for k in old_keys]
    assert fetch(writer, session, old_keys[:1]) == [bytes([7]) * block_bytes]
    assert disk_stats(old)["checksum_failures"] == 0
    warnings = [line for line in server.log_text().splitlines() if WARNING in line]
    assert len(warnings) == 1, warnings
    assert "'tiny-model changed'" in warnings[0] and "'tiny-model bf16 bs16'" in warnings[0]
    assert "8 blocks of 1 other namespace" in warnings[0]


def test_no_warning_for_a_fresh_or_matching_directory(server: Server) -> None:
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    store(client, session, keys(4))
    client.close()
    server.terminate()
    server.start()
    client = KVKeepClient(server.socket)
    session = client.hello(NS, BLOCK)
    assert client.lookup(session, keys(4)).num_present == 4
    assert WARNING not in server.log_text()


def test_cache_salts_never_share_blocks_in_any_tier(server: Server) -> None:
    tenants = {salt: dataclasses.replace(NS, cache_salt=salt) for salt in ("alice", "bob")}
    client = KVKeepClient(server.socket)
    sessions = {salt: client.hello(ns, BLOCK) for salt, ns in tenants.items()}
    chains = {salt: keys(6, ns) for salt, ns in tenants.items()}  # same tokens, same prompt
    assert chains["alice"] != chains["bob"]
    store(client, sessions["alice"], chains["alice"], tag=b"alice")
    for where in ("ram", "disk"):
        for salt, other in (("alice", "bob"), ("bob", "alice")):
            # Neither tenant's keys, nor the other's, are hits for the other namespace.
            assert client.lookup(sessions[other], chains[salt]).num_present == 0
            if salt == "bob":
                assert client.lookup(sessions[other], chains[other]).num_present == 6
        got = fetch(client, sessions["alice"], chains["alice"])
        assert got == [payload(k, tag=b"alice").tobytes() for k in chains["alice"]], where
        if where == "ram":
            client.close()
            server.terminate()
            server.start()  # everything now comes from disk
            client = KVKeepClient(server.socket)
            sessions = {salt: client.hello(ns, BLOCK) for salt, ns in tenants.items()}
            assert client.lookup(sessions["alice"], chains["alice"]).tiers == ("disk",) * 6


def test_tcp_needs_the_token_and_local_files_are_private(
    make_server: MakeServer, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"tenant-token\n")
    port = _free_port()
    srv = make_server(
        "--ram", "8MiB", "--disk", "32MiB", "--extent", "1MiB",
        "--listen", f"127.0.0.1:{port}", "--token-file", str(token),
    )  # fmt: skip
    srv.start()
    for bad in (None, b"", b"tenant-token-", b"x" * 4096):
        client = KVKeepClient(address=("127.0.0.1", port), token=bad, timeout_s=2)
        with pytest.raises(CacheRefused, match="unauthorized"):
            client.hello(NS, BLOCK)
    # A raw client that skips AUTH is refused and disconnected on its first request.
    with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
        raw.sendall(p.frame(p.request_body(1, p.Op.STATS, {})))
        assert b"unauthorized" in raw.recv(4096)
        assert raw.recv(1) == b"", "the connection is closed after the refusal"
    good = KVKeepClient(address=("127.0.0.1", port), token=b"tenant-token")
    session = good.hello(NS, BLOCK)
    store(good, session, keys(2))
    assert fetch(good, session, keys(2)) == [payload(k).tobytes() for k in keys(2)]
    arena = Path((srv.directory / "arena.path").read_text().strip())
    for path in (Path(srv.socket), arena, srv.directory / "server.lock"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for seg in (srv.directory / "disk").glob("seg-*.log"):
        assert stat.S_IMODE(seg.stat().st_mode) & 0o077 == 0, seg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
