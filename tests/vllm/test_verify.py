"""A load's checksums on several threads find the same first bad slot as one thread."""

from __future__ import annotations

import numpy as np
import pytest

from kvkeep.store.base import checksum
from kvkeep.vllm.verify import SlotVerifier, default_threads


def _slots(n: int, size: int = 4096) -> tuple[list[memoryview], list[int]]:
    rng = np.random.default_rng(n)
    views = [memoryview(rng.integers(0, 255, size, dtype=np.uint8).tobytes()) for _ in range(n)]
    return views, [checksum(v) for v in views]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("bad", [(), (0,), (5,), (6, 2), (11,), (3, 9, 10)])
def test_the_first_bad_slot_is_found_whatever_part_holds_it(
    threads: int, bad: tuple[int, ...]
) -> None:
    views, expected = _slots(12)
    for i in bad:
        expected[i] ^= 1  # a checksum that the slot's bytes miss
    verifier = SlotVerifier(threads, min_parallel_bytes=0)
    try:
        assert verifier.first_bad(views, expected) == min(bad, default=len(views))
        assert verifier.first_bad(views[:1], expected[:1]) == (0 if 0 in bad else 1)
        assert verifier.first_bad([], []) == 0
    finally:
        verifier.close()


def test_small_runs_stay_on_the_callers_thread_and_big_ones_are_split() -> None:
    views, expected = _slots(8)
    verifier = SlotVerifier(4, min_parallel_bytes=8 * 4096)
    try:
        assert verifier.first_bad(views[:7], expected[:7]) == 7  # below the threshold
        assert verifier._pool is not None and not verifier._pool._threads  # never used
        expected[6] ^= 1
        assert verifier.first_bad(views, expected) == 6
        assert len(verifier._pool._threads) >= 1, "a big run was not split"
    finally:
        verifier.close()


def test_default_threads_leave_cores_to_the_engine() -> None:
    assert 1 <= default_threads() <= 8
