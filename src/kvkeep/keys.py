"""Block keys: a namespace fingerprint and chained hashing over token ids.

A block's key is ``sha256(parent_key || token_ids as uint32 little-endian)``. The chain starts
at the namespace's root key, so two namespaces (models, dtypes, layouts, TP ranks, salts,
format versions) never share a key. Nothing here depends on Python's ``hash()``, so keys are
identical across processes, restarts and ``PYTHONHASHSEED`` values.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NewType

import numpy as np

BlockKey = NewType("BlockKey", bytes)
"""32 bytes: sha256 of (parent key, the block's token ids)."""

KEY_BYTES = 32
FORMAT_VERSION = 1
_ROOT_TAG = b"kvkeep/root/v1\x00"
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class Namespace:
    """Everything that makes the bytes of a KV block mean something.

    Two engines may share a block only if all of these fields are equal. ``model_digest`` is a
    digest of the model's config (and weights identity); ``layout`` names the physical KV layout
    (e.g. ``"LBHNC"``); ``backend`` names the attention backend and, on CPU, the instruction set
    that packs pages.
    """

    model_digest: str
    kv_dtype: str
    layout: str
    backend: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str | None = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got {self.tp_rank}/{self.tp_size}")
        if not self.model_digest:
            raise ValueError("model_digest must not be empty")

    def canonical(self) -> bytes:
        """The canonical encoding: sorted-key compact JSON of every field (UTF-8)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """32-byte sha256 of :meth:`canonical`; stable across processes and versions."""
        return _digest_of(self)

    def root_key(self) -> BlockKey:
        """The parent key of a prompt's first block in this namespace."""
        return root_key_of(self.digest())


@functools.lru_cache(maxsize=1024)
def _digest_of(namespace: Namespace) -> bytes:
    """Equal namespaces have one digest: computed once (the connector asks for it every step,
    and the JSON and hash took 0.1 ms a time)."""
    return hashlib.sha256(namespace.canonical()).digest()


def root_key_of(digest: bytes) -> BlockKey:
    """The root key of the namespace with this digest (e.g. one read from a cache server's
    ``namespaces.json``), for tools that inspect a cache without the engine's config."""
    if len(digest) != KEY_BYTES:
        raise ValueError(f"a namespace digest is {KEY_BYTES} bytes, got {len(digest)}")
    return BlockKey(hashlib.sha256(_ROOT_TAG + digest).digest())


_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes. Raises ValueError on anything but integers in
    [0, 2**32).

    A list or tuple (what vLLM's requests hold) goes through ``array``, which checks the range
    as it converts: 0.5 ms for a 115k-token prompt, against 1.7 ms through numpy, on every new
    request the scheduler keys."""
    if _NATIVE_U32 and isinstance(token_ids, list | tuple):
        try:
            return array.array("I", token_ids).tobytes()
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in [0, 2**32)") from None
    arr = np.asarray(token_ids)
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > _MAX_TOKEN_ID):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def chain_keys(
    root: Namespace | BlockKey,
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids``; a trailing partial block gets no key.

    ``root`` is a namespace (its root key starts the chain) or a root key already computed.
    Pass ``parent`` (the key of the block just before ``token_ids[0]``) to extend an existing
    chain incrementally, e.g. during decode; ``token_ids`` must then start on a block boundary.
    Pure function: same inputs give the same keys in every process.
    """
    if isinstance(root, Namespace) and root.block_size != block_size:
        raise ValueError(f"block_size {block_size} != namespace block_size {root.block_size}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = parent if parent is not None else _root_of(root)
    return chain_packed(prev, pack_tokens(token_ids), block_size)


def chain_packed(parent: BlockKey, packed: bytes, block_size: int) -> list[BlockKey]:
    """``chain_keys`` on tokens already packed (``pack_tokens``), after the block keyed
    ``parent`` (or the root key). Pure."""
    stride = 4 * block_size
    keys: list[BlockKey] = []
    prev = parent
    for start in range(0, len(packed) - stride + 1, stride):
        prev = BlockKey(hashlib.sha256(prev + packed[start : start + stride]).digest())
        keys.append(prev)
    return keys


def _root_of(root: Namespace | BlockKey) -> BlockKey:
    if isinstance(root, Namespace):
        return root.root_key()
    if len(root) != KEY_BYTES:
        raise ValueError(f"a root key is {KEY_BYTES} bytes, got {len(root)}")
    return root
