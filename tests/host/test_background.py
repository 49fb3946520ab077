"""kvkeep's background work gives way to the engine: under the default policy the cache
server's write-through thread (and its start-up arena prefault) is in Linux's SCHED_IDLE
class; the rest of the process is not."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest

from kvkeep.host import background
from kvkeep.server.client import KVKeepClient
from serverproc import Server


def policy_in_thread() -> tuple[bool, int]:
    out: list[tuple[bool, int]] = []

    def run() -> None:
        out.append((background.give_way(), os.sched_getscheduler(0)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


@pytest.fixture
def restore_policy():
    yield
    background.set_policy("idle")


def test_give_way_lowers_only_the_calling_thread(restore_policy: None) -> None:
    assert policy_in_thread() == (True, os.SCHED_IDLE)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    background.set_policy("normal")
    assert policy_in_thread() == (False, os.SCHED_OTHER)
    with pytest.raises(ValueError, match="idle, normal"):
        background.set_policy("low")


def thread_names(pid: int) -> dict[int, str]:
    return {t.id: Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
            for t in psutil.Process(pid).threads()}  # fmt: skip


def test_start_thread_names_the_thread_in_the_kernel_too() -> None:
    seen: list[str] = []

    def read_own_name() -> None:
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text())

    thread = background.start_thread(read_own_name, "kvkeep-a-long-name-cut")
    thread.join()
    assert thread.name == "kvkeep-a-long-name-cut" and thread.daemon
    assert seen == ["kvkeep-a-long-n\n"]  # the kernel keeps 15 bytes


def thread_policies(pid: int) -> dict[int, int]:
    return {t.id: os.sched_getscheduler(t.id) for t in psutil.Process(pid).threads()}


@pytest.mark.parametrize("policy", ["idle", "normal"])
def test_the_cache_servers_write_through_runs_at_idle_priority(tmp_path: Path, policy: str) -> None:
    """The writer thread is idle by default and normal with ``--background normal``; the
    thread that answers requests is never lowered. (The thread that allocates and maps the
    arena at start-up gives way too; it is gone once the server says ``arena_ready``.)"""
    directory = tmp_path / "srv"
    directory.mkdir()
    server = Server(directory, ["--ram", "32MiB", "--disk", "64MiB", "--background", policy])
    server.start()
    try:
        client = KVKeepClient(server.socket)
        deadline = time.monotonic() + 30
        while not client.stats()["arena_ready"] and time.monotonic() < deadline:
            time.sleep(0.02)
        client.close()
        expected = 1 if policy == "idle" else 0
        while True:  # the prefault thread returns right after it sets arena_ready
            policies = thread_policies(server.pid)
            idle = [tid for tid, p in policies.items() if p == os.SCHED_IDLE]
            if len(idle) == expected or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert policies[server.pid] == os.SCHED_OTHER
        assert len(idle) == expected, policies
        names = thread_names(server.pid)
        assert "kvkeep-writer" in names.values(), names  # named in the kernel, for top -H
        assert [names[tid] for tid in idle] == ["kvkeep-writer"] * expected
    finally:
        server.kill()
