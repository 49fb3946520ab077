"""Hot prefixes stay in RAM: a prefix the engine keeps serving from its own pool is TOUCHed
(or saved again), so other traffic evicts everything else first, and it is still there to be
the first hit after the engine restarts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvkeep.server.client import KVKeepClient
from kvkeep.vllm.touch import TouchQueue

from .helpers import BLOCK, NS, keys, store

# 4 MiB of RAM in 1 MiB extents holds 64 blocks of 64 KiB; no disk: what RAM evicts is gone.
SMALL = ("--ram", "4MiB", "--disk", "0", "--extent", "1MiB")


def _traffic_then_lookup(server_factory: object, keep_warm: Callable[..., None] | None) -> int:
    """Store a 6-block prefix, then 20 rounds of 8 other blocks (160 blocks through a
    64-block RAM), calling ``keep_warm(client, session, prefix)`` after each round; how many
    leading prefix blocks RAM still holds at the end."""
    server = server_factory(*SMALL)  # type: ignore[operator]
    server.start()
    client = KVKeepClient(server.socket, timeout_s=5)
    session = client.hello(NS, BLOCK)
    prefix = keys(6)
    assert len(store(client, session, prefix)) == 6
    for round_ in range(20):
        others = keys(8, offset=10_000 + 1_000 * round_)
        assert len(store(client, session, others)) == 8
        if keep_warm is not None:
            keep_warm(client, session, prefix)
    found = client.lookup(session, prefix)
    assert set(found.tiers) <= {"ram"}
    return found.num_present


def test_without_refresh_the_prefix_ages_out(server_factory: object) -> None:
    assert _traffic_then_lookup(server_factory, None) == 0


def _refreshed(client: KVKeepClient, session: object, prefix: list[bytes]) -> None:
    """What the scheduler does when vLLM serves ``prefix`` from its pool: submit, off-thread."""
    touches = TouchQueue(client.sibling())
    try:
        assert touches.submit(session, prefix)  # type: ignore[arg-type]
        touches.flush()
    finally:
        touches.close()


@pytest.mark.parametrize(
    "keep_warm",
    [
        pytest.param(lambda c, s, ks: c.touch(s, ks), id="touch"),
        pytest.param(lambda c, s, ks: c.release(c.reserve(s, ks)), id="saved-again"),
        pytest.param(_refreshed, id="scheduler-touches"),
    ],
)
def test_a_refreshed_prefix_outlives_other_traffic(
    server_factory: object, keep_warm: Callable[..., None]
) -> None:
    assert _traffic_then_lookup(server_factory, keep_warm) == 6


def test_touch_counts_no_hit_and_ignores_unknown_keys(server_factory: object) -> None:
    server = server_factory(*SMALL)  # type: ignore[operator]
    server.start()
    client = KVKeepClient(server.socket, timeout_s=5)
    session = client.hello(NS, BLOCK)
    store(client, session, keys(2))
    client.touch(session, [*keys(2), *keys(3, offset=50_000)])
    ram = client.stats()["tiers"]["ram"]
    assert (ram["hits"], ram["misses"], ram["blocks"]) == (0, 0, 2)
