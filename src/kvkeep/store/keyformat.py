"""The persisted key format: how a block is named on disk and in the shared Valkey/Redis tier.

A stored block's key is 64 bytes::

    store key  = namespace digest (32) || block key (32)
    namespace digest = sha256("kvkeep/store-ns/v2\\0" || client digest (32) || block_bytes u64 LE)

The client digest is ``kvkeep.keys.Namespace.digest()`` (model, dtypes, layout, block size,
rank, cache_salt, format version); the block key is its sha256 chain over tokens. Folding
``block_bytes`` into the namespace means a client announcing a known digest with another block
size can never be handed blocks of the wrong length: it simply has none.

Every byte of this is persisted: the disk tier writes store keys into its records and indexes,
and the remote tier uses ``kvkeep:<KEY_FORMAT_VERSION>:`` || store key. Changing how a key is
derived silently orphans every stored block, so any change must bump ``KEY_FORMAT_VERSION``
(which also moves the remote tier's default prefix); ``tests/store/test_keyformat.py`` pins a
known answer per version and fails on a change that does not.

Versions: 1, CRC-32 checksums. 2, XXH3-64 checksums in every stored value: the version is
folded into the namespace digest, so no key of one version equals a key of another anywhere,
and the remote prefix moves, so servers of both versions can share one Valkey without each
deleting the other's values as corrupt (the disk tier's own ``VERSION`` refuses old records).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

KEY_FORMAT_VERSION = 2

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
