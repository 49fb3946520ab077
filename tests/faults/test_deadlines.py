"""Fault 7: a server that accepts connections but never answers (the real process, SIGSTOPped).
Every client call raises CacheUnavailable within the client's timeout; after SIGCONT it works."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvkeep.server.client import CacheUnavailable, KVKeepClient

from .conftest import Server
from .helpers import BLOCK, NS, fetch, keys, payload, store

TIMEOUT = 0.5
SLACK = 1.0  # a deadline, not a speed: the calls would otherwise hang for good


@pytest.fixture
def stopped(server: Server) -> Iterator[Server]:
    """The server with some blocks stored, then SIGSTOPped; always resumed afterwards."""
    client = KVKeepClient(server.socket)
    store(client, client.hello(NS, BLOCK), keys(4))
    client.close()
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)


def timed(call: Callable[..., Any], *args: Any) -> float:
    started = time.monotonic()
    with pytest.raises(CacheUnavailable):
        call(*args)
    return time.monotonic() - started


def test_every_call_times_out_against_a_stopped_server(stopped: Server) -> None:
    connected = KVKeepClient(stopped.socket, timeout_s=TIMEOUT)
    os.kill(stopped.pid, signal.SIGCONT)
    session = connected.hello(NS, BLOCK)  # connected and announced while it was running
    held = connected.acquire(session, keys(1))
    os.kill(stopped.pid, signal.SIGSTOP)
    calls: dict[str, Callable[[KVKeepClient], Any]] = {
        "lookup": lambda c: c.lookup(session, keys(4)),
        "reserve": lambda c: c.reserve(session, keys(2, offset=999)),
        "acquire": lambda c: c.acquire(session, keys(4)),
        "commit": lambda c: c.commit(session, [], []),
        "stats": lambda c: c.stats(),
        "hello": lambda c: c.hello(NS, 2 * BLOCK),
    }
    for name, call in calls.items():
        fresh = KVKeepClient(stopped.socket, timeout_s=TIMEOUT)  # connects into the backlog
        assert timed(call, fresh) < TIMEOUT + SLACK, f"fresh client, {name}"
        reused = KVKeepClient(stopped.socket, timeout_s=TIMEOUT)
        os.kill(stopped.pid, signal.SIGCONT)
        reused_session = reused.hello(NS, BLOCK)
        os.kill(stopped.pid, signal.SIGSTOP)
        assert reused_session == session
        assert timed(call, reused) < TIMEOUT + SLACK, f"connected client, {name}"
    assert timed(lambda: connected.release(held)) < TIMEOUT + SLACK


def test_threads_sharing_a_client_each_keep_the_deadline(stopped: Server) -> None:
    client = KVKeepClient(stopped.socket, timeout_s=TIMEOUT)
    session = client.session(NS, BLOCK)
    durations: list[float] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            durations.append(timed(lambda: client.lookup(session, keys(4))))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and len(durations) == 4
    assert max(durations) < TIMEOUT + SLACK, durations


def test_recovers_after_sigcont(stopped: Server) -> None:
    client = KVKeepClient(stopped.socket, timeout_s=TIMEOUT, max_backoff_s=0.2)
    session = client.session(NS, BLOCK)
    assert timed(lambda: client.lookup(session, keys(4))) < TIMEOUT + SLACK
    os.kill(stopped.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while True:
        try:
            found = client.lookup(session, keys(4))
            break
        except CacheUnavailable:
            assert time.monotonic() < deadline, "did not recover after SIGCONT"
            time.sleep(0.05)
    assert found.num_present == 4
    assert fetch(client, session, keys(4)) == [payload(k).tobytes() for k in keys(4)]
