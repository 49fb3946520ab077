"""The saver on a real cache server: what the step stages arrives with its own bytes, and
nothing the server or staging does wrong blocks or breaks the step."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvkeep.keys import BlockKey, Namespace, chain_keys
from kvkeep.server.client import KVKeepClient, Session, SlotRef
from kvkeep.vllm import saver as saver_module
from kvkeep.vllm.counters import Counters
from kvkeep.vllm.layout import KVLayout, LayoutDescription
from kvkeep.vllm.loader import BlockLoader
from kvkeep.vllm.mover import Mover
from kvkeep.vllm.plan import BlockTransfer, RequestLoad
from kvkeep.vllm.saver import Saver, _Ring, staging_shape
from serverproc import Server

L, B, H, N, C = 2, 12, 2, 16, 32
NS = Namespace("tiny-model", "bfloat16", "LBHNC", "cpu", block_size=N)


def engine() -> KVLayout:
    """An LBHNC cache of one allocation, as vLLM registers it, with random contents."""
    five = torch.randn(L, B, H, N, C).to(torch.bfloat16)
    views = {f"layer{i}": five[i] for i in range(L)}
    page = H * N * C * 2
    desc = LayoutDescription("LBHNC", B, N, 1, tuple(views), page)
    return KVLayout.build(desc, views)


def block_bytes(layout: KVLayout, block_id: int) -> bytes:
    out = np.zeros(layout.block_bytes, dtype=np.uint8)
    layout.gather(block_id, out)
    return out.tobytes()


def make_saver(
    srv: Server, layout: KVLayout, shape: tuple[int, int] = (4, 8), timeout: float = 2.0
) -> tuple[Saver, Counters]:
    counters = Counters()
    client = KVKeepClient(srv.socket, timeout_s=timeout)
    saver = Saver(client, layout, counters.add, counters.timed, shape)
    return saver, counters


def keys(n: int, offset: int = 0) -> list[BlockKey]:
    return chain_keys(NS, list(range(offset, offset + n * N)), N)


def stored(srv: Server, session: Session, ks: list[BlockKey]) -> list[bytes]:
    client = KVKeepClient(srv.socket, timeout_s=5)
    try:
        slots = client.acquire(session, ks)
        assert all(client.verify(s) for s in slots)
        out = [client.slot_view(s).tobytes() for s in slots]
        client.release(slots)
        return out
    finally:
        client.close()


def test_staged_blocks_arrive_under_their_keys_with_their_bytes(server: Server) -> None:
    layout = engine()
    saver, counters = make_saver(server, layout)
    session = KVKeepClient.session(NS, layout.block_bytes)
    ks = keys(5)
    ids = [7, 2, 9, 4, 11]
    first = [BlockTransfer(ids[i], ks[i]) for i in (0, 1)]
    assert saver.stage(session, first) == 2 and saver.drain(10)
    # the server skips the two it holds; rows must still pair with the right keys
    saver.stage(session, [BlockTransfer(b, k) for b, k in zip(ids, ks, strict=True)])
    assert saver.drain(10)
    assert stored(server, session, ks) == [block_bytes(layout, b) for b in ids]
    assert counters.values["saved_tokens"] == 5 * N
    # what --profile reports: the saver thread's CPU, the server's and its RPC thread's
    assert counters.values["saver_cpu_s"] > 0
    client = KVKeepClient(server.socket)
    stats = client.stats()
    client.close()
    assert stats["cpu_s"] >= stats["rpc_cpu_s"] > 0
    assert counters.values["save_failures"] == 0
    saver.shutdown()


def lingering_saver(
    server: Server, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], quiet_s: float
) -> tuple[Saver, KVLayout, Session]:
    """A saver that lingers 30 s for more jobs, ``quiet_s`` after the last; its layout and a
    session."""
    monkeypatch.setattr(saver_module, "LINGER_S", 30.0)
    monkeypatch.setattr(saver_module, "QUIET_S", quiet_s)
    layout = engine()
    saver, _ = make_saver(server, layout, shape=shape)
    return saver, layout, KVKeepClient.session(NS, layout.block_bytes)


def count_reserves(saver: Saver) -> list[int]:
    """The saver's RESERVEs from now on, each as its number of keys (the list grows)."""
    calls: list[int] = []
    reserve = saver.client.reserve

    def counted(session: Session, ks: Sequence[BlockKey]) -> list[SlotRef]:
        calls.append(len(ks))
        return reserve(session, ks)

    saver.client.reserve = counted  # type: ignore[method-assign]
    return calls


def test_small_steps_are_stored_together(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of one block each, staged within the linger time, reach the server in one
    RESERVE/COMMIT pair, each block with its own bytes (drain ends the wait)."""
    monkeypatch.setattr(saver_module, "LINGER_S", 30.0)
    monkeypatch.setattr(saver_module, "QUIET_S", 30.0)
    layout = engine()
    saver, counters = make_saver(server, layout, shape=staging_shape(1, 4096, 16 * 4096))
    calls = count_reserves(saver)
    session = KVKeepClient.session(NS, layout.block_bytes)
    ks, ids = keys(6), [3, 8, 1, 6, 10, 5]
    for block_id, key in zip(ids, ks, strict=True):
        assert saver.stage(session, [BlockTransfer(block_id, key)]) == 1
        time.sleep(0.01)  # a step's forward
    assert saver.drain(10)
    assert stored(server, session, ks) == [block_bytes(layout, b) for b in ids]
    assert calls == [6]
    assert counters.values["saved_tokens"] == 6 * N
    saver.shutdown()


def test_small_steps_take_only_the_rows_they_fill(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging for 4 jobs of 8 blocks holds 16 jobs of 2 blocks: ten such steps (a prefill at
    serve's CPU budget) all stage, none is skipped, and nothing is stored until they stop (a
    buffer per job ran low after 3 and stored in the middle of the prefill)."""
    saver, layout, session = lingering_saver(server, monkeypatch, (4, 8), quiet_s=30.0)
    calls = count_reserves(saver)
    ks = keys(20, 200)
    ids = [i % B for i in range(20)]
    for step in range(10):
        pair = [BlockTransfer(ids[2 * step + j], ks[2 * step + j]) for j in (0, 1)]
        assert saver.stage(session, pair) == 2
        time.sleep(0.02)  # a step's forward
    time.sleep(0.2)
    assert calls == [], "stored while steps still staged"
    saver.flush()
    assert saver.drain(10)
    assert calls == [20]
    assert stored(server, session, ks) == [block_bytes(layout, b) for b in ids]
    saver.shutdown()


def test_the_staging_ring_hands_out_rows_in_order_and_wraps() -> None:
    ring = _Ring(10)
    a, b = ring.take(4), ring.take(4)
    assert a is not None and b is not None and (a[0], b[0]) == (0, 4)
    assert ring.take(3) is None  # 2 rows left at the end, and row 0 is taken
    ring.give_back(a[1])  # rows 0-3 free again
    c = ring.take(3)  # skips rows 8-9 and starts at 0
    assert c is not None and c[0] == 0 and ring.free() == 10 - 4 - 2 - 3
    ring.untake(c[1])  # a gather that failed gives its rows back at once, skipped ones too
    assert ring.free() == 10 - 4
    ring.give_back(b[1])
    assert ring.free() == 10
    d = ring.take(8)  # 8 rows from row 8 would cross the end: from row 0
    assert d is not None and d[0] == 0 and ring.take(1) is None


def wakeups(thread_id: int) -> int:
    """How often the thread has gone to sleep and been woken (Linux)."""
    status = Path(f"/proc/self/task/{thread_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc")
def test_a_lingering_saver_is_not_woken_by_each_step(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the saver lingers, a staged job does not wake it: on a CPU engine each wake-up
    took a core from the forward once a step. The jobs are all stored at the flush."""
    saver, layout, session = lingering_saver(server, monkeypatch, (32, 1), quiet_s=30.0)
    ks = keys(12, 80)
    ids = list(range(12))
    assert saver.stage(session, [BlockTransfer(ids[0], ks[0])]) == 1
    time.sleep(0.2)  # the first job wakes it; it lingers now
    thread_id = saver._thread.native_id
    assert thread_id is not None
    before = wakeups(thread_id)
    for block_id, key in zip(ids[1:], ks[1:], strict=True):
        assert saver.stage(session, [BlockTransfer(block_id, key)]) == 1
        time.sleep(0.01)  # a step's forward
    assert wakeups(thread_id) - before <= 1, "the saver was woken by staged jobs"
    assert saver.drain(10)
    assert stored(server, session, ks) == [block_bytes(layout, b) for b in ids]
    saver.shutdown()


def test_a_step_that_saves_nothing_stores_what_waits(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs wait for more only while steps keep saving: a flush (a step with no saves, as
    when a prefill ends) sends them at once, long before the linger time."""
    saver, layout, session = lingering_saver(server, monkeypatch, (16, 1), quiet_s=30.0)
    ks = keys(2, 40)
    for block_id, key in zip((4, 9), ks, strict=True):
        assert saver.stage(session, [BlockTransfer(block_id, key)]) == 1
    saver.flush()
    deadline = time.monotonic() + 10
    while stored(server, session, ks) != [block_bytes(layout, 4), block_bytes(layout, 9)]:
        assert time.monotonic() < deadline, "the flushed jobs were not stored"
        time.sleep(0.05)
    saver.shutdown()


def test_saves_wait_while_steps_stage_and_go_once_they_stop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores are kept out of a running prefill: nothing reaches the server while steps keep
    staging (each within QUIET_S of the last), and what waits is stored once they stop (the
    engine went idle without a step that saves nothing), long before the linger time."""
    saver, layout, session = lingering_saver(server, monkeypatch, (32, 1), quiet_s=0.3)
    ks = keys(10, 120)
    for block_id, key in enumerate(ks):
        assert saver.stage(session, [BlockTransfer(block_id, key)]) == 1
        time.sleep(0.1)  # a step's forward: a second of steps, three times QUIET_S
        assert stored(server, session, ks[:1]) == [], "stored while steps still staged"
    stopped = time.monotonic()
    while stored(server, session, ks) != [block_bytes(layout, b) for b in range(10)]:
        assert time.monotonic() - stopped < 5, "not stored once the steps stopped"
        time.sleep(0.05)
    saver.shutdown()


def test_a_dead_server_costs_saves_only_and_frees_the_staging(server: Server) -> None:
    layout = engine()
    saver, counters = make_saver(server, layout, shape=(2, 1))
    session = KVKeepClient.session(NS, layout.block_bytes)
    server.kill()
    for round_ in range(6):  # more rounds than staging buffers: each one came back
        t0 = time.perf_counter()
        assert saver.stage(session, [BlockTransfer(round_, keys(1, round_)[0])]) == 1
        assert time.perf_counter() - t0 < 0.5  # the step never waits for the server
        assert saver.drain(10)
    assert counters.values["save_failures"] == 6
    saver.shutdown()


def test_a_stalled_server_never_stalls_the_step(server: Server) -> None:
    """With the server stopped, RESERVE waits for its timeout in the background; the step
    goes on, and skips (counts) saves once every staging buffer is in flight."""
    layout = engine()
    saver, counters = make_saver(server, layout, shape=(2, 1), timeout=1.0)
    session = KVKeepClient.session(NS, layout.block_bytes)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        staged = [saver.stage(session, [BlockTransfer(i, keys(1, i)[0])]) for i in range(4)]
        assert time.perf_counter() - t0 < 0.5
        assert staged[:2] == [1, 1] and sum(staged) <= 3
        assert counters.values["saves_skipped_busy"] >= 1
        assert saver.drain(10)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    saver.shutdown()


def test_staging_holds_two_steps_by_default_and_splits_a_small_budget() -> None:
    mib = 1 << 20
    assert staging_shape(100, mib, None) == (16, 12)  # two full steps of 1 MiB blocks, 16 jobs
    assert staging_shape(10, mib, None) == (16, 4)  # at least 64 MiB, in 16 jobs
    assert staging_shape(100, mib, 8 * mib) == (16, 1)  # a small budget: more, smaller jobs
    assert staging_shape(100, 16 * mib, 1) == (16, 1)
    assert staging_shape(768, 2 * mib, None) == (16, 32)  # capped at 1 GiB (pinned on CUDA)


def test_the_saver_thread_keeps_the_engines_priority(server: Server) -> None:
    """Saves are not background work that may wait for idle cores (kvkeep.host.background): on an
    engine that is never idle, a saver at idle priority stored almost nothing, and S7's
    kvkeep hit rate fell 8 points below the planner's."""
    saver, _ = make_saver(server, engine())
    try:
        assert saver._thread.native_id is not None
        assert os.sched_getscheduler(saver._thread.native_id) == os.SCHED_OTHER
    finally:
        saver.shutdown()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind to one")
def test_the_saver_thread_is_not_bound_to_its_creator_s_core(server: Server) -> None:
    """vLLM's CPU worker binds its main thread to one core (its OpenMP team's first); the
    saver started from it must not inherit that core, but run on the process's CPUs."""
    allowed = os.sched_getaffinity(0)
    if os.sched_getaffinity(os.getppid()) != allowed:
        pytest.skip("pytest runs on other CPUs than its parent process")
    os.sched_setaffinity(0, {min(allowed)})  # as vLLM binds the worker's main thread
    try:
        saver, _ = make_saver(server, engine())
    finally:
        os.sched_setaffinity(0, allowed)
    thread_id = saver._thread.native_id
    assert thread_id is not None
    deadline = time.monotonic() + 5
    while os.sched_getaffinity(thread_id) != allowed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.sched_getaffinity(thread_id) == allowed, "the saver kept its creator's core"
    saver.shutdown()


class GatedSaver(Saver):
    """A saver whose copy of a row into its slot can be held just before it starts
    (``hold_before``) or just after it ends (``hold_after``): gates in place of timing."""

    def __init__(self, *args: object, hold_before: bool = False, hold_after: bool = False,
                 **kwargs: object) -> None:  # fmt: skip
        self.hold_before, self.hold_after = hold_before, hold_after
        self.at_gate, self.go = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _copy_into(self, slot: np.ndarray, row: np.ndarray) -> None:
        if self.hold_before:
            self.at_gate.set()
            assert self.go.wait(10)
        np.copyto(slot, row)
        if self.hold_after:
            self.at_gate.set()
            assert self.go.wait(10)


def gated(srv: Server, layout: KVLayout, **holds: bool) -> tuple[GatedSaver, Counters, list[int]]:
    """A gated saver on its own connection, its counters and the offsets it RESERVEd."""
    counters = Counters()
    client = KVKeepClient(srv.socket, timeout_s=2.0)
    saver = GatedSaver(client, layout, counters.add, counters.timed, (4, 8), **holds)
    offsets: list[int] = []
    reserve = client.reserve

    def spied(session: Session, ks: Sequence[BlockKey]) -> list[SlotRef]:
        slots = reserve(session, ks)
        offsets.extend(s.offset for s in slots)
        return slots

    client.reserve = spied  # type: ignore[method-assign]
    return saver, counters, offsets


def connections(srv: Server) -> int:
    client = KVKeepClient(srv.socket, timeout_s=2.0)
    try:
        return int(client.stats()["connections"]) - 1  # not this one
    finally:
        client.close()


def test_a_stray_write_into_a_slot_before_its_commit_is_a_miss_not_a_hit(server: Server) -> None:
    """Writer 1 loses its reservation of slot X mid-copy (its connection closes, as after
    ``Saver.shutdown``'s join times out); the free list hands X to writer 2 at once; writer
    1's bytes land in X after writer 2 copied its own and before writer 2 COMMITs. The
    checksum writer 2 commits is of its own staged row, so a load of its key fails the
    check and is a counted miss; a checksum of the slot would have passed the wrong bytes."""
    one, two = engine(), engine()
    session = KVKeepClient.session(NS, one.block_bytes)
    first, second = keys(1, offset=0)[0], keys(1, offset=5000)[0]
    writer1, counters1, offsets1 = gated(server, one, hold_before=True)
    assert writer1.stage(session, [BlockTransfer(3, first)]) == 1
    assert writer1.at_gate.wait(10), "writer 1 reserved its slot and is about to copy"
    assert connections(server) == 1
    writer1.client.close()  # the server aborts writer 1's reservation of X
    deadline = time.monotonic() + 10
    while connections(server) and time.monotonic() < deadline:
        time.sleep(0.01)
    writer2, counters2, offsets2 = gated(server, two, hold_after=True)
    assert writer2.stage(session, [BlockTransfer(5, second)]) == 1
    assert writer2.at_gate.wait(10), "writer 2 copied its row and has not committed"
    assert offsets2 == offsets1, "the free list gave writer 2 the slot writer 1 lost"
    writer1.go.set()  # writer 1's bytes land in X; its COMMIT then fails
    assert writer1.drain(10) and counters1.values["save_failures"] == 1
    writer2.go.set()
    assert writer2.drain(10) and counters2.values["save_failures"] == 0
    assert block_bytes(one, 3) != block_bytes(two, 5)

    reader = KVKeepClient(server.socket, timeout_s=2.0)
    assert reader.lookup(session, [second]).num_present == 1, "writer 2's COMMIT was taken"
    target = engine()
    counters = Counters()
    loader = BlockLoader(KVKeepClient(server.socket, timeout_s=2.0), target, Mover(),
                         counters.add, counters.timed)  # fmt: skip
    assert loader.load(session, RequestLoad("r", (BlockTransfer(0, second),))) == 0, (
        "writer 1's bytes under writer 2's key passed the load's check"
    )
    assert reader.lookup(session, [second]).num_present == 0, "the bad slot was dropped"
    assert reader.stats()["tiers"]["ram"]["checksum_failures"] == 1
    reader.close()
    for saver in (writer1, writer2):
        saver.shutdown()
