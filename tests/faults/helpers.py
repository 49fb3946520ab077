"""Blocks whose bytes are a function of their key, so any block served can be checked."""

from __future__ import annotations

import hashlib
import time

import numpy as np

from kvkeep.keys import BlockKey, Namespace, chain_keys
from kvkeep.server.client import KVKeepClient, Session, SlotRef
from kvkeep.store.base import checksum

NS = Namespace("tiny-model", "bfloat16", "LBHNC", "cpu", block_size=16)
BLOCK = 64 * 1024


def keys(n: int, ns: Namespace = NS, offset: int = 0) -> list[BlockKey]:
    """``n`` chained block keys of tokens ``offset, offset+1, ...`` in ``ns``."""
    return chain_keys(ns, list(range(offset, offset + n * ns.block_size)), ns.block_size)


def payload(key: bytes, length: int = BLOCK, tag: bytes = b"") -> np.ndarray:
    seed = np.frombuffer(hashlib.sha256(tag + key).digest(), dtype=np.uint8)
    return np.resize(seed, length)


def store(
    client: KVKeepClient, session: Session, block_keys: list[BlockKey], tag: bytes = b""
) -> list[SlotRef]:
    """Reserve, fill with ``payload(key, tag)`` and commit; returns the slots written."""
    slots = client.reserve(session, block_keys)
    for slot in slots:
        client.slot_view(slot)[:] = payload(slot.key, slot.length, tag)
    client.commit(session, slots, [checksum(payload(s.key, s.length, tag).data) for s in slots])
    return slots


def fetch(client: KVKeepClient, session: Session, block_keys: list[BlockKey]) -> list[bytes]:
    """The leading hits' bytes, each checked against the checksum the server sent with it."""
    slots = client.acquire(session, block_keys)
    try:
        assert all(client.verify(s) for s in slots), "a served block failed its checksum"
        return [client.slot_view(s).tobytes() for s in slots]
    finally:
        client.release(slots)


def drain(client: KVKeepClient, timeout_s: float = 30) -> None:
    """Wait until write-behind has finished every committed block, the one being written too."""
    deadline = time.monotonic() + timeout_s
    while client.stats()["pending_writes"]:
        assert time.monotonic() < deadline, "write-behind did not drain"
        time.sleep(0.02)


def disk_stats(client: KVKeepClient) -> dict[str, int]:
    stats: dict[str, int] = client.stats()["tiers"]["disk"]
    return stats
