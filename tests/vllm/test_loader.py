"""Background loads on a real cache server: each submitted request is reported exactly once,
its verified blocks hold the stored bytes, the rest are named as failed, and no pin is left."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from test_saver import NS, block_bytes, engine, keys, make_saver

from kvkeep.server.client import KVKeepClient, Session
from kvkeep.vllm.counters import Counters
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.loader import BackgroundLoads, BlockLoader, LoadResult
from kvkeep.vllm.mover import Mover
from kvkeep.vllm.plan import BlockTransfer, RequestLoad
from kvkeep.vllm.verify import SlotVerifier
from serverproc import Server


def stored_blocks(srv: Server, n: int) -> tuple[KVLayout, Session, list[BlockTransfer]]:
    """``n`` blocks of a source engine saved under ``keys(n)``."""
    source = engine()
    saver, _ = make_saver(srv, source)
    session = KVKeepClient.session(NS, source.block_bytes)
    blocks = [BlockTransfer(i, k) for i, k in enumerate(keys(n))]
    assert saver.stage(session, blocks) == n and saver.drain(10)
    saver.shutdown()
    return source, session, blocks


def background(srv: Server, layout: KVLayout) -> tuple[BackgroundLoads, Counters]:
    counters = Counters()
    client = KVKeepClient(srv.socket, timeout_s=2.0)
    loader = BlockLoader(client, layout, Mover(), counters.add, counters.timed)
    return BackgroundLoads(loader, counters.add), counters


def wait_finished(loads: BackgroundLoads, n: int) -> list[LoadResult]:
    results: list[LoadResult] = []
    deadline = time.monotonic() + 10
    while len(results) < n and time.monotonic() < deadline:
        results += loads.take_finished()
        time.sleep(0.01)
    return results


def arena_problems(srv: Server) -> list[str]:
    """The server's arena accounting (pins included); [] when sound."""
    return srv.check_integrity()


def test_background_loads_fill_the_blocks_and_report_each_request_once(server: Server) -> None:
    source, session, blocks = stored_blocks(server, 6)
    target = engine()
    loads, counters = background(server, target)
    into = [10, 3, 7, 1, 8, 5]
    first = RequestLoad("a", tuple(BlockTransfer(into[i], blocks[i].key) for i in range(4)), True)
    second = RequestLoad("b", (BlockTransfer(into[4], blocks[4].key),), True)
    loads.submit(session, first, None)
    loads.submit(session, second, None)
    assert loads.pending == 2
    results = wait_finished(loads, 2)
    assert sorted(results) == [LoadResult("a", 4, ()), LoadResult("b", 1, ())]
    assert loads.take_finished() == [] and loads.pending == 0
    for i in range(5):
        assert block_bytes(target, into[i]) == block_bytes(source, i)
    assert counters.values["copy_in_s"] > 0
    loads.shutdown()
    assert arena_problems(server) == []


def test_a_corrupt_block_ends_the_load_and_names_the_rest(server: Server) -> None:
    """Block 2's bytes are flipped in the arena: blocks 0-1 load, 2-3 are reported failed,
    and block 2 is dropped by the server (its pin was released as corrupt)."""
    _, session, blocks = stored_blocks(server, 4)
    client = KVKeepClient(server.socket, timeout_s=2.0)
    slots = client.acquire(session, [blocks[2].key])
    view = client.slot_view(slots[0])
    view[:8] = np.bitwise_not(view[:8])
    client.release(slots)
    target = engine()
    loads, _ = background(server, target)
    request = RequestLoad("r", tuple(BlockTransfer(i + 4, b.key) for i, b in enumerate(blocks)))
    loads.submit(session, request, None)
    assert wait_finished(loads, 1) == [LoadResult("r", 2, (6, 7))]
    assert client.lookup(session, [b.key for b in blocks]).num_present == 2
    client.close()
    loads.shutdown()
    assert arena_problems(server) == []


def test_a_dead_server_fails_the_whole_load_and_still_reports_it(server: Server) -> None:
    _, session, blocks = stored_blocks(server, 3)
    loads, _ = background(server, engine())
    server.kill()
    request = RequestLoad("r", tuple(BlockTransfer(i, b.key) for i, b in enumerate(blocks)), True)
    loads.submit(session, request, None)
    assert wait_finished(loads, 1) == [LoadResult("r", 0, (0, 1, 2))]
    loads.shutdown()


def test_submit_never_waits_for_the_server(server: Server) -> None:
    _, session, blocks = stored_blocks(server, 2)
    loads, _ = background(server, engine())
    os.kill(server.pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        loads.submit(session, RequestLoad("r", (BlockTransfer(0, blocks[0].key),), True), None)
        assert loads.take_finished() == []
        assert time.perf_counter() - t0 < 0.2
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert wait_finished(loads, 1) == [LoadResult("r", 1, ())]
    loads.shutdown()
    assert arena_problems(server) == []


def test_a_corrupt_block_stops_the_load_there(server: Server) -> None:
    """Block 3 of 6 corrupt: the load reports 3, blocks 0-2 hold their stored bytes, and the
    server drops block 3; whether the checksums ran on the loader's thread after its copy or
    on helper threads beside it (one, or two and the loader's thread)."""
    client = KVKeepClient(server.socket, timeout_s=2.0)
    stored: list[bytes] = []
    for threads in (1, 2, 3):
        source, session, blocks = stored_blocks(server, 6)  # block 3 again, once dropped
        stored = stored or [block_bytes(source, i) for i in range(3)]  # the server keeps these
        slots = client.acquire(session, [blocks[3].key])
        view = client.slot_view(slots[0])
        view[-8:] = np.bitwise_not(view[-8:])
        client.release(slots)
        target = engine()
        counters = Counters()
        loader = BlockLoader(KVKeepClient(server.socket, timeout_s=2.0), target, Mover(),
                             counters.add, counters.timed)  # fmt: skip
        loader.verifier = SlotVerifier(threads, 0, 0, part_bytes=1)  # a part per slot
        request = RequestLoad("r", tuple(BlockTransfer(i, b.key) for i, b in enumerate(blocks)))
        assert loader.load(session, request) == 3
        assert [block_bytes(target, i) for i in range(3)] == stored
        assert client.lookup(session, [b.key for b in blocks]).num_present == 3  # 3 dropped
        assert counters.values["verify_s"] > 0 and counters.values["copy_in_s"] > 0
        loader.verifier.close()
        loader.client.close()
    client.close()
    assert arena_problems(server) == []
