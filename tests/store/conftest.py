from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvkeep.store.memory import ArenaConfig, ArenaTier
from kvkeep.store.redis_process import RedisProcess


@pytest.fixture
def make_arena() -> Iterator[object]:
    made: list[ArenaTier] = []

    def make(size: int, extent: int) -> ArenaTier:
        path = f"/dev/shm/kvkeep-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        arena = ArenaTier(ArenaConfig(size, extent), path)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        if Path(arena.arena.path).exists():
            arena.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private redis-server (maxmemory + allkeys-lru) on 127.0.0.1, stopped by PID.

    Fails, never skips, when redis-server is missing: the remote tier must be tested in CI.
    """
    server = RedisProcess(tmp_path / "redis", maxmemory="64mb")
    server.start()
    yield server
    server.stop()
