"""The persisted key format: how a block is named on disk and in the shared Valkey/Redis tier.

A stored block's key is 64 bytes::

    store key  = namespace digest (32) || block key (32)
    namespace digest = sha256("kvkeep/store-ns/v2\\0" || client digest (32) || block_bytes u64 LE)

The client digest is ``kvkeep.keys.Namespace.digest()``; the block key is its sha256 chain
over tokens. With ``block_bytes`` folded in, a client of another block size has no blocks.
Every byte is persisted (disk records and indexes; the remote tier's key, after
``kvkeep:<KEY_FORMAT_VERSION>:``), so any change to how a key is derived must bump
``KEY_FORMAT_VERSION``, or every stored block is silently orphaned;
``tests/store/test_keyformat.py`` pins a known answer per version. Versions and why they
never alias: docs/notes/key-format.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

KEY_FORMAT_VERSION = 2  # 1: CRC-32 checksums; 2: XXH3-64 checksums in every stored value

StoreKey = NewType("StoreKey", bytes)
"""64 bytes: namespace digest (32) + block key (32). Keys of two namespaces never alias."""

NamespaceDigest = NewType("NamespaceDigest", bytes)
"""32 bytes: the first half of every store key of one namespace and block size."""

DIGEST_BYTES = 32
STORE_KEY_BYTES = 2 * DIGEST_BYTES
REMOTE_KEY_PREFIX = f"kvkeep:{KEY_FORMAT_VERSION}:".encode()
_NAMESPACE_TAG = f"kvkeep/store-ns/v{KEY_FORMAT_VERSION}\0".encode()


def namespace_digest(client_digest: bytes, block_bytes: int) -> NamespaceDigest:
    """The namespace a client's blocks of ``block_bytes`` bytes are stored under. Pure."""
    return NamespaceDigest(
        hashlib.sha256(_NAMESPACE_TAG + client_digest + block_bytes.to_bytes(8, "little")).digest()
    )


def store_keys(namespace: NamespaceDigest, block_keys: Sequence[bytes]) -> list[StoreKey]:
    """The store keys of ``block_keys`` (each 32 bytes; the caller has checked) in
    ``namespace``. Plain concatenation: this runs for every key of every request."""
    return [StoreKey(namespace + k) for k in block_keys]


def namespace_of(key: StoreKey) -> NamespaceDigest:
    """The namespace digest a store key belongs to."""
    return NamespaceDigest(key[:DIGEST_BYTES])
