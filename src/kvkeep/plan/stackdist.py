"""Exact LRU stack distances of a block trace, with prefix semantics and vLLM's eviction order.

A reference's stack distance is its 1-based position in the LRU stack just before the request
that reads it; it hits in an LRU cache of ``C`` blocks iff its distance is ``<= C``, so one
pass gives the hit rate at every capacity. The replay follows vLLM's order: after a request
is looked up, ``tail_blocks`` fresh ids are touched for the blocks its output filled, then its
blocks from last to first (vLLM frees them in reverse, so the first block ends on top).
Invariants: within a request the hits are exactly a prefix (the effective distance is the
running maximum of distances along the request, which changes nothing on a well-formed
trace); a reference past a request's ``hit_cap`` never hits (:data:`COLD`); tail ids are
never references. O(n log n) in all, with a Fenwick tree over touch times.
Why LRU is a stack algorithm here, why distances are monotone and how positions are counted:
docs/notes/stack-distances.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvkeep.plan.trace import BlockTrace, Request

COLD = np.iinfo(np.int64).max
"""Effective distance of a reference that hits in no cache (first touch, or past the cap)."""

IntArray = npt.NDArray[np.int64]


class Curve(NamedTuple):
    """Hit rate (fraction of block references) against LRU capacity in blocks."""

    capacities: IntArray
    hit_rates: npt.NDArray[np.float64]


class Fenwick:
    """Prefix sums over slots ``1..size`` with point updates, both O(log size)."""

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)

    def add(self, slot: int, delta: int) -> None:
        tree, n = self.tree, len(self.tree)
        while slot < n:
            tree[slot] += delta
            slot += slot & -slot

    def prefix(self, slot: int) -> int:
        """Sum of slots ``1..slot`` (0 for ``slot <= 0``)."""
        tree, total = self.tree, 0
        while slot > 0:
            total += tree[slot]
            slot &= slot - 1
        return total


class _LRUStack:
    """The replayed LRU stack: latest touch time per block, counted by a Fenwick tree."""

    def __init__(self, touches: int) -> None:
        self.marks = Fenwick(touches)
        self.last: dict[int, int] = {}
        self.now = 0

    def position(self, block: int) -> int:
        """1-based stack position of ``block`` now, or COLD if it was never touched."""
        slot = self.last.get(block)
        if slot is None:
            return int(COLD)
        return len(self.last) - self.marks.prefix(slot - 1)

    def touch(self, block: int) -> None:
        """Move ``block`` to the top of the stack."""
        old = self.last.get(block)
        if old is not None:
            self.marks.add(old, -1)
        self.now += 1
        self.marks.add(self.now, 1)
        self.last[block] = self.now


@dataclass(frozen=True)
class StackDistances:
    """Effective stack distance and token weight of every block reference, in trace order.

    ``request_starts[r]`` is the index of request ``r``'s first reference; ``prompt_tokens``
    the trace's total prompt tokens (the denominator of token hit rates).
    """

    distances: IntArray
    weights: IntArray
    request_starts: IntArray
    prompt_tokens: int
    distinct_blocks: int

    @property
    def references(self) -> int:
        return int(self.distances.size)

    def hit_rate(self, capacity_blocks: int) -> float:
        """Fraction of block references that hit in an LRU cache of ``capacity_blocks``."""
        hits = np.count_nonzero(self.distances <= capacity_blocks)
        return float(hits) / max(1, self.references)

    def token_hit_rate(self, capacity_blocks: int) -> float:
        """Fraction of prompt tokens served from a cache of ``capacity_blocks``."""
        hit = self.weights[self.distances <= capacity_blocks].sum()
        return float(hit) / max(1, self.prompt_tokens)

    def ceiling(self) -> float:
        """Hit rate of an unbounded cache: every reference that is not COLD."""
        return self.hit_rate(int(COLD) - 1)

    def hits_per_request(self, capacity_blocks: int) -> IntArray:
        """Blocks each request hits in a cache of ``capacity_blocks`` (a prefix of it)."""
        hit = (self.distances <= capacity_blocks).astype(np.int64)
        sums = np.add.reduceat(np.append(hit, 0), self.request_starts) if hit.size else hit
        empty = np.diff(np.append(self.request_starts, hit.size)) == 0
        return np.where(empty, 0, sums[: self.request_starts.size]).astype(np.int64)

    def curve(self, points: int = 200) -> Curve:
        """Hit rates on a log grid of capacities from 1 block to the working set."""
        top = max(2, self.distinct_blocks)
        caps = np.unique(np.geomspace(1, top, points).astype(np.int64))
        finite = np.sort(self.distances[self.distances != COLD])
        rates = np.searchsorted(finite, caps, side="right") / max(1, self.references)
        return Curve(caps, rates.astype(np.float64))


def stack_distances(trace: BlockTrace) -> StackDistances:
    """Replay ``trace`` once through an LRU stack in vLLM's order (see the module doc).

    Pure: the trace is not modified. O(n log n) in the number of block references.
    """
    tails = sum(r.tail_blocks for r in trace.requests)
    stack = _LRUStack(trace.references + tails)
    dist: list[int] = []
    weights: list[int] = []
    starts: list[int] = []
    for request in trace.requests:
        starts.append(len(dist))
        dist.extend(_effective(stack, request))
        weights.extend(_weights(request, trace.block_tokens))
        for _ in range(request.tail_blocks):
            stack.touch(-stack.now - 1)  # a fresh id: real block ids are >= 0
        for block in reversed(request.blocks):
            stack.touch(block)
    return StackDistances(
        distances=np.asarray(dist, dtype=np.int64),
        weights=np.asarray(weights, dtype=np.int64),
        request_starts=np.asarray(starts, dtype=np.int64),
        prompt_tokens=trace.prompt_tokens,
        distinct_blocks=len(stack.last) - tails,
    )


def _effective(stack: _LRUStack, request: Request) -> list[int]:
    """Running maximum of the blocks' positions before the request; COLD past the cap."""
    out, worst = [], 0
    for i, block in enumerate(request.blocks):
        worst = max(worst, stack.position(block))
        out.append(worst if i < request.hit_cap else int(COLD))
    return out


def _weights(request: Request, block_tokens: int) -> list[int]:
    """Prompt tokens each block covers (a trailing partial block covers fewer)."""
    return [
        max(0, min(block_tokens, request.tokens - i * block_tokens))
        for i in range(len(request.blocks))
    ]
