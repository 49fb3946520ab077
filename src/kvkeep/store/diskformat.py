"""The disk tier's on-disk format: record headers and segment indexes (see ``disk.py``).

A record is ``header || payload``; the header (96 bytes, little-endian) is::

    magic "KVKR" | version u16 | kind u16 (0 data, 1 tombstone) | length u64 |
    key 64 bytes | payload checksum u64 | header checksum u64 (over the 88 bytes before it)

An index (``seg-N.idx``) is a header (magic "KVKI", version, count, segment size, checksum of
the body) and one fixed-size row per record. ``VERSION`` names both formats, checksum included.
Pure functions over bytes and files; no state.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvkeep.store.base import StoreKey, checksum

MAGIC = b"KVKR"
INDEX_MAGIC = b"KVKI"
VERSION = 2  # 2: XXH3-64 checksums (1: CRC-32)
KIND_DATA, KIND_TOMBSTONE = 0, 1
_HEADER = struct.Struct("<4sHHQ64sQ")
_HEADER_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size + _HEADER_SUM.size
_PREAMBLE = struct.Struct("<4sH")  # what every version's record and index start with
_INDEX_HEADER = struct.Struct("<4sHHQQQ")  # magic, version, pad, count, segment size, checksum
_INDEX_DTYPE = np.dtype(
    [
        ("key", "u1", (64,)),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("crc", "<u8"),
        ("kind", "<u8"),
    ]  # "crc": the persisted name of the checksum column (XXH3-64, see ``VERSION``)
)


class Record(NamedTuple):
    """One record of a segment, as found in its index or by a scan; ``checksum`` is the
    payload's (``kvkeep.store.base.checksum``)."""

    key: StoreKey
    offset: int  # of the payload
    length: int
    checksum: int
    kind: int


def pack_header(kind: int, key: bytes, length: int, block_checksum: int) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, kind, length, key, block_checksum)
    return head + _HEADER_SUM.pack(checksum(head))


def unpack_header(raw: bytes, payload_offset: int) -> Record | None:
    """The record a header describes, or None if it is not a valid header."""
    if len(raw) != HEADER_BYTES:
        return None
    head = raw[: _HEADER.size]
    if checksum(head) != _HEADER_SUM.unpack_from(raw, _HEADER.size)[0]:
        return None
    magic, version, kind, length, key, block_checksum = _HEADER.unpack(head)
    if magic != MAGIC or version != VERSION or kind not in (KIND_DATA, KIND_TOMBSTONE):
        return None
    return Record(StoreKey(key), payload_offset, length, block_checksum, kind)


def format_version(path: Path) -> int | None:
    """The version the segment's first record names; None if it has no readable record
    header (empty, or torn: the scan deals with those)."""
    with open(path, "rb") as f:
        raw = f.read(_PREAMBLE.size)
    if len(raw) < _PREAMBLE.size:
        return None
    magic, version = _PREAMBLE.unpack(raw)
    return int(version) if magic == MAGIC else None


def write_index(path: Path, records: list[Record], segment_size: int) -> None:
    """Write a segment's index atomically (tmp + fsync + rename)."""
    table = np.zeros(len(records), dtype=_INDEX_DTYPE)
    if records:
        table["key"] = np.frombuffer(b"".join(r.key for r in records), np.uint8).reshape(-1, 64)
        table["offset"] = [r.offset for r in records]
        table["length"] = [r.length for r in records]
        table["crc"] = [r.checksum for r in records]
        table["kind"] = [r.kind for r in records]
    body = table.tobytes()
    header = _INDEX_HEADER.pack(INDEX_MAGIC, VERSION, 0, len(records), segment_size, checksum(body))
    tmp = path.with_suffix(".idx.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def read_index(path: Path, segment_size: int) -> list[Record] | None:
    """A segment's records from its index; None if missing, corrupt or not for this size."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < _INDEX_HEADER.size:
        return None
    magic, version, _, count, size, index_checksum = _INDEX_HEADER.unpack_from(raw)
    body = raw[_INDEX_HEADER.size :]
    valid = magic == INDEX_MAGIC and version == VERSION and size == segment_size
    if not valid or len(body) != count * _INDEX_DTYPE.itemsize or checksum(body) != index_checksum:
        return None
    table = np.frombuffer(body, dtype=_INDEX_DTYPE)
    keys = table["key"].tobytes()
    columns = zip(
        table["offset"].tolist(),
        table["length"].tolist(),
        table["crc"].tolist(),
        table["kind"].tolist(),
        strict=True,
    )
    return [
        Record(StoreKey(keys[i * 64 : i * 64 + 64]), off, length, block_checksum, kind)
        for i, (off, length, block_checksum, kind) in enumerate(columns)
    ]
