"""Eviction policy: which unpinned block goes first. Bookkeeping of slots lives in the tiers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class LruPolicy:
    """Least-recently-used order over slot ids. Not thread-safe: the owning tier locks.

    ``add`` and ``touch`` make a slot the most recent; ``victims`` yields oldest first. The
    policy knows nothing about pins: the tier skips candidates it cannot evict.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, slot: int) -> None:
        self._order[slot] = None
        self._order.move_to_end(slot)

    def touch(self, slot: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def touch_many(self, slots: Iterable[int]) -> None:
        """``touch`` each of ``slots`` in turn (the last ends most recent)."""
        order = self._order
        move = order.move_to_end
        for slot in slots:
            if slot in order:
                move(slot)

    def remove(self, slot: int) -> None:
        self._order.pop(slot, None)

    def victims(self) -> Iterator[int]:
        """Slots from least to most recently used. Do not mutate while iterating."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
