from __future__ import annotations

import hashlib

import numpy as np

from kvkeep.keys import BlockKey, Namespace, chain_keys
from kvkeep.server.client import KVKeepClient, Session, SlotRef
from kvkeep.store.base import checksum

NS = Namespace("tiny-model", "bfloat16", "LBHNC", "cpu", block_size=16)
BLOCK = 64 * 1024


def keys(n: int, ns: Namespace = NS, offset: int = 0) -> list[BlockKey]:
    return chain_keys(ns, list(range(offset, offset + n * ns.block_size)), ns.block_size)


def payload(key: bytes, length: int = BLOCK) -> np.ndarray:
    seed = np.frombuffer(hashlib.sha256(key).digest(), dtype=np.uint8)
    return np.resize(seed, length)


def store(client: KVKeepClient, session: Session, block_keys: list[BlockKey]) -> list[SlotRef]:
    slots = client.reserve(session, block_keys)
    for slot in slots:
        client.slot_view(slot)[:] = payload(slot.key, slot.length)
    client.commit(session, slots, [checksum(payload(s.key, s.length).data) for s in slots])
    return slots


def read_back(client: KVKeepClient, session: Session, block_keys: list[BlockKey]) -> list[bytes]:
    slots = client.acquire(session, block_keys)
    try:
        assert all(client.verify(s) for s in slots)
        return [client.slot_view(s).tobytes() for s in slots]
    finally:
        client.release(slots)
