"""The persisted key format is pinned: a change without a version bump orphans stored data."""

from __future__ import annotations

import hashlib

from kvkeep.store import keyformat
from kvkeep.store.remote import RemoteConfig

# One known answer per key format version. Changing how store keys are derived must bump
# KEY_FORMAT_VERSION and add its answer here, never edit an existing one.
KNOWN = {
    1: "ff961e9f2d7d485fdc554e71b53430073162b5f1fd908053f8689d1f47d8cb81",
    2: "39284ac093879014a1fa7a8d3c69dc5ac2d7d2c9d99e1220ec71b2f564241818",
}


def _answer() -> str:
    ns = keyformat.namespace_digest(bytes(range(32)), 65536)
    keys = keyformat.store_keys(ns, [b"\x07" * 32, bytes(range(32, 64))])
    assert all(len(k) == keyformat.STORE_KEY_BYTES for k in keys)
    assert all(keyformat.namespace_of(k) == ns for k in keys)
    return hashlib.sha256(b"".join(keys)).hexdigest()


def test_key_format_matches_its_version() -> None:
    assert _answer() == KNOWN[keyformat.KEY_FORMAT_VERSION], (
        "the persisted key format changed: bump KEY_FORMAT_VERSION and add its known answer"
    )


def test_block_bytes_is_part_of_the_namespace() -> None:
    digest = bytes(32)
    assert keyformat.namespace_digest(digest, 4096) != keyformat.namespace_digest(digest, 8192)


def test_remote_keys_carry_the_version() -> None:
    assert (
        RemoteConfig("redis://h:1").key_prefix == f"kvkeep:{keyformat.KEY_FORMAT_VERSION}:".encode()
    )
