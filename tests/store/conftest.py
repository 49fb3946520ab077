"""Arenas in /dev/shm, removed after each test and checked for consistent accounting."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvkeep.store.ram import RamTier
from kvkeep.store.slots import ArenaConfig


@pytest.fixture
def make_arena() -> Iterator[object]:
    made: list[RamTier] = []

    def make(size: int, extent: int) -> RamTier:
        path = f"/dev/shm/kvkeep-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        arena = RamTier(ArenaConfig(size, extent), path)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        if Path(arena.arena.path).exists():
            arena.close()
    for arena in made:  # every test, faults included, leaves the accounting consistent
        assert arena.check_integrity() == []
