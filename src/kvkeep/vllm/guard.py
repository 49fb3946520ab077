"""The load guard: no request reads the blocks a failed synchronous load left behind.

vLLM caches a synchronous load's blocks when it allocates them and, under the "recompute"
policy, leaves them cached when the load fails, so a request admitted on a hit over them in
the same step (vllm-project/vllm#49250) or while the owner recomputes them would read stale
KV. Two rules close both gaps, over vLLM's own block hashes, so they hold for every request
vLLM could admit, including those kvkeep cannot key:

1. Until a synchronous load's outcome is known, no request is admitted on a vLLM hit over the
   blocks it writes or computes on top of them in that step (the answer is None: ask again).
2. When a step reports failed blocks, every holder's blocks from its first failed one on
   leave vLLM's prefix cache; the owner recomputes them in place and kvkeep saves them again.

Rule 2 must be there before any synchronous load: without a KV cache manager that can evict,
or once an eviction raised, loads are asynchronous. Free of vllm. Why: docs/notes/load-guard.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Mapping, Sequence

BlockHash = bytes  # vLLM's ``Request.block_hashes[i]``: block i and everything before it

PLANS_IN_FLIGHT = 1
"""Plans handed to vLLM whose outcome may still be unknown when it admits requests, under
asynchronous scheduling (vLLM schedules a step before it processes the output of the step
before). 0 when vLLM schedules step by step (``compat.plans_in_flight``)."""


class SyncLoadGuard:
    """vLLM block hashes that no admission may hit: those synchronous loads write, kept for
    the plan being built and the last ``PLANS_IN_FLIGHT`` plans (rule 1), and those of failed
    blocks whose eviction failed, per owner, until it has computed them again. Not
    thread-safe (vLLM's scheduler is single-threaded)."""

    def __init__(self, plans_in_flight: int = PLANS_IN_FLIGHT) -> None:
        self._building: set[BlockHash] = set()
        self._recent: deque[frozenset[BlockHash]] = deque(maxlen=max(plans_in_flight, 0))
        # owner req_id -> {block index: hash} of failed blocks left in vLLM's prefix cache
        self._failed: dict[str, dict[int, BlockHash]] = {}
        self._orphaned: set[BlockHash] = set()  # of owners that finished before recomputing

    def hold(self, hashes: Iterable[BlockHash]) -> None:
        """A synchronous load planned for the plan being built writes these blocks."""
        self._building.update(hashes)

    def planned(self) -> None:
        """The plan being built was handed to vLLM; the oldest one held expires."""
        self._recent.append(frozenset(self._building))
        self._building = set()

    def hold_until_recomputed(self, owner: str, first: int, hashes: Sequence[BlockHash]) -> None:
        """Blocks ``first..`` of ``owner`` (``hashes`` from index ``first``) failed to load
        and stay in vLLM's prefix cache: hold them until ``owner`` has computed past each."""
        held = self._failed.setdefault(owner, {})
        held.update((first + i, h) for i, h in enumerate(hashes))

    def progress(self, owner: str, num_computed_tokens: int, block_size: int) -> None:
        """``owner`` has computed ``num_computed_tokens``: its blocks before that are valid."""
        held = self._failed.get(owner)
        if held is None:
            return
        for index in [i for i in held if (i + 1) * block_size <= num_computed_tokens]:
            del held[index]
        if not held:
            del self._failed[owner]

    def release(self, owner: str) -> None:
        """``owner`` finished. Blocks of it that failed and were never computed again stay
        in vLLM's prefix cache when it frees them, still under their hashes: they stay held
        (``orphaned``) until the whole prefix cache is reset (``clear_orphaned``)."""
        self._orphaned.update(self._failed.pop(owner, {}).values())

    @property
    def orphaned(self) -> bool:
        return bool(self._orphaned)

    def clear_orphaned(self) -> None:
        """vLLM's prefix cache was reset: no hash of a freed block can be hit any more."""
        self._orphaned.clear()

    @property
    def active(self) -> bool:
        return bool(self._building) or any(self._recent) or bool(self._failed or self._orphaned)

    def covers(self, hashes: Sequence[BlockHash]) -> bool:
        """Whether any of ``hashes`` (a request's vLLM hit) may hold bytes no load or
        compute has confirmed."""
        if not self.active:
            return False
        held: list[Container[BlockHash]] = [self._building, *(s for s in self._recent if s)]
        held += [set(f.values()) for f in self._failed.values()]
        held.append(self._orphaned)
        return any(h in s for h in hashes for s in held)


def first_failed(tables: Mapping[str, Sequence[int]], failed: set[int]) -> dict[str, int]:
    """Of each block table that holds a failed block, the index of its first one. Pure."""
    out = {}
    for req_id, table in tables.items():
        first = next((i for i, block in enumerate(table) if block in failed), None)
        if first is not None:
            out[req_id] = first
    return out


def tails_from(tables: Iterable[Sequence[int]], failed: set[int]) -> set[int]:
    """Of each block table that holds a failed block, the blocks from the first failed one
    on: what vLLM must not serve from its prefix cache any more. Pure."""
    tails: set[int] = set(failed)
    for table in tables:
        first = next((i for i, block in enumerate(table) if block in failed), None)
        if first is not None:
            tails.update(table[first:])
    return tails
