from __future__ import annotations

import hashlib

from kvkeep.store.base import StoreKey, checksum

NS = b"n" * 32


def key(i: int, ns: bytes = NS) -> StoreKey:
    return StoreKey(ns + hashlib.sha256(str(i).encode()).digest())


def payload(i: int, length: int) -> bytes:
    seed = hashlib.sha256(f"payload{i}".encode()).digest()
    return (seed * (length // 32 + 1))[:length]


def crc(i: int, length: int) -> int:
    return checksum(payload(i, length))
