"""A cache server's arena as its clients map it: once per process, its pages mapped ahead.

Every ``KVKeepClient`` of a process (a worker has one for loads on the step, one for
background loads, one for saves) shares one mapping of a server instance's arena, kept while
any of them uses it. A new mapping is populated in the background (``MADV_POPULATE_WRITE``,
Linux 5.14+, in small chunks) at the idle priority of kvkeep's background work
(``kvkeep.host.background``); elsewhere, or when the kernel refuses, pages fault in on first
use. A client that finds a new server instance hands its old mapping to ``retire``, and a
background thread unmaps it, off the LOOKUP or load that found the restart.
What page faults and unmapping cost: docs/notes/arena-mapping.md.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
import weakref

from kvkeep.host.background import give_way, start_thread
from kvkeep.store.shm import populate, unpopulate


class ArenaMap:
    """One instance's arena, mapped read-write; ``map`` lives as long as this object."""

    __slots__ = ("__weakref__", "instance", "map", "populated")

    def __init__(self, instance: str, arena_map: mmap.mmap) -> None:
        self.instance, self.map = instance, arena_map
        self.populated = threading.Event()  # set once the background populate has ended


_MAPS: weakref.WeakValueDictionary[tuple[str, str], ArenaMap] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def shared_map(path: str, instance: str, size: int) -> ArenaMap:
    """This process's mapping of ``instance``'s arena at ``path``, made (and populated in the
    background) by the first caller. Raises OSError if the file cannot be mapped."""
    with _LOCK:
        found = _MAPS.get((path, instance))
        if found is not None and len(found.map) == size:
            return found
        fd = os.open(path, os.O_RDWR)
        try:
            arena = ArenaMap(instance, mmap.mmap(fd, size))
        finally:
            os.close(fd)
        _MAPS[(path, instance)] = arena
    start_thread(_populate_idle, "kvkeep-populate", arena.map, arena.populated)
    return arena


def _populate_idle(arena_map: mmap.mmap, done: threading.Event) -> None:
    # Not unbound (``kvkeep.host.background.unbind``): at idle priority on its creator's core it
    # runs only while that thread waits, and never takes the process's memory-map lock
    # while that thread, starting up, maps memory.
    give_way()
    try:
        populate(arena_map)
    finally:
        done.set()


RETIRE_DELAY_S = 1.0  # longer than any caller keeps a reference after handing one over
_retired: queue.SimpleQueue[tuple[float, ArenaMap, object]] = queue.SimpleQueue()
_retirer: threading.Thread | None = None


def retire(arena: ArenaMap, holder: object = None) -> None:
    """Unmap ``arena`` (and drop ``holder``, an object holding it) on a background thread,
    ``RETIRE_DELAY_S`` from now; never blocks. The caller keeps no other reference to either.

    The thread first drops the mapping's page-table entries a chunk at a time, so that it
    never holds the process's memory-map lock for long, then its reference. The thread runs
    at the engine's priority: at idle priority a busy engine could preempt it while it holds
    that lock and then wait on it (every mmap of a new tensor takes it). A client still
    reading the old mapping only faults its pages in again: the bytes stay in the file.
    """
    global _retirer
    _retired.put((time.monotonic() + RETIRE_DELAY_S, arena, holder))
    with _LOCK:
        if _retirer is None or not _retirer.is_alive():
            _retirer = start_thread(_unmap_retired, "kvkeep-unmap")


def _unmap_retired() -> None:
    while True:
        due, arena, holder = _retired.get()
        time.sleep(max(0.0, due - time.monotonic()))
        unpopulate(arena.map)
        del arena, holder
