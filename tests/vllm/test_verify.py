"""A load's checksums, on helper threads beside its copy, find the same first bad slot as one
thread does."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvkeep.store.base import checksum
from kvkeep.vllm import verify
from kvkeep.vllm.verify import SlotVerifier, default_threads, host_threads


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
    verifier = SlotVerifier(threads, 0, 0, part_bytes=2 * 4096)  # parts of two slots
    try:
        assert verifier.first_bad(views, expected) == min(bad, default=len(views))
        check = verifier.start(views, expected)  # the caller copies meanwhile
        copied = [bytes(v) for v in views]
        assert check.result() == min(bad, default=len(views)) == check.result()
        assert copied == [bytes(v) for v in views]
        assert verifier.first_bad(views[:1], expected[:1]) == (0 if 0 in bad else 1)
        assert verifier.first_bad([], []) == 0
    finally:
        verifier.close()


def test_small_loads_stay_on_the_callers_thread_and_big_ones_start_at_once() -> None:
    views, expected = _slots(8)
    verifier = SlotVerifier(2, min_parallel_bytes=8 * 4096, min_parallel_slot_bytes=4096)
    try:
        assert verifier.first_bad(views[:7], expected[:7]) == 7  # below the threshold
        assert verifier._pool is not None and not verifier._pool._threads  # never used
        small = SlotVerifier(2, min_parallel_bytes=0, min_parallel_slot_bytes=8192)
        assert small.first_bad(views, expected) == 8  # slots too small to share
        assert small._pool is not None and not small._pool._threads
        small.close()
        expected[6] ^= 1
        check = verifier.start(views, expected)
        assert len(verifier._pool._threads) == 1, "a big load's checksums did not start"
        assert check.result() == 6
    finally:
        verifier.close()


def test_default_threads_leave_cores_to_the_engine() -> None:
    assert 1 <= default_threads() <= 8
    assert host_threads(1) == min(2, len(os.sched_getaffinity(0)))
    assert host_threads(4096) == 1


class _Gates:
    """``checksum`` for the verifier that holds each slot's thread until the test lets it go,
    so that a test decides in which order threads record what they find (a race that real
    checksums only lose now and then)."""

    def __init__(self, n: int) -> None:
        self.entered = [threading.Event() for _ in range(n)]
        self.go = [threading.Event() for _ in range(n)]
        self.holder: dict[int, threading.Thread] = {}
        self._index: dict[int, int] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch, views: list[memoryview]) -> None:
        self._index = {id(v): i for i, v in enumerate(views)}
        monkeypatch.setattr(verify, "checksum", self._checksum)

    def _checksum(self, view: memoryview) -> int:
        i = self._index[id(view)]
        self.holder[i] = threading.current_thread()
        self.entered[i].set()
        assert self.go[i].wait(10), f"slot {i} was never let go"
        return checksum(view)


@contextlib.contextmanager
def _gated_check(
    monkeypatch: pytest.MonkeyPatch, n: int, bad: tuple[int, ...], threads: int
) -> Iterator[tuple[_Gates, threading.Thread, list[int]]]:
    """``n`` slots, ``bad`` ones missing their checksum, checked a part per slot on
    ``threads`` threads under ``_Gates``; ``result()`` runs on a thread of its own (the
    loader's, which copies first) and appends its answer to the list yielded. Every gate is
    let go on the way out."""
    views, expected = _slots(n)
    for i in bad:
        expected[i] ^= 1
    gates = _Gates(n)
    gates.install(monkeypatch, views)
    verifier = SlotVerifier(threads, 0, 0, part_bytes=1)
    out: list[int] = []
    try:
        check = verifier.start(views, expected)
        thread = threading.Thread(target=lambda: out.append(check.result()), name="loader")
        thread.start()
        yield gates, thread, out
    finally:
        for go in gates.go:
            go.set()
        verifier.close()


def test_a_later_bad_slot_found_last_does_not_hide_an_earlier_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slots 1 and 2 bad, held by different threads: slot 1's thread records first, slot 2's
    after it. The answer is still 1."""
    with _gated_check(monkeypatch, 3, (1, 2), threads=3) as (gates, thread, out):
        assert all(e.wait(10) for e in gates.entered), "three threads did not share the slots"
        for i in (1, 2, 0):
            gates.go[i].set()
            time.sleep(0.05)  # slot i's thread records what it found before the next goes
        thread.join(10)
        assert out == [1]


def test_the_answer_waits_for_the_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot 0 bad and held by a helper: the loader's thread, done with its own part, waits for
    the helper's answer instead of reporting every slot good (and unpinning slots that a
    helper still reads)."""
    with _gated_check(monkeypatch, 2, (0,), threads=2) as (gates, thread, out):
        assert gates.entered[0].wait(10) and gates.entered[1].wait(10)
        mine = next(i for i, t in gates.holder.items() if t is thread)
        gates.go[mine].set()
        thread.join(0.3)
        assert thread.is_alive() and out == [], "the answer came before a helper's"
        gates.go[1 - mine].set()
        thread.join(10)
        assert out == [0]
