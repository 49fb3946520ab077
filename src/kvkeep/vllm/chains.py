"""The keys of recently finished requests, so that a request that extends one is keyed only
from where the two part (``RecentChains``). A coding agent's turn re-sends the previous turn's
prompt and reply, so without it every turn hashes its whole context again: 4 ms for 115k
tokens in 16-token blocks, on the scheduler's thread.

A block's key is a pure function of the chain's root and every token up to the block's end,
so another chain's keys are reused only for the blocks whose tokens are equal byte for byte
(compared, never inferred from a hash), under the same root.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvkeep.keys import BlockKey, chain_packed, pack_tokens

DEFAULT_MAX_BYTES = 32 << 20  # packed tokens and keys kept (about 45 chains of 115k tokens)
_KEY_BYTES = 32


class _Chain(NamedTuple):
    root: BlockKey
    packed: bytes  # the keyed blocks' tokens, packed (``kvkeep.keys.pack_tokens``)
    keys: tuple[BlockKey, ...]

    @property
    def nbytes(self) -> int:
        return len(self.packed) + _KEY_BYTES * len(self.keys)


def common_blocks(a: bytes, b: bytes, stride: int) -> int:
    """How many leading blocks of ``stride`` bytes ``a`` and ``b`` have equal."""
    n = min(len(a), len(b)) // stride
    if n == 0:
        return 0
    if a[: n * stride] == b[: n * stride]:
        return n
    words = stride // 4
    x = np.frombuffer(a, dtype=np.uint32, count=n * words).reshape(n, words)
    y = np.frombuffer(b, dtype=np.uint32, count=n * words).reshape(n, words)
    return int(np.argmax((x != y).any(axis=1)))


class RecentChains:
    """The chains of the last finished requests within ``max_bytes``, least recently used
    dropped first. Not thread-safe (the scheduler's thread only)."""

    def __init__(self, block_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.stride = 4 * block_size  # packed bytes of one block's tokens
        self.max_bytes = max_bytes
        self._chains: OrderedDict[int, _Chain] = OrderedDict()  # least recently used first
        self._by_first: dict[BlockKey, list[int]] = {}  # a chain's first key -> its ids
        self._bytes = 0
        self._next_id = 0
        self.reused_blocks = 0  # keys taken from a recent chain instead of hashed

    def add(self, root: BlockKey, packed: bytes, keys: Sequence[BlockKey]) -> None:
        """Keep a finished request's chain: ``keys[i]`` keys block i of ``packed``."""
        if not keys or len(packed) != len(keys) * self.stride:
            return
        chain = _Chain(root, packed, tuple(keys))
        if chain.nbytes > self.max_bytes:
            return
        first = self._by_first.setdefault(keys[0], [])
        for chain_id in first:  # one that this chain extends is redundant now
            old = self._chains[chain_id]
            if old.root == root and packed.startswith(old.packed):
                self._drop(chain_id)
                break
        self._chains[self._next_id] = chain
        self._by_first.setdefault(keys[0], []).append(self._next_id)
        self._next_id += 1
        self._bytes += chain.nbytes
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._chains)))

    def prefix(self, root: BlockKey, packed: bytes) -> list[BlockKey]:
        """The keys of the longest run of leading blocks of ``packed`` (whole blocks) that a
        recent chain under ``root`` has keyed; [] if none."""
        if len(packed) < self.stride or not self._chains:
            return []
        first = BlockKey(hashlib.sha256(root + packed[: self.stride]).digest())
        best, best_id = 0, None
        for chain_id in self._by_first.get(first, ()):
            chain = self._chains[chain_id]
            if chain.root != root:
                continue
            n = common_blocks(chain.packed, packed, self.stride)
            if n > best:
                best, best_id = n, chain_id
        if best_id is None:
            return []
        self._chains.move_to_end(best_id)
        self.reused_blocks += best
        return list(self._chains[best_id].keys[:best])

    def _drop(self, chain_id: int) -> None:
        chain = self._chains.pop(chain_id)
        self._bytes -= chain.nbytes
        ids = self._by_first[chain.keys[0]]
        ids.remove(chain_id)
        if not ids:
            del self._by_first[chain.keys[0]]

    def __len__(self) -> int:
        return len(self._chains)


class _KeyMemo(NamedTuple):
    root: BlockKey
    keys: list[BlockKey]  # of the request's full blocks so far
    packed: bytearray  # their tokens, packed


class RequestKeys:
    """Each request's block keys, extended as its tokens grow; a new request takes the keys
    of the blocks it shares with a recently finished one (``recent``) and hashes the rest."""

    def __init__(self, block_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.block_size = block_size
        self.recent = RecentChains(block_size, max_bytes)
        self._memos: dict[str, _KeyMemo] = {}

    def keys_for(self, req_id: str, root: BlockKey, tokens: Sequence[int]) -> list[BlockKey]:
        """Keys of every full block of ``tokens`` under ``root``. Idempotent: a request's
        tokens only ever grow, so the memo's keys stay valid (a new root starts over)."""
        memo = self._memos.get(req_id)
        if memo is None or memo.root != root:
            memo = _KeyMemo(root, [], bytearray())
            self._memos[req_id] = memo
        keys, size = memo.keys, self.block_size
        done = len(keys) * size
        full = (len(tokens) - done) // size
        if full:
            packed = pack_tokens(tokens[done : done + full * size])
            if not keys:
                keys += self.recent.prefix(root, packed)
            skip = 4 * (len(keys) * size - done)  # bytes of ``packed`` keyed just now
            keys += chain_packed(keys[-1] if keys else root, packed[skip:], size)
            memo.packed.extend(packed)
        return keys

    def finish(self, req_id: str) -> None:
        """Forget the request; keep its chain among the recent ones. Idempotent."""
        memo = self._memos.pop(req_id, None)
        if memo is not None:
            self.recent.add(memo.root, bytes(memo.packed), memo.keys)
